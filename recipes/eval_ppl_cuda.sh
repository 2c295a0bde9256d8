#!/usr/bin/env bash
# eval-ppl of models/tiny on the CPU engine and on the CUDA engine, same held-out
# sequences, in one device call; prints both rows and the difference last.
#   here:    bash recipes/gpu_check.sh --build
#   device:  run(command="bash recipes/unpack_bins.sh && bash recipes/eval_ppl_cuda.sh", carry=["target/gpu-pack"], timeout_s=300)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/eval-ppl-out}"
mkdir -p "$OUT"
source recipes/cuda_env.sh
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
