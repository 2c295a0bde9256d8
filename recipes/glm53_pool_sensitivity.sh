#!/usr/bin/env bash
# The KV-pool sensitivity of findings/glm53-mtp-speedup-pool.md: re-runs
# experiments/glm53-mtp-speedup-pool.ron with the calibrated pool (kv.calibrate
# num_blocks at N = 2, 512 in the manifest) set to each size given (default
# 350 400 450 512 600 800) and prints the predicted MTP N = 2 speed-up over
# N = 0 at c32 and N = 5 over N = 2 at c32. Records go to a temporary folder,
# never to runs/. Usage: bash recipes/glm53_pool_sensitivity.sh [BLOCKS...]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=./target/release/speclab
[ -x "$bin" ] || cargo build --release --quiet
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(350 400 450 512 600 800)
printf '%-10s %-28s %-28s\n' "num_blocks" "n=2 vs n=0 at c32" "n=5 vs n=2 at c32"
for nb in "${sizes[@]}"; do
  m="$tmp/pool-$nb.ron"
  sed -e "s/num_blocks: 512, num_speculative_tokens/num_blocks: $nb, num_speculative_tokens/" \
      -e "s/name: \"glm53-mtp-speedup-pool\"/name: \"glm53-mtp-speedup-pool-$nb\"/" \
      experiments/glm53-mtp-speedup-pool.ron > "$m"
  grep -q "num_blocks: $nb, num_speculative_tokens" "$m" || { echo "could not set num_blocks in $m" >&2; exit 1; }
  "$bin" run "$m" --fresh --out "$tmp/pool-$nb.json" > /dev/null
  "$bin" findings "$tmp/pool-$nb.json" --out-dir "$tmp" > /dev/null
  md="$tmp/glm53-mtp-speedup-pool-$nb.md"
  c32=$(grep -F '| `n=2 seqs=32` |' "$md" | awk -F'|' '{print $5}')
  n5=$(grep -F '| `n=5 seqs=32` |' "$md" | awk -F'|' '{print $5}')
  printf '%-10s %-28s %-28s\n' "$nb" "$c32" "$n5"
done
