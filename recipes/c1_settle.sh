#!/usr/bin/env bash
# The c = 1 ratios the issue's goals name (MTP N = 2 >= 1.41x, DFlash2 N = 7 >= 3x no
# drafter), measured over several processes in ONE device call: legs of
# `speclab bench e2e --concurrency 1 --drafters none,mtp:2,dflash2:7 --repeat 3` (greedy,
# graphs on), with the switch AB_VAR (default SPECLAB_DF2_APPEND_GRAPH: the DFlash2 context
# append in the step's graph) on in odd legs and off (=0) in even legs; then each leg's
# ratios and their median.
# Before the legs, gpu_check --parity-only (PARITY=0 skips it).
# Legs of one call differ by up to 5% (findings/cuda-engine-h200.md): one leg settles
# nothing near a threshold.
#
#   here:    bash recipes/gpu_check.sh --build
#   device:  run(command="bash recipes/unpack_bins.sh && COMMIT=<commit> bash recipes/c1_settle.sh", carry=["target/gpu-pack"], timeout_s=600)
# LEGS sets the number of legs (default 6). Records in $OUT/records.tar, summary in
# $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_OUT=/tmp/c1-settle-out
KEEP_TAR=1  # records into $FINAL/records.tar (call_prelude.sh keep)
source recipes/call_prelude.sh
nvidia-smi -L || true
if [ "${PARITY:-1}" != 0 ]; then  # every parity line first (PARITY=0 skips)
  timeout 240 "$CHK" --model models/tiny --parity-only --json "$W/gpu_check.json" > "$W/gpu_check.log" 2>&1 || rc=1
  keep "$W/gpu_check.json"
  python3 recipes/parity_summary.py "$W/gpu_check.json" "prefill" "append" || rc=1
fi
for i in $(seq 1 "${LEGS:-6}"); do
  g=$(( i % 2 ))
  env "${AB_VAR:-SPECLAB_DF2_APPEND_GRAPH}=$g" timeout 80 "$BIN" bench e2e --graphs on --concurrency 1 --repeat 3 \
    --drafters none,mtp:2,dflash2:7 "${C[@]}" --out "$W/bench-e2e-c1-leg$i.json" > "$W/leg$i.log" 2>&1 \
    || { rc=1; echo "leg $i failed: $(tail -3 "$W/leg$i.log")"; }
  keep "$W/bench-e2e-c1-leg$i.json"
done
python3 - "$W" "${LEGS:-6}" <<'PY' || rc=1
import json, statistics, sys
d, n = sys.argv[1], int(sys.argv[2])
# wall: decode_tok_s (graph captures inside the steps); steady: decode_tok_s_steady (the
# captures' host time taken out, as vLLM and the PyTorch anchor time), when recorded.
ratios = {k: [] for k in ("mtp", "df2", "mtp_s", "df2_s")}
print("| leg | switch | none tok/s | MTP N=2 tok/s | x | x steady | DFlash2 N=7 tok/s | x | x steady |")
print("|---|---|---|---|---|---|---|---|---|")
for i in range(1, n + 1):
    try:
        r = json.load(open(f"{d}/bench-e2e-c1-leg{i}.json"))
    except Exception as e:
        print(f"| {i} | no record ({e}) |"); continue
    t = {(x["drafter"], x["num_spec"]): x for x in r["rows"]}
    a, b, c = t[("none", 0)], t[("mtp", 2)], t[("dflash2", 7)]
    w = lambda x, y: y["decode_tok_s"] / x["decode_tok_s"]
    st = lambda x, y: y.get("decode_tok_s_steady", float("nan")) / x.get("decode_tok_s_steady", float("nan"))
    ratios["mtp"].append(w(a, b)); ratios["df2"].append(w(a, c))
    ratios["mtp_s"].append(st(a, b)); ratios["df2_s"].append(st(a, c))
    print(f"| {i} | {'on' if i % 2 else 'off'} | {a['decode_tok_s']:,.0f} | {b['decode_tok_s']:,.0f} | {w(a, b):.3f} | {st(a, b):.3f} "
          f"| {c['decode_tok_s']:,.0f} | {w(a, c):.3f} | {st(a, c):.3f} |")
for k, name in (("mtp", "MTP N=2"), ("df2", "DFlash2 N=7")):
    for suf, how in (("", "wall"), ("_s", "steady (captures out)")):
        v = ratios[k + suf]
        if v:
            print(f"{name} / none at c=1, {how}: median {statistics.median(v):.3f}, range {min(v):.3f}-{max(v):.3f} over {len(v)} legs")
PY
tar czf "$FINAL/logs.tgz" -C "$W" --exclude='*.json' .
exit $rc
