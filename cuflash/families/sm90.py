"""The Hopper (sm_90a) kernel family: the warp-specialised forward on TMA and wgmma.

kernels_cu/flash_fwd_sm90.cuh: one producer warpgroup loads Q and a ring of K/V tiles with TMA
(tensor maps encoded on the host per call: cuflash/tma.py, cuflash/_forward_sm90.py), consumer
warpgroups of 64 query rows each compute S = Q K^T and O += P V with wgmma, registers moved from the
producer to the consumers by setmaxnreg. Built for sm_90a, which runs on compute capability 9.0
only (H100, H200). The forward dispatch (families.choose) prefers it there, and falls back to the
mma.sync forward for calls it cannot serve (cuflash/tma.py says which).

Defaults are FlashAttention-3's shapes for these head dims (block_q 128, two consumers, ping-pong
and intra-warpgroup overlap on); not yet measured in cuflash.
"""
from __future__ import annotations

import dataclasses
import itertools

from ..tiles import Sm90BwdConfig, Sm90FwdConfig
from .base import F32, F32_IN, I32_WS, OUT, KernelFamily
from .sm80 import _run_fwd

# A CUtensorMap by value (kernels_cu/core/ptx_sm90.cuh): const __grid_constant__, so the kernel
# hands the TMA unit the parameter's own address.
TMA_MAP = "const __grid_constant__ cuflash::TmaMap"

# Registers per thread of a consumer warpgroup after setmaxnreg (kernels_cu/sm90/traits.cuh,
# Sm90FwdTraits::kConsumerRegs; one consumer has the file to itself, 255 is ptxas' per-thread limit),
# and what addresses, softmax statistics, loop state and the mask take besides the accumulators.
CONSUMER_REGS = {1: 255, 2: 240, 3: 160}
CONSUMER_OVERHEAD_REGS = 24  # measured: d64 three consumers, block_k 128 (152 estimated) compile clean in 160


def _acc(t) -> int:
    """A consumer thread's live accumulators: S (64 x block_k fp32), P (the same in 16 bits, packed
    in pairs) and O (64 x head_dim fp32), each spread over the warpgroup's 128 threads."""
    return t.block_k // 2 + t.block_k // 4 + t.head_dim // 2


def _consumer_cap(t, props) -> int:
    return CONSUMER_REGS.get(t.consumers, 0) - CONSUMER_OVERHEAD_REGS


def _call_problem(problem):
    from .. import tma

    return tma.call_problem(problem)


def _plan(problem, tile, dtype):
    from .._forward_sm90 import plan

    return plan(problem, tile, dtype)


def _product(d, block_k, consumers, stages, pingpong=(0, 1), overlap=(1,), q_stages=(1, 2), persistent=(0, 1, 2)) -> list:
    # overlap 0 (S, softmax, P V strictly in turn) was slower everywhere in the bring-up
    # (docs/bench/h200-sm90-bringup-2026-11-30.jsonl); it stays a valid tile, not a searched one
    return [Sm90FwdConfig(d, *c)
            for c in itertools.product(block_k, consumers, stages, pingpong, overlap, q_stages, persistent)]


def _drawn(tile):
    """The tile with the drawn tile order (persistent 2: sm90/tile_feed.cuh)."""
    return dataclasses.replace(tile, persistent=2)


