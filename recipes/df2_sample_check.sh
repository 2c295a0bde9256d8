#!/usr/bin/env bash
# DFlash2's sampled drafting over the device's candidates (cuda/src/dflash.rs
# `pick_walk_sampled`, q as sparse rows: engine/src/spec/probs.rs) in ONE device call:
#  1. gpu_check --parity-only: every parity line, with the sampler's verdicts on dense and
#     sparse q against the host reference, and DFlash2 sampled with the walk over the
#     device's candidates against the CPU picker (same target, same seed);
#  2. experiments/acceptance-tiny-cuda.ron with the new picker, compared with the record
#     runs/acceptance-tiny-cuda.json (the CPU picker, dense q) and with the CPU record;
#  3. `speclab bench e2e --temperature 1.0` (device sampler, graphs on) for none and
#     DFlash2 N = 7: the new picker, then SPECLAB_DF2_DEVICE_CANDS=0 (the CPU picker), then
#     the new picker again (an A/B/A, so the legs' spread shows), and a greedy leg.
#
#   here:    bash recipes/gpu_check.sh --build
#   device:  run(command="bash recipes/unpack_bins.sh && COMMIT=<commit> bash recipes/df2_sample_check.sh", carry=["target/gpu-pack"], timeout_s=600)
# E2E_C sets the legs' concurrencies (default 1,32,128).
# Records land in $OUT as each step ends, the printed summary in $OUT/summary.txt, logs in
# $OUT/logs.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_OUT=/tmp/df2-sample-check-out
source recipes/call_prelude.sh
timeout 240 "$CHK" --model models/tiny --parity-only --json "$W/gpu_check.json" > "$W/gpu_check.log" 2>&1 || rc=1
keep "$W/gpu_check.json"
python3 recipes/parity_summary.py "$W/gpu_check.json" sampler sampled || rc=1
timeout 150 "$BIN" run experiments/acceptance-tiny-cuda.ron --out "$W/acceptance-tiny-cuda.json" \
  > "$W/acceptance.log" 2>&1 || { rc=1; echo "acceptance failed: $(tail -2 "$W/acceptance.log")"; }
keep "$W/acceptance-tiny-cuda.json"
echo "## the CPU picker's record (runs/acceptance-tiny-cuda.json) against the walk over the device's candidates"
python3 recipes/compare_real.py runs/acceptance-tiny-cuda.json "$W/acceptance-tiny-cuda.json" | tail -3
echo "## the CPU record against it"
python3 recipes/compare_real.py runs/acceptance-tiny.json "$W/acceptance-tiny-cuda.json" | tail -3
E=(bench e2e --temperature 1.0 --sampler device --graphs on --concurrency "${E2E_C:-1,32,128}" "${C[@]}")
leg() {  # name, env, drafters
  env $2 timeout 150 "$BIN" "${E[@]}" --drafters "$3" --out "$W/bench-e2e-$1.json" > "$W/e2e-$1.log" 2>&1 \
    || { rc=1; echo "e2e leg $1 failed: $(tail -3 "$W/e2e-$1.log")"; }
  keep "$W/bench-e2e-$1.json"
  echo "## bench e2e T = 1.0, leg $1 ($2)"
  grep '^|' "$W/e2e-$1.log" | cut -d'|' -f2-11,14,18
}
leg t1-cands "SPECLAB_DF2_DEVICE_CANDS=1" none,dflash2:7
leg t1-hostpick "SPECLAB_DF2_DEVICE_CANDS=0" dflash2:7
leg t1-cands-again "SPECLAB_DF2_DEVICE_CANDS=1" dflash2:7
timeout 150 "$BIN" bench e2e --drafters none,dflash2:7 --graphs on --concurrency "${E2E_C:-1,32,128}" "${C[@]}" \
  --out "$W/bench-e2e-greedy.json" > "$W/e2e-greedy.log" 2>&1 || { rc=1; echo "greedy leg failed: $(tail -3 "$W/e2e-greedy.log")"; }
keep "$W/bench-e2e-greedy.json"
echo "## bench e2e greedy (same machine)"
grep '^|' "$W/e2e-greedy.log" | cut -d'|' -f2-11,14
tar czf "$FINAL/logs.tgz" -C "$W" --exclude='*.json' .
exit $rc
