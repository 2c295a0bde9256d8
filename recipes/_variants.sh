# one-off: the MoE bench under NVRTC tunable variants, then gpu_check (tiny) with defaults
source recipes/cuda_env.sh
B=target/gpu-check/speclab
for d in "W4_TS=1" "W4_TS=1,W4_ZSPLIT=0" "W4_TS=1,W4_FOLD=1" "W4_TS=1,W4_MINB=5" "W4_TS=2" "W4_TS=2,W4_FOLD=1"; do
  echo "== $d"
  SPECLAB_KERNEL_DEFINES=$d timeout 120 $B bench moe --m 1,4,16,64 --routing uniform,sequence --iters 30 --out $OUT/v-$d.json > $OUT/v-$d.txt 2>$OUT/v-$d.log
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['w4_blocks_per_sm'], d['w4_regs_local'])" "$OUT/v-$d.json"
  tail -10 $OUT/v-$d.txt | head -9
done
OUT=$OUT/gc bash recipes/gpu_check.sh > $OUT/gc.txt 2>&1; tail -12 $OUT/gc.txt
cd $OUT && tar czf v.tgz v-* gc gc.txt && rm -rf v-* gc .v-*
