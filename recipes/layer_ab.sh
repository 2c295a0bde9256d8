#!/usr/bin/env bash
# The GLM-5.3-Flash MoE layer's bf16 GEMMs (router 288 x 4096, shared expert 4096 x 4096 and
# 4096 x 2048) at decode rows, kernel settings against each other in ONE device call:
# `speclab bench moe` (uniform routing, M = MS, default 1,2,4,8) once per leg, legs in the
# order A B A B ... (LEGS environment settings, ';'-separated, "" = the defaults; ROUNDS
# times, default 2); then models/tiny (gpu_check: parity incl. the skinny lines, graphed
# decode steps) once per TINY_LEGS setting (default: the defaults, then skinny off); then a
# table of layer us and the layer's launches timed alone, per leg, the median over rounds.
#
#   here:    bash recipes/gpu_check.sh --build
#   device:  run(command="bash recipes/unpack_bins.sh && COMMIT=<c> bash recipes/layer_ab.sh", carry=["target/gpu-pack"])
# Records in $OUT/records.tar (leg<round>_<i>.json, tiny_<i>.json), the table in $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_OUT=/tmp/layer-ab-out
KEEP_TAR=1
source recipes/call_prelude.sh
nvidia-smi -L || true
LEGS_DEFAULT='SPECLAB_LIN_SKINNY_MAX=off;;SPECLAB_KERNEL_DEFINES=LS_PREWAIT=0;SPECLAB_KERNEL_DEFINES=LS_EXACT_ROWS=0;SPECLAB_LIN_SKINNY_MAX=8'
IFS=';' read -ra SETS <<< "${LEGS-$LEGS_DEFAULT}"
[ "${#SETS[@]}" -gt 0 ] || SETS=("")
for r in $(seq 1 "${ROUNDS:-2}"); do
  for i in "${!SETS[@]}"; do
    f="$W/leg${r}_$i.json"
    echo "== round $r leg $i: ${SETS[$i]:-defaults}"
    env ${SETS[$i]} timeout 120 "$BIN" bench moe --m "${MS:-1,2,4,8}" --routing uniform \
      --iters "${ITERS:-50}" --out "$f" > "$W/leg${r}_$i.log" 2>&1 || { rc=1; tail -3 "$W/leg${r}_$i.log"; }
    keep "$f"
  done
done
IFS=';' read -ra TSETS <<< "${TINY_LEGS-;SPECLAB_LIN_SKINNY_MAX=off}"
for i in "${!TSETS[@]}"; do
  echo "== models/tiny leg $i: ${TSETS[$i]:-defaults}"
  env ${TSETS[$i]} timeout 150 "$CHK" --model models/tiny --json "$W/tiny_$i.json" --steps 50 \
    > "$W/tiny_$i.log" 2>&1 || { rc=1; tail -5 "$W/tiny_$i.log"; }
  tail -14 "$W/tiny_$i.log"
  keep "$W/tiny_$i.json"
done
python3 - "$W" "${ROUNDS:-2}" "${LEGS-$LEGS_DEFAULT}" <<'PY' || rc=1
import json, statistics, sys
legs = sys.argv[3][:-1] if sys.argv[3].endswith(";") else sys.argv[3]
d, rounds, sets = sys.argv[1], int(sys.argv[2]), (legs.split(";") if legs else [""])
cols = ["layer_us", "experts_us", "router_us", "topk_us", "align_us", "shared_swiglu_us",
        "shared_down_us", "combine_us"]
t = {}
for r in range(1, rounds + 1):
    for i in range(len(sets)):
        try:
            rec = json.load(open(f"{d}/leg{r}_{i}.json"))
        except Exception as e:
            print(f"round {r} leg {i}: no record ({e})"); continue
        for row in rec["rows"]:
            v = {**row.get("layer_parts", {}), **row}
            t.setdefault(row["m"], {}).setdefault(i, []).append((v, row["pass"]))
print("\nus, median over rounds (layer: as step.rs runs it; the rest: each launch alone)")
print("| M | leg | " + " | ".join(c[:-3] for c in cols) + " | pass |")
print("|---|---|" + "---|" * (len(cols) + 1))
for m in sorted(t):
    for i in sorted(t[m]):
        vs = t[m][i]
        cells = [f"{statistics.median(v[c] for v, _ in vs):.1f}" for c in cols]
        print(f"| {m} | {sets[i] or 'defaults'} | " + " | ".join(cells) +
              f" | {all(p for _, p in vs)} |")
PY
exit $rc
