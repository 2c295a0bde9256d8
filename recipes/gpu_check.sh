#!/usr/bin/env bash
# Device check of the CUDA engine (issue 11): parity against the CPU engine and the
# PyTorch goldens on models/tiny, then decode-step timing at batch 1/8/32/128 with CUDA
# graphs off and on, in ONE device call. The GPU machine has no cargo: build here first.
#
#   here:    bash recipes/gpu_check.sh --build        # release binary -> target/gpu-check/
#   device:  run(command="bash recipes/gpu_check.sh", carry=["target/gpu-check"], timeout_s=600)
#
# Writes $OUT/gpu_check.json and $OUT/gpu_check.log; the table is printed last.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=target/gpu-check/gpu_check

if [ "${1:-}" = "--build" ]; then
  CARGO_PROFILE_RELEASE_DEBUG=0 cargo build --release --locked -p speclab-cuda --example gpu_check
  mkdir -p target/gpu-check
  cp target/release/examples/gpu_check "$BIN"
  strip "$BIN" 2>/dev/null || true
  ls -la "$BIN"
  exit 0
fi

OUT="${OUT:-/tmp/gpu-check-out}"
mkdir -p "$OUT"
[ -x "$BIN" ] || { echo "missing $BIN: run 'bash recipes/gpu_check.sh --build' here and carry target/gpu-check"; exit 3; }

# libcuda (driver) and libnvrtc (CUDA 13.0 toolkit, or the pip wheel of the image's python).
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu; do
  [ -d "$d" ] && ls "$d"/libcuda.so* >/dev/null 2>&1 && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" && break
done
NVRTC=$(find /usr/local/cuda/lib64 /usr/local/cuda*/lib64 /usr/local/cuda*/targets /opt /usr/lib/python3*/ /usr/local/lib/python3*/ \
  -name 'libnvrtc.so*' -not -name '*builtins*' -not -name '*alt*' 2>/dev/null | head -1 || true)
[ -n "$NVRTC" ] && export LD_LIBRARY_PATH="$(dirname "$NVRTC"):$LD_LIBRARY_PATH"
echo "libnvrtc: ${NVRTC:-not found}"
export SPECLAB_KERNEL_CACHE=/tmp/speclab-kernel-cache
nvidia-smi -L || true
set -o pipefail
"$BIN" --model models/tiny --json "$OUT/gpu_check.json" --steps 50 2>&1 | tee "$OUT/gpu_check.log"
