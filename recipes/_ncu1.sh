source recipes/cuda_env.sh
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for d in "W4_TS=2" "W4_TS=1"; do
  SPECLAB_KERNEL_DEFINES=$d timeout 150 "$NCU" --clock-control none -k regex:'moe_.*_w4' -c 2 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats --section SchedulerStats \
    target/gpu-check/speclab bench moe --m 1 --routing uniform --iters 1 --copies 1 --check-pairs 8 \
    --out /tmp/ncu.json > "$OUT/ncu_$d.txt" 2>&1
  echo "== $d exit $?"
  grep -E "moe_.*w4|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|One or More Eligible|Issued Warp|L1/TEX Hit|Mem Busy|Max Bandwidth|Local" "$OUT/ncu_$d.txt" | head -40
  grep -iE "stall|bottleneck|est\. speedup" "$OUT/ncu_$d.txt" | head -12 | cut -c1-220
done
SPECLAB_KERNEL_DEFINES=W4_TS=1 timeout 100 target/gpu-check/speclab bench moe --m 1,4,16,64 --routing uniform,sequence --iters 30 --out $OUT/ts1.json | tail -10
