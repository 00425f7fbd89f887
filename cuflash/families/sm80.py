"""The mma.sync (sm_80+) kernel families: v2 forward, v1 forward, backward dK/dV, deterministic dQ.

Defaults are measured on an H200 (docs/perf-notes.md, scripts/sweep_bwd.py and the tuner's
exhaustive sweep, tuning/nvidia-h200.json, 2026-11-29): the fastest tiles that compile with no
register spills for sm_80 and sm_90a, in order of preference; later entries serve GPUs with less
shared memory (A100: 163 KB, L4 / RTX 4090: ~99 KB per block).
"""
from __future__ import annotations

import dataclasses
import itertools

from ..tiles import BwdConfig, DecodeConfig, DqConfig, FwdConfig, V1Config
from .base import F32, F32_IN, F32_WS, I32_WS, IN, OUT, KernelFamily

_MIN_CC, _MIN_CC_WHY = (8, 0), "needs mma.sync bf16 and cp.async"

# The kernels' pointer parameters, named after the launch plans' array slots.
_FWD_POINTERS = ((IN, "q"), (IN, "k"), (IN, "v"), (OUT, "out"), (F32, "lse"))
_BWD_INPUTS = ((IN, "q"), (IN, "k"), (IN, "v"), (IN, "dout"), (F32_IN, "lse2"), (F32_IN, "delta"))


def _product(make, *axes) -> list:
    return [make(*choice) for choice in itertools.product(*axes)]


# fp32 accumulator tiles live at once, spread over the block's threads (a lower bound of the
# registers the kernel needs; the tuner prunes tiles whose bound exceeds the register cap).
def _fwd_acc(t) -> int:  # O (block_q x d) + S (block_q x block_k)
    return (t.block_q * t.head_dim + t.block_q * t.block_k) // t.threads


