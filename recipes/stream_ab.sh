#!/usr/bin/env bash
# Issue 12's check of the INT4 expert GEMMs' stream split (SPECLAB_W4_STREAM, linear.cu
# w4_stream) in ONE device call: models/tiny's parity with the split forced on every MoE
# launch (SPECLAB_W4_STREAM=all, W4S_MIN_UNITS=0, so even tiny's few half groups take it),
# then recipes/moe_ab.sh with and without it: bf16 activations (ROUNDS_A16 rounds, default
# 2), then, while the call is younger than EXACT_BEFORE seconds (default 290), the exact
# kernels (one round).  Each bench row checks itself against the f64 reference.
#
#   here:    bash recipes/gpu_check.sh --build
#   device:  run(command="bash recipes/unpack_bins.sh && COMMIT=<c> bash recipes/stream_ab.sh", carry=["target/gpu-pack"])
# $OUT/par_stream.{log,json}, $OUT/summary.txt + records.tar (bf16), $OUT/exact/ (exact).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/stream-ab-out}"
mkdir -p "$OUT"
S=$SECONDS
nvidia-smi -L || true
SPECLAB_W4_STREAM=all SPECLAB_KERNEL_DEFINES=W4S_MIN_UNITS=0 timeout 150 \
  target/gpu-check/gpu_check --model models/tiny --parity-only --json "$OUT/par_stream.json" \
  > "$OUT/par_stream.log" 2>&1
echo "parity with the stream split forced: rc=$?, $(grep -c PASS "$OUT/par_stream.log") PASS lines, $(grep -ci fail "$OUT/par_stream.log") naming a failure; t=$((SECONDS - S)) s"
LEGS='SPECLAB_KERNEL_DEFINES=W4_XS=1;SPECLAB_KERNEL_DEFINES=W4_XS=1 SPECLAB_W4_STREAM=all' \
  ROUNDS="${ROUNDS_A16:-2}" ITERS="${ITERS:-40}" bash recipes/moe_ab.sh > /dev/null 2>&1
echo "bf16 A/B done: t=$((SECONDS - S)) s"
if [ $((SECONDS - S)) -lt "${EXACT_BEFORE:-290}" ]; then
  OUT="$OUT/exact" LEGS=';SPECLAB_W4_STREAM=all' ROUNDS=1 ITERS="${ITERS:-40}" \
    bash recipes/moe_ab.sh > /dev/null 2>&1
  echo "exact A/B done: t=$((SECONDS - S)) s"
fi
