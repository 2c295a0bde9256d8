# one-off: ncu stall breakdown of the final INT4 kernels at M = 1 and 16 (uniform)
source recipes/cuda_env.sh
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for m in 1 16; do
  timeout 150 "$NCU" --clock-control none -k regex:'moe_.*_w4' -c 2 --print-details all \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis \
    target/gpu-check/speclab bench moe --m $m --routing uniform --iters 1 --copies 1 --check-pairs 8 \
    --out /tmp/ncu.json > "$OUT/ncu-final-m$m.txt" 2>&1
  echo "== M=$m exit $?"
  grep -E "moe_.*w4 \(|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Issued Warp|Warp Cycles Per Issued|Stall [A-Z]|Executed Instructions  |Registers Per" "$OUT/ncu-final-m$m.txt" | grep -vE " 0(\.0+)?$" | head -60
done
