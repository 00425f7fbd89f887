#!/usr/bin/env bash
# A/B two versions of kernel sources in one GPU call: runs CMD with the working tree's files (A),
# then with each FILE replaced by its alternative ALT (B), then puts the A files back.
# Usage: bash scripts/ab_sources.sh FILE=ALT [FILE=ALT ...] -- CMD ...
#   e.g. (on branch sm90bwd3, main's versions saved beside it, untracked, so the device gets them):
#   git show main:kernels_cu/sm90/bwd.cuh > ab/bwd.cuh; git show main:kernels_cu/sm90/bwd_traits.cuh > ab/bwd_traits.cuh
#   bash scripts/ab_sources.sh kernels_cu/sm90/bwd.cuh=ab/bwd.cuh kernels_cu/sm90/bwd_traits.cuh=ab/bwd_traits.cuh \
#        -- bash scripts/gpu_run.sh sm90bwd
# Kernels compile from the files at run time (NVRTC), so each run sees its version; CUDA_CACHE_DISABLE
# (gpu_run.sh) keeps NVRTC's cache from mixing them up.
set -uo pipefail
pairs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do pairs+=("$1"); shift; done
[ "${1:-}" = "--" ] || { echo "usage: $0 FILE=ALT ... -- CMD ..." >&2; exit 2; }
shift
tmp=$(mktemp -d)
for p in "${pairs[@]}"; do f=${p%%=*}; cp "$f" "$tmp/$(echo "$f" | tr / _)"; done
restore() { for p in "${pairs[@]}"; do f=${p%%=*}; cp "$tmp/$(echo "$f" | tr / _)" "$f"; done; }
trap restore EXIT
echo "===== A: the working tree's sources"
"$@"
for p in "${pairs[@]}"; do f=${p%%=*}; a=${p#*=}; cp "$a" "$f"; done
echo "===== B: ${pairs[*]}"
"$@"
