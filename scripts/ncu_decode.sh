#!/usr/bin/env bash
# Issue 17's decode cells under ncu: our decode kernel against SDPA cuDNN's on one cell (one step each,
# scripts/decode_once.py), with the memory sections (DRAM and L2 throughput, bytes in flight),
# occupancy, launch shape and warp stalls. Usage: bash scripts/ncu_decode.sh [CELL] [SPLITS ...]
# (CELL default 1x131072; each SPLITS value one run of ours, 0 = the heuristic; cuDNN last).
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} CUDA_CACHE_DISABLE=1
cell=${1:-1x131072}; shift || true
runs=("${@:-0}")
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy --section WarpStateStats"
for who in "${runs[@]}" cudnn; do
  if [ "$who" = cudnn ]; then flags=--cudnn; else flags="--splits $who"; fi
  log="$OUT/ncu-decode-$cell-$who.txt"
  echo "== $cell ${flags}"
  timeout 150 ncu --profile-from-start off $sections python3 scripts/decode_once.py --cell "$cell" $flags >"$log" 2>&1
  grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Memory Throughput|L2 Hit|Grid Size|Block Size|Registers Per|Achieved Occupancy|Theoretical Occupancy|Waves Per SM|Dynamic Shared|Stall|==ERR" "$log" | head -40
done
