#!/usr/bin/env bash
# Issue 11's device sampler (cuda/kernels/sample.cu, cuda/src/sample.rs) in ONE device call:
#  1. gpu_check --parity-only: every parity line, with the sampler's verdicts against the
#     host reference `verify_with_uniforms` on the device's own logits;
#  2. experiments/acceptance-tiny-cuda.ron (greedy and T = 1.0 legs) on the device sampler
#     and again with SPECLAB_DEVICE_SAMPLE=0 (the host sampler), compared with each other and
#     with the CPU record runs/acceptance-tiny.json;
#  3. `speclab bench e2e --temperature 1.0 --sampler both`: sampled decode tok/s with the
#     host sampler and the device sampler side by side (outputs must be equal), and a
#     top-k 50 / top-p 0.9 leg; a c = 1 eager leg checked against the CPU engine.
#
#   here:    bash recipes/gpu_check.sh --build
#   device:  run(command="bash recipes/unpack_bins.sh && COMMIT=<commit> bash recipes/sample_check.sh", carry=["target/gpu-pack"], timeout_s=600)
# E2E_C sets the sampled legs' concurrencies (default 1,8,32,128).
# Records land in $OUT as each step ends, the printed summary in $OUT/summary.txt, logs in
# $OUT/logs.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_OUT=/tmp/sample-check-out
source recipes/call_prelude.sh
timeout 240 "$CHK" --model models/tiny --parity-only --json "$W/gpu_check.json" > "$W/gpu_check.log" 2>&1 || rc=1
keep "$W/gpu_check.json"
python3 recipes/parity_summary.py "$W/gpu_check.json" sampler || rc=1
E=(bench e2e --temperature 1.0 --drafters none,mtp:2,dflash2:7 "${C[@]}")
timeout 240 "$BIN" "${E[@]}" --sampler both --graphs on --concurrency "${E2E_C:-1,8,32,128}" \
  --out "$W/bench-e2e-t1.json" > "$W/e2e.log" 2>&1 || { rc=1; echo "e2e sampled legs failed: $(tail -3 "$W/e2e.log")"; }
keep "$W/bench-e2e-t1.json"
echo "## bench e2e, T = 1.0 (sampler host, then device)"
grep '^|' "$W/e2e.log" | cut -d'|' -f2-11,14,18
for s in device host; do
  env=""; [ $s = host ] && env="SPECLAB_DEVICE_SAMPLE=0"
  env $env timeout 150 "$BIN" run experiments/acceptance-tiny-cuda.ron --out "$W/acceptance-tiny-cuda-$s.json" \
    > "$W/acceptance-$s.log" 2>&1 || { rc=1; echo "acceptance ($s sampler) failed: $(tail -2 "$W/acceptance-$s.log")"; }
  keep "$W/acceptance-tiny-cuda-$s.json"
done
echo "## CPU record against the device sampler"
python3 recipes/compare_real.py runs/acceptance-tiny.json "$W/acceptance-tiny-cuda-device.json" | tail -4
echo "## host sampler against the device sampler (same GPU logits)"
python3 recipes/compare_real.py "$W/acceptance-tiny-cuda-host.json" "$W/acceptance-tiny-cuda-device.json" | tail -2
timeout 100 "$BIN" "${E[@]}" --sampler device --graphs off --concurrency 1 --cpu-check-max 1 \
  --out "$W/bench-e2e-t1-cpu.json" > "$W/e2e-cpu.log" 2>&1 || { rc=1; echo "e2e cpu-check leg failed: $(tail -3 "$W/e2e-cpu.log")"; }
keep "$W/bench-e2e-t1-cpu.json"
echo "## bench e2e, c = 1 eager, CPU check"
grep '^|' "$W/e2e-cpu.log" | cut -d'|' -f2-8,18
timeout 100 "$BIN" "${E[@]}" --top-k 50 --top-p 0.9 --sampler both --graphs on --concurrency 8 \
  --out "$W/bench-e2e-topkp.json" > "$W/e2e-topkp.log" 2>&1 || { rc=1; echo "e2e top-k/top-p failed: $(tail -3 "$W/e2e-topkp.log")"; }
keep "$W/bench-e2e-topkp.json"
echo "## bench e2e, top-k 50 / top-p 0.9"
grep '^|' "$W/e2e-topkp.log" | cut -d'|' -f2-8,14,18
tar czf "$FINAL/logs.tgz" -C "$W" --exclude='*.json' .
exit $rc
