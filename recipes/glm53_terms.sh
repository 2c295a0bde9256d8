#!/usr/bin/env bash
# The term ledger of findings/glm53-mtp-speedup-terms.md: re-runs
# experiments/glm53-mtp-speedup-terms.ron with each of its two added terms on or off
# (hardware.ep_busiest: the busiest expert-parallel rank; hardware.allreduce_gb_s: the
# all-reduce bytes) and prints the predicted MTP N = 2 speed-up over N = 0 at c1 / c8 /
# c32 and N = 5 over N = 2 at c32. Both off is experiments/glm53-mtp-speedup-pool.ron's
# model. Records go to a temporary folder, never to runs/.
# Usage: bash recipes/glm53_terms.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bin=./target/release/speclab
[ -x "$bin" ] || cargo build --release --quiet
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
src=experiments/glm53-mtp-speedup-terms.ron
printf '%-22s %-10s %-10s %-10s %-12s\n' "terms" "n2/n0 c1" "n2/n0 c8" "n2/n0 c32" "n5/n2 c32"
for v in "neither:false:0.0" "busiest rank:true:0.0" "all-reduce bytes:false:360.0" "both:true:360.0"; do
  IFS=: read -r label busy gbs <<< "$v"
  tag=$(echo "$label" | tr -c 'a-z0-9\n' '-')
  m="$tmp/terms-$tag.ron"
  sed -e "s/ep_busiest: true, allreduce_gb_s: 360.0/ep_busiest: $busy, allreduce_gb_s: $gbs/" \
      -e "s/name: \"glm53-mtp-speedup-terms\"/name: \"glm53-terms-$tag\"/" "$src" > "$m"
  grep -q "ep_busiest: $busy, allreduce_gb_s: $gbs" "$m" || { echo "could not set the terms in $m" >&2; exit 1; }
  "$bin" run "$m" --fresh --out "$tmp/terms-$tag.json" > /dev/null
  "$bin" findings "$tmp/terms-$tag.json" --out-dir "$tmp" > /dev/null
  md="$tmp/glm53-terms-$tag.md"
  col() { grep -F "| \`$1\` |" "$md" | awk -F'|' '{print $5}' | awk '{print $1}'; }
  printf '%-22s %-10s %-10s %-10s %-12s\n' "$label" "$(col 'n=2 seqs=1')" "$(col 'n=2 seqs=8')" "$(col 'n=2 seqs=32')" "$(col 'n=5 seqs=32')"
done
