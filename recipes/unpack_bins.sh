#!/usr/bin/env bash
# On the device machine: unpack the binaries `bash recipes/gpu_check.sh --build` packed into
# target/gpu-pack/bins.tar.xz (carried instead of target/gpu-check, which with the tracked
# tree would pass the device tool's 64 MiB) into target/gpu-check, where every recipe reads them.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f target/gpu-pack/bins.tar.xz ] || { echo "missing target/gpu-pack/bins.tar.xz: run 'bash recipes/gpu_check.sh --build' here and carry target/gpu-pack"; exit 3; }
mkdir -p target/gpu-check
tar xJf target/gpu-pack/bins.tar.xz -C target/gpu-check
