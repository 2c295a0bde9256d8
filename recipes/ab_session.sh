#!/usr/bin/env bash
# One device call for an A/B of a launch setting (default: programmatic dependent launch,
# `SPECLAB_PDL`, cuda/src/device.rs) beside the full issue 11 + 12 run:
#   1. recipes/device_all.sh (gpu_check parity + timing, the PyTorch anchors, bench e2e
#      with E2E_ARGS, bench moe + its anchors) with the setting on (the default);
#   2. the same engine with SPECLAB_PDL=0: gpu_check --timing-only, a bench e2e of
#      AB_DRAFTERS (graphs on, same concurrencies), bench moe.
# Everything lands in $OUT/results.tgz (+ the records beside it).
#
#   here:    bash recipes/gpu_check.sh --build
#   device:  run(command="COMMIT=<sha> bash recipes/ab_session.sh", carry=["target/gpu-check"])
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL="${OUT:-/tmp/ab-session-out}"
mkdir -p "$FINAL"
W=$(mktemp -d)
OUT="$W/on" bash recipes/device_all.sh
on=$?
source recipes/cuda_env.sh
BIN=target/gpu-check
mkdir -p "$W/off"
export SPECLAB_PDL=0
timeout 120 $BIN/gpu_check --timing-only --model models/tiny --json "$W/off/gpu_check.json" \
  --steps 50 > "$W/off/gpu_check.log" 2>&1
sed -n '/^| batch/,/^$/p' "$W/off/gpu_check.log"
timeout 200 $BIN/speclab bench e2e --model models/tiny --graphs on --cpu-check-max 0 \
  --drafters "${AB_DRAFTERS:-none,mtp:2,dflash2:7}" --out "$W/off/bench-e2e.json" \
  ${COMMIT:+--commit $COMMIT} 2> "$W/off/bench-e2e.err" | tail -20
timeout 200 $BIN/speclab bench moe --out "$W/off/bench_moe.json" \
  > "$W/off/bench_moe.txt" 2> "$W/off/bench_moe.log"
echo "bench moe (SPECLAB_PDL=0) exit $?"
unset SPECLAB_PDL
find "$W" -name '*.lock' -delete
tar czf "$FINAL/results.tgz" -C "$W" .
echo "device_all (default launch) exit $on"
