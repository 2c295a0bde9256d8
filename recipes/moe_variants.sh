#!/usr/bin/env bash
# The INT4 MoE kernels under NVRTC tunables (issue 12): `speclab bench moe` once per variant
# (each a SPECLAB_KERNEL_DEFINES value, cuda/README.md), records into $OUT/v-<variant>.json
# and one archive $OUT/variants.tgz (the device tool returns at most 8 files).
#
#   here:    bash recipes/gpu_check.sh --build
#   device:  run(command="bash recipes/moe_variants.sh W4_TS=1 W4_TS=2 W4_TS=2,W4_FOLD=1",
#                carry=["target/gpu-check"], timeout_s=600)
# MOE_ARGS overrides the bench arguments (default: M = 1, 4, 16, 64, uniform and sequence).
# The sweep of runs/moe-variants/ ran these variants (runs/moe-variants/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/moe-variants-out}"
mkdir -p "$OUT"
[ $# -gt 0 ] || { echo "usage: bash recipes/moe_variants.sh DEFINES [DEFINES ...]"; exit 2; }
source recipes/cuda_env.sh
BIN=target/gpu-check/speclab
for d in "$@"; do
  echo "== $d"
  # shellcheck disable=SC2086
  SPECLAB_KERNEL_DEFINES=$d timeout 120 $BIN bench moe ${MOE_ARGS:---m 1,4,16,64 --routing uniform,sequence --iters 30} \
    --out "$OUT/v-$d.json" > "$OUT/v-$d.txt" 2> "$OUT/v-$d.log" || echo "variant $d failed: $(tail -2 "$OUT/v-$d.log")"
  tail -10 "$OUT/v-$d.txt" | head -9
done
(cd "$OUT" && tar czf variants.tgz v-* && rm -f v-* .v-*)
