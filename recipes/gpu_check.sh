#!/usr/bin/env bash
# Device check of the CUDA engine (issue 11): parity against the CPU engine and the
# PyTorch goldens on models/tiny, then decode-step timing at batch 1/8/32/128 with CUDA
# graphs off and on, in ONE device call. The GPU machine has no cargo: build here first.
#
#   here:    bash recipes/gpu_check.sh --build        # release binary -> target/gpu-check/
#   device:  run(command="bash recipes/unpack_bins.sh && bash recipes/gpu_check.sh", carry=["target/gpu-pack"], timeout_s=600)
#
# Writes $OUT/gpu_check.json and $OUT/gpu_check.log; the table is printed last.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=target/gpu-check/gpu_check

if [ "${1:-}" = "--build" ]; then
  CARGO_PROFILE_RELEASE_DEBUG=0 cargo build --release --locked -p speclab-cuda --example gpu_check
  CARGO_PROFILE_RELEASE_DEBUG=0 cargo build --release --locked -p speclab --bin speclab
  mkdir -p target/gpu-check
  cp target/release/examples/gpu_check "$BIN"
  cp target/release/speclab target/gpu-check/speclab
  strip "$BIN" target/gpu-check/speclab 2>/dev/null || true
  # The tracked tree is about 59 MiB of the device tool's 64 MiB: carry the binaries packed
  # (target/gpu-pack, about 3.4 MB at xz -9e) and unpack them there with
  #   run(command="bash recipes/unpack_bins.sh && ...", carry=["target/gpu-pack"])
  mkdir -p target/gpu-pack
  rm -f target/gpu-pack/*.tar.xz
  tar cf - -C target/gpu-check gpu_check speclab | xz -9e -T1 > target/gpu-pack/bins.tar.xz
  ls -la target/gpu-check target/gpu-pack
  exit 0
fi

OUT="${OUT:-/tmp/gpu-check-out}"
mkdir -p "$OUT"
[ -x "$BIN" ] || { echo "missing $BIN: run 'bash recipes/gpu_check.sh --build' here and carry target/gpu-check"; exit 3; }

source recipes/cuda_env.sh
echo "libnvrtc: ${NVRTC:-not found}"
nvidia-smi -L || true
set -o pipefail
# The step loop end to end (scheduler + MTP drafter + CUDA target): greedy output of
# --device cuda must equal --device cpu. Before the check so its table stays last.
CLI=target/gpu-check/speclab
if [ -x "$CLI" ]; then
  P=1,1000,2000,3000,4000,500,600,700
  for dev in cpu cuda; do
    timeout 120 "$CLI" generate --model models/tiny --device $dev --drafter mtp --num-spec 2 \
      --prompt-ids $P --max-tokens 48 --ignore-eos --json > "$OUT/generate_$dev.json" 2> "$OUT/generate_$dev.err" \
      || echo "generate --device $dev failed: $(tail -3 "$OUT/generate_$dev.err")"
  done
  python3 - "$OUT" <<'PY' || true
import json, sys
d = sys.argv[1]
try:
    a, b = (json.load(open(f"{d}/generate_{x}.json"))["output_ids"] for x in ("cpu", "cuda"))
    print("generate --drafter mtp --num-spec 2: cuda output", "EQUALS" if a == b else "DIFFERS FROM", "cpu output", f"({len(b)} tokens)")
except Exception as e:
    print("generate comparison unavailable:", e)
PY
fi
# On a parity failure, locate bad memory accesses (compute-sanitizer works on the
# Firecracker machines) before printing the table again.
rc=0
"$BIN" --model models/tiny --json "$OUT/gpu_check.json" --steps 50 > "$OUT/gpu_check.log" 2>&1 || rc=$?
if [ "$rc" != 0 ] && command -v compute-sanitizer >/dev/null; then
  timeout 240 compute-sanitizer --tool memcheck --print-limit 30 "$BIN" --model models/tiny --parity-only \
    --json /tmp/sanitized.json > "$OUT/sanitizer.log" 2>&1 || true
  echo "compute-sanitizer (exit $rc run): $(grep -c 'Invalid' "$OUT/sanitizer.log" || true) invalid accesses; head:"
  grep -m 8 -A3 'Invalid\|ERROR' "$OUT/sanitizer.log" || true
fi
cat "$OUT/gpu_check.log"
exit "$rc"
