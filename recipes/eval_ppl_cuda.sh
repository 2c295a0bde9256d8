#!/usr/bin/env bash
# eval-ppl of models/tiny on the CPU engine and on the CUDA engine, same held-out
# sequences, in one device call; prints both rows and the difference last.
#   here:    bash recipes/gpu_check.sh --build
#   device:  run(command="bash recipes/eval_ppl_cuda.sh", carry=["target/gpu-check"], timeout_s=300)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/eval-ppl-out}"
mkdir -p "$OUT"
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu; do
  [ -d "$d" ] && ls "$d"/libcuda.so* >/dev/null 2>&1 && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" && break
done
NVRTC=$(find /usr/local/cuda/lib64 /usr/local/cuda*/lib64 /usr/local/cuda*/targets -name 'libnvrtc.so*' \
  -not -name '*builtins*' -not -name '*alt*' 2>/dev/null | head -1 || true)
[ -n "$NVRTC" ] && export LD_LIBRARY_PATH="$(dirname "$NVRTC"):$LD_LIBRARY_PATH"
export SPECLAB_KERNEL_CACHE=/tmp/speclab-kernel-cache
for dev in cpu cuda; do
  timeout 120 target/gpu-check/speclab eval-ppl models/tiny --data models/tiny/data.safetensors \
    --limit ${LIMIT:-16} --device $dev --json > "$OUT/eval_ppl_$dev.json" 2> "$OUT/eval_ppl_$dev.err" \
    || echo "$dev failed: $(tail -2 "$OUT/eval_ppl_$dev.err")"
done
python3 - "$OUT" <<'PY'
import json, sys
d = sys.argv[1]
a, b = (json.load(open(f"{d}/eval_ppl_{x}.json"))[0] for x in ("cpu", "cuda"))
for r in (a, b):
    print(f"{r['device']:>4}: ce {r['ce_nats']:.6f} nats, ppl {r['ppl']:.4f}, top1 {r['top1']:.4f}, {r['positions']} positions, {r['seconds']:.2f} s")
print(f"|ce cuda - ce cpu| = {abs(a['ce_nats'] - b['ce_nats']):.2e}; top1 equal: {a['top1'] == b['top1']}")
PY
