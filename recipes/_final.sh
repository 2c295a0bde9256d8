# one-off: the records of this session in one call (device_all), then the W4_ILP sweep if time is left
S=$(date +%s)
COMMIT=${COMMIT:-} bash recipes/device_all.sh > $OUT/device_all.txt 2>&1; echo "device_all rc $?"
tail -60 $OUT/device_all.txt | cut -c1-180
source recipes/cuda_env.sh
for d in "W4_ILP=2" "W4_ILP=4" "W4_TS=1,W4_ILP=2"; do
  [ $(( $(date +%s) - S )) -lt 500 ] || break
  echo "== $d"
  SPECLAB_KERNEL_DEFINES=$d timeout 60 target/gpu-check/speclab bench moe --m 1,4,16,64 --routing uniform,sequence --iters 30 --out $OUT/v-$d.json > $OUT/v-$d.txt 2>$OUT/v-$d.log
  tail -10 $OUT/v-$d.txt | head -9
done
cd $OUT && tar czf v.tgz v-* device_all.txt && rm -rf v-* .v-*
