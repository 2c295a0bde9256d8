# one-off: real manifests on the GPU (incl. the six-request wedge), then gpu_check with W4_ZSPLIT=0 (tiny, informational)
S=$(date +%s)
bash recipes/real_cuda.sh; echo "real_cuda rc $? ($(( $(date +%s) - S )) s)"
source recipes/cuda_env.sh
if [ $(( $(date +%s) - S )) -lt 420 ]; then
  SPECLAB_KERNEL_DEFINES=W4_ZSPLIT=0 timeout 120 target/gpu-check/gpu_check --model models/tiny --json $OUT/gc-zsplit0.json --steps 50 > $OUT/gc-zsplit0.log 2>&1
  sed -n '/^| batch/,/^$/p' $OUT/gc-zsplit0.log; grep -c '^  ok' $OUT/gc-zsplit0.log
fi
