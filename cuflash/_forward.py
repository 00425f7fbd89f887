"""Forward pass (v2 algorithm): validate, pick a kernel family and config, allocate outputs, launch
on CuPy's current stream.

Also the body the v1 forward shares (run_forward). The v2 forward has two families
(families.FORWARDS): the Hopper kernel (cuflash/_forward_sm90.py builds its plan) where it can run
a call, the mma.sync kernel (_plan here) everywhere else. Every forward kernel takes FwdParams
(cuflash/params.py), packed once per plan.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import _compile, families, problem
from . import _plans as plan_cache
from .launch import Buffer, FilledPlan, Launch, Plan, check_grid
from .mask import MaskOptions
from .params import pack_fwd
from .problem import AttnProblem
from .tiles import FwdConfig, Sm90FwdConfig

INPUTS = ("q", "k", "v", "out", "lse")  # Plan.run's arguments; out and lse may be None (allocated)
OUTPUTS = ("out", "lse")
# per-batch key lengths (AttnProblem.seqused_k, the KV cache): an int32 device array, one per batch
INPUTS_SEQUSED_K = (*INPUTS, "seqused_k")
# variable-length batches (AttnProblem.varlen, cuflash/varlen.py): int32 device arrays, batch + 1 each
INPUTS_VARLEN = (*INPUTS, "cu_seqlens_q", "cu_seqlens_k")


def output_buffers(p: AttnProblem, dtype) -> tuple:
    """out (like q) and lse (float32 (batch, heads, seqlen_q)), when the caller gives none. Varlen:
    out (total_q, heads, head_dim) and lse (heads, total_q), FlashAttention's packed layout. out's
    head dim is v's (p.dv)."""
    if p.varlen:
        return (Buffer("out", (p.total_q, p.heads, p.dv), dtype), Buffer("lse", (p.heads, p.total_q), np.float32))
    return (Buffer("out", (p.batch, p.seqlen_q, p.heads, p.dv), dtype),
            Buffer("lse", (p.batch, p.heads, p.seqlen_q), np.float32))


