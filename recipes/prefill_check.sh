#!/usr/bin/env bash
# The prefill kernels (chunked KDA: cuda/src/kda_chunk.rs, kda.cu kda_chunk_prep / kda_chunk_scan;
# attention.cu prefill_attention)
# in ONE device call:
#  1. gpu_check: every parity line (with the chunked prefill's: against the CPU engine and
#     the per-token recurrence over long, continued and mixed prefill steps and the decode
#     steps after them), graphed decode timing, and prefill timing with the chunked
#     kernels off and on (its table);
#  2. bench e2e at c = 1 and 8: no drafter, MTP N = 2 and DFlash2 N = 7 with its context
#     append in the step's graph, then with it launched eagerly (SPECLAB_DF2_APPEND_GRAPH=0),
#     then in the graph again (E2E=0 skips it);
#  3. eval-ppl on the CPU and on the GPU (16 held-out sequences of 512 tokens: prefill only),
#     the GPU with the chunked kernels and without (SPECLAB_KDA_CHUNKED=0);
#  4. the real manifests on the GPU (prompts up to 4,000 tokens), compared leg by leg with
#     the CPU records (status, output digests, accepted drafts).
#
#   here:    bash recipes/gpu_check.sh --build
#   device:  run(command="bash recipes/unpack_bins.sh && COMMIT=<commit> bash recipes/prefill_check.sh", carry=["target/gpu-pack"], timeout_s=600)
# Records land in $OUT/records.tar as each step ends, the printed summary in
# $OUT/summary.txt, logs in $OUT/logs.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_OUT=/tmp/prefill-check-out
KEEP_TAR=1  # records into $FINAL/records.tar (call_prelude.sh keep)
source recipes/call_prelude.sh
nvidia-smi -L || true
timeout 300 "$CHK" --model models/tiny --json "$W/gpu_check.json" > "$W/gpu_check.log" 2>&1 || rc=1
keep "$W/gpu_check.json"
python3 recipes/parity_summary.py "$W/gpu_check.json" "KDA" || rc=1
grep -A12 '^| prompts x tokens' "$W/gpu_check.log"
grep -B1 -A10 '^| batch | graphs' "$W/gpu_check.log" | tail -10
# DFlash2's context append inside the step's graph (cuda/src/dflash.rs run_step) A/B/A,
# beside no drafter and MTP N = 2 (greedy, graphs on, c = 1 and 8, medians of 3 runs).
E=(bench e2e --graphs on --concurrency "${E2E_C:-1,8}" --repeat 3 "${C[@]}")
leg() {  # name, env, drafters
  env $2 timeout 120 "$BIN" "${E[@]}" --drafters "$3" --out "$W/bench-e2e-$1.json" > "$W/e2e-$1.log" 2>&1 \
    || { rc=1; echo "e2e leg $1 failed: $(tail -3 "$W/e2e-$1.log")"; }
  keep "$W/bench-e2e-$1.json"
  echo "## bench e2e, leg $1 ($2)"
  grep '^|' "$W/e2e-$1.log" | cut -d'|' -f2-11,14
}
if [ "${E2E:-1}" != 0 ]; then
  leg append-graph "SPECLAB_DF2_APPEND_GRAPH=1" none,mtp:2,dflash2:7
  leg append-eager "SPECLAB_DF2_APPEND_GRAPH=0" none,dflash2:7
  leg append-graph-again "SPECLAB_DF2_APPEND_GRAPH=1" none,mtp:2,dflash2:7
fi
ppl() {  # name, env, device
  env $2 timeout 90 "$BIN" eval-ppl models/tiny --data models/tiny/data.safetensors --limit 16 \
    --device $3 --json > "$W/eval-ppl-$1.json" 2> "$W/eval-ppl-$1.err" || { rc=1; echo "eval-ppl $1 failed: $(tail -2 "$W/eval-ppl-$1.err")"; }
  keep "$W/eval-ppl-$1.json"
}
ppl cpu "" cpu
ppl cuda-chunked "SPECLAB_KDA_CHUNKED=1" cuda
ppl cuda-per-token "SPECLAB_KDA_CHUNKED=0 SPECLAB_ATT_TILED=0" cuda
ppl cuda-chunked-again "SPECLAB_KDA_CHUNKED=1" cuda
python3 - "$W" <<'PY' || rc=1
import json, sys
d = sys.argv[1]
rows = {}
for n in ("cpu", "cuda-chunked", "cuda-per-token", "cuda-chunked-again"):
    try:
        rows[n] = json.load(open(f"{d}/eval-ppl-{n}.json"))[0]
    except Exception as e:
        print(f"eval-ppl {n}: no record ({e})")
for n, r in rows.items():
    print(f"eval-ppl {n:>18}: ce {r['ce_nats']:.7f} nats, top1 {r['top1']:.4f}, {r['positions']} positions, {r['seconds']:.2f} s")
if "cpu" in rows:
    for n, r in rows.items():
        if n != "cpu":
            print(f"  |ce {n} - ce cpu| = {abs(r['ce_nats'] - rows['cpu']['ce_nats']):.2e}; top1 equal: {r['top1'] == rows['cpu']['top1']}")
PY
for m in df2w-real-six df2w-real-above-none quality-spot; do
  timeout 150 "$BIN" run experiments/$m-cuda.ron --out "$W/$m-cuda.json" > "$W/$m.log" 2>&1 \
    || { rc=1; echo "$m failed: $(tail -2 "$W/$m.log")"; }
  keep "$W/$m-cuda.json"
  echo "## $m: the CPU record against the GPU (chunked prefill)"
  python3 recipes/compare_real.py runs/$m.json "$W/$m-cuda.json" | tail -4
done
tar czf "$FINAL/logs.tgz" -C "$W" --exclude='*.json' .
exit $rc
