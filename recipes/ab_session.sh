#!/usr/bin/env bash
# One device call: the full issue 11 + 12 run with the default settings, then A/B legs
# with other settings of the engine's switches, measured side by side in the same call.
#   1. recipes/device_all.sh (gpu_check parity + timing, the PyTorch anchors, bench e2e
#      with E2E_ARGS, bench moe + its anchors), defaults;
#   2. for each entry of AB_ENVS (';'-separated environment settings, default
#      "SPECLAB_PDL=0"): gpu_check --timing-only and a bench e2e of AB_DRAFTERS (graphs
#      on, the same concurrencies) under it, and bench moe when AB_MOE=1 (every leg) or
#      when the leg's number is in AB_MOE_LEGS (space-separated, e.g. "2 5"); legs whose
#      number is in AB_NO_E2E_LEGS skip the bench e2e (MoE-only legs); AB_E2E_ARGS adds
#      arguments to the legs' bench e2e (e.g. "--repeat 3"), E2E_ARGS to the defaults'.
# Switches: SPECLAB_PDL=0 (programmatic dependent launch off, cuda/src/device.rs),
# SPECLAB_CAPTURE_AT=n (capture a step's graph at its n-th use, cuda/src/backend.rs),
# SPECLAB_MTP_PAD=0 (the MTP chain's first pass unpadded, cuda/src/mtp.rs),
# SPECLAB_LIN_TILED_MIN=off (the per-column bf16 GEMMs instead of the register-tiled ones),
# SPECLAB_ROUTER_NORM=0 (the post-attention rmsnorm as its own kernel, not in the router).
# SPECLAB_ROUTER_ALIGN=0 (moe_align as its own kernel, not in the router's last block),
# SPECLAB_MOE_COMBINE=0 (moe_combine as its own kernel, not the shared expert's epilogue),
# SPECLAB_KERNEL_DEFINES=LT_PREWAIT=0 (the tiled GEMMs load weights after the PDL wait).
# SPECLAB_KDA_FUSED=0 (each KDA layer's conv, recurrence and gated norm as three kernels).
# SPECLAB_ROUTER_PRE=0 (the router without its weight prologue and one-block no-ticket path),
# SPECLAB_W4_PRE=0 (the INT4 expert GEMMs without their weight prologue),
# SPECLAB_SHARED_MERGE=0 (the shared expert's SwiGLU as its own launch after the experts),
# SPECLAB_KDA_LOWRANK=0 (the KDA f / g up-projections as a linear_pair launch),
# SPECLAB_KDA_FUSED_ROWS=16 (the fused KDA kernel for verify chunks too, not decode only),
# SPECLAB_MTP_IN_NORM=0 (the MTP layer's embedding + input norms as three launches),
# SPECLAB_KDA_PRE=0 (the KDA kernels read state and metadata after the PDL wait),
# SPECLAB_FINAL_DUP=0 (a decode step's final norm + an identity gather_rows),
# SPECLAB_KDA_PAIR=0 (verify chunks' KDA layer in four launches, not two),
# SPECLAB_W4_KS=n (the INT4 expert GEMMs' K split forced to n = 1, 2, 4 or 8 ways),
# SPECLAB_W4_WAVES=0 (their K split by the reaching rule, not the wave rule).
# Several settings in one leg are space-separated: "A=0 B=off".
# Everything lands in $OUT/results.tgz; leg i's outputs under ab<i>/ with its settings in
# ab<i>/env.txt.
#
#   here:    bash recipes/gpu_check.sh --build  (then pack: tar czf target/gpu-pack/bin.tgz
#            -C target/gpu-check gpu_check speclab)
#   device:  run(command="mkdir -p target/gpu-check && tar xzf target/gpu-pack/bin.tgz -C
#            target/gpu-check && COMMIT=<sha> bash recipes/ab_session.sh",
#            carry=["target/gpu-pack"])
set -uo pipefail
cd "$(dirname "$0")/.."
# Records name the commit the binaries were built from (the device copy's .git is stale).
[ -n "${COMMIT:-}" ] && export SPECLAB_GIT_COMMIT="$COMMIT"
FINAL="${OUT:-/tmp/ab-session-out}"
mkdir -p "$FINAL"
W=$(mktemp -d)
OUT="$W/on" bash recipes/device_all.sh
on=$?
source recipes/cuda_env.sh
BIN=target/gpu-check
IFS=';' read -ra ENVS <<< "${AB_ENVS:-SPECLAB_PDL=0}"
i=0
for e in "${ENVS[@]}"; do
  i=$((i + 1))
  d="$W/ab$i"
  mkdir -p "$d"
  echo "$e" > "$d/env.txt"
  echo "== A/B leg $i: $e"
  env $e timeout 120 $BIN/gpu_check --timing-only --model models/tiny --json "$d/gpu_check.json" \
    --steps 50 > "$d/gpu_check.log" 2>&1
  sed -n '/^| batch/,/^$/p' "$d/gpu_check.log"
  if [[ " ${AB_NO_E2E_LEGS:-} " != *" $i "* ]]; then
    env $e timeout 200 $BIN/speclab bench e2e --model models/tiny --graphs on --cpu-check-max 0 \
      --drafters "${AB_DRAFTERS:-none,mtp:2,dflash2:7}" --out "$d/bench-e2e.json" \
      ${COMMIT:+--commit $COMMIT} ${AB_E2E_ARGS:-} 2> "$d/bench-e2e.err" | tail -16
  fi
  if [ "${AB_MOE:-0}" = 1 ] || [[ " ${AB_MOE_LEGS:-} " == *" $i "* ]]; then
    env $e timeout 200 $BIN/speclab bench moe --out "$d/bench_moe.json" \
      > "$d/bench_moe.txt" 2> "$d/bench_moe.log"
    echo "bench moe ($e) exit $?"
  fi
done
find "$W" -name '*.lock' -delete
tar czf "$FINAL/results.tgz" -C "$W" .
echo "device_all (defaults) exit $on"
