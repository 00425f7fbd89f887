"""Backward pass: validate, pick configs, allocate gradients and workspaces, launch on CuPy's stream.

Launch sequence (kernels_cu/flash_bwd.cuh):
    bwd_prep        delta = rowsum(dO * O), lse2 = lse * log2(e) (+inf where P must be 0), dq_acc = 0
    flash_bwd_dkdv  dK, dV per key tile; dQ added to the fp32 dq_acc with atomics
    bwd_dq_convert  dq = softmax_scale * dq_acc, to the input dtype
    bwd_dkdv_reduce GQA/MQA only (heads_kv < heads): the dK/dV kernel wrote dK, dV per query head
                    into expanded (batch, seqlen_k, heads, head_dim) buffers of the input dtype
                    (dk_exp, dv_exp); this sums each k/v head's group of them in fp32 into dk, dv.
                    Not after the Hopper dK/dV kernel's group loop (group_loop: a CTA per K/V head
                    runs its group's query heads, dK / dV summed in registers and written to dk, dv)
With deterministic=True the atomics are off and flash_bwd_dq computes dQ in registers instead
(bitwise reproducible, three extra GEMMs); there is no dq_acc then, and the kernels that take it
get a null pointer. The Hopper dK/dV kernel's deterministic mode keeps dq_acc instead and adds
each 64 x 64 dQ block to it in a fixed order of its key blocks (its tile's dq_bulk 3 twin, turn
counters in a zeroed dq_sem buffer; kernels_cu/sm90/det_order.cuh), then bwd_dq_convert_frag (or
its varlen twin) converts.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import _compile, device, families, problem
from . import _plans as plan_cache
from .launch import GRID_YZ_MAX, Buffer, FilledPlan, Launch, Plan, check_grid
from .mask import UNBOUNDED, MaskOptions
from .params import pack_bwd
from .problem import AttnProblem
from .signature import BWD_ARRAYS
from .tiles import BwdConfig, DqConfig

# lse2 / delta / dq_acc rows are padded to this multiple (>= every block_q) so the kernels copy
# them with unguarded 16-byte loads.
_ROW_PAD = 128
_AUX_THREADS = 256
OUTPUTS = ("dq", "dk", "dv")
# GQA/MQA: the dK/dV kernel's output slots -> the expanded (per query head) buffers it writes instead
_EXPANDED = {"dk": "dk_exp", "dv": "dv_exp"}


def prep_threads_per_row(head_dim: int) -> int:
    """bwd_prep's threads per row: its 16-byte chunks rounded up to a power of two (the row's
    shuffle reduction; mirrors TPR in kernels_cu/rowwise/bwd_prep.cuh)."""
    chunks = head_dim // 8
    return 1 << (chunks - 1).bit_length()


def _pointers(family) -> tuple:
    return tuple(name for _, name in family.pointers)


def _aux_pointers(name: str) -> tuple:
    return tuple(n for _, n in _compile.AUX_KERNELS[name][0])


# variable-length batches: the plan's extra slots (int32 device offsets, batch + 1 each)
VARLEN_SLOTS = ("cu_seqlens_q", "cu_seqlens_k")


def _alibi_slot(p: AttnProblem) -> tuple:
    """The optional last inputs of the plan and last pointers of the dK/dV and dQ kernels: ALiBi's
    slopes, then a user modification's aux pointer table (cuflash.ScoreMod)."""
    return (("alibi_slopes",) if p.alibi else ()) + (("mod_aux",) if p.mod is not None else ())


# a block mask (cuflash.BlockMask): the dK/dV kernel's transposed lists, the dQ kernel's lists (the
# kernels' bm_counts / bm_index pointers after mod_aux)
BM_DKDV_SLOTS = ("bm_counts_t", "bm_index_t")
BM_DQ_SLOTS = ("bm_counts", "bm_index")


def _block_mask_inputs(p: AttnProblem) -> tuple:
    """The plan's block-mask inputs, in backward()'s order: the transposed lists, then (deterministic:
    the dQ kernel runs) the lists."""
    if p.block_mask is None:
        return ()
    return BM_DKDV_SLOTS + (BM_DQ_SLOTS if p.deterministic else ())