def _plan(p: AttnProblem, cfg: FwdConfig, dtype) -> Plan:
    """The sm80 forward's plan (families.FWD.plan)."""
    # blockIdx.x = m_block + m_blocks * (head + heads * batch)
    m_blocks = -(-p.seqlen_q // cfg.block_q)
    n_blocks = m_blocks * p.heads * p.batch
    check_grid(n_blocks)
    kernel = _compile.get_kernel(cfg, p.features, p.device)
    if p.seqused_k and p.varlen:
        raise NotImplementedError("per-batch key lengths (seqused_k) with variable-length batches")
    inputs = INPUTS_VARLEN if p.varlen else INPUTS_SEQUSED_K if p.seqused_k else INPUTS
    inputs = with_mod_inputs(p, inputs)
    launch = Launch(kernel, (n_blocks,), (cfg.threads,), cfg.smem_bytes, pointers=inputs)
    params = pack_fwd(p, m_blocks)
    if p.block_mask is not None:  # entries per key-block list: the tile's key blocks
        params["bm_nb"] = -(-p.seqlen_k // cfg.block_k)
    return Plan(p.device, inputs, output_buffers(p, dtype), (launch,), OUTPUTS, params)


def with_mod_inputs(p: AttnProblem, inputs: tuple) -> tuple:
    """The forwards' optional last slots, in the kernels' order: alibi_slopes (attn/score_mod.cuh
    AlibiBias), then a user modification's aux pointer table mod_aux (UserMod)."""
    if p.alibi:
        inputs = (*inputs, "alibi_slopes")
    if p.mod is not None:
        inputs = (*inputs, "mod_aux")
    if p.block_mask is not None:
        inputs = (*inputs, "bm_counts", "bm_index")
    if p.sinks:
        inputs = (*inputs, "sinks")
    return inputs


def empty_plan(p: AttnProblem, dtype) -> FilledPlan:
    """A call with a batch, heads or seqlen of 0: no launch; out 0 and lse -inf (with seqlen_k 0 every
    row sees no key; otherwise the outputs are empty)."""
    out, lse = output_buffers(p, dtype)
    return FilledPlan(p.device, INPUTS, ((out, 0), (lse, -np.inf)))


def run_forward(candidates: tuple, plans: plan_cache.PlanCache, q, k, v, *, mask: MaskOptions, softmax_scale,
                dropout_p, seed, config, out, lse, backend=None, alibi_slopes=None, score_mod=None, block_mask=None,
                sinks=None):
    """The body the v2 and v1 forwards share: the call's dropout, the cached (or, with an explicit
    config, fresh) launch plan, optional output buffers, the launch. `mask`: the call's MaskOptions
    (the plan key holds its `key`, the values of its fields).

    candidates: the pass's kernel families in order of preference (families.FORWARDS for v2); the
    plan's family is families.choose(candidates, problem, backend) and its tile
    families.select(family, problem), or, with an explicit `config`, the config's family (checked
    against the candidates, `backend`, the device and the problem). Each family builds its plan
    (KernelFamily.plan). The backend choice is part of the plan: the plan key holds the `backend`
    argument, and CUFLASH_BACKEND is read when a plan is built, not per call. `alibi_slopes`: None
    or a float32 CuPy array (heads,) or (batch, heads) (problem.check_alibi_slopes), an input after
    the others; `score_mod`: None or a cuflash.ScoreMod, its aux pointer table the last input;
    `block_mask`: None or a cuflash.BlockMask of score_mod's mask, whose key-block lists for the
    plan's tile follow the table (the plan cache keeps the tile beside the plan); `sinks`: None or a
    float32 CuPy array (heads,) of attention sinks, joined in the kernel where its family has the
    instances (the v2 forwards: the plan takes it as its last input), else applied to the kernel's
    results after it (cuflash/sinks.py: v1, the decode kernel, an empty call).
    """
    import cupy

    dropout = problem.resolve_dropout(dropout_p, seed)
    if block_mask is not None:
        from .block_mask import BlockMask

        if score_mod is None or not isinstance(block_mask, BlockMask):
            problem.with_block_mask(None, block_mask, score_mod)  # raises, naming the argument

    def build_with_tile(cfg):  # (plan, its tile: None for an empty problem)
        infos = (problem.describe(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
        p = problem.resolve_forward(*infos, mask, softmax_scale, dropout)
        if alibi_slopes is not None:
            p = problem.with_alibi(p, problem.describe(alibi_slopes, "alibi_slopes"))
        p = problem.with_score_mod(p, score_mod)
        p = problem.with_block_mask(p, block_mask, score_mod)
        if p.empty:
            return empty_plan(p, q.dtype), None
        if cfg is None and _decode_route(candidates, p, backend):
            from . import kvcache

            return kvcache.plan_dense_decode(p, q.dtype), None
        family = families.choose(candidates, p, backend) if cfg is None else _explicit_family(candidates, cfg, p, backend)
        if sinks is not None and family.supports(dataclasses.replace(p.features, sinks=True)):
            p = problem.with_sinks(p, problem.describe(sinks, "sinks"))
        if cfg is None:
            cfg = families.select(family, p)
        return family.plan(p, cfg, q.dtype), cfg

    arrays = (q, k, v) if alibi_slopes is None else (q, k, v, alibi_slopes)
    tile = None
    cupy_arrays = all(type(a) is cupy.ndarray for a in arrays)
    if config is None and cupy_arrays:
        key = lambda: (*plan_key(arrays, mask.key, softmax_scale, dropout is not None, backend, score_mod),
                       *(() if sinks is None else ("sinks",)))
        if block_mask is None:
            plan = plans.get(key, lambda: build_with_tile(None)[0])
        else:  # the lists are the tile's: the cache keeps it beside the plan
            plan, tile = plans.get(lambda: (*key(), "block_mask", block_mask.layout), lambda: build_with_tile(None))
            # this mask against this call, every call (a cached plan knows only its layout)
            block_mask.check_call(score_mod.source, q.shape[0], q.shape[2], q.shape[1], k.shape[1], q.device.id)
    elif cupy_arrays and block_mask is None:  # a given config: its plan cached under the config too (the
        # tuner's trials time what a repeated call costs, not a plan build per call: ~0.1 ms, which bounded
        # its timings of short kernels)
        key = lambda: (*plan_key(arrays, mask.key, softmax_scale, dropout is not None, backend, score_mod), "config", config,
                       *(() if sinks is None else ("sinks",)))
        plan = plans.get(key, lambda: build_with_tile(config)[0])
    else:
        plan, tile = build_with_tile(config)
    if out is not None:
        out = _checked_out(out, q, v.shape[-1])
    if lse is not None:
        lse = _checked_lse(lse, (q.shape[0], q.shape[2], q.shape[1]))
    args = (q, k, v, out, lse) if alibi_slopes is None else (q, k, v, out, lse, alibi_slopes)
    if score_mod is not None:
        args = (*args, score_mod.pointer_table(q.device.id))
    if block_mask is not None and tile is not None:
        args = (*args, *block_mask.lists(tile.block_q, tile.block_k))
    if sinks is None:
        return plan.run(args, None if dropout is None else dropout.kernel_args)
    if "sinks" in plan.inputs:
        return plan.run((*args, sinks), None if dropout is None else dropout.kernel_args)
    from . import sinks as sinks_mod

    return sinks_mod.apply(*plan.run(args, None if dropout is None else dropout.kernel_args), sinks)


def _decode_route(candidates: tuple, p: AttnProblem, backend) -> bool:
    """Whether a v2 forward call goes to the decode kernel (kvcache.dense_decode_problem: few query
    rows per K/V head, as a decoding step passing the whole cache has), which reads each key and
    value once per K/V head and splits the keys over the GPU. Not when a backend is forced (the
    argument or CUFLASH_BACKEND: comparisons of the two prefill kernels keep them)."""
    if candidates is not families.FORWARDS or backend is not None or families.env_backend() is not None:
        return False
    from . import kvcache

    return kvcache.dense_decode_problem(p) is None


def _explicit_family(candidates: tuple, cfg, p: AttnProblem, backend):
    """The family of a caller-given config: one of `candidates`, of `backend` when one is given,
    able to serve the problem on its device (TypeError / ValueError otherwise)."""
    from . import device

    families.check_backend(backend)
    family = next((f for f in candidates if isinstance(cfg, f.tile_cls)), None)
    if family is None:
        names = " or ".join(f.tile_cls.__name__ for f in candidates)
        raise TypeError(f"config must be a {names}, got {type(cfg).__name__}")
    family.check_explicit(cfg, p.features)
    if backend is not None and family.backend != backend:
        raise ValueError(f"config {cfg} is a {family.backend} config, but backend={backend!r}")
    props = device.supported(p.device)
    why = family.cannot_run(p, props) or family.launch_limits_problem(cfg, props)
    if why:
        raise ValueError(f"config {cfg} cannot run this call on {props.name} (cc {props.cc_str}): {why}")
    return family


def _checked_out(out, q, dv=None):
    """`out` given for q (with v's head dim `dv` where it differs): C-contiguous, of q's dtype and device."""
    info = problem.describe(out, "out")
    shape = tuple(q.shape) if dv is None else (*q.shape[:-1], dv)
    if info.shape != shape or info.dtype != q.dtype.name or info.device != q.device.id:
        raise ValueError(f"out must match q (shape {shape}, dtype {q.dtype.name}, device {q.device.id}), "
                         f"got shape {info.shape}, dtype {info.dtype}, device {info.device}")
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    if info.ptr % problem.ALIGN_BYTES:  # the kernels store 4 to 16 bytes at once (the split combine: 8)
        raise ValueError(f"out's data pointer is not {problem.ALIGN_BYTES}-byte aligned")
    return out


def _checked_lse(lse, shape):
    import cupy

    if not isinstance(lse, cupy.ndarray) or lse.shape != shape or lse.dtype != cupy.float32 or not lse.flags.c_contiguous:
        raise ValueError(f"lse must be a contiguous float32 CuPy array of shape {shape}")
    return lse


_plans = plan_cache.PlanCache()


def plan_key(arrays, mask_key, softmax_scale, dropout_on: bool, backend, score_mod=None) -> tuple:
    """The forward plans' cache key (one function: cuflash/_torch.py's direct launches look the plan
    up again under it, and a key that differs there silently disables them)."""
    return (*plan_cache.array_key(arrays), mask_key, softmax_scale, dropout_on, backend,
            None if score_mod is None else score_mod.source)


def forward(q, k, v, *, mask: MaskOptions | None = None, softmax_scale=None, dropout_p=0.0, seed=None,
            config: FwdConfig | Sm90FwdConfig | None = None, out=None, lse=None, backend: str | None = None,
            alibi_slopes=None, score_mod=None, block_mask=None, sinks=None, **mask_options):
    """Returns (out, lse): out like q, lse float32 (batch, heads, seqlen_q).

    The mask: the record `mask` (what cuflash.attention hands on) or cuflash.attention's mask
    keywords (`causal=True`, ...: `mask_options`, MaskOptions' fields), not both; neither is no mask.
    dropout_p > 0 drops attention probabilities with the Philox mask of `seed` (an int; the same
    seed must go to the backward); lse is that of the undropped scores.
    `out` and `lse` may be given (internal: tests poison them, the backward reuses them); otherwise
    fresh contiguous arrays are allocated. `config` overrides the selected kernel config (a
    FwdConfig runs the sm80 kernel, an Sm90FwdConfig the Hopper one). `backend`: None (the Hopper
    kernel where it can run the call, else sm80; CUFLASH_BACKEND forces one), "sm80" or "sm90".
    `alibi_slopes`: ALiBi, FlashAttention's convention: a float32 CuPy array (heads,) or (batch,
    heads) on q's device; each score softmax_scale q.k (after softcap) gains -slope |i + offset - j|,
    offset the mask's alignment (seqlen_k - seqlen_q bottom-right). Both backends.
    `score_mod`: a cuflash.ScoreMod (user CUDA C++ score and/or mask snippets, cuflash/score_mods.py),
    applied before the built-in mask and ALiBi. Both backends.
    `block_mask`: a cuflash.BlockMask of score_mod's mask snippet (score_mod.block_mask(...)): the
    key blocks it empties are skipped (cuflash/block_mask.py). Both backends.
    `sinks`: attention sinks, a float32 CuPy array (heads,) of logits on q's device (cuflash/sinks.py),
    joined in the kernel's epilogue: out and lse come out rescaled. Both backends.
    """
    if mask_options or type(mask) is not MaskOptions:
        mask = MaskOptions.given(mask, mask_options)
    return run_forward(families.FORWARDS, _plans, q, k, v, mask=mask, softmax_scale=softmax_scale,
                       dropout_p=dropout_p, seed=seed, config=config, out=out, lse=lse, backend=backend,
                       alibi_slopes=alibi_slopes, score_mod=score_mod, block_mask=block_mask, sinks=sinks)
