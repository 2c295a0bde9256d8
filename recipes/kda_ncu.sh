#!/usr/bin/env bash
# Nsight Compute's warp-state breakdown of the KDA kernels on models/tiny (where a token's
# time goes in the recurrence, findings/cuda-engine-h200.md): `speclab generate` with no
# drafter (decode: kda_fused_64) and with DFlash2 N = 7 (8-row verify chunks:
# kda_conv / kda_recurrent), kernels 61-72 of each run, clocks left alone. Reports into
# $OUT/ncu_kda_{none,dflash2}.txt, a digest on stdout.
#
#   here:    bash recipes/gpu_check.sh --build
#   device:  run(command="bash recipes/unpack_bins.sh && bash recipes/kda_ncu.sh", carry=["target/gpu-pack"], timeout_s=450)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kda-ncu-out}"
mkdir -p "$OUT"
source recipes/cuda_env.sh
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu"; exit 3; }
B=target/gpu-check/speclab
P="The quick brown fox jumps over the lazy dog and then"
for d in none dflash2; do
  extra=()
  [ "$d" = dflash2 ] && extra=(--drafter-dir models/dflash2-tiny --num-spec 7)
  timeout 200 "$NCU" --clock-control none -k regex:'kda_' -s 60 -c 12 --print-details all \
    --section SpeedOfLight --section WarpStateStats --section LaunchStats --section SchedulerStats \
    $B generate --device cuda --model models/tiny --drafter $d "${extra[@]}" --max-tokens 48 \
    --ignore-eos --prompt "$P" > "$OUT/ncu_kda_$d.txt" 2>&1
  echo "$d ncu exit $?"
done
for d in none dflash2; do
  echo "== $d"
  grep -E "^  kda_|Duration|Warp Cycles Per Issued|Stall [A-Z]|Issued Warp|Grid Size|Registers Per" \
    "$OUT/ncu_kda_$d.txt" | head -60
done
