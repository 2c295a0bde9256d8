#!/usr/bin/env bash
# Issue 12: block traces of the INT4 MoE kernels (W4_TRACE=1, cuda/src/w4trace.rs) in ONE
# device call: `speclab bench moe` at MS (default 1,2,4,8,16,64; all three routings) with
# the kernels compiled with DEFINES (default W4_XS=1) plus W4_TRACE=1, then the phase table
# of recipes/bench_report.py trace. The timed column of that record runs traced kernels;
# compare timings from untraced legs (recipes/moe_ab.sh).
#
#   here:    bash recipes/gpu_check.sh --build
#   device:  run(command="bash recipes/unpack_bins.sh && COMMIT=<c> bash recipes/moe_trace.sh", carry=["target/gpu-pack"])
# Record $OUT/bench_moe_trace.json, its log bench_moe_trace.log, the table in $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_OUT=/tmp/moe-trace-out
source recipes/call_prelude.sh
nvidia-smi -L || true
f="$W/bench_moe_trace.json"
SPECLAB_KERNEL_DEFINES="${DEFINES:-W4_XS=1},W4_TRACE=1" timeout 200 "$BIN" bench moe \
  --m "${MS:-1,2,4,8,16,64}" --iters "${ITERS:-30}" --out "$f" > "$W/bench_moe_trace.log" 2>&1 \
  || { rc=1; tail -5 "$W/bench_moe_trace.log"; }
keep "$f" "$W/bench_moe_trace.log"
[ -f "$f" ] && python3 recipes/bench_report.py trace "$f" || rc=1
exit $rc
