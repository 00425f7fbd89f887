#!/usr/bin/env bash
# One call on the lent GPU: environment facts, GPU tests, compute-sanitizer, benchmark.
# Usage: bash scripts/gpu_run.sh [golden] [tests] [alltests] [alltests1] [alltests2] [sanitize] [bench] [benchfull] [overhead] [roofline] [tune] [checktable] [dropoutdefault]
#        [fuzz] [peakmem] [ring] [ringbench] (ring, ringbench: 2 GPUs) [projectring] [varlen] [benchshapes]
#        [limits] [partiald] [bwddet] [bwdprofile] [branchcheck] [newapis] [failcheck] [decodetests] [softcaptests] [decode] [decodegraph] [overheadthread] [decodeab] [mergeab] [pagedtests] [pagedab] [pagedh200] [h200todo] [gqachunks] [profiledecode] [varlen] [alibi] [alibitiles] [scoremod] [snippettiles] [windowsinks] [windowbucket] [windowtiles] [sinkstests] [blockmask] [sm90fwd] [sm90bwd] [tilesched] [l2sections] [stagedo] [benchcells] [ncupipes] [detab] [detwaits] [splitd] [bwdncu] [bwdstall] [bwdab] [fwdstall] [mufu]  (the sm90 bring-up harness: correctness matrix and per-config timings)
#        (default: tests sanitize bench). golden: the restructuring guard's bitwise output check;
#        tests: every GPU test plus the CPU test files that need torch (skipped in CI, run only here);
#        alltests: the whole suite, CPU compile tests included (over 555 s on an H100 with xdist: split it
#        over two calls as alltests1, the GPU tests and torch's CPU files, and alltests2, the other CPU files).
# Writes logs and JSON under $OUT (or ./out when $OUT is unset).
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# NVRTC 13 caches compiles (~/.nv/ComputeCache) and returns an empty log on a hit, which would hide
# ptxas' resource report from the compile tests and the tuner's pruning.
export CUDA_CACHE_DISABLE=1
stages=${*:-tests sanitize bench}
# pytest-xdist is on the H200 image: the compile-heavy suite spreads over its 16 cores (the tests share
# the one GPU; test_tune_gpu.py, which times what it asserts on, runs after them alone). XDIST= runs serially.
XDIST=${XDIST--n 14}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv | tee "$OUT/env.txt"
python3 -c "import cupy, sys; print('cupy', cupy.__version__, 'nvrtc', cupy.cuda.nvrtc.getVersion(), 'runtime', cupy.cuda.runtime.runtimeGetVersion(), 'py', sys.version.split()[0])" | tee -a "$OUT/env.txt"
# memcheck, racecheck and synccheck over one script, their summaries appended to a log
sanitize_script() {
  for tool in memcheck racecheck synccheck; do
    timeout 120 compute-sanitizer --tool $tool --report-api-errors no --print-limit 20 python3 "$1" 2>&1 | tail -3 | tee -a "$2"
  done
}
# ncu PC sampling of one kernel launch (the 4th matching KERNEL_REGEX): NAME.log, the raw page's PICK
# columns on stdout (scripts/ncu_raw_pick.py), with SASS=1 the stalls per SASS instruction in
# NAME-sass.csv.gz; the report itself removed. Usage: ncu_stall NAME KERNEL_REGEX SASS "PICK ..." -- COMMAND...
ncu_stall() {
  local name=$1 regex=$2 sass=$3 pick=$4
  shift 5
  timeout 150 ncu -k regex:"$regex" --launch-skip 3 -c 1 --set full -f -o "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  ncu --import "$OUT/$name.ncu-rep" --page raw --csv 2>/dev/null | python3 scripts/ncu_raw_pick.py $pick
  if [ "$sass" = 1 ]; then
    ncu --import "$OUT/$name.ncu-rep" --page source --csv --print-source sass 2>/dev/null | gzip > "$OUT/$name-sass.csv.gz"
  fi
  rm -f "$OUT/$name.ncu-rep"
}
for s in $stages; do
  case $s in
    golden) python3 scripts/golden/outputs_golden.py check tests/golden/outputs.json 2>&1 | tee "$OUT/golden.log" | tail -45 ;;
    alltests|alltests1|alltests2)  # -v: each result is written as it comes, so a timeout still leaves the failures' names.
      # The whole suite needs more than one call's 600 s on an H100 (2026-12-06): alltests1 runs the GPU tests
      # and the CPU files that need torch, alltests2 the other CPU files (the compile tests CI also runs).
      needs_torch='^\s*(import torch|torch = pytest.importorskip)'
      case $s in
        alltests) files=tests ;;
        alltests1) files="tests/gpu $(grep -l -E "$needs_torch" tests/test_*.py | tr '\n' ' ')" ;;
        alltests2) files=$(grep -L -E "$needs_torch" tests/test_*.py | tr '\n' ' ') ;;
      esac
      # tests/gpu/test_tune_gpu.py alone afterwards, as `tests` does: it times what it asserts on, and its
      # tuner workers ran out of GPU memory beside 15 other workers (xdist 16, H100, 2026-12-07)
      tune_file=tests/gpu/test_tune_gpu.py
      timeout ${ALLTESTS_TIMEOUT:-500} python3 -m pytest -v $files $XDIST -p no:cacheprovider -rfE --durations=15 \
        $(case " $files " in *" tests/gpu "*|*" tests "*) echo --ignore=$tune_file ;; esac) >"$OUT/$s.log" 2>&1
      case " $files " in *" tests/gpu "*|*" tests "*)
        timeout 200 python3 -m pytest -v -p no:cacheprovider -rfE $tune_file >>"$OUT/$s.log" 2>&1 ;; esac
      grep -E " FAILED | ERROR |(passed|failed).* in " "$OUT/$s.log" | tail -60 ;;
    tune)  # the export merges into a copy of this GPU's shipped table, named as cuflash.bench.gpu_slug names it
           # (nvidia-h200, nvidia-h100-80gb-hbm3; stale entries of a re-tuned family: drop them by hand)
      slug=$(python3 -c "import sys; from cuflash.bench import gpu_slug; print(gpu_slug(sys.argv[1]))" \
        "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)")
      [ -f "tuning/$slug.json" ] && cp "tuning/$slug.json" "$OUT/$slug${TUNE_TAG:-}.json"
      python3 -m cuflash.tune --kernels ${TUNE_KERNELS:-fwd bwd bwd_dq fwd_sm90 bwd_sm90} --dtypes ${TUNE_DTYPES:-bf16} --seqlens ${TUNE_SEQLENS:-8192} \
        --head-dims ${TUNE_HEAD_DIMS:-64 128} --perf-classes ${TUNE_CLASSES:-dense dropout softcap} ${TUNE_ARGS:-} \
        --json "$OUT/tune${TUNE_TAG:-}.json" --export "$OUT/$slug${TUNE_TAG:-}.json" 2>&1 | tee "$OUT/tune${TUNE_TAG:-}.log" | tail -45
      rm -f "$OUT/$slug${TUNE_TAG:-}.json.lock" ;;
    dropoutdefault)  # branch dropout-class-default's tile (two consumers, no ping-pong, two Q stages, drawn grid) against
                     # main's untuned dropout tile, on this GPU's tuned dropout shapes: check_table over a copy of the
                     # table (H200: the shipped one; H100: its 84 tuned entries) whose dropout entries name that tile
      src=${DROPOUT_SRC:-tuning/nvidia-h200.json}
      nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 && src=${DROPOUT_SRC:-docs/bench/tune-h100-all-84-entries-2026-12-07.json}
      python3 -c "
