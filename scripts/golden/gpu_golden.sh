#!/usr/bin/env bash
# One GPU call for the restructuring guard: golden outputs (record or check) and the quick benchmark.
# Usage: bash scripts/golden/gpu_golden.sh record|check
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee "$OUT/env.txt"
mode=${1:-check}
if [ "$mode" = record ]; then
  time python3 scripts/golden/outputs_golden.py record "$OUT/outputs.json" 2>&1 | tail -5
else
  time python3 scripts/golden/outputs_golden.py check tests/golden/outputs.json 2>&1 | tee "$OUT/golden-check.log" | tail -45
fi
python3 -m cuflash.bench --quick --json "$OUT/bench-quick.json" 2>&1 | tee "$OUT/bench-quick.log" | tail -30
