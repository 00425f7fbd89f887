#!/usr/bin/env bash
# Pipe utilisation of the sm90 forward, plain against variants, on the lent GPU (ncu, one launch each):
#   bash scripts/ncu_pipes.sh "" --softcap "--alibi"      (each argument: scripts/profile_fwd.py's flags;
#   one with --cudnn profiles SDPA cuDNN's forward kernel on that shape instead of ours)
# Asks ncu which per-pipe metrics this GPU has (MUFU = xu, FMA, ALU, the wgmma tensor pipe) and prints
# them with the duration, the speed-of-light and the warp stall breakdown. Logs under $OUT.
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} CUDA_CACHE_DISABLE=1
ncu --query-metrics 2>/dev/null | grep -oE "^sm__(inst_executed_pipe_(xu|fma|alu|fmaheavy|fmalite)|pipe_(xu|fma|alu|fmaheavy|tensor_op_gmma|shared)_cycles_active)\b" \
  | sort -u > "$OUT/pipe-metrics.txt"
metrics=$(sed 's/$/.avg.pct_of_peak_sustained_active/' "$OUT/pipe-metrics.txt" | paste -sd,)
for flags in "$@"; do
  tag=$(echo "plain $flags" | tr -d ' -')
  echo "== ${flags:-plain}"
  kregex=fwd_sm90; case " $flags " in *" --cudnn "*) kregex=fprop ;; esac
  timeout 150 ncu -k regex:$kregex --launch-skip 3 -c 1 --section SpeedOfLight --section WarpStateStats \
    --section InstructionStats ${metrics:+--metrics "$metrics"} python3 scripts/profile_fwd.py $flags >"$OUT/ncu-$tag.txt" 2>&1
  grep -E "Duration|pct_of_peak|Throughput|Executed Ipc|Warp Cycles Per Issued|==ERR" "$OUT/ncu-$tag.txt" | head -30
done