FWD_SM90 = KernelFamily(
    name="fwd_sm90", description="forward on Hopper: TMA + wgmma, warp-specialised (out, lse)",
    what="sm90 forward", pass_="forward", tile_cls=Sm90FwdConfig,
    header="flash_fwd_sm90.cuh", template="cuflash::flash_fwd_sm90",
    # tile_counter: the dynamic tile order's counter (persistent 2: sm90/tile_feed.cuh), else null
    pointers=((TMA_MAP, "tq"), (TMA_MAP, "tk"), (TMA_MAP, "tv"), (OUT, "out"), (F32, "lse"), (I32_WS, "tile_counter")),
    params="FwdParams", min_cc=(9, 0), min_cc_why="needs TMA, wgmma and setmaxnreg (sm_90a)",
    max_cc=(9, 0), max_cc_why="wgmma and setmaxnreg are sm_90a-only: sm_90a code runs on 9.0 alone",
    arch_specific=True, backend="sm90",
    # column masking (a head dim between the instances', or v's own: MLA's 192 / 128) through the
    # rank-4 TMA maps (cuflash/tma.py): 1.5-2.6x the sm80 forward on the H200 (bf16, N 2048 / 8192,
    # causal or not; 192/128 at N 8192: 650.9 TFLOP/s, 1.08x cuDNN; scripts/bench_partial_d.py)
    takes_partial_d=True,
    domain=lambda d: (_product(d, (96, 128, 176, 192), (2,), (2,)) if d == 128
                      else _product(d, (64, 80), (2,), (2,)) if d == 256
                      else _product(d, (96, 112), (2,), (2,)) if d == 192
                      else _product(d, (96, 128, 192), (2, 3), (2,))),
    # measured on the H200 (bf16, seqlen 2k-16k, docs/bench/h200-sm90-bringup-2026-11-30.jsonl):
    # d128 128x128 ping-pong on a persistent grid; d64 three consumers (192 query rows), whose
    # dropout instantiation spills (160 registers), hence the two-consumer fallback
    defaults={
        64: (Sm90FwdConfig(64, 128, 3, 2, 1, 1, 1, 1), Sm90FwdConfig(64, 128, 2, 2, 1, 1, 1, 1)),
        128: (Sm90FwdConfig(128, 128, 2, 2, 1, 1, 1, 1), Sm90FwdConfig(128, 128, 2, 2, 0, 1, 1, 1)),
        # d256: FlashAttention-3's 128 x 80 with two consumers (O is 128 of a consumer's 240 registers;
        # Q 64 KB + two 80-key K/V stages 160 KB fill the 227 KB); ptxas-checked, not yet run
        256: (Sm90FwdConfig(256, 80, 2, 2, 1, 1, 1, 1), Sm90FwdConfig(256, 64, 2, 2, 1, 1, 1, 1)),
        192: (Sm90FwdConfig(192, 112, 2, 2, 1, 1, 1, 1), Sm90FwdConfig(192, 96, 2, 2, 1, 1, 1, 1)),  # FA3: 128 x 112
    },
    accumulator_registers=_acc, register_limit=_consumer_cap,
    # ptxas, sm_90a (tests/test_compile_sm90.py keeps this honest): three consumers have 160
    # registers each, which the dropout mask's Philox state does not fit; the softcap instance spills
    # 16 B (NVRTC 13.0 and 13.5; the two-consumer fallback compiles clean with softcap, dropout and
    # windows). The sliding-window one spilled 4 B under 13.0 until the consumers stopped walking the
    # tiles themselves (sm90/tile_feed.cuh, 2026-12-02): none now, so windows take the default
    spilling={"dropout": frozenset({Sm90FwdConfig(64, 128, 3, 2, 1, 1, 1, 1)}),
              "softcap": frozenset({Sm90FwdConfig(64, 128, 3, 2, 1, 1, 1, 1)})}, call_problem=_call_problem,
    # softcap's MUFU.TANH lengthens each consumer's softmax past the other's GEMMs, so ping-pong's
    # alternation costs more than it hides: at d128 the 128-key tile without it runs softcap at
    # 0.79-0.82x of plain where the ping-pong default gives 0.73-0.79x and dense's tuned tile
    # (192 keys) 0.74-0.75x (H200, bf16, N 2048 and 8192, scripts/bench_softcap.py, 2026-12-01)
    # At d64 the softcap class takes three consumers without ping-pong on a greedy persistent grid (its
    # instance compiles spill-free with every feature: 128 registers, NVRTC 13.0 and 13.5), what the
    # H200's tuner picked for d64 softcap; on an H100 it ran 5.5% / 10.8% faster than the two-consumer
    # fallback the family's defaults gave (N2048 / N8192, docs/bench/h100-softcap-fixedref-ab-2026-12-06b.log, B)
    # d128 takes two Q stages on a greedy persistent grid: on an H100 (main's kernel, cap 30, N2048 /
    # N8192) 481.0 / 523.7 TFLOP/s against 460.7 / 497.9 on one Q stage and a static grid, 0.888 /
    # 0.883 of plain (docs/bench/h100-softcap-fixedref-final-ab-2026-12-07.log, B); the H200's tuner
    # picked two Q stages for every d128 softcap entry
    class_defaults={"softcap": {128: (Sm90FwdConfig(128, 128, 2, 2, 0, 1, 2, 2),),
                                64: (Sm90FwdConfig(64, 128, 3, 2, 0, 1, 2, 2),)}},
    # ragged batches draw their tiles (persistent 2, kernels_cu/sm90/tile_feed.cuh): a CTA takes the next
    # tile when it is about to run out, so one sequence's long tiles do not pile up on a few CTAs as
    # they do with a static stride. H200, bf16, bench_varlen's 10 sequences (16k tokens, d128, 16
    # heads), TFLOP/s, the default tile strided / one CTA per tile / drawn: 469.7 / 511.8 / 514.3,
    # causal 374.7 / 372.1 / 428.7 (scripts/bench_tile_sched.py). On the dense table's tile: against a
    # dense batch of equal FLOPs on its tuned tile, in one run, varlen on that tile drawn ran 0.83x
    # (causal 0.99x), on the default tile drawn 0.73x (causal 0.77x) in another (scripts/bench_varlen.py)
    varlen_tile=_drawn,
    # a causal mask's tiles differ in length too: every tuned causal entry of the H200 table (bf16,
    # dense and softcap, d64 / d128 / d192 / d256, N 512-8192) drew its tiles, 1.06-1.27x the
    # default's static stride (tuning/nvidia-h200.json), so an untuned causal call draws them as well
    causal_tile=_drawn,
    plan=_plan, run=_run_fwd, deterministic_outputs=(0, 1), takes_varlen=True, takes_alibi=True, takes_user_mod=True,
    takes_block_mask=True, nullable_pointers=True, takes_sinks=True,
)


