# one-off: the records after the templated token count, in one call
source recipes/cuda_env.sh
timeout 60 target/gpu-check/speclab bench moe --m 1,16 --routing uniform --iters 20 --out $OUT/quick.json 2>/dev/null | tail -3
COMMIT=${COMMIT:-} bash recipes/device_all.sh > $OUT/device_all.txt 2>&1; echo "device_all rc $?"
grep -A12 "^ routing" $OUT/device_all.txt | head -12; grep -B2 -A8 "Best drafter" $OUT/device_all.txt | tail -8; grep -E "^\| (1|128) \| on" $OUT/device_all.txt | head -4
OUT=$OUT bash recipes/real_cuda.sh > $OUT/real.txt 2>&1; echo "real_cuda rc $?"; tail -3 $OUT/real.txt
cd $OUT && tar czf all.tgz device_all.txt real.txt quick.json
