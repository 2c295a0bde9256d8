# Sourced by the device recipes (recipes/*.sh): put libcuda (the driver) and libnvrtc (the
# CUDA 13.0 toolkit, or a pip wheel of the image's python) on LD_LIBRARY_PATH, and keep the
# PTX cache of the kernels under /tmp for the machine's life.
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu; do
  [ -d "$d" ] && ls "$d"/libcuda.so* >/dev/null 2>&1 && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" && break
done
NVRTC=$(find /usr/local/cuda/lib64 /usr/local/cuda*/lib64 /usr/local/cuda*/targets /opt /usr/lib/python3*/ /usr/local/lib/python3*/ \
  -name 'libnvrtc.so*' -not -name '*builtins*' -not -name '*alt*' 2>/dev/null | head -1 || true)
[ -n "$NVRTC" ] && export LD_LIBRARY_PATH="$(dirname "$NVRTC"):${LD_LIBRARY_PATH:-}"
export SPECLAB_KERNEL_CACHE="${SPECLAB_KERNEL_CACHE:-/tmp/speclab-kernel-cache}"