import json, sys
from cuflash.tuning_store import source_fingerprint
doc = json.load(open(sys.argv[1]))
tile = dict(block_k=128, consumers=2, stages=2, pingpong=0, overlap=1, q_stages=2, persistent=2)
# the shapes' entries name today's sources: check_table compares the two tiles on today's kernel
doc['entries'] = [dict(e, config=dict(e['config'], **tile), source=source_fingerprint('fwd_sm90')) for e in doc['entries']
                  if e['kernel'] == 'fwd_sm90' and e['perf_class'] == 'dropout']
json.dump(doc, open(sys.argv[2], 'w'), indent=1)" "$src" "$OUT/dropout-default-proposed.json"
      timeout ${CHECK_TABLE_TIMEOUT:-300} python3 scripts/check_table.py "$OUT/dropout-default-proposed.json" \
        --json "$OUT/dropout-default-check.json" 2>&1 | grep -v Warning | tee "$OUT/dropout-default-check.log" ;;
    checktable)  # a tuned table's entries against the untuned tile before they ship (CHECK_TABLE: the table, default
                 # the H100's 84 tuned entries of 2026-12-07; CHECK_TABLE_ARGS e.g. --kernels fwd_sm90 --classes dense)
      timeout ${CHECK_TABLE_TIMEOUT:-540} python3 scripts/check_table.py ${CHECK_TABLE:-docs/bench/tune-h100-all-84-entries-2026-12-07.json} \
        ${CHECK_TABLE_ARGS:-} --json "$OUT/check-table.json" --write "$OUT/checked-table.json" 2>&1 | grep -v Warning \
        | tee "$OUT/check-table.log" ;;
    tests) python3 -m pytest -q $XDIST -p no:cacheprovider -rfE --maxfail=30 -m gpu tests --ignore=tests/gpu/test_tune_gpu.py ${TESTS_ARGS:-} 2>&1 \
             | tee "$OUT/gpu-tests.log" | tail -40
           # serially: its re-measurement of tuned against default is skipped while other workers share the GPU
           python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/gpu/test_tune_gpu.py 2>&1 | tee -a "$OUT/gpu-tests.log" | tail -5
           python3 -m pytest -q -p no:cacheprovider -rfE tests/test_torch_meta.py tests/test_signature.py tests/test_interop.py \
             tests/test_mask.py tests/test_reference.py tests/test_bench.py tests/test_roofline.py 2>&1 | tee "$OUT/torch-cpu-tests.log" | tail -15 ;;
    sanitize)
      for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do
        for cases in ${SANITIZE_CASES:-sanitize_cases sanitize_features}; do
          echo "== $tool $cases" | tee -a "$OUT/sanitize.log"
          timeout ${SANITIZE_TIMEOUT:-600} compute-sanitizer --tool $tool --report-api-errors no --print-limit 20 python3 scripts/$cases.py 2>&1 | tail -6 | tee -a "$OUT/sanitize.log"
        done
      done
      # every run must end in "ERROR SUMMARY: 0 errors" (racecheck: "0 hazards"): say which did not
      bad=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitize.log" | grep -vE ": 0 (errors|hazards)" | wc -l)
      runs=$(grep -cE "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitize.log")
      echo "sanitize: $runs summaries, $bad not clean" | tee -a "$OUT/sanitize.log" ;;
    bench) python3 -m cuflash.bench --quick --json "$OUT/bench-quick.json" 2>&1 | tee "$OUT/bench-quick.log" ;;
    fuzz) CUFLASH_FUZZ_CASES=${FUZZ_CASES:-2000} timeout ${FUZZ_TIMEOUT:-300} python3 -m pytest -q $XDIST -p no:cacheprovider \
            -rfE tests/gpu/test_fuzz_gpu.py tests/gpu/test_concurrency_gpu.py tests/gpu/test_soak_gpu.py 2>&1 \
            | tee "$OUT/fuzz.log" | tail -25 ;;
    ring) timeout ${RING_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_ring_gpu.py 2>&1 \
            | tee "$OUT/ring.log" | tail -20 ;;  # needs 2 GPUs: run with kind nvidia-h200-x2
    ringbench) for n in ${RING_SEQLENS:-262144}; do  # 2+ GPUs: issue 15's per-GPU throughput bar
                 timeout 300 python3 scripts/bench_ring.py --seqlen $n --json "$OUT/ring-bench-$n.json" 2>&1 \
                   | grep -v Warning | tee -a "$OUT/ring-bench.log" | tail -6
               done ;;
    projectring)  # issue 16 (4 / 8 GPUs not lent): the ring's per-GPU throughput projected from one GPU's times
      # at 1M tokens; the link's GB/s: LINK_GBPS, else the K/V exchange of a ringbench run before it (2 GPUs)
      gbps=${LINK_GBPS:-$(python3 -c "import glob, json; r = [x['exchange_gbps'] for f in glob.glob('$OUT/ring-bench-*.json') for x in json.load(open(f))]; print(min(r) if r else '')")}
      [ -n "$gbps" ] || { echo "projectring: no LINK_GBPS and no ringbench run before it"; continue; }
      timeout ${PROJECT_RING_TIMEOUT:-400} python3 scripts/project_ring.py --seqlen ${PROJECT_SEQLEN:-1048576} --gpus ${PROJECT_GPUS:-2 4 8} \
        --link-gbps $gbps --json "$OUT/project-ring.json" 2>&1 | grep -v Warning | tee "$OUT/project-ring.log" | tail -5 ;;
    varlen) timeout 300 python3 -m pytest -q $XDIST -p no:cacheprovider -rfE tests/gpu/test_varlen_gpu.py tests/test_varlen.py \
              2>&1 | tee "$OUT/varlen-tests.log" | tail -25
            timeout 240 python3 scripts/bench_varlen.py --json "$OUT/bench-varlen.json" 2>&1 | tee "$OUT/bench-varlen.log" | tail -4 ;;
    newapis) timeout ${NEWAPIS_TIMEOUT:-300} python3 -m pytest -q $XDIST -p no:cacheprovider -rfE --maxfail=30 \
               tests/gpu/test_cache_batch_gpu.py tests/gpu/test_cache_leftpad_gpu.py tests/gpu/test_seqused_gpu.py tests/gpu/test_paged_varlen_gpu.py \
               tests/gpu/test_sinks_gpu.py tests/gpu/test_transformers_gpu.py tests/test_transformers_masks.py \
               tests/gpu/test_varlen_gpu.py::test_torch_compile_runs_varlen 2>&1 \
               | tee "$OUT/newapis-tests.log" | tail -25 ;;  # cache_batch_idx, seqused_q/k, paged varlen, varlen sinks, transformers' padded / packed rows (2026-12-05)
    softcaptests)  # softcap's GPU files with the library's own tiles (the class defaults: d128's two Q stages passed
                   # here on an H100, 2026-12-07), then softcap's cost against plain per tile (bench_softcap.py)
      timeout ${SOFTCAP_TESTS_TIMEOUT:-240} python3 -m pytest -q $XDIST -p no:cacheprovider -rfE --maxfail=30 tests/gpu/test_softcap_gpu.py \
        tests/gpu/test_score_mod_gpu.py tests/gpu/test_varlen_gpu.py tests/test_features.py 2>&1 | tee "$OUT/softcap-tests.log" | tail -6
      timeout ${SOFTCAP_BENCH_TIMEOUT:-200} python3 scripts/bench_softcap.py --seqlens 2048 8192 --json "$OUT/softcap-bench.json" 2>&1 \
        | grep "TFLOP/s" | tee "$OUT/softcap-bench.log" ;;
    failcheck)  # the 2026-12-06 H100 run's failures, with tracebacks (that run timed out before its summary):
                # seqused with NaN against finite unused rows, the paged bitwise cases (now without prepared
                # plans), cache_batch's repeated indices, rotary over paged caches (fixed since), then the files
      timeout 80 python3 scripts/debug_fails.py 2>&1 | grep -v Warn | tee "$OUT/debug-fails.log" | tail -13
      timeout ${FAILCHECK_TIMEOUT:-300} python3 -m pytest -q $XDIST -p no:cacheprovider --tb=short --maxfail=20 \
        tests/gpu/test_seqused_gpu.py tests/gpu/test_paged_gpu.py tests/gpu/test_cache_batch_gpu.py \
        tests/gpu/test_cache_leftpad_gpu.py tests/gpu/test_transformers_gpu.py 2>&1 \
        | tee "$OUT/failcheck.log" | grep -E "^E |passed|failed|\.py:[0-9]+: " | head -60 ;;
    mergeab)  # issue 17's 1 x 128k cell (0.988 of cuDNN on the H200 on 2026-12-07) after the split decode's one-pass
              # merge (merged 2026-12-07 after its H100 tests; H100 A/B 1.000 / 0.998 of cuDNN): decodeab against the
              # kernel before it (MERGE_BASE)
      mkdir -p ab && git show ${MERGE_BASE:-e8c46fe}:kernels_cu/sm80/decode.cuh > ab/decode_old.cuh
      AB_ROUNDS=${AB_ROUNDS:-2} bash "$0" decodeab 2>&1 | grep -E "=====| x " ;;
    decodetests) timeout ${DECODE_TESTS_TIMEOUT:-300} python3 -m pytest -q $XDIST -p no:cacheprovider -rfE --maxfail=30 \
                   tests/gpu/test_decode_gpu.py tests/gpu/test_kvcache_gpu.py tests/gpu/test_staging_gpu.py \
                   tests/gpu/test_flash_attn_interface_gpu.py $(ls tests/gpu/test_paged_gpu.py 2>/dev/null) ${TESTS_EXTRA:-} 2>&1 \
                   | tee "$OUT/decode-tests.log" | tail -25 ;;  # the KV-cache kernels (issue 17)
    branchcheck)  # the waiting branches' first GPU run (decode-next = gqa-fused-bwd + decode-host + the decode
                  # kernel's own lengths and tuning; decode-graphs: graph-owned temporaries of captured calls): their tests
      timeout ${BRANCHCHECK_TIMEOUT:-400} python3 -m pytest -q $XDIST -p no:cacheprovider -rfE --maxfail=30 \
        tests/gpu/test_gqa_gpu.py tests/gpu/test_varlen_gpu.py tests/gpu/test_decode_gpu.py tests/gpu/test_kvcache_gpu.py \
        tests/gpu/test_staging_gpu.py tests/gpu/test_paged_gpu.py tests/gpu/test_fuzz_kvcache_gpu.py \
        tests/gpu/test_graphs_gpu.py tests/gpu/test_kvcache_graphs_gpu.py 2>&1 \
        | tee "$OUT/branch-tests.log" | tail -25
      timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE -k decode tests/gpu/test_tune_gpu.py 2>&1 \
        | tee -a "$OUT/branch-tests.log" | tail -5 ;;
    decode) timeout ${DECODE_TIMEOUT:-240} python3 scripts/bench_decode.py --json "$OUT/bench-decode.json" 2>&1 \
              | grep -v Warning | tee "$OUT/bench-decode.log" | tail -8 ;;  # issue 17's decode bandwidth bar
    decodegraph)  # issue 17's closing table from CUDA-graph replays (the bar's cells, paged 16 / 256), then the
                  # paged probe with the library's tile choice (families/sm80.py _decode_paged_tile) at d128 and d256
      timeout ${DECODE_TIMEOUT:-200} python3 scripts/bench_decode.py --graph --json "$OUT/bench-decode-graph.json" 2>&1 \
        | grep " x " | tee "$OUT/bench-decode-graph.log"
      [ "${DECODE_PROBES:-1}" = 1 ] || continue  # DECODE_PROBES=0: the table alone
      for d in 128 256; do timeout 100 python3 scripts/paged_probe.py --head-dim $d --tiles default \
        --json "$OUT/paged-probe-d$d.json" 2>&1 | grep " x " | tee -a "$OUT/paged-probe.log"; done
      # d64: its 4-warp default read 3-8% under 8 warps, 3 stages on contiguous caches (H100, 2026-12-05)
      timeout 100 python3 scripts/paged_probe.py --head-dim 64 --tiles default 8,3 --cells 1x131072 8x8192 8x32768 64x2048 \
        --json "$OUT/paged-probe-d64.json" 2>&1 | grep " x " | tee -a "$OUT/paged-probe.log" ;;
    decodeab)  # the working tree's decode kernel (A) against AB_DECODE, an older sm80/decode.cuh (B; e.g. git show HEAD~1:kernels_cu/sm80/decode.cuh > ab/decode_old.cuh, untracked so the device gets it): issue 17's
               # graph table (heuristic splits) for each, AB_ROUNDS times in turn (scripts/ab_sources.sh)
      for r in $(seq ${AB_ROUNDS:-2}); do
        timeout ${DECODE_TIMEOUT:-240} bash scripts/ab_sources.sh kernels_cu/sm80/decode.cuh=${AB_DECODE:-ab/decode_old.cuh} -- \
          python3 scripts/bench_decode.py --graph --splits 0 2>&1 | grep -E "=====| x " | tee -a "$OUT/decode-ab.log"
      done ;;
    profiledecode) timeout ${PROFILE_DECODE_TIMEOUT:-120} python3 scripts/profile_decode.py 2>&1 | grep -v Warning \
                     | tee "$OUT/profile-decode.log" | grep -E "==|host us|x  " ;;  # host vs kernel time per decode step
    pagedh200)  # issue 17: the H200's slow paged reads (2026-12-06: 256-row pages at 0.71-0.74x of contiguous with the
                # d128 default; some tiles slow on pages in order, the contiguous cache's own addresses): page sizes and
                # orders per tile, then ncu of the default tile on 256- and on 16-row pages (memory and stall sections)
      timeout 200 python3 scripts/paged_probe.py --head-dim 128 --tiles default 8,2 4,4 --cells 1x131072 8x8192 \
        --layouts 16s 16o 64s 128s 256s 256o 512s --json "$OUT/paged-h200.json" 2>&1 | grep " x " | tee "$OUT/paged-h200.log"
      for ps in 256 16; do
        timeout 150 ncu --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
          --section Occupancy --section LaunchStats python3 scripts/decode_once.py --cell 1x131072 --page-size $ps \
          > "$OUT/ncu-paged$ps.txt" 2>&1
        grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|L2 Hit|Grid Size|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Stall" \
          "$OUT/ncu-paged$ps.txt" | head -20
      done ;;
    h200todo)  # what waits for an H200 (2026-12-08), in one call: issue 17's closing table (CUDA-graph replays against
               # cuDNN, paged 16 / 256; its 1 x 128k cell read 0.988 before the one-pass merge), then issue 13's window
               # bar under the width's-bucket rule on the H200's table: at most 150 + 300 s. (The ALiBi d64 re-tune
               # is a call of its own: TUNE_KERNELS=fwd_sm90 TUNE_HEAD_DIMS=64 TUNE_SEQLENS="2048 8192" TUNE_CLASSES=alibi tune.)
      DECODE_PROBES=0 DECODE_TIMEOUT=${DECODE_TIMEOUT:-150} bash "$0" decodegraph 2>&1 | grep " x "
      bash "$0" windowbucket 2>&1 | tail -30 ;;  # (600 s a call)
    pagedtests)  # pages of whole tiles (2026-12-06, 35th session: sm80/decode.cuh WHOLE_PAGES): the paged and decode tests
      timeout ${PAGED_TESTS_TIMEOUT:-300} python3 -m pytest -q $XDIST -p no:cacheprovider -rfE --maxfail=30 tests/gpu/test_paged_gpu.py \
        tests/gpu/test_paged_varlen_gpu.py tests/gpu/test_fuzz_kvcache_gpu.py tests/gpu/test_decode_gpu.py \
        tests/gpu/test_kvcache_graphs_gpu.py tests/gpu/test_kvcache_alibi_gpu.py tests/gpu/test_cache_batch_gpu.py \
        tests/gpu/test_cache_leftpad_gpu.py 2>&1 | tee "$OUT/paged-tests.log" | tail -15
      timeout 150 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/sanitize_paged.py 2>&1 \
        | tail -3 | tee "$OUT/sanitize-paged.log" ;;
    pagedab)  # the working tree's paged reads (A) against AB_DECODE's (B, default ab/decode_old.cuh): page sizes per tile
      timeout ${PAGED_AB_TIMEOUT:-400} bash scripts/ab_sources.sh kernels_cu/sm80/decode.cuh=${AB_DECODE:-ab/decode_old.cuh} -- \
        python3 scripts/paged_probe.py --head-dim 128 --tiles ${PAGED_TILES:-default 4,3 8,2 4,4} --cells 1x131072 8x8192 \
        --layouts ${PAGED_LAYOUTS:-16s 64s 256s 256o} 2>&1 | grep -E "=====| x " | tee "$OUT/paged-ab.log" ;;
    ncudecode) bash scripts/ncu_decode.sh ${NCU_DECODE_CELL:-1x131072} ${NCU_DECODE_SPLITS:-0} ;;  # ours vs cuDNN's decode kernel, memory sections
    alibi)  # issue 13's ALiBi: its GPU and compile tests, then its cost against the plain kernels
      timeout ${ALIBI_TIMEOUT:-300} python3 -m pytest -v $XDIST -p no:cacheprovider -rfE tests/gpu/test_alibi_gpu.py \
        tests/gpu/test_kvcache_alibi_gpu.py tests/test_alibi.py >"$OUT/alibi-tests.log" 2>&1; grep -E " FAILED | ERROR |(passed|failed).* in " "$OUT/alibi-tests.log" | tail -30
      timeout 240 python3 scripts/bench_alibi.py --json "$OUT/bench-alibi.json" 2>&1 | tee "$OUT/bench-alibi.log" ;;
    alibitiles)  # issue 13's ALiBi d64 forward per named tile, the working tree (A) against AB_FWD (B, an older
                 # kernels_cu/sm90/fwd.cuh, untracked: e.g. git show HEAD:kernels_cu/sm90/fwd.cuh > ab/fwd_old.cuh),
                 # then the explicit-tile GPU test on A
      timeout ${ALIBI_TILES_TIMEOUT:-300} bash scripts/ab_sources.sh kernels_cu/sm90/fwd.cuh=${AB_FWD:-ab/fwd_old.cuh} -- \
        python3 scripts/bench_alibi_tiles.py --rounds 3 2>&1 | grep -E "=====|^N|Error" | tee "$OUT/alibi-tiles-ab.log"
      timeout 100 python3 -m pytest -q $XDIST -p no:cacheprovider -rfE tests/gpu/test_alibi_gpu.py -k hopper_d64 2>&1 | tail -3 ;;
    scoremod)  # issue 13's user snippets: their GPU and CPU tests, then their cost against the built-ins
      timeout ${SCOREMOD_TIMEOUT:-300} python3 -m pytest -v $XDIST -p no:cacheprovider -rfE -s tests/gpu/test_score_mod_gpu.py \
        tests/test_score_mods.py >"$OUT/scoremod-tests.log" 2>&1
      grep -E " FAILED | ERROR |(passed|failed).* in |cold snippet" "$OUT/scoremod-tests.log" | tail -30
      timeout 240 python3 scripts/bench_score_mod.py --json "$OUT/bench-score-mod.json" 2>&1 | grep -v Warning \
        | tee "$OUT/bench-score-mod.log" ;;
    sinkstests)  # attention sinks (joined in the v2 forwards' epilogue since 2026-12-07): their GPU tests
      timeout 220 python3 -m pytest -q $XDIST -p no:cacheprovider -rfE tests/gpu/test_sinks_gpu.py tests/test_sinks.py \
        tests/gpu/test_alibi_gpu.py tests/gpu/test_score_mod_gpu.py tests/gpu/test_varlen_gpu.py -k "sink or Sink" 2>&1 \
        | tee "$OUT/sinks-tests.log" | tail -6 ;;
    windowsinks)  # issue 13's window bar (4096 at N32768 against full, visible FLOPs) and sinks bar (against plain)
      timeout ${WINDOW_SINKS_TIMEOUT:-240} python3 scripts/bench_window_sinks.py --json "$OUT/bench-window-sinks.json" 2>&1 \
        | grep -v Warning | tee "$OUT/bench-window-sinks.log" ;;
    windowbucket)  # issue 13's window bar under the width's-bucket rule (cuflash/_tuned.py _bucket: a 4096 window at
                   # N32768 takes the 4096 bucket's tiles) against the longer sequence's bucket (ab/tuned_old.py:
                   # git show <before>:cuflash/_tuned.py), forward and backward, d128 and d64
      mkdir -p ab && [ -f "${AB_TUNED:-ab/tuned_old.py}" ] || git show ${WINDOW_BUCKET_BASE:-e8c46fe}:cuflash/_tuned.py > ab/tuned_old.py
      timeout ${WINDOW_BUCKET_TIMEOUT:-300} bash scripts/ab_sources.sh cuflash/_tuned.py=${AB_TUNED:-ab/tuned_old.py} -- \
        python3 scripts/bench_window_sinks.py --only window --json "$OUT/window-bucket.json" 2>&1 | grep -v Warning \
        | tee "$OUT/window-bucket.log" ;;
    windowtiles)  # issue 13's window bar by tile (2026-12-07, H200: the automatic tiles' windows 0.880-0.899 of full
                  # forward): a 4096 window's forward on named tiles (128-key blocks: block ceiling 0.970 against
                  # the tuned 192-key tile's 0.941; two Q stages for the short tiles' hand-over; the N4096 entries)
      timeout ${WINDOW_TILES_TIMEOUT:-240} python3 scripts/bench_window_sinks.py --only window --window-passes fwd \
        --windows 4096,0 --window-tiles ${WINDOW_TILES:-128,192,2,2,1,1,1,1 128,128,2,2,1,1,1,1 128,128,2,2,0,1,1,1 \
        128,128,2,2,1,1,2,1 128,128,2,2,0,1,2,2 128,128,2,2,0,1,1,2 64,128,3,2,1,1,1,2 64,128,3,2,1,1,2,2 64,128,2,2,1,1,2,2} \
        --json "$OUT/window-tiles.json" 2>&1 | grep -v Warning | tee "$OUT/window-tiles.log" ;;
    snippettiles)  # issue 13's snippet bar by tile: the softcap snippet on named tiles against the built-in
      timeout ${SNIPPET_TILES_TIMEOUT:-240} python3 scripts/bench_snippet_tiles.py --json "$OUT/snippet-tiles.json" 2>&1 \
        | grep -v Warning | tee "$OUT/snippet-tiles.log" ;;
    blockmask)  # issue 13's block masks for mask snippets: their GPU and CPU tests, then the snippet bench
      timeout ${BLOCKMASK_TIMEOUT:-240} python3 -m pytest -v $XDIST -p no:cacheprovider -rfE tests/gpu/test_block_mask_gpu.py \
        tests/test_block_mask.py >"$OUT/blockmask-tests.log" 2>&1
      grep -E " FAILED | ERROR |(passed|failed).* in " "$OUT/blockmask-tests.log" | tail -30
      timeout 240 python3 scripts/bench_score_mod.py --json "$OUT/bench-score-mod.json" 2>&1 | grep -v Warning \
        | tee "$OUT/bench-score-mod.log" ;;
    headdimv) timeout ${HEADDIMV_TIMEOUT:-240} python3 -m pytest -q $XDIST -p no:cacheprovider -rfE tests/gpu/test_head_dim_v_gpu.py \
                tests/test_head_dim_v.py 2>&1 | tee "$OUT/headdimv-tests.log" | tail -20 ;;  # issue 12: v's own head dim
    limits)  # issue 14's limits lifted on CPU, first run here: the d192 / d256 backward as on a ~99 KB GPU
             # (2-warp tiles, one dS^T buffer), varlen backwards and block masks past 65,535 on a grid axis
      timeout ${LIMITS_TIMEOUT:-300} python3 -m pytest -v $XDIST -p no:cacheprovider -rfE -k "99kb or 65535 or grid_axis" \
        tests/gpu/test_headdims_gpu.py tests/gpu/test_varlen_gpu.py tests/gpu/test_block_mask_gpu.py >"$OUT/limits-tests.log" 2>&1
      grep -E " FAILED | ERROR |(passed|failed).* in " "$OUT/limits-tests.log" | tail -30 ;;
    partiald)  # the Hopper forward's column-masking instances (forced sm90) against sm80 and SDPA
      for c in "" --causal; do timeout 200 python3 scripts/bench_partial_d.py $c --json "$OUT/bench-partial-d${c}.json" 2>&1 \
        | grep -v Warning | tee -a "$OUT/bench-partial-d.log"; done ;;
    peakmem) timeout 120 python3 scripts/peak_memory.py "$OUT/peak-memory.json" 2>&1 | tee "$OUT/peak-memory.log" ;;
    torchtests) timeout ${TORCH_TESTS_TIMEOUT:-240} python3 -m pytest -q $XDIST -p no:cacheprovider -rfE --maxfail=30 \
                  tests/gpu/test_torch_gpu.py tests/gpu/test_transformers_gpu.py tests/gpu/test_interop_gpu.py tests/gpu/test_graphs_gpu.py \
                  tests/test_torch_meta.py tests/test_interop.py 2>&1 | tee "$OUT/torch-tests.log" | tail -20 ;;  # issue 18's torch paths
    profileoverhead) timeout 120 python3 scripts/profile_overhead.py 2>&1 | grep -v Warning | tee "$OUT/profile-overhead.log" \
                       | head -150 ;;  # cProfile of the per-call host work at the overhead shape
    overhead) python3 -m cuflash.bench --overhead --json "$OUT/overhead.json" 2>&1 | tee "$OUT/overhead.log" ;;
    overheadthread)  # issue 18: the torch fwd + bwd step split at the backward per autograd thread setting, whole
                     # output kept (the reply's tail alone lost the device-thread lines, 2026-12-07)
      timeout 150 python3 scripts/overhead_thread.py >"$OUT/overhead-thread.log" 2>&1
      grep -E "step .*call->bwd" "$OUT/overhead-thread.log" ;;
    gqachunks)  # issue 12: the group loop's causal chunk sizes (16: the whole grid) against the default (the L2
                # rule), MHA and the expanded path, in one process
      timeout ${GQA_TIMEOUT:-300} python3 scripts/bench_gqa_bwd.py --causal 1 0 --chunks ${GQA_CHUNKS:-1 2 3 4 8 16} --rounds 8 \
        --json "$OUT/gqa-chunks.json" 2>&1 | grep -v Warning | tee "$OUT/gqa-chunks.log" | tail -4 ;;
    benchshapes)  # issue 12's figures: Llama-3-8B GQA (32/8 heads) against MHA at the same shape; head_dim 256
      for g in 4 1; do python3 -m cuflash.bench --head-dims 128 --hidden 4096 --gqa $g --seqlens 8192 --reps 20 \
                         --json "$OUT/bench-gqa$g.json" 2>&1 | tee -a "$OUT/bench-shapes.log" | tail -5; done
      python3 -m cuflash.bench --head-dims 256 --seqlens 2048 8192 --reps 20 --json "$OUT/bench-d256.json" 2>&1 \
        | tee -a "$OUT/bench-shapes.log" | tail -8 ;;
    splitd)  # issue 12: the split-head-dim Hopper backward (head_dim 256; automatic since 2026-12-04) and its
      # dq_bulk 4 twin (dQ staged over the block's Q / dO images; the default since 2026-12-04): their GPU tests, the
      # sanitizers over sanitize_features (which runs both), then both tiles timed in one process beside cuDNN
      timeout 300 python3 -m pytest -q $XDIST -p no:cacheprovider -rfE tests/gpu/test_backward_gpu.py tests/gpu/test_varlen_gpu.py \
        -k "256 or split_head_dim" 2>&1 | tee -a "$OUT/splitd.log" | tail -12
      sanitize_script scripts/sanitize_features.py "$OUT/splitd.log"
      SM90_BWD_CFG="256,64,2,2,0,0;256,64,2,2,4,0" timeout 240 python3 scripts/sm90_bringup.py benchbwd 2>&1 \
        | grep -v Warn | tee -a "$OUT/splitd.log" | tail -6 ;;
    benchfull) python3 -m cuflash.bench --json "$OUT/bench-full.json" 2>&1 | tee "$OUT/bench-full.log" ;;
    benchcells)  # some cells of the benchmark (BENCH_ARGS: its flags, e.g. --seqlens 512 1024 --passes fwd)
      python3 -m cuflash.bench ${BENCH_ARGS:-} --json "$OUT/bench-cells${BENCH_TAG:-}.json" 2>&1 | tee "$OUT/bench-cells${BENCH_TAG:-}.log" ;;
    ncupipes)  # NCU_CASES: profile_fwd.py flag sets separated by ';' (one ncu launch each: scripts/ncu_pipes.sh)
      IFS=';' read -ra ncu_cases <<< "${NCU_CASES:---d 64 --n 512 --causal;--d 64 --n 512 --causal --cudnn}"
      timeout ${NCU_TIMEOUT:-400} bash scripts/ncu_pipes.sh "${ncu_cases[@]}" ;;
    sm90bwd) for c in ${SM90_BWD_CFGS:-128,64,2,2,2,1 128,64,2,2,4,1 64,64,2,2,2,1 64,64,2,2,4,1}; do  # dq_bulk 4: not yet run
               SM90_BWD_CFG=$c timeout ${SM90_BWD_TIMEOUT:-90} python3 scripts/sm90_bringup.py bwd benchbwd 2>&1 \
                 | grep -v Warning | tee -a "$OUT/sm90-bwd.log" | tail -12; echo "[cfg $c rc=${PIPESTATUS[0]}]"
             done ;;
    bwdprofile)  # where the backward's time goes, beside SDPA cuDNN's (per kernel), per-CTA phase stamps of the
      # sm90 backward and forward's work tiles, and the deterministic mode's ratio to the atomic one
      timeout 180 python3 scripts/bwd_phases.py --json "$OUT/bwd-phases.json" 2>&1 | grep -E "^d[0-9]+ N" | tee "$OUT/bwdprofile.log"
      timeout 90 python3 scripts/trace_bwd_tiles.py --shapes 128:512,128:8192,64:512 --json "$OUT/trace-bwd.json" 2>&1 \
        | grep -v Warn | tee -a "$OUT/bwdprofile.log" | grep -E "span|epilogue|per iter|gap"
      timeout 90 python3 scripts/trace_fwd_tiles.py --shapes 128:512,128:1024,128:8192 --json "$OUT/trace-fwd.json" 2>&1 \
        | grep -vE "Warn|load_index" | tee -a "$OUT/bwdprofile.log" | grep -E "tiles|epilogue share"
      timeout 120 python3 scripts/bench_deterministic.py --no-sm80 --json "$OUT/bench-deterministic.json" 2>&1 | grep -v Warn \
        | tee -a "$OUT/bwdprofile.log" | tail -8 ;;
    mufu) timeout 60 python3 scripts/mufu_rate.py 2>&1 | tee "$OUT/mufu-rate.log" ;;  # issue 13: packed MUFU forms' rate
    bwdncu)  # issue 11's last cell: ncu's full set on our d128 main kernel and cuDNN's, unmasked, at N2048
      # (0.94x) and N8192 (0.98x main kernel against main kernel), one steady-state launch each
      for n in ${NCU_SEQLENS:-2048 8192}; do for who in ours cudnn; do
        timeout 150 ncu -k regex:"bwd_sm90|bprop" --launch-skip 3 -c 1 --set full python3 scripts/profile_bwd_pair.py $who --n $n \
          > "$OUT/ncu-bwd-d128-n$n-$who.txt" 2>&1
        grep -E "Duration|Executed Ipc Active|Issue Slots Busy|L2 Hit Rate|DRAM Throughput|No Eligible|Warp Cycles Per Issued" \
          "$OUT/ncu-bwd-d128-n$n-$who.txt" | sed "s/^/n$n $who /"
      done; done ;;
    bwdstall)  # issue 11's last cell: where the warps of ours and of cuDNN's main backward kernel stall (ncu's
      # PC sampling: totals per reason, and ours per SASS instruction), d128 unmasked, NCU_N (2048) keys
      for who in ours cudnn; do
        ncu_stall stall-$who "bwd_sm90|bprop" $([ $who = ours ] && echo 1 || echo 0) \
          "pcsamp_warps_issue_stalled inst_executed_pipe" -- python3 scripts/profile_bwd_pair.py $who --n ${NCU_N:-2048} \
          | sed "s/^/$who /" | tee -a "$OUT/stall-totals.txt" | sort -t' ' -k3 -g -r | head -14
      done ;;
    fwdstall)  # the forward's gaps (issue 12's d256 causal N2048, issue 13's softcap, d64 causal N512): ncu's PC
      # sampling, ours and cuDNN's stall totals per reason, and ours per SASS instruction
      # (scripts/ncu_stall_summary.py reads the csv); FWDSTALL_CASES: profile_fwd.py flag sets separated by ';';
      # FWDSTALL_WHO: "ours" alone skips cuDNN (which has no varlen case)
      IFS=';' read -ra fcases <<< "${FWDSTALL_CASES:---d 256 --n 2048 --causal;--d 128 --softcap;--d 64 --n 512 --causal}"
      for c in "${fcases[@]}"; do
        tag=$(echo "$c" | tr -d ' -'); [ -n "$tag" ] || tag=plain
        for who in ${FWDSTALL_WHO:-ours cudnn}; do
          [ $who = ours ] && { k=fwd_sm90; extra=; sass=1; } || { k=fprop; extra=--cudnn; sass=0; }
          ncu_stall fstall-$tag-$who $k $sass "pcsamp_warps_issue_stalled gpu__time_duration.sum inst_executed.sum" \
            -- python3 scripts/profile_fwd.py $c $extra \
            | grep -v not_issued | sed "s/^/$tag $who /" | tee -a "$OUT/fstall-totals.txt" | sort -k4 -g -r | head -8
        done
      done ;;
    bwdab)  # issue 11: the non-split Hopper backward's two scheduling constants (kernels_cu/sm90/bwd.cuh:
      # kBwdRowStatsAhead, kBwdDqHandoffLate), each A/B against the working tree, d128 unmasked beside cuDNN
      for alt in off ahead late; do
        case $alt in
          off) sed 's/kBwdRowStatsAhead = true;/kBwdRowStatsAhead = false;/; s/kBwdDqHandoffLate = true;/kBwdDqHandoffLate = false;/' ;;
          ahead) sed 's/kBwdDqHandoffLate = true;/kBwdDqHandoffLate = false;/' ;;
          late) sed 's/kBwdRowStatsAhead = true;/kBwdRowStatsAhead = false;/' ;;
        esac < kernels_cu/sm90/bwd.cuh > /tmp/bwd_$alt.cuh
        cmp -s kernels_cu/sm90/bwd.cuh /tmp/bwd_$alt.cuh && echo "bwdab: the $alt variant's edit did not apply"
        bash scripts/ab_sources.sh kernels_cu/sm90/bwd.cuh=/tmp/bwd_$alt.cuh -- env SM90_BWD_CFG=${BWDAB_CFG:-128,64,2,2,4,1} \
          SM90_BWD_SEQLENS=${BWDAB_SEQLENS:-2048,8192} SM90_BWD_CAUSAL=${BWDAB_CAUSAL:-0} SM90_BWD_NO_SM80=1 \
          timeout 120 python3 scripts/sm90_bringup.py benchbwd 2>&1 | grep -E "=====|^[{]" | sed "s/^/[$alt] /" | tee -a "$OUT/bwdab.log"
      done ;;
    detab)  # the deterministic backward's loss (issue 11): its CTA order by head groups (main) against key
      # blocks fastest (the atomic mode's order, a one-line variant) in one call, then ncu of the ordered
      # kernel beside the atomic one at d128 N2048 (DRAM and L2 traffic, stalls)
      sed 's/const BlockCoord blk = kOrdered ? schedule_blocks_grouped(/const BlockCoord blk = (kOrdered \&\& false) ? schedule_blocks_grouped(/' \
        kernels_cu/sm90/bwd.cuh > /tmp/bwd_kb_fastest.cuh
      grep -q "(kOrdered && false)" /tmp/bwd_kb_fastest.cuh || echo "detab: the variant's edit did not apply (bwd.cuh changed?)"
      bash scripts/ab_sources.sh kernels_cu/sm90/bwd.cuh=/tmp/bwd_kb_fastest.cuh -- bash -c \
        'timeout 90 python3 scripts/bench_deterministic.py --no-sm80 2>&1 | grep -E "^d[0-9]"' | tee "$OUT/detab.log"
      for which in ours det; do
        timeout 120 ncu -k regex:bwd_sm90 --launch-skip 3 -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
          --section WarpStateStats python3 scripts/profile_bwd_pair.py $which --n 2048 --d 128 > "$OUT/ncu-bwd-$which.txt" 2>&1
        grep -E "Duration|DRAM Throughput|L2 Hit|Memory Throughput|Warp Cycles Per Issued|==ERR" "$OUT/ncu-bwd-$which.txt" | head -8
      done ;;
    detwaits)  # issue 11's last bar: where the deterministic backward waits against the atomic one, per CTA
      # (turns, the store warp idle, completions, the consumers' staging), dense and causal, then the ratio
      for c in "" --causal; do timeout 120 python3 scripts/trace_det_waits.py --shapes ${DET_SHAPES:-64:2048,128:2048} $c \
        --json "$OUT/det-waits${c}.json" 2>&1 | grep -v Warn | tee -a "$OUT/det-waits.log"; done
      timeout 200 python3 scripts/bench_deterministic.py --no-sm80 --json "$OUT/bench-deterministic.json" 2>&1 \
        | grep -E "^d[0-9]" | tee -a "$OUT/det-waits.log" ;;
    bwddet)  # the Hopper deterministic backward (automatic on the H200 since the tenth session): its GPU
      # tests and the race test, the sanitizers over sanitize_features (which runs it), its speed against the atomic mode
      timeout 240 python3 -m pytest -q $XDIST -p no:cacheprovider -rfE tests/gpu/test_backward_gpu.py tests/gpu/test_race_gpu.py \
        tests/gpu/test_varlen_gpu.py -k "deterministic or refuses or race or atomic" 2>&1 \
        | tee -a "$OUT/bwddet.log" | tail -12
      sanitize_script scripts/sanitize_features.py "$OUT/bwddet.log"
      # BWDDET_BENCH=0: the tests and sanitizers only (detwaits has the Hopper-only bench)
      [ "${BWDDET_BENCH:-1}" = 1 ] && timeout 300 python3 scripts/bench_deterministic.py --json "$OUT/bench-deterministic.json" 2>&1 | grep -v Warn \
        | tee -a "$OUT/bwddet.log" | tail -8 ;;
    tilesched)  # the sm90 forward's tile orders (kernels_cu/sm90/tile_feed.cuh): bitwise tests, the sanitizers, the bench
      timeout 240 python3 -m pytest -q $XDIST -p no:cacheprovider -rfE tests/gpu/test_tile_feed_gpu.py tests/gpu/test_forward_gpu.py \
        tests/gpu/test_varlen_gpu.py 2>&1 | tee "$OUT/tilesched-tests.log" | tail -8
      sanitize_script scripts/sanitize_tile_feed.py "$OUT/tilesched.log"
      timeout 300 python3 scripts/bench_tile_sched.py --json "$OUT/bench-tile-sched.json" 2>&1 | grep -v Warn \
        | tee -a "$OUT/tilesched.log" | tail -12 ;;
    l2sections)  # the sm90 forward's causal order by L2 sections (attn/tile_order.cuh): its tests, memcheck, the A/B
      timeout ${L2_TESTS_TIMEOUT:-200} python3 -m pytest -q $XDIST -p no:cacheprovider -rfE tests/gpu/test_tile_feed_gpu.py \
        tests/gpu/test_forward_gpu.py tests/test_tile_order_twin.py 2>&1 | tee "$OUT/l2sections-tests.log" | tail -8
      timeout 120 compute-sanitizer --tool memcheck --report-api-errors no --print-limit 20 python3 scripts/sanitize_tile_feed.py \
        2>&1 | tail -3 | tee -a "$OUT/l2sections-tests.log"
      timeout ${L2_BENCH_TIMEOUT:-300} python3 scripts/bench_l2_sections.py --json "$OUT/bench-l2-sections.json" 2>&1 \
        | grep -v Warn | tee "$OUT/bench-l2-sections.log" | tail -16 ;;
    stagedo)  # the sm90 forward's staged epilogue: bitwise against the direct one, then q2 tiles beside cuDNN
      timeout 150 python3 scripts/check_staged_o.py 2>&1 | grep -v Warn > "$OUT/check-staged.log"; grep -E "BAD|mismatches" "$OUT/check-staged.log"
      timeout 200 python3 scripts/bench_fwd_configs.py --json "$OUT/bench-fwd-configs.json" 2>&1 | grep -v Warn \
        | tee "$OUT/bench-fwd-configs.log" | tail -30 ;;
    sm90fwd) timeout 300 python3 scripts/sm90_bringup.py check bench 2>&1 | tee "$OUT/sm90-fwd.log" | grep -v "^ok" | tail -40 ;;
    roofline) python3 -m cuflash.roofline --out "$OUT/roofline.png" --json "$OUT/roofline.json" 2>&1 | tee "$OUT/roofline.log" ;;
    *) echo "unknown stage $s" ;;
  esac
done
