#!/usr/bin/env bash
# Issue 11's real-manifest proof on the GPU, in one device call: the df2w-real-* wedge
# manifests and the 24-prompt quality spot-suite with `real.device: cuda`
# (experiments/*-cuda.ron), records into $OUT, then `verify-lossless` of the spot-suite on
# the GPU. Compare the records with the CPU ones here:
#   python3 recipes/compare_real.py runs/quality-spot.json runs/quality-spot-cuda.json ...
#
#   here:    bash recipes/gpu_check.sh --build
#   device:  run(command="bash recipes/unpack_bins.sh && bash recipes/real_cuda.sh", carry=["target/gpu-pack"], timeout_s=600)
set -uo pipefail
cd "$(dirname "$0")/.."
# Records name the commit the binary was built from (the device copy's .git is stale).
[ -n "${COMMIT:-}" ] && export SPECLAB_GIT_COMMIT="$COMMIT"
FINAL="${OUT:-/tmp/real-cuda-out}"
mkdir -p "$FINAL"
# Records bring lock and timing files: everything goes to one archive (8 files come back).
OUT=$(mktemp -d)
source recipes/cuda_env.sh
BIN=target/gpu-check/speclab
rc=0
for m in df2w-real-above-fixed df2w-real-above-none df2w-real-below-none df2w-real-six quality-spot; do
  timeout 200 $BIN run experiments/$m-cuda.ron --out "$OUT/$m-cuda.json" > "$OUT/$m.log" 2>&1 || { rc=1; echo "$m failed: $(tail -2 "$OUT/$m.log")"; }
  tail -1 "$OUT/$m.log"
done
timeout 200 $BIN verify-lossless experiments/quality-spot-cuda.ron > "$OUT/verify-lossless.log" 2>&1 || rc=1
tail -6 "$OUT/verify-lossless.log"
tar czf "$FINAL/real-cuda.tgz" -C "$OUT" .
exit $rc