# The group loop's grid has `group` times fewer CTAs, each `group` times longer: it needs this many
# CTAs per SM (the kernel runs one per SM) so that the last wave's tail stays short. (MQA at batch 2,
# seqlen 8192 would be 128 CTAs of 32 heads each on 132 SMs.) A first guess, not yet measured.
GROUP_LOOP_MIN_WAVES = 4


def group_loop(p: AttnProblem, cfg, dq_cfg) -> bool:
    """Whether the dK/dV kernel takes a GQA/MQA group per CTA (kernels_cu/sm90/bwd.cuh kGroupLoop):
    its family has the instances, the call has a group, none of the features whose per-query-head
    state lives through the kernel's loop (dropout, ALiBi, a user modification), nor block masks or a
    deterministic dQ, and its grid of (key block, K/V head, batch) CTAs fills GROUP_LOOP_MIN_WAVES
    waves. Then dK / dV are summed over the group in registers and written to dk / dv directly;
    otherwise per query head into the expanded buffers that bwd_dkdv_reduce sums."""
    f = p.features
    if not (p.group > 1 and families.of(cfg).takes_group_loop and dq_cfg is None and getattr(cfg, "dq_bulk", 0) != 3
            and not (f.dropout or f.alibi or f.user_mod or f.block_mask)):
        return False
    ctas = -(-p.seqlen_k // cfg.block_k) * p.heads_kv * p.batch
    return ctas >= GROUP_LOOP_MIN_WAVES * device.query(p.device).sm_count


def _main_kernel(p: AttnProblem, cfg, fused: bool):
    """The dK/dV kernel of this plan: its group-loop instance when `fused`."""
    return _compile.get_kernel(cfg, dataclasses.replace(p.features, group_loop=True) if fused else p.features, p.device)


def varlen_ws_rows_per_head(p: AttnProblem) -> int:
    """Workspace rows per head of a varlen backward: every sequence starts at (its first row +
    _ROW_PAD x its index) rounded down to _ROW_PAD (kernels_cu/attn/mask.cuh, SeqSpan::ws_row0)."""
    return -(-(p.total_q + _ROW_PAD * p.batch) // _ROW_PAD) * _ROW_PAD


def _plan_varlen(p: AttnProblem, cfg: BwdConfig, dq_cfg: DqConfig | None, dtype) -> Plan:
    """The backward of variable-length batches (cuflash/varlen.py): the same kernels' varlen
    instances; the row-wise ones on a (row chunks, heads, batch) grid over each sequence's rows."""
    b, h, d, hkv, gqa = p.batch, p.heads, p.head_dim, p.heads_kv, p.group > 1
    bz = min(b, GRID_YZ_MAX)  # the row-wise kernels' grid z strides over the sequences (BwdParams.batch)
    if h > GRID_YZ_MAX:  # their grid y: one head each
        raise ValueError(f"variable-length backwards take at most {GRID_YZ_MAX} heads, got {h}")
    pad = varlen_ws_rows_per_head(p)
    ws_rows = h * pad
    kd = p.features.head_dim
    chunks = kd // 8
    rows_grid = -(-p.seqlen_q // _ROW_PAD) * _ROW_PAD  # the longest sequence's padded rows
    prep = _compile.get_aux_kernel("bwd_prep_varlen", p.features, p.device)
    launches = [Launch(prep, (-(-rows_grid * prep_threads_per_row(kd) // _AUX_THREADS), h, bz), (_AUX_THREADS,), 0,
                       pointers=_aux_pointers("bwd_prep_varlen"))]
    n_blocks = -(-p.seqlen_k // cfg.block_k) * getattr(cfg, "column_splits", 1)
    fused = group_loop(p, cfg, dq_cfg)
    grid_heads = hkv if fused else h  # the group loop: a CTA per K/V head
    check_grid(n_blocks * grid_heads * b)
    fam = families.of(cfg)
    main = _main_kernel(p, cfg, fused)
    # sm90: its slots (the offsets after dv) and the per-call bind of its TMA maps
    slots, bind = fam.main_args(p, cfg) if fam.main_args is not None else (
        _pointers(families.BWD) + VARLEN_SLOTS + _alibi_slot(p), None)
    if gqa and not fused:
        slots = tuple(_EXPANDED.get(n, n) for n in slots)
    launches.append(Launch(main, (n_blocks * grid_heads * b,), (cfg.threads,), cfg.smem_bytes, pointers=slots, bind=bind))
    m_blocks = 0
    if dq_cfg is not None:  # deterministic: the dQ kernel
        m_blocks = -(-p.seqlen_q // dq_cfg.block_q)
        check_grid(m_blocks * h * b)
        launches.append(Launch(_compile.get_kernel(dq_cfg, p.features, p.device), (m_blocks * h * b,),
                               (dq_cfg.threads,), dq_cfg.smem_bytes,
                               pointers=_pointers(families.BWD_DQ) + VARLEN_SLOTS + _alibi_slot(p)))
    else:
        # dq_acc row-major, or in the sm90 kernel's fragment order (its dq_bulk 2 / 4 tiles, and 3:
        # the deterministic twin, the same layout)
        name = "bwd_dq_convert_frag_varlen" if getattr(cfg, "dq_bulk", 0) >= 2 else "bwd_dq_convert_varlen"
        convert = _compile.get_aux_kernel(name, p.features, p.device)
        launches.append(Launch(convert, (-(-p.seqlen_q * chunks // _AUX_THREADS), h, bz), (_AUX_THREADS,), 0,
                               pointers=_aux_pointers(name)))
    expanded = ()
    if gqa and not fused:
        reduce = _compile.get_aux_kernel("bwd_dkdv_reduce", p.features, p.device)
        launches.append(Launch(reduce, (-(-p.total_k * hkv * chunks // _AUX_THREADS),), (_AUX_THREADS,), 0,
                               pointers=_aux_pointers("bwd_dkdv_reduce")))
        expanded = tuple(Buffer(n, (p.total_k, h, w), dtype) for n, w in zip(_EXPANDED.values(), (d, p.dv)))
    buffers = (Buffer("dq", (p.total_q, h, d), dtype), Buffer("dk", (p.total_k, hkv, d), dtype),
               Buffer("dv", (p.total_k, hkv, p.dv), dtype), Buffer("delta", (ws_rows,)), Buffer("lse2", (ws_rows,)),
               Buffer("dq_acc", None if dq_cfg is not None else (ws_rows * kd,)), _dq_sem(cfg, ws_rows, kd), *expanded)
    params = _with_det_order(pack_bwd(p, pad, n_blocks, m_blocks, group_loop=fused), p, cfg, n_blocks)
    return Plan(p.device, BWD_ARRAYS + VARLEN_SLOTS + _alibi_slot(p), buffers, tuple(launches), OUTPUTS, params)


def _plan(p: AttnProblem, cfg: BwdConfig, dq_cfg: DqConfig | None, dtype) -> Plan:
    if p.varlen:
        return _plan_varlen(p, cfg, dq_cfg, dtype)
    b, nq, nk, h, d = p.batch, p.seqlen_q, p.seqlen_k, p.heads, p.head_dim
    hkv, gqa = p.heads_kv, p.group > 1
    pad = -(-nq // _ROW_PAD) * _ROW_PAD
    ws_rows = b * h * pad
    kd = p.features.head_dim  # the instantiated head dim (>= d): dq_acc's row length
    chunks = kd // 8  # the aux kernels' threads each take 8 elements of a row (idle past d)

    prep = _compile.get_aux_kernel("bwd_prep", p.features, p.device)
    launches = [Launch(prep, (-(-ws_rows * prep_threads_per_row(kd) // _AUX_THREADS),), (_AUX_THREADS,), 0,
                       pointers=_aux_pointers("bwd_prep"))]

    # key tiles x head-dim column splits (an sm80 tile past d=128: BwdConfig.column_splits), the
    # kernel's BwdParams.n_blocks
    n_blocks = -(-nk // cfg.block_k) * getattr(cfg, "column_splits", 1)
    fused = group_loop(p, cfg, dq_cfg)
    grid_heads = hkv if fused else h  # the group loop: a CTA per K/V head
    check_grid(n_blocks * grid_heads * b)
    fam = families.of(cfg)
    main = _main_kernel(p, cfg, fused)
    # the dK/dV kernel: its pointer slots, or (sm90) the slots a per-call bind turns into TMA maps
    slots, bind = fam.main_args(p, cfg) if fam.main_args is not None else (_pointers(fam) + _alibi_slot(p), None)
    if p.block_mask is not None:
        slots = slots + BM_DKDV_SLOTS
    if gqa and not fused:  # dK, dV per query head, into the expanded buffers bwd_dkdv_reduce sums
        slots = tuple(_EXPANDED.get(n, n) for n in slots)
    launches.append(Launch(main, (n_blocks * grid_heads * b,), (cfg.threads,), cfg.smem_bytes, pointers=slots, bind=bind))

    m_blocks = 0  # BwdParams.m_blocks: the dQ kernel's, when it runs
    if dq_cfg is not None:
        m_blocks = -(-nq // dq_cfg.block_q)
        check_grid(m_blocks * h * b)
        dq_kernel = _compile.get_kernel(dq_cfg, p.features, p.device)
        launches.append(Launch(dq_kernel, (m_blocks * h * b,), (dq_cfg.threads,), dq_cfg.smem_bytes,
                               pointers=_pointers(families.BWD_DQ) + _alibi_slot(p)
                               + (BM_DQ_SLOTS if p.block_mask is not None else ())))
    elif getattr(cfg, "dq_bulk", 0) >= 2:  # dq_acc in the sm90 kernel's fragment order: a thread per 2 rows x 8 columns
        convert = _compile.get_aux_kernel("bwd_dq_convert_frag", p.features, p.device)
        launches.append(Launch(convert, (-(-ws_rows * kd // 16 // _AUX_THREADS),), (_AUX_THREADS,), 0,
                               pointers=_aux_pointers("bwd_dq_convert_frag")))
    else:
        convert = _compile.get_aux_kernel("bwd_dq_convert", p.features, p.device)
        n_rows = b * h * nq
        launches.append(Launch(convert, (-(-n_rows * chunks // _AUX_THREADS),), (_AUX_THREADS,), 0,
                               pointers=_aux_pointers("bwd_dq_convert")))

    expanded = ()
    if gqa and not fused:
        kv_rows = b * nk * hkv
        reduce = _compile.get_aux_kernel("bwd_dkdv_reduce", p.features, p.device)
        launches.append(Launch(reduce, (-(-kv_rows * chunks // _AUX_THREADS),), (_AUX_THREADS,), 0,
                               pointers=_aux_pointers("bwd_dkdv_reduce")))
        expanded = tuple(Buffer(n, (b, nk, h, w), dtype) for n, w in zip(_EXPANDED.values(), (d, p.dv)))

    buffers = (Buffer("dq", (b, nq, h, d), dtype), Buffer("dk", (b, nk, hkv, d), dtype),
               Buffer("dv", (b, nk, hkv, p.dv), dtype), Buffer("delta", (ws_rows,)), Buffer("lse2", (ws_rows,)),
               Buffer("dq_acc", None if dq_cfg is not None else (ws_rows * kd,)), _dq_sem(cfg, ws_rows, kd), *expanded)
    params = _with_det_order(pack_bwd(p, pad, n_blocks, m_blocks, group_loop=fused), p, cfg, n_blocks)
    if p.block_mask is not None:  # entries per list row: the dQ tile's key blocks, the dK/dV tile's query blocks
        params["bm_nb"] = -(-nk // dq_cfg.block_k) if dq_cfg is not None else 0
        params["bm_mb"] = -(-nq // cfg.block_q)
    return Plan(p.device, BWD_ARRAYS + _alibi_slot(p) + _block_mask_inputs(p), buffers, tuple(launches), OUTPUTS,
                params)


def det_rotation(p, n_blocks: int, m_blocks: int, sm_count: int) -> int:
    """BwdParams.det_rotate of the sm90 deterministic backward (kernels_cu/sm90/det_order.cuh): 1
    where the rotated order may apply (the grid in the atomic mode's CTA order; each CTA takes a
    stride from its own sequence, det_stride), 0 for the staircase everywhere (the grid by head
    groups). Rotated, a key block may wait for a higher one of its head: only where a head's
    n_blocks CTAs (the longest sequence's, varlen) fit on the GPU at once (dispatched in order, the
    head's first ones cannot then wait for ones no SM will take), never with a left window edge
    (its instances keep the staircase). A dense unmasked call needs n_blocks <= m_blocks, where key
    block n starts at query block r n, r = m_blocks // n_blocks, and a dQ block's contributors
    arrive r steps apart (stride 1 left the turn's hand-over on the critical path: measured at
    d64); otherwise the head groups' order serves its staircase better. Varlen: each sequence
    decides in the kernel, the staircase where it has more key blocks than query blocks."""
    if p.window_left != UNBOUNDED or n_blocks > sm_count:
        return 0
    if p.window_right == UNBOUNDED and not getattr(p, "varlen", False) and n_blocks > m_blocks:
        return 0
    return 1


def _with_det_order(params, p, cfg, n_blocks: int):
    """`params` with det_rotate set for the sm90 deterministic twin (dq_bulk 3; seqlen_q: the longest
    sequence's, varlen); unchanged otherwise."""
    if getattr(cfg, "dq_bulk", 0) == 3:
        params["det_rotate"] = det_rotation(p, n_blocks, -(-p.seqlen_q // cfg.block_q), device.query(p.device).sm_count)
    return params


def _dq_sem(cfg, ws_rows: int, kd: int) -> Buffer:
    """The sm90 deterministic mode's turn counters (dq_bulk 3): one per 64 x 64 dQ block, zeroed per
    call; otherwise no buffer (a null pointer)."""
    if getattr(cfg, "dq_bulk", 0) != 3:
        return Buffer("dq_sem", None)
    return Buffer("dq_sem", (ws_rows // 64 * (kd // 64),), np.int32, zeroed=True)


_plans = plan_cache.PlanCache()


def plan_key(arrays, mask_key, softmax_scale, deterministic, dropout_on: bool, backend, score_mod=None) -> tuple:
    """The backward plans' cache key (as _forward.plan_key: cuflash/_torch.py looks plans up under it)."""
    return (*plan_cache.array_key(arrays), mask_key, softmax_scale, deterministic, dropout_on, backend,
            None if score_mod is None else score_mod.source)


def _main_family(p, config, backend):
    """The dK/dV kernel's family: the config's, else the one `backend` forces, else the automatic
    choice (families.BACKWARDS: the Hopper kernel where it can run and was measured faster,
    CUFLASH_BACKEND applying as for the forward); ValueError naming the reason where a forced
    backend cannot run the call."""
    if backend is None and config is not None:
        backend = families.of(config).backend
    return families.choose(families.BACKWARDS, p, backend)


def _build_plan(arrays, mask, softmax_scale, deterministic, dropout, config, dq_config, backend=None,
                alibi_slopes=None, score_mod=None, block_mask=None) -> tuple:
    """(plan, dK/dV tile, dQ tile or None); the tiles None for an empty problem."""
    infos = [problem.describe(x, n) for x, n in zip(arrays, BWD_ARRAYS)]
    p = problem.resolve_backward(*infos, mask, softmax_scale, deterministic, dropout)
    if alibi_slopes is not None:
        p = problem.with_alibi(p, problem.describe(alibi_slopes, "alibi_slopes"))
    if score_mod is not None:
        if score_mod.source.score is not None and score_mod.source.grad is None:
            raise ValueError("score_mod: the backward of a score snippet needs its derivative: "
                             "ScoreMod(score=..., grad=...) (d score_mod / d score)")
        p = problem.with_score_mod(p, score_mod)
    p = problem.with_block_mask(p, block_mask, score_mod)
    if p.empty:  # no launch: zero gradients of q, k, v's shapes (empty where their arrays are)
        dtype = arrays[1].dtype
        return FilledPlan(p.device, BWD_ARRAYS, tuple((Buffer(n, x.shape, dtype), 0)
                                                       for n, x in zip(OUTPUTS, infos[1:4]))), None, None
    cfg, dq_cfg = with_dq_tile(p, _tile(_main_family(p, config, backend), config, p),
                               lambda: _tile(families.BWD_DQ, dq_config, p))
    return _plan(p, cfg, dq_cfg, arrays[1].dtype), cfg, dq_cfg


def with_dq_tile(p, cfg, dq_tile) -> tuple:
    """(dK/dV tile, dQ tile or None) of a call whose dK/dV tile is `cfg`: deterministic on the Hopper
    kernel, its dq_bulk 3 twin (the same tile, dQ's block reductions in a fixed order) and no dQ
    kernel; otherwise `cfg`, and dq_tile() where deterministic (the dQ kernel's tile)."""
    if p.deterministic and families.of(cfg) is families.BWD_SM90:
        return dataclasses.replace(cfg, dq_bulk=3), None
    return cfg, (dq_tile() if p.deterministic else None)


def _tile(family, config, p):
    """The caller's tile (checked against family, problem and device: ValueError before any launch
    where the device cannot launch it), else the selected one."""
    if config is None:
        return families.select(family, p)
    family.check_explicit(config, p.features)
    from . import device

    props = device.supported(p.device)
    why = family.launch_limits_problem(config, props)
    if why:
        raise ValueError(f"config {config} cannot run on {props.name} (cc {props.cc_str}): {why}")
    return config


def backward(dout, q, k, v, out, lse, *, mask: MaskOptions | None = None, softmax_scale=None, deterministic=False,
             dropout_p=0.0, seed=None, config: BwdConfig | None = None, dq_config: DqConfig | None = None,
             backend: str | None = None, alibi_slopes=None, score_mod=None, block_mask=None, **mask_options):
    """Gradients (dq, dk, dv) of attention for upstream gradient `dout`; CuPy arrays like q, k, v.

    `out` and `lse` are the forward's results for the same q, k, v, mask, softmax_scale,
    dropout_p and seed (the dropout mask is regenerated from the seed, never stored). The mask:
    the record `mask` or the mask keywords (`causal=True`, ...), as the forward (cuflash/_forward.py).
    `config` / `dq_config` override the selected kernel configs (tuner, tests).
    `backend`: None (automatic: the Hopper dK/dV kernel on a cc 9.0 GPU at head_dim 64, 128 and 256
    where it can run, else the mma.sync one; cuflash/families/__init__.py), "sm80" or "sm90" (cc 9.0)
    to force one. `alibi_slopes`: the forward's (cuflash/_forward.py).
    `score_mod`: the forward's cuflash.ScoreMod; a score snippet needs its `grad` snippet here.
    `block_mask`: the forward's cuflash.BlockMask (the dK/dV kernels, sm80 and Hopper, read its
    transposed lists, the dQ kernel its lists).
    """
    import cupy

    if mask_options or type(mask) is not MaskOptions:
        mask = MaskOptions.given(mask, mask_options)
    arrays = (dout, q, k, v, out, lse) if alibi_slopes is None else (dout, q, k, v, out, lse, alibi_slopes)
    dropout = problem.resolve_dropout(dropout_p, seed)
    if block_mask is not None:
        from .block_mask import BlockMask

        if score_mod is None or not isinstance(block_mask, BlockMask):
            problem.with_block_mask(None, block_mask, score_mod)  # raises, naming the argument
        # this mask against this call, every call (a cached plan knows only its layout)
        block_mask.check_call(score_mod.source, q.shape[0], q.shape[2], q.shape[1], k.shape[1], q.device.id)
    cupy_arrays = all(type(a) is cupy.ndarray for a in arrays)
    if config is None and dq_config is None and cupy_arrays:
        key = lambda: plan_key(arrays, mask.key, softmax_scale, deterministic, dropout is not None, backend, score_mod)
        build = lambda: _build_plan(arrays, mask, softmax_scale, deterministic, dropout, None, None, backend,
                                    alibi_slopes, score_mod, block_mask)
        if block_mask is None:
            plan, cfg, dq_cfg = _plans.get(key, lambda: build()[0]), None, None
        else:  # the lists are the tiles': the cache keeps them beside the plan
            plan, cfg, dq_cfg = _plans.get(lambda: (*key(), "block_mask", block_mask.layout), build)
    elif cupy_arrays and block_mask is None:  # given configs: cached under them too (as the forward's)
        key = lambda: (*plan_key(arrays, mask.key, softmax_scale, deterministic, dropout is not None, backend, score_mod),
                       "config", config, dq_config)
        plan, cfg, dq_cfg = _plans.get(key, lambda: _build_plan(
            arrays, mask, softmax_scale, deterministic, dropout, config, dq_config, backend, alibi_slopes, score_mod,
            block_mask)[0]), None, None
    else:
        plan, cfg, dq_cfg = _build_plan(arrays, mask, softmax_scale, deterministic, dropout, config, dq_config, backend,
                                        alibi_slopes, score_mod, block_mask)
    if score_mod is not None:
        arrays = (*arrays, score_mod.pointer_table(q.device.id))
    if block_mask is not None and cfg is not None:
        arrays = (*arrays, *block_mask.lists(cfg.block_q, cfg.block_k, transposed=True))
        if dq_cfg is not None:
            arrays = (*arrays, *block_mask.lists(dq_cfg.block_q, dq_cfg.block_k))
    return plan.run(arrays, None if dropout is None else dropout.kernel_args)
