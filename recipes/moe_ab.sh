#!/usr/bin/env bash
# Issue 12's A/B of INT4 MoE settings in ONE device call: `speclab bench moe` at the goal's
# M (MS, default 1,2,4,8,16,32,64; all three routings) once per leg, legs run in the order
# A B A B ... (LEGS environment settings, ';'-separated, "" = the defaults; ROUNDS times,
# default 2), so drift between the first and last leg shows; then a table of experts us per
# (routing, M) per setting, the median over its rounds.
#
#   here:    bash recipes/gpu_check.sh --build
#   device:  run(command="bash recipes/unpack_bins.sh && LEGS=';SPECLAB_W4_KS=4' COMMIT=<c> bash recipes/moe_ab.sh", carry=["target/gpu-pack"])
# Records in $OUT/records.tar (leg<round>_<i>.json), the table in $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_OUT=/tmp/moe-ab-out
KEEP_TAR=1
source recipes/call_prelude.sh
nvidia-smi -L || true
IFS=';' read -ra SETS <<< "${LEGS:-}"
[ "${#SETS[@]}" -gt 0 ] || SETS=("")
for r in $(seq 1 "${ROUNDS:-2}"); do
  for i in "${!SETS[@]}"; do
    f="$W/leg${r}_$i.json"
    echo "== round $r leg $i: ${SETS[$i]:-defaults}"
    # A leg may name another binary (SPECLAB_BIN=path, e.g. an earlier commit's, unpacked
    # beside this one), so two builds alternate in one call.
    env ${SETS[$i]} bash -c 'exec timeout 150 "${SPECLAB_BIN:-$0}" "$@"' "$BIN" bench moe \
      --m "${MS:-1,2,4,8,16,32,64}" --iters "${ITERS:-50}" \
      --out "$f" > "$W/leg${r}_$i.log" 2>&1 || { rc=1; tail -3 "$W/leg${r}_$i.log"; }
    keep "$f"
  done
done
python3 - "$W" "${ROUNDS:-2}" "${LEGS:-}" <<'PY' || rc=1
import json, statistics, sys
# As bash's `read -ra` (which drops one trailing empty field) split LEGS.
legs = sys.argv[3][:-1] if sys.argv[3].endswith(";") else sys.argv[3]
d, rounds, sets = sys.argv[1], int(sys.argv[2]), (legs.split(";") if legs else [""])
t = {}
for r in range(1, rounds + 1):
    for i in range(len(sets)):
        try:
            rec = json.load(open(f"{d}/leg{r}_{i}.json"))
        except Exception as e:
            print(f"round {r} leg {i}: no record ({e})"); continue
        for row in rec["rows"]:
            k = (row["routing"], row["m"])
            t.setdefault(k, {}).setdefault(i, []).append((row["experts_us"], row["frac_copy"], row["pass"]))
            if "experts_us_chained" in row:
                t.setdefault(("chained",) + k, {}).setdefault(i, []).append(
                    (row["experts_us_chained"], row["frac_copy_chained"], row["pass"]))
names = [s or "defaults" for s in sets]
for chained in (False, True):
    keys = [k for k in t if (k[0] == "chained") == chained]
    if not keys:
        continue
    print("\n" + ("experts us a call in chains of back-to-back calls" if chained else "experts us, single calls"))
    print("| routing | M | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(sets))
    for k in sorted(keys, key=lambda k: (k[-2], k[-1])):
        cells = []
        for i in range(len(sets)):
            v = t[k].get(i, [])
            if not v:
                cells.append("-"); continue
            us = statistics.median(x[0] for x in v)
            fr = statistics.median(x[1] for x in v)
            ok = all(x[2] for x in v)
            cells.append(f"{us:.1f} ({100 * fr:.0f}%){'' if ok else ' FAIL'} [{'/'.join(f'{x[0]:.1f}' for x in v)}]")
        print(f"| {k[-2]} | {k[-1]} | " + " | ".join(cells) + " |")
PY
exit $rc
