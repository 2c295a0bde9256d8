# Sourced by the one-call device recipes (sample_check.sh, df2_sample_check.sh) after
# `cd` to the repository root, with DEFAULT_OUT set: exports SPECLAB_GIT_COMMIT from
# COMMIT, sends the output to $FINAL/summary.txt as well, sets up the CUDA libraries
# (cuda_env.sh), and defines BIN / CHK (the carried binaries), C (the --commit flag), rc,
# W (a scratch directory for records, their locks and logs) and keep() (copy a finished
# record to $FINAL at once, so a call cut short keeps what finished; with KEEP_TAR=1 set
# before sourcing, append it to $FINAL/records.tar instead: the device tool returns at
# most 8 files a call).
[ -n "${COMMIT:-}" ] && export SPECLAB_GIT_COMMIT="$COMMIT"
FINAL="${OUT:-$DEFAULT_OUT}"
mkdir -p "$FINAL"
W=$(mktemp -d)
exec > >(tee "$FINAL/summary.txt") 2>&1
source recipes/cuda_env.sh
BIN=target/gpu-check/speclab
CHK=target/gpu-check/gpu_check
C=(--commit "${COMMIT:-unknown}")
rc=0
if [ "${KEEP_TAR:-0}" = 1 ]; then
  keep() { for f in "$@"; do [ -f "$f" ] && tar rf "$FINAL/records.tar" -C "$(dirname "$f")" "$(basename "$f")"; done; }
else
  keep() { cp "$@" "$FINAL/" 2>/dev/null; }
fi
