#!/usr/bin/env bash
# Nsight Compute counters of the INT4 MoE kernels at GLM-5.3-Flash shapes (issue 12's
# "what limits each regime"): moe_gate_up_w4 / moe_down_w4 at M = 1 and M = 16 (uniform
# routing; CASES="M:routing ..." picks others, e.g. CASES="8:sequence"), SpeedOfLight + Occupancy + WarpStateStats + MemoryWorkloadAnalysis, clocks left
# alone (--clock-control none). Reports into $OUT/ncu_m*.txt.
#
#   here:    bash recipes/gpu_check.sh --build
#   device:  run(command="bash recipes/unpack_bins.sh && bash recipes/moe_ncu.sh", carry=["target/gpu-pack"], timeout_s=400)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/moe-ncu-out}"
mkdir -p "$OUT"
source recipes/cuda_env.sh
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu"; exit 3; }
# DETAILS=1 adds --print-details all and the scheduler / instruction sections (the stall
# breakdown of runs/ncu-final-m*.txt); SPECLAB_KERNEL_DEFINES passes through to the bench.
EXTRA=()
[ "${DETAILS:-0}" = 1 ] && EXTRA=(--print-details all --section SchedulerStats --section InstructionStats --section ComputeWorkloadAnalysis)
for case in ${CASES:-1:uniform 16:uniform}; do
  m=${case%%:*}; r=${case#*:}
  f="$OUT/ncu_m$m.txt"; [ "$r" = uniform ] || f="$OUT/ncu_m${m}_$r.txt"
  timeout 170 "$NCU" --clock-control none -k regex:'moe_(.*_w4|split_x)' -c 3 "${EXTRA[@]}" \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    target/gpu-check/speclab bench moe --m $m --routing $r --iters 1 --copies 1 --check-pairs 8 \
    --out /tmp/ncu-m$m.json > "$f" 2>&1
  echo "M=$m $r ncu exit $?"
  grep -E "moe_.*w4 \(|moe_split_x|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Issued Warp|Stall [A-Z]|One or More Eligible|Executed Instructions  |L2 Hit" "$f" | head -70
done