def _bwd_acc(t) -> int:  # dK + dV (block_k x this block's d / column_splits columns each) + S^T (block_k x block_q)
    return (2 * t.block_k * t.head_dim // t.column_splits + t.block_k * t.block_q) // t.threads


def _dq_acc(t) -> int:  # dQ (block_q x d) + S (block_q x block_k)
    return (t.block_q * t.head_dim + t.block_q * t.block_k) // t.threads


# --- the launch plans of the forwards (the backward builds its three-launch plan itself)

def _plan_fwd(p, tile, dtype):
    from .._forward import _plan

    return _plan(p, tile, dtype)


def _plan_fwd_v1(p, tile, dtype):
    from .._forward_v1 import _plan

    return _plan(p, tile, dtype)


# --- how the tuner runs one tile: the public entry points with an explicit config, so it times
# exactly what users run. Inputs: q, k, v (+ out, lse, dout for the backward; runner.py).

def _run_fwd(tile, d, causal, features, props, out=None, lse=None):
    from .._forward import forward

    return tuple(forward(d["q"], d["k"], d["v"], causal=causal, config=tile, out=out, lse=lse, **d["options"]))


def _run_fwd_v1(tile, d, causal, features, props, out=None, lse=None):
    from .._forward_v1 import forward_v1

    return tuple(forward_v1(d["q"], d["k"], d["v"], causal=causal, config=tile, out=out, lse=lse, **d["options"]))


def _bwd_args(d):
    return d["dout"], d["q"], d["k"], d["v"], d["out"], d["lse"]


def _run_bwd(tile, d, causal, features, props, out=None, lse=None):
    from .._backward import backward

    return tuple(backward(*_bwd_args(d), causal=causal, config=tile, **d["options"]))


def _run_bwd_dq(tile, d, causal, features, props, out=None, lse=None):
    from .._backward import backward

    # the dK/dV kernel fixed at its default, so only dQ's tile varies
    main = BWD.default(tile.head_dim, props.smem_optin, features)
    return tuple(backward(*_bwd_args(d), causal=causal, deterministic=True, config=main, dq_config=tile,
                          **d["options"]))


FWD = KernelFamily(
    name="fwd", description="forward (out, lse)", what="forward", pass_="forward", tile_cls=FwdConfig,
    header="flash_fwd.cuh", template="cuflash::flash_fwd", pointers=_FWD_POINTERS,
    params="FwdParams", min_cc=_MIN_CC, min_cc_why=_MIN_CC_WHY, arch_specific=False,
    domain=lambda d: _product(lambda bq, bk, w, s: FwdConfig(d, bq, bk, w, s),
                              (64, 128, 192), (32, 48, 64, 96, 128), (4, 8), (2, 3)),
    # d 32, 96, 256 (ptxas-checked, not yet measured): d256 keeps 16 query rows per warp and 32-key
    # tiles (O alone is 128 fp32 registers per thread; 64-key tiles spill on sm_90a at 8 warps)
    defaults={
        32: (FwdConfig(32, 128, 128, 4, 3), FwdConfig(32, 128, 64, 4, 2)),
        64: (FwdConfig(64, 128, 96, 4, 2), FwdConfig(64, 128, 64, 4, 2), FwdConfig(64, 64, 64, 4, 2)),
        96: (FwdConfig(96, 128, 128, 8, 2), FwdConfig(96, 128, 64, 8, 2)),
        128: (FwdConfig(128, 128, 128, 8, 3), FwdConfig(128, 128, 128, 8, 2), FwdConfig(128, 128, 64, 8, 2),
              FwdConfig(128, 64, 64, 4, 2)),
        192: (FwdConfig(192, 128, 64, 8, 3), FwdConfig(192, 128, 64, 8, 2), FwdConfig(192, 128, 32, 8, 2)),
        256: (FwdConfig(256, 128, 32, 8, 3), FwdConfig(256, 128, 32, 8, 2), FwdConfig(256, 64, 32, 4, 2)),
    },
    accumulator_registers=_fwd_acc,
    # softcap with a window spills 32 B (d64) and 12 B (d128) on sm_80, with dropout too 4 B on the
    # d128 two-stage tile; the next defaults compile clean (tests/test_softcap.py); (the partial_d
    # instances, run for head dims between the instantiated ones, spill where these do)
    spilling={"dropout": frozenset({FwdConfig(64, 128, 96, 4, 2), FwdConfig(32, 128, 128, 4, 3)}),
              "local+softcap": frozenset({FwdConfig(64, 128, 96, 4, 2), FwdConfig(128, 128, 128, 8, 3)}),
              "dropout+local+softcap": frozenset({FwdConfig(128, 128, 128, 8, 2)}),
              # attention sinks (the epilogue's sink term) with a window and softcap: 12 B on sm_80 (20 on sm_90a)
              "local+softcap+sinks": frozenset({FwdConfig(128, 128, 128, 8, 2)}),
              # per-batch key lengths (the KV cache) with softcap: 44 B on d64's first tile (sm_80, sm_90a)
              "softcap+seqused_k": frozenset({FwdConfig(64, 128, 96, 4, 2)}),
              # with a window too, 4 B on sm_90a since the exact rescale factor (attn/softmax.cuh)
              "local+softcap+seqused_k": frozenset({FwdConfig(128, 128, 128, 8, 2)}),
              # variable-length batches with softcap (on sm_80 and sm_90a: an H100/H200 runs varlen
              # here): 4-48 B on these 128-key tiles; the next defaults compile clean
              "softcap+varlen": frozenset({FwdConfig(32, 128, 128, 4, 3), FwdConfig(64, 128, 96, 4, 2),
                                           FwdConfig(128, 128, 128, 8, 3), FwdConfig(128, 128, 128, 8, 2)}),
              "local+softcap+varlen": frozenset({FwdConfig(96, 128, 128, 8, 2)}),
              "dropout+softcap+varlen": frozenset({FwdConfig(96, 128, 128, 8, 2)}),  # 4 B, sm_90a
              "alibi+varlen": frozenset({FwdConfig(64, 128, 96, 4, 2)}),  # 44 B
              "dropout+local+softcap+varlen": frozenset({FwdConfig(64, 128, 64, 4, 2)}),  # 16 B, sm_80
              "partial_d+softcap+varlen": frozenset({FwdConfig(96, 128, 128, 8, 2)}),
              # split-KV (the fp32 epilogue) with softcap: 4-72 B on these
              "softcap+split_kv": frozenset({FwdConfig(128, 128, 128, 8, 2)}),
              "seqused_k+softcap+split_kv": frozenset({FwdConfig(32, 128, 128, 4, 3), FwdConfig(128, 128, 128, 8, 3)})},
    plan=_plan_fwd, run=_run_fwd, deterministic_outputs=(0, 1), takes_seqused_k=True, takes_varlen=True,
    takes_split_kv=True, takes_alibi=True, takes_user_mod=True, takes_block_mask=True, nullable_pointers=True, takes_sinks=True,
)

# The 4-warp backward tiles are not defaults: their dQ tile (64 fp32 registers per thread on top of
# dK, dV) spills on sm_80, except d128's 32-query one, the ~99 KB fallback of an L4 / RTX 4090.
# d192 and d256 fit ~99 KB only as 2-warp tiles of 32 x 32 with one dS^T buffer (BwdConfig.
# ds_buffers); those are the last resorts of their lists and run only where nothing larger fits
# (cc 8.6 / 8.9: `last_resort`, which no other device considers, not even for a user snippet whose
# every other tile spills). At 255 registers they spill a little in some instances (sm_86: d192
# 8-64 B, d256 0-8 B with varlen or a partial head dim); where no tile that does not spill fits, the
# selection takes a spilling one over none (KernelFamily.default), and tests/test_compile_bwd.py
# bounds them.
BWD = KernelFamily(
    name="bwd", description="backward dK/dV kernel (dQ by atomics)", what="backward", pass_="backward",
    tile_cls=BwdConfig, header="flash_bwd.cuh", template="cuflash::flash_bwd_dkdv",
    pointers=(*_BWD_INPUTS, (F32, "dq_acc"), (OUT, "dk"), (OUT, "dv")), params="BwdParams", min_cc=_MIN_CC,
    min_cc_why=_MIN_CC_WHY, arch_specific=False,
    domain=lambda d: _product(lambda bq, w, s: BwdConfig(d, bq, 16 * w, w, s), (32, 64, 128), (4, 8), (2, 3)),
    # d 32, 96, 256 and the 32-query tiles (ptxas-checked, not yet measured): block_q 32 makes the
    # dQ product's warp tile 16 x d/2, which is what lets 4 warps fit (the ~99 KB fallback of d128).
    # d192 and d256 run as two column splits per key tile (BwdConfig.column_splits).
    defaults={
        32: (BwdConfig(32, 128, 128, 8, 2), BwdConfig(32, 64, 128, 8, 2)),
        64: (BwdConfig(64, 128, 128, 8, 3), BwdConfig(64, 128, 128, 8, 2), BwdConfig(64, 64, 128, 8, 2)),
        96: (BwdConfig(96, 64, 128, 8, 2), BwdConfig(96, 32, 64, 4, 2)),
        128: (BwdConfig(128, 64, 128, 8, 3), BwdConfig(128, 64, 128, 8, 2), BwdConfig(128, 32, 128, 8, 3),
              BwdConfig(128, 32, 64, 4, 2)),
        192: (BwdConfig(192, 64, 128, 8, 2), BwdConfig(192, 32, 64, 4, 2), BwdConfig(192, 32, 32, 2, 2)),
        256: (BwdConfig(256, 32, 128, 8, 2), BwdConfig(256, 32, 64, 4, 2), BwdConfig(256, 32, 32, 2, 2)),
    },
    accumulator_registers=_bwd_acc,
    last_resort=frozenset({BwdConfig(192, 32, 32, 2, 2), BwdConfig(256, 32, 32, 2, 2)}),
    # the d64 128-query tiles with softcap and dropout: 12 B (three stages) and 8 B (two) on sm_80
    spilling={"dropout+softcap": frozenset({BwdConfig(64, 128, 128, 8, 3), BwdConfig(64, 128, 128, 8, 2)}),
              "alibi+dropout": frozenset({BwdConfig(64, 128, 128, 8, 3), BwdConfig(64, 128, 128, 8, 2),  # 4-28 B
                                          BwdConfig(128, 64, 128, 8, 3), BwdConfig(128, 64, 128, 8, 2)}),
              # variable-length batches: 4-16 B on these (sm_90a for d128, both targets for d192);
              # d128 then runs 32-query tiles (231-246 registers)
              "varlen": frozenset({BwdConfig(128, 64, 128, 8, 3), BwdConfig(128, 64, 128, 8, 2),
                                   BwdConfig(192, 64, 128, 8, 2)}),
              "dropout+varlen": frozenset({BwdConfig(64, 128, 128, 8, 3), BwdConfig(64, 128, 128, 8, 2)}),  # 12-16 B, sm_90a
              # column masking (a head dim below the instance's, or v's own): 4 B on sm_90a since
              # v's columns are masked apart from q's and k's (the value head dim, issue 12)
              "partial_d": frozenset({BwdConfig(128, 64, 128, 8, 2)})},
    run=_run_bwd, deterministic_outputs=(1, 2),  # dK, dV (dQ is summed by atomics)
    takes_varlen=True, takes_alibi=True, takes_user_mod=True, takes_block_mask=True, nullable_pointers=True,
)

BWD_DQ = KernelFamily(
    name="bwd_dq", description="deterministic backward's dQ kernel", what="deterministic dQ", pass_="backward",
    tile_cls=DqConfig, header="flash_bwd.cuh", template="cuflash::flash_bwd_dq",
    pointers=(*_BWD_INPUTS, (OUT, "dq")), params="BwdParams", min_cc=_MIN_CC, min_cc_why=_MIN_CC_WHY,
    arch_specific=False,
    domain=lambda d: _product(lambda w, bk, s: DqConfig(d, 16 * w, bk, w, s), (2, 4, 8), (16, 32, 64, 128), (2, 3)),
    defaults={
        32: (DqConfig(32, 64, 64, 4, 2), DqConfig(32, 128, 64, 8, 2)),
        64: (DqConfig(64, 64, 64, 4, 2), DqConfig(64, 128, 64, 8, 2)),
        96: (DqConfig(96, 64, 64, 4, 2), DqConfig(96, 128, 64, 8, 2)),
        128: (DqConfig(128, 64, 64, 4, 2), DqConfig(128, 128, 64, 8, 2)),
        192: (DqConfig(192, 128, 64, 8, 2), DqConfig(192, 64, 32, 4, 2)),
        256: (DqConfig(256, 128, 32, 8, 2), DqConfig(256, 64, 32, 4, 2), DqConfig(256, 32, 16, 2, 2)),
    },
    accumulator_registers=_dq_acc,
    spilling={"alibi+softcap": frozenset({DqConfig(192, 128, 64, 8, 2)}),  # 8-20 B
              "alibi+local": frozenset({DqConfig(192, 128, 64, 8, 2)}),
              "dropout": frozenset({DqConfig(192, 128, 64, 8, 2)}),  # 8 B on sm_90a
              # variable-length batches: 4-16 B (sm_90a; d64 with softcap and a partial head dim)
              "softcap+varlen": frozenset({DqConfig(192, 128, 64, 8, 2)}),
              "partial_d+softcap+varlen": frozenset({DqConfig(64, 64, 64, 4, 2)}),
              "dropout+local+softcap+varlen": frozenset({DqConfig(64, 64, 64, 4, 2)})},  # 24 B, sm_90a
    run=_run_bwd_dq, deterministic_outputs=(0, 1, 2), takes_varlen=True, takes_alibi=True, takes_user_mod=True,
    takes_block_mask=True, nullable_pointers=True,
)

# The v1 kernel exists to be compared with v2, so its defaults use v2's default tile shapes
# (block_q x block_k). At d=64 it takes 8 warps where v2 takes 4: v1 runs only batch*heads
# blocks, one per SM, and 4 warps of 32 rows sit at 255 registers. Its dropout instantiations do
# not spill (tests/test_compile_dropout.py).
FWD_V1 = KernelFamily(
    name="fwd_v1", description="forward, v1 algorithm (FlashAttention-1)", what="v1 forward", pass_="forward",
    tile_cls=V1Config, header="flash_fwd_v1.cuh", template="cuflash::flash_fwd_v1",
    pointers=(*_FWD_POINTERS, (F32_WS, "ws_o"), (F32_WS, "ws_ml")), params="FwdParams", min_cc=_MIN_CC,
    min_cc_why=_MIN_CC_WHY, arch_specific=False,
    domain=lambda d: _product(lambda bq, bk, w, s: V1Config(d, bq, bk, w, s),
                              (64, 128), (32, 64, 96, 128), (4, 8), (2, 3)),
    defaults={
        32: (V1Config(32, 128, 128, 8, 2), V1Config(32, 64, 64, 4, 2)),
        64: (V1Config(64, 128, 96, 8, 2), V1Config(64, 128, 64, 8, 2), V1Config(64, 64, 64, 4, 2)),
        96: (V1Config(96, 128, 64, 8, 2), V1Config(96, 64, 64, 4, 2)),
        128: (V1Config(128, 128, 128, 8, 2), V1Config(128, 128, 64, 8, 2), V1Config(128, 64, 64, 4, 2)),
        # no d192, d256: every v1 tile spills there (56-250 B: O read back from the workspace next to
        # 96-128 accumulator registers), so calls of head_dim > 128 have no v1 kernel
    },
    accumulator_registers=_fwd_acc,
    # softcap at d128 128x128: 8-12 B on sm_80 (255 registers); 128x64 compiles clean
    spilling={"softcap": frozenset({V1Config(128, 128, 128, 8, 2)})},
    plan=_plan_fwd_v1, run=_run_fwd_v1, deterministic_outputs=(0, 1), tuned_by_default=False,
    # the v1 kernel masks one head dim for q, k, v and its O workspace alike
    call_problem=lambda p: ("the v1 forward has no value head dim other than q's (use algorithm='v2')"
                            if p.dv != p.head_dim else None),
)


def _decode_acc(t) -> int:  # a warp's O (16 rows x its d / col_splits columns) + S (16 x 16) over its 32 lanes
    return t.head_dim // 2 // t.col_splits + 8


def _plan_decode(p, tile, dtype):
    from ..kvcache import plan_decode

    return plan_decode(p, tile, dtype)


def _run_decode(tile, d, causal, features, props, out=None, lse=None):
    from ..kvcache import _forward_cupy
    from ..mask import MaskOptions

    # one decoding step as attention_with_kvcache runs it (device lengths; the split count by the
    # tile's min_split_blocks; the class's options: softcap's cap, ALiBi's slopes)
    o = d["options"]
    return tuple(_forward_cupy(d["q"], d["k"], d["v"], d["lens"], None, None,
                               MaskOptions.of(causal=causal, softcap=o.get("softcap", 0.0)), None, out=out, lse=lse,
                               config=tile, alibi_slopes=o.get("alibi_slopes")))


def _decode_paged_tile(tile, p, props):
    """The decode tile for a paged cache (issue 17: paged >= 0.95x contiguous). Measured on an H100,
    fp16, 32 / 8 heads, one query, CUDA-graph replays (scripts/paged_probe.py, 2026-12-05),
    as a ratio to the contiguous cache with its default tile: 16-row shuffled pages read at
    0.93-0.94 (d128) and 0.91-0.92 (d256) with the 4-warp defaults, 0.97-0.98 and 0.98-1.00 with 8
    warps and 3 stages; 256-row pages 0.99 at d128 either way, 0.92-0.93 at d256 with 4 warps and
    0.99-1.00 with 8 warps and 2 stages. Pages in order (the contiguous cache's very addresses)
    read at 0.96 with the 4-warp d128 default, 1.00 with 8 warps: the paged address work, not only
    the scattered pages, costs the narrow tile. At d64 the other way round: its default is the
    8-warp tile (contiguous caches read 4-8% faster with it), and 16-row pages read 0.5-3% faster
    with 4 warps and 4 stages (2026-12-06, two H100 runs; one H200 run: 0.805 against 0.64-0.70 of
    the copy). Not taken where (batch, K/V head)s already
    fill two 4-warp blocks per SM (64 x 2k: at d128 the 4-warp default 0.98, 8 warps 0.95; at d64
    8 warps 0.92-0.94, 4 warps 0.87-0.89). Where the 3-stage tile does not fit (A100's 163 KB), the
    2-stage one (d128 paged 16 on the H100: 0.96-0.97; not run on an A100). With the grouped
    copy (2026-12-06, sm80/decode.cuh GROUPED_PAGES) 16-row pages at d128 read 0.978 / 0.968 on the
    8-warp tile against 0.965 / 0.960 on the 4-warp default (H100, 1 x 128k / 8 x 8k): the rule
    still gains, by less."""
    cands = DECODE_PAGED_TILES.get((tile.head_dim, p.page_size < 64), ())
    if not cands or tile in cands or p.batch * p.heads_kv >= 2 * props.sm_count:
        return tile
    if cands[0].warps > tile.warps or tile == DECODE.defaults[tile.head_dim][0]:  # widen a narrow tile; narrow the default
        for other in cands:
            if other.smem_bytes <= props.smem_optin:
                return dataclasses.replace(other, min_split_blocks=tile.min_split_blocks)
    return tile


# (head_dim, pages of fewer than 64 rows) -> the paged decode tiles, first fitting taken
# (_decode_paged_tile); the CPU compile tests cover these with the selectable tiles
DECODE_PAGED_TILES = {(64, True): (DecodeConfig(64, 4, 4),),
                      (128, True): (DecodeConfig(128, 8, 3), DecodeConfig(128, 8, 2)),
                      (256, True): (DecodeConfig(256, 8, 3), DecodeConfig(256, 8, 2)),
                      (256, False): (DecodeConfig(256, 8, 2),)}


# Decoding against a KV cache (cuflash/kvcache.py): a GQA group's query heads packed in one tile,
# chosen by attention_with_kvcache when group * seqlen_q <= 16 (never by the prefill forward). The
# defaults keep two blocks of 4 warps per H200 SM at d128 (100 KB each). The tuner times one
# decoding step (runner.py: one query token, DECODE_TUNE_GROUP query heads per K/V head, the cache
# full) over the tiles and their host-only min_split_blocks (how far num_splits=0 splits the keys),
# per cache length.
DECODE = KernelFamily(
    name="decode", description="decode against a KV cache (GQA group packed)", what="decode",
    pass_="decode", tile_cls=DecodeConfig, header="flash_decode.cuh", template="cuflash::flash_decode",
    pointers=_FWD_POINTERS, params="FwdParams", min_cc=_MIN_CC, min_cc_why=_MIN_CC_WHY, arch_specific=False,
    domain=lambda d: _product(lambda w, s, mb: DecodeConfig(d, w, s, mb), (2, 4, 8), (2, 3, 4), (1, 2, 4, 8, 16)),
    defaults={
        32: (DecodeConfig(32, 4, 4), DecodeConfig(32, 4, 2)),
        # d64: 8 warps, 3 stages read contiguous caches faster than 4 warps, 4 stages (graph
        # replays, x copy: H100 2026-12-05 and -06 0.93-0.96 against 0.88-0.90; H200 2026-12-06
        # 0.945 / 0.930 against 0.892 / 0.908); 16-row pages keep the 4-warp tile (_decode_paged_tile)
        64: (DecodeConfig(64, 8, 3), DecodeConfig(64, 4, 4), DecodeConfig(64, 4, 2)),
        96: (DecodeConfig(96, 4, 3), DecodeConfig(96, 4, 2)),
        128: (DecodeConfig(128, 4, 3), DecodeConfig(128, 4, 2)),
        # above 128 two warps per key slice, half of O's columns each (a whole O row spilled 4-12 B)
        192: (DecodeConfig(192, 8, 2), DecodeConfig(192, 4, 2)),
        256: (DecodeConfig(256, 4, 3), DecodeConfig(256, 4, 2)),
    },
    paged_tile=_decode_paged_tile,
    accumulator_registers=_decode_acc, plan=_plan_decode, takes_dropout=False, takes_partial_d=False,
    takes_seqused_k=True, needs_seqused_k=True, takes_split_kv=True, takes_paged=True, tuned_by_default=False,
    takes_alibi=True, nullable_pointers=True,
    split_merge_pointers=((OUT, "merged_out"), (F32, "merged_lse"), (I32_WS, "split_counters")),
    run=_run_decode, deterministic_outputs=(0, 1), causal_matters=False,
)