def _bwd_call_problem(problem):
    from .. import _backward_sm90

    return _backward_sm90.call_problem(problem)


def _bwd_main_args(problem, tile):
    from .. import _backward_sm90

    return _backward_sm90.main_args(problem, tile)


def _bwd_acc(t) -> int:
    """A consumer thread's resident accumulators: dK and dV (64 keys x head_dim fp32 each; the
    split-head-dim tile: x head_dim / 2) over 128 threads."""
    return t.head_dim // 2 if t.split_d else t.head_dim


def _run_bwd(tile, d, causal, features, props, out=None, lse=None):
    from .._backward import backward

    return tuple(backward(d["dout"], d["q"], d["k"], d["v"], d["out"], d["lse"], causal=causal, config=tile,
                          backend="sm90", **d["options"]))


# Measured on the H200 (docs/perf-notes.md, 2026-12-02, bf16, same run as cuDNN): the overlapped
# tile with dQ staged in fragment order and added by one bulk reduction per 16 KB block,
# (128, 64, 2, 2, 2, 1), runs d128 N8192 at 492 TFLOP/s (cuDNN 525; the same tile with per-element
# atomics 415, the store-warp tile 315, the sm80 kernel 255), d64 N8192 at 411 (cuDNN 434, sm80
# 244), so the automatic choice takes it at both head dims. The store-warp tile gains nothing from
# the overlap (314.5): its store warp, one bulk reduction per dQ row, is what it waits for.
# The eleventh session (2026-12-02, same process, bf16) measured dQ's fragment-order blocks reduced
# by the producer warpgroup's store warp instead (dq_bulk 4: the consumers go straight on to the next
# query block) 1-4% faster in all eight cells: d128 N8192 508.1 vs 497.3 (causal 473.3 vs 460.6),
# N2048 445.2 vs 435.4; d64 N8192 431.8 vs 414.6 (causal 410.9 vs 394.2; cuDNN 437.0 / 400.3).
# The twenty-second session (2026-12-04) read lse2 / delta ahead of their wgmma waits and handed each
# dQ block to the store warp under the next block's GEMMs (kernels_cu/sm90/bwd.cuh): +3.5%, every
# cell of the benchmark 0.97-1.18x cuDNN, d128 N8192 547.5 TFLOP/s (1.02x).
BWD_SM90 = KernelFamily(
    name="bwd_sm90", description="backward dK/dV on Hopper: TMA + wgmma (dQ by bulk reductions)", what="sm90 backward",
    pass_="backward", tile_cls=Sm90BwdConfig, header="flash_bwd_sm90.cuh", template="cuflash::flash_bwd_sm90",
    pointers=((TMA_MAP, "tq"), (TMA_MAP, "tk"), (TMA_MAP, "tv"), (TMA_MAP, "tdo"), (F32_IN, "lse2"),
              (F32_IN, "delta"), (F32, "dq_acc"), (OUT, "dk"), (OUT, "dv"), (I32_WS, "dq_sem")),
    params="BwdParams", min_cc=(9, 0), min_cc_why="needs TMA, wgmma and setmaxnreg (sm_90a)",
    max_cc=(9, 0), max_cc_why="wgmma and setmaxnreg are sm_90a-only: sm_90a code runs on 9.0 alone",
    arch_specific=True, backend="sm90", takes_partial_d=False,
    domain=lambda d: ([Sm90BwdConfig(d, 64, 2, 2, b, 0) for b in (0, 4)] if d > 128 else
                      [Sm90BwdConfig(d, 64, 2, s, b, o) for s in (2, 3) for b in (0, 1, 2, 4) for o in (0, 1)]),
    # The overlapped fragment-order tile first, then the same with atomics. Every tile of the
    # domain compiles without spills (NVRTC 13.0 and 13.5, sm_90a), dense and with a window,
    # softcap or ALiBi, since acc_dq no longer lives around the consumers' loop (dq_wg in sm90/bwd.cuh: it cost 32 registers, and the store-warp
    # tile spilled 16 B, 40 B with ALiBi and softcap), and with dropout since the dK/dV epilogue is
    # staged through shared memory (the atomic tile spilled 4-24 B with dropout, 8 B with ALiBi and
    # softcap, when it stored from the fragments).
    defaults={64: (Sm90BwdConfig(64, 64, 2, 2, 4, 1), Sm90BwdConfig(64, 64, 2, 2, 2, 1), Sm90BwdConfig(64, 64, 2, 2, 0, 1)),
              128: (Sm90BwdConfig(128, 64, 2, 2, 4, 1), Sm90BwdConfig(128, 64, 2, 2, 2, 1),
                    Sm90BwdConfig(128, 64, 2, 2, 0, 1)),
              # the split-head-dim tile (docs/sm90-backward-plan.md; Sm90BwdTraits::kSplitD): on the
              # H200 (2026-12-04, bf16, N2048 / 8192) 244-292 TFLOP/s against the sm80 kernel's
              # 144-171 (1.66-1.71x; cuDNN 282-360), its GPU tests and sanitizers clean.
              # Its dq_bulk 4 twin (dQ staged over the block's Q / dO images for the store warp's
              # bulk reductions, not per-element atomics; Sm90BwdTraits::kDqInStage), first run
              # 2026-12-04 (twenty-second session, one process, bf16): 328-399 TFLOP/s against the
              # atomic tile's 244-293 and cuDNN's 301-376 (1.05-1.12x cuDNN), GPU tests and
              # sanitizers clean. So it comes first; the atomic tile stays as the fallback.
              256: (Sm90BwdConfig(256, 64, 2, 2, 4, 0), Sm90BwdConfig(256, 64, 2, 2, 0, 0))},
    auto_head_dims=frozenset({64, 128, 256}),
    accumulator_registers=_bwd_acc, register_limit=_consumer_cap, call_problem=_bwd_call_problem,
    main_args=_bwd_main_args, run=_run_bwd, deterministic_outputs=(1, 2),
    takes_alibi=True, takes_user_mod=True, takes_block_mask=True, nullable_pointers=True,
    # GQA / MQA: a CTA per (key block, K/V head) runs the group's query heads, dK / dV summed in its
    # registers (kGroupLoop, cuflash/_backward.py group_loop): no per-query-head scratch, no reduce pass
    takes_group_loop=True,
    # variable-length batches, dQ in the same fragment order (each sequence's workspace rows start at
    # a multiple of 128): varlen / dense of equal useful FLOPs 0.93, causal 0.98 on the H200 (with
    # per-element atomics: 0.80 / 0.73; scripts/bench_varlen.py, 2026-12-02)
    takes_varlen=True,
    # the deterministic mode: the tile's dq_bulk 3 twin (dQ's block reductions in key-block order),
    # faster than the sm80 deterministic backward on the H200 (scripts/bench_deterministic.py).
    # Tuned by default since the eleventh session: the H200's tuner kept the default in all four
    # dense cells (d64 / d128, causal or not, N8192; docs/bench/tune-h200-bwd-sm90-2026-12-02.log).
    # Those four entries were dropped when the dK/dV epilogue changed (2026-12-03): with no entry
    # the default runs, the tile they held; not yet re-tuned.
)
