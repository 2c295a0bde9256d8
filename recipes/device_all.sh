#!/usr/bin/env bash
# Issues 11 + 12 in ONE device call: recipes/e2e_bench.sh (parity, per-kernel profile,
# PyTorch e2e anchors, `speclab bench e2e`) then recipes/moe_bench.sh (`speclab bench moe`
# at GLM-5.3-Flash shapes + the bf16 anchors), with the binaries of
# `bash recipes/gpu_check.sh --build`. The device tool returns at most 8 files, so every
# output is packed into $OUT/results.tgz; the two bench records are also copied beside it.
#
#   device:  run(command="bash recipes/unpack_bins.sh && bash recipes/device_all.sh", carry=["target/gpu-pack"], timeout_s=600)
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL="${OUT:-/tmp/device-all-out}"
mkdir -p "$FINAL"
W=$(mktemp -d)
OUT="$W/e2e" bash recipes/e2e_bench.sh
e2e=$?
OUT="$W/moe" MOE_BIN=target/gpu-check/speclab bash recipes/moe_bench.sh
moe=$?
tar czf "$FINAL/results.tgz" -C "$W" .
cp "$W/e2e/bench-e2e.json" "$FINAL/" 2>/dev/null
cp "$W/moe/bench_moe.json" "$FINAL/" 2>/dev/null
cp "$W/moe/bench_moe_a16.json" "$FINAL/" 2>/dev/null
echo "e2e_bench exit $e2e, moe_bench exit $moe"
[ "$e2e" = 0 ] && [ "$moe" = 0 ]
