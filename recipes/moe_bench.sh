#!/usr/bin/env bash
# Issue 12 in ONE device call: `speclab bench moe` (one GLM-5.3-Flash W4A16 MoE layer with
# the engine's INT4 kernels, M = 1..256, uniform / zipf / sequence routing, each row checked
# against an f64 reference), then the PyTorch anchors (recipes/anchors/moe_bf16.py, a copy
# of ../shared/anchors/moe_bf16.py: copy bandwidth, bf16 torch._grouped_mm and a per-expert
# loop at the same shapes), then a comparison table. The GPU machine has no cargo.
#
#   here:    bash recipes/moe_bench.sh --build      # release binary -> target/moe-bench/
#   device:  run(command="bash recipes/moe_bench.sh", carry=["target/moe-bench"], timeout_s=600)
#
# Writes $OUT/bench_moe.json (the record; commit it as runs/bench-moe.json), $OUT/bench_moe.log
# (speclab's table and log),
# $OUT/bench_moe_a16.json (the same kernels with bf16 activations, W4_XS=1; MOE_A16=0 skips),
# $OUT/gpu_anchors.json, $OUT/anchors.log; the table is printed last. Exit: speclab's (1 = a row
# failed its reference check, every row still printed; 2 = an error such as no CUDA device, see
# bench_moe.log); 3 = the binary was not built and carried.
# MOE_ARGS overrides the bench arguments (default: all M, all routings, 50 iterations).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${MOE_BIN:-target/moe-bench/speclab}
# The device's copy of .git is stale: the record names the commit COMMIT gives, if set.
[ -n "${COMMIT:-}" ] && export SPECLAB_GIT_COMMIT="$COMMIT"

if [ "${1:-}" = "--build" ]; then
  CARGO_PROFILE_RELEASE_DEBUG=0 cargo build --release --locked -p speclab --bin speclab
  mkdir -p target/moe-bench
  cp target/release/speclab "$BIN"
  strip "$BIN" 2>/dev/null || true
  ls -la target/moe-bench
  exit 0
fi

OUT="${OUT:-/tmp/moe-bench-out}"
mkdir -p "$OUT"
[ -x "$BIN" ] || { echo "missing $BIN: run 'bash recipes/moe_bench.sh --build' here and carry target/moe-bench"; exit 3; }

source recipes/cuda_env.sh
echo "libnvrtc: ${NVRTC:-not found}"
nvidia-smi -L || true

rc=0
# shellcheck disable=SC2086
RUST_LOG=info timeout 300 "$BIN" bench moe ${MOE_ARGS:-} --out "$OUT/bench_moe.json" \
  > "$OUT/bench_moe.log" 2>&1 || rc=$?
echo "speclab bench moe: exit $rc"
[ "$rc" = 0 ] || tail -5 "$OUT/bench_moe.log"
# The same kernels compiled for bf16 activations (W4_XS=1: W4A16 as vLLM's Marlin MoE takes
# them), record bench_moe_a16.json; MOE_A16=0 skips it.
if [ "${MOE_A16:-1}" != 0 ]; then
  a16=0
  # shellcheck disable=SC2086
  SPECLAB_KERNEL_DEFINES=W4_XS=1 RUST_LOG=info timeout 300 "$BIN" bench moe ${MOE_ARGS:-} \
    --out "$OUT/bench_moe_a16.json" > "$OUT/bench_moe_a16.log" 2>&1 || a16=$?
  echo "speclab bench moe (W4_XS=1): exit $a16"
  [ "$a16" = 0 ] || { tail -5 "$OUT/bench_moe_a16.log"; rc=$a16; }
fi
OUT="$OUT" timeout 240 python3 recipes/anchors/moe_bf16.py > "$OUT/anchors.log" 2>&1 \
  || echo "anchors failed: $(tail -3 "$OUT/anchors.log")"

for rec in bench_moe.json bench_moe_a16.json; do
[ -f "$OUT/$rec" ] || continue
python3 - "$OUT" "$rec" <<'PY' || true
import json, sys
d = sys.argv[1]
try:
    b = json.load(open(f"{d}/{sys.argv[2]}"))
except Exception as e:
    print("no bench record:", e); sys.exit(0)
print(f"\n== {sys.argv[2]} (kernel defines {b.get('kernel_defines') or 'none: exact activations'})")
try:
    a = json.load(open(f"{d}/gpu_anchors.json"))
except Exception as e:
    a = {"moe_bf16": []}; print("no anchors:", e)
anc = {r["M"]: r for r in a.get("moe_bf16", [])}
print(f"\n{b['device']}: copy {b['copy_gb_s']:.0f} GB/s (end {b['copy_gb_s_end']:.0f}); "
      f"torch copy {a.get('copy_GBps', float('nan')):.0f} GB/s, torch {a.get('torch', '?')}; "
      f"INT4 GEMM resident blocks/SM (gate_up, down): {b.get('w4_blocks_per_sm')}")
print("experts_us = moe_gate_up_w4 + moe_down_w4 (CUDA events, median); layer_us = router + topk + align + experts + bf16 shared + combine")
print("x gmm = torch bf16 grouped_mm us / experts_us (anchor routing: softmax top-8 of randn logits, ~uniform)")
hdr = f"{'routing':>8} {'M':>4} {'experts':>7} {'experts_us':>10} {'floor_us':>9} {'GB/s':>6} {'%copy':>6} {'layer_us':>9} {'gmm_us':>8} {'x gmm':>6} {'loop_us':>8} {'check':>6}"
print(hdr)
for r in b["rows"]:
    an = anc.get(r["m"], {})
    g = an.get("grouped_mm_us")
    print(f"{r['routing']:>8} {r['m']:>4} {r['distinct_experts']:>7.1f} {r['experts_us']:>10.1f} {r['floor_us']:>9.1f} "
          f"{r['gb_s']:>6.0f} {100*r['frac_copy']:>5.0f}% {r['layer_us']:>9.1f} "
          f"{(g if g else float('nan')):>8.1f} {(g / r['experts_us'] if g else float('nan')):>5.1f}x "
          f"{an.get('loop_us', float('nan')):>8.1f} {'ok' if r['pass'] else 'FAIL':>6}")
goals = [r for r in b["rows"] if r["m"] <= 64]
worst = min(goals, key=lambda r: r["frac_copy"]) if goals else None
if worst:
    print(f"worst M<=64 row: {worst['routing']} M={worst['m']} at {100*worst['frac_copy']:.0f}% of copy (goal 70%)")
print("all reference checks pass" if b["all_pass"] else "SOME REFERENCE CHECKS FAILED")
PY
done
# The device tool returns at most 8 files a call: the records' lock files go (the six files
# above stay: two records, their logs, the anchors and their log).
rm -f "$OUT"/.bench_moe*.json.lock
exit "$rc"
