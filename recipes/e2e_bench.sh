#!/usr/bin/env bash
# One device call for issue 11's proof: the CUDA engine's parity check and per-kernel
# profile (recipes/gpu_check.sh's binary), the PyTorch anchors of models/tiny (eager and
# CUDA graph, recipes/anchors/), then `speclab bench e2e` through the real step loop with
# the anchors beside its rows. The bench table is printed last.
#
#   here:    bash recipes/gpu_check.sh --build     # target/gpu-check/{gpu_check,speclab}
#   device:  run(command="bash recipes/unpack_bins.sh && bash recipes/e2e_bench.sh", carry=["target/gpu-pack"], timeout_s=600)
#
# Environment: E2E_ARGS adds arguments to `speclab bench e2e` (e.g. "--graphs on");
# SKIP_ANCHORS=1 skips the PyTorch anchors; COMMIT stamps the record.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/e2e-bench-out}"
mkdir -p "$OUT"
source recipes/cuda_env.sh
BIN=target/gpu-check
[ -x $BIN/speclab ] || { echo "missing $BIN/speclab: run 'bash recipes/gpu_check.sh --build' here"; exit 3; }

# 1. parity + timing + per-kernel profile (its log kept; a short summary printed).
timeout 200 $BIN/gpu_check --model models/tiny --json "$OUT/gpu_check.json" --steps 50 > "$OUT/gpu_check.log" 2>&1
echo "gpu_check exit $?: $(grep -c '^  ok' "$OUT/gpu_check.log") ok, $(grep -c '^  FAIL' "$OUT/gpu_check.log") FAIL"
grep -E '^  FAIL|ERROR|^profile|^copy' "$OUT/gpu_check.log"
sed -n '/^| batch/,/^$/p' "$OUT/gpu_check.log"

# 2. the PyTorch anchors (same prompts, same model), JSON into $OUT.
ANCH=""
if [ "${SKIP_ANCHORS:-0}" != 1 ]; then
  for s in e2e_ref e2e_graph; do
    if PYTHONUNBUFFERED=1 timeout 200 python3 recipes/anchors/$s.py . > "$OUT/$s.log" 2>&1; then
      ANCH="${ANCH:+$ANCH,}$OUT/$s.json"
    else
      echo "anchor $s failed: $(tail -3 "$OUT/$s.log")"
    fi
  done
fi

# 3. the engine end to end, anchors beside each row; table last.
timeout 450 $BIN/speclab bench e2e --model models/tiny --out "$OUT/bench-e2e.json" \
  ${ANCH:+--anchors $ANCH} ${COMMIT:+--commit $COMMIT} ${E2E_ARGS:-} 2> "$OUT/bench-e2e.err"
rc=$?
[ $rc != 0 ] && echo "bench e2e exit $rc: $(tail -5 "$OUT/bench-e2e.err")"
exit $rc
