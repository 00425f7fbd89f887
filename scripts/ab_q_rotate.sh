#!/usr/bin/env bash
# A/B of the sm90 atomic backward's rotated walk (BwdParams.q_rotate; CUFLASH_BWD_Q_ROTATE 1 / 0):
# the same kernel, the parameter alone differs; arms alternate in separate processes, SDPA in each.
# Usage (on the GPU machine): bash scripts/ab_q_rotate.sh [pairs] -- BENCH_ARGS from the environment.
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
for i in $(seq 1 ${1:-2}); do
  for rot in 1 0; do
    echo "== q_rotate $rot, pass $i" | tee -a "$OUT/ab-q-rotate.log"
    CUFLASH_BWD_Q_ROTATE=$rot python3 -m cuflash.bench ${BENCH_ARGS:---head-dims 128 64 --seqlens 2048 8192 --causal 0 --passes bwd} \
      --json "$OUT/ab-q-rotate-$rot-$i.json" 2>&1 | grep -v Warn | grep -E "^ +[0-9]" | tee -a "$OUT/ab-q-rotate.log"
  done
done
