"""Variable-length batches: `attention_varlen` and `attention_varlen_backward`, FlashAttention's
`flash_attn_varlen_func` layout (issue 12).

Sequences of different lengths are packed along one token axis: q (total_q, heads, head_dim), k and
v (total_k, heads_kv, head_dim); sequence b is the rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q
and [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k and v (int32 device arrays of batch + 1 offsets,
starting at 0, non-decreasing). Each sequence attends only to its own keys, with the mask aligned
per sequence (bottom-right by default: the last query sits at the last key). Empty sequences are
allowed (no rows to write; a sequence with queries and no key gives out 0 and lse -inf).

The kernels are the sm80 families' variable-length instances (Features.varlen: the v2 forward,
the backward's dK/dV and deterministic dQ kernels, and row-wise prep / convert kernels over a
(row chunks, heads, batch) grid) and the Hopper forward (TMA maps over the packed arrays as one
batch of all the rows; each work tile finds its sequence's rows); each block reads its sequence's
two offsets and moves its rows, lengths and mask with them (kernels_cu/attn/mask.cuh SeqSpan). The
backward's fp32 workspaces pad each sequence to a multiple of 128 rows (SeqSpan::ws_row0). The
Hopper backward (opt-in) has no varlen instances: the backward runs the sm80 kernels. Dropout as cuflash.attention's.

What is checked before any launch: shapes, dtypes, devices, head dims, GQA divisibility, the
cu_seqlens arrays' shape, dtype and device, max_seqlen_q / max_seqlen_k (non-negative ints; at least
1 when the batch has tokens). Not checked, because reading the device offsets would synchronise:
that they start at 0, never decrease, end at total_q / total_k and that no sequence is longer than
max_seqlen_q (the grid covers max_seqlen_q queries per sequence; rows past it are not computed).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import _forward, _interop, families, launch, problem, seqused
from . import _plans as plan_cache
from .launch import Buffer, FilledPlan
from .mask import MaskOptions
from .problem import ArrayInfo, AttnProblem

_plans = plan_cache.PlanCache()
_bwd_plans = plan_cache.PlanCache()


def _packed(info: ArrayInfo, name: str, heads_name: str) -> ArrayInfo:
    """The 4-D view (1, total, heads, head_dim) of a packed 3-D array, batch stride 0, for the dense checks."""
    if len(info.shape) != 3:
        raise ValueError(f"{name} must have 3 dimensions (total_tokens, {heads_name}, head_dim) (sequences packed "
                         f"along the first), got shape {info.shape}")
    return dataclasses.replace(info, shape=(1, *info.shape), strides=(0, *info.strides))


def _max_seqlen(x, name: str, total: int) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {x!r}")
    x = int(x)
    if x < 0 or x >= 2**28:
        raise ValueError(f"{name} must be in [0, 2^28), got {x}")
    if x == 0 and total > 0:
        raise ValueError(f"{name} is 0 but there are {total} tokens: it must be at least the longest sequence")
    return x


def _check_offsets(info: ArrayInfo, name: str, device: int) -> int:
    """The batch size of a cu_seqlens array (ArrayInfo), checked: (batch + 1,) integers on `device`."""
    if len(info.shape) != 1 or info.shape[0] < 1:
        raise ValueError(f"{name} must have shape (batch + 1,), got {info.shape}")
    if info.dtype not in ("int32", "int64", "uint32", "uint64"):
        raise TypeError(f"{name} must hold integers (int32), got dtype {info.dtype}")
    if info.device != device:
        raise ValueError(f"{name} is on device {info.device}, q on {device}")
    return info.shape[0] - 1


def _offsets_info(x, name: str) -> ArrayInfo:
    import cupy

    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"{name} must be a CuPy array of int32 offsets on the GPU (or a CUDA tensor of another "
                        f"framework), got {type(x).__module__}.{type(x).__qualname__}")
    return ArrayInfo(tuple(x.shape), x.dtype.name, x.dtype.itemsize, tuple(x.strides), x.data.ptr, x.device.id)


def resolve(qi: ArrayInfo, ki: ArrayInfo, vi: ArrayInfo, cu_q: ArrayInfo, cu_k: ArrayInfo, max_seqlen_q,
            max_seqlen_k, mask: MaskOptions, softmax_scale, dropout=None):
    """The AttnProblem of a varlen forward, from the arrays' descriptions: the dense checks on 4-D views
    of the packed arrays, then the varlen geometry (the window's offset only; align_end for
    bottom-right). Raises TypeError / ValueError naming the argument."""
    qi = _packed(qi, "q", "heads")
    ki, vi = _packed(ki, "k", "heads_kv"), _packed(vi, "v", "heads_kv")
    p = problem.resolve_forward(qi, ki, vi, mask, softmax_scale, dropout)
    batch = _check_offsets(cu_q, "cu_seqlens_q", p.device)
    batch_k = _check_offsets(cu_k, "cu_seqlens_k", p.device)
    if batch_k != batch:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got {batch + 1} "
                         f"and {batch_k + 1}")
    total_q, total_k = p.seqlen_q, p.seqlen_k
    if max(total_q, total_k) >= 2**31:
        raise ValueError(f"total tokens must be below 2^31, got total_q {total_q}, total_k {total_k}")
    mq = _max_seqlen(max_seqlen_q, "max_seqlen_q", total_q)
    mk = _max_seqlen(max_seqlen_k, "max_seqlen_k", total_k)
    left, right, _ = mask.geometry(0, 0)
    return dataclasses.replace(p, batch=batch, seqlen_q=mq, seqlen_k=mk, window_left=left, window_right=right,
                               offset=0, varlen=True, total_q=total_q, total_k=total_k,
                               align_end=mask.alignment == "bottom_right")


def resolve_backward(doi: ArrayInfo, qi: ArrayInfo, ki: ArrayInfo, vi: ArrayInfo, oi: ArrayInfo, li: ArrayInfo,
                     cu_q: ArrayInfo, cu_k: ArrayInfo, max_seqlen_q, max_seqlen_k, mask: MaskOptions, softmax_scale,
                     deterministic=False, dropout=None) -> AttnProblem:
    """The AttnProblem of a varlen backward: resolve()'s, plus out and dout shaped like q (packed,
    the same layout rules) and lse the forward's float32 (heads, total_q), C-contiguous."""
    p = resolve(qi, ki, vi, cu_q, cu_k, max_seqlen_q, max_seqlen_k, mask, softmax_scale, dropout)
    strides = dict(p.strides)
    for a, name in ((oi, "out"), (doi, "dout")):
        if a.dtype != qi.dtype:
            raise TypeError(f"{name} must have q's dtype {qi.dtype}, got {a.dtype}")
        want_shape = (*qi.shape[:2], p.dv)  # v's head dim where it differs from q's
        if tuple(a.shape) != want_shape:
            what = "q's shape" if p.dv == p.head_dim else "q's shape with v's head dim"
            raise ValueError(f"{name} must have {what} {want_shape}, got shape {a.shape}")
        if a.device != qi.device:
            raise ValueError(f"{name} must be on q's device {qi.device}, got device {a.device}")
        packed = _packed(a, name, "heads")
        problem._check_layout(packed, name)
        strides[name] = tuple(s // a.itemsize for s in packed.strides[:3])
    want = (p.heads, p.total_q)
    if li.dtype != "float32":
        raise TypeError(f"lse must be float32 (the forward's log-sum-exp), got dtype {li.dtype}")
    if tuple(li.shape) != want:
        raise ValueError(f"lse must have shape (heads, total_q) = {want}, got shape {li.shape}")
    if p.total_q and p.heads and (li.strides[-1] != 4 or (p.heads > 1 and li.strides[0] != 4 * p.total_q)):
        raise ValueError(f"lse must be C-contiguous, got strides {li.strides}; pass the lse the forward returned")
    if li.device != qi.device:
        raise ValueError(f"lse must be on q's device {qi.device}, got device {li.device}")
    return dataclasses.replace(p, strides=strides, deterministic=problem.check_flag(deterministic, "deterministic"))


def _empty_plan(p, dtype) -> FilledPlan:
    """No query or no key in the whole batch: out 0 and lse -inf (rows with no key), or empty outputs."""
    out, lse = _forward.output_buffers(p, dtype)
    return FilledPlan(p.device, _forward.INPUTS_VARLEN, ((out, 0), (lse, -np.inf)))


def _offsets(p: AttnProblem, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes, score_mod):
    """(p, cu_q, cu_k, alibi_slopes) for the kernels: the offsets as contiguous int32; with seqused_q /
    seqused_k, each sequence split in three (cuflash/seqused.py: the offsets and p's batch, per-batch
    slopes repeated). Everything checked before the first launch."""
    import cupy

    used = seqused_q is not None or seqused_k is not None
    if used and score_mod is not None:  # its snippets would see the split's sequence index 3b, not b
        raise NotImplementedError("seqused_q / seqused_k with a score_mod are not supported")
    lengths = [None if x is None else seqused.device_lengths(x, n, p.batch, p.device)
               for x, n in ((seqused_q, "seqused_q"), (seqused_k, "seqused_k"))]
    with launch.graph_temporaries():  # (an int64 or strided copy lives only as long as the call)
        cu_q, cu_k = (cupy.ascontiguousarray(x.astype(cupy.int32, copy=False)) for x in (cu_seqlens_q, cu_seqlens_k))
    if not used:
        return p, cu_q, cu_k, alibi_slopes
    cu_q, cu_k = seqused.expand(cu_q, cu_k, *lengths, p.batch)
    alibi_slopes = seqused.repeat_slopes(alibi_slopes)
    p = dataclasses.replace(p, batch=3 * p.batch)
    if alibi_slopes is not None:
        p = problem.with_alibi(p, problem.describe(alibi_slopes, "alibi_slopes"))
    return p, cu_q, cu_k, alibi_slopes


def _forward_cupy(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask: MaskOptions,
                  softmax_scale, out=None, lse=None, backend=None, dropout_p=0.0, seed=None, alibi_slopes=None,
                  score_mod=None, seqused_q=None, seqused_k=None):
    """The CuPy body: (out, lse). `out`, `lse`: given buffers (internal: the GPU tests poison them).
    `alibi_slopes`: ALiBi's (heads,) or (batch, heads) float32 slopes, an input after the offsets;
    `score_mod`: a cuflash.ScoreMod (positions within each sequence), its aux table the last input;
    `seqused_q` / `seqused_k`: the used lengths (cuflash/seqused.py), host or CuPy integers."""
    infos = [problem.describe(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))]
    offsets = [_offsets_info(x, n) for x, n in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k"))]
    dropout = problem.resolve_dropout(dropout_p, seed)
    p = resolve(*infos, *offsets, max_seqlen_q, max_seqlen_k, mask, softmax_scale, dropout)
    p = problem.with_alibi(p, None if alibi_slopes is None else problem.describe(alibi_slopes, "alibi_slopes"))
    p = problem.with_score_mod(p, score_mod)
    p, cu_q, cu_k, alibi_slopes = _offsets(p, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes,
                                           score_mod)
    slopes = () if alibi_slopes is None else (alibi_slopes,)
    table = () if score_mod is None else (score_mod.pointer_table(p.device),)

    def build():
        if p.empty:
            return _empty_plan(p, q.dtype)
        family = families.choose(families.FORWARDS, p, backend)  # the Hopper kernel where it can run
        return family.plan(p, families.select(family, p), q.dtype)

    plan = _plans.get(lambda: (*plan_cache.array_key((q, k, v, *slopes)), p.batch, p.seqlen_q, p.seqlen_k, mask.key,
                               softmax_scale, backend, dropout is not None, p.mod), build)
    if out is not None:
        out = _forward._checked_out(out, q, v.shape[-1])
    if lse is not None:
        lse = _forward._checked_lse(lse, (p.heads, p.total_q))
    return plan.run((q, k, v, out, lse, cu_q, cu_k, *slopes, *table), None if dropout is None else dropout.kernel_args)


def _backward_cupy(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   mask: MaskOptions, softmax_scale, deterministic=False, dropout_p=0.0, seed=None, alibi_slopes=None,
                   score_mod=None, backend=None, seqused_q=None, seqused_k=None):
    """The CuPy body of the backward: (dq, dk, dv) like q, k, v (packed); `alibi_slopes`,
    `score_mod` (a score snippet with its grad snippet) and `seqused_q` / `seqused_k` the forward's;
    `backend` forces the dK/dV kernel (None: the automatic choice)."""
    from . import _backward

    arrays = (dout, q, k, v, out, lse)
    infos = [problem.describe(x, n) for x, n in zip(arrays, ("dout", "q", "k", "v", "out", "lse"))]
    offsets = [_offsets_info(x, n) for x, n in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k"))]
    dropout = problem.resolve_dropout(dropout_p, seed)
    p = resolve_backward(*infos, *offsets, max_seqlen_q, max_seqlen_k, mask, softmax_scale, deterministic, dropout)
    p = problem.with_alibi(p, None if alibi_slopes is None else problem.describe(alibi_slopes, "alibi_slopes"))
    if score_mod is not None and score_mod.source.score is not None and score_mod.source.grad is None:
        raise ValueError("score_mod: the backward of a score snippet needs its derivative: "
                         "ScoreMod(score=..., grad=...) (d score_mod / d score)")
    p = problem.with_score_mod(p, score_mod)
    p, cu_q, cu_k, alibi_slopes = _offsets(p, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, alibi_slopes,
                                           score_mod)
    slopes = () if alibi_slopes is None else (alibi_slopes,)
    table = () if score_mod is None else (score_mod.pointer_table(p.device),)

    def build():
        if p.empty:  # no launch: zero gradients of q, k, v's shapes
            return FilledPlan(p.device, (), tuple((Buffer(n, x.shape, q.dtype), 0)
                                                  for n, x in zip(_backward.OUTPUTS, (q, k, v))))
        cfg, dq_cfg = _backward.with_dq_tile(p, families.select(_backward._main_family(p, None, backend), p),
                                             lambda: families.select(families.BWD_DQ, p))
        return _backward._plan(p, cfg, dq_cfg, q.dtype)

    key = lambda: (*plan_cache.array_key((*arrays, *slopes)), p.batch, p.seqlen_q, p.seqlen_k, mask.key, softmax_scale,
                   p.deterministic, dropout is not None, p.mod, backend)
    plan = _bwd_plans.get(key, build)
    return plan.run((*arrays, cu_q, cu_k, *slopes, *table), None if dropout is None else dropout.kernel_args)


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                              max_seqlen_k: int, *, causal: bool = False, softmax_scale: float | None = None,
                              window_size=(-1, -1), alignment: str = "bottom_right", softcap: float = 0.0,
                              deterministic: bool = False, dropout_p: float = 0.0, seed: int | None = None,
                              alibi_slopes=None, score_mod=None, backend: str | None = None, seqused_q=None,
                              seqused_k=None):
    """Gradients (dq, dk, dv) of attention_varlen for the upstream gradient `dout` (packed like q);
    `out` and `lse` are the forward's (lse (heads, total_q)). The mask options must be the forward's.
    deterministic=True: bitwise reproducible dq (a dQ kernel instead of fp32 atomics). dropout_p, seed:
    the forward's (the mask is regenerated from the seed, not stored). backend: the dK/dV kernel
    (None: automatic, the Hopper one on an H100/H200 at head_dim 64 and 128, else sm80; "sm90" or
    "sm80" forces one; deterministic=True takes the Hopper kernel's ordered dQ there too).
    seqused_q, seqused_k: the forward's. dq, dk and dv are 0 in the rows a sequence does not use.
    CuPy arrays, torch tensors (no autograd: call it yourself, or use attention_varlen on tensors
    that require grad) and other DLPack arrays."""
    families.check_backend(backend)
    mask = MaskOptions.of(causal=causal, window_size=window_size, alignment=alignment, softcap=softcap)
    names, arrays, fw, dev, optional, behind = _inputs(
        ["dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k"],
        [dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k], alibi_slopes, seqused_q, seqused_k)

    if dropout_p and seed is None:
        raise ValueError("seed is required with dropout_p > 0: pass the seed the forward used")

    def body(*a):
        opt = _interop.rejoin(optional, a[8:], behind)
        return _backward_cupy(*a[:8], max_seqlen_q, max_seqlen_k, mask, softmax_scale, deterministic, dropout_p, seed,
                              opt["alibi_slopes"], score_mod, backend, opt["seqused_q"], opt["seqused_k"])

    return body(*arrays) if fw == _interop.CUPY else _interop.run(body, arrays, fw, dev, names)


def _inputs(names: list, arrays: list, alibi_slopes, seqused_q, seqused_k, block_table=None, sinks=None):
    """(names, arrays, framework, device, optional names, behind) of a varlen call: the arrays, then
    the used lengths and the table on a device (cuflash/_interop.py optional_inputs), the slopes and
    the sinks (last), which the body gets back by rejoin(optional names, its arrays past the fixed
    ones, behind)."""
    fw, dev = _interop.common_framework(arrays, names)
    n_fixed = len(arrays)
    behind = _interop.optional_inputs(fw, names, arrays, seqused_q=seqused_q, seqused_k=seqused_k,
                                      block_table=block_table)
    for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):  # of q's framework and device
        if x is None:
            behind[name] = None
        else:
            names.append(name)
            arrays.append(x)
    if len(arrays) > n_fixed:
        fw, dev = _interop.common_framework(arrays, names)
    return tuple(names), tuple(arrays), fw, dev, tuple(names[n_fixed:]), behind


def _with_sinks(out, lse, sinks):
    """(out, lse) rescaled by the sinks (cuflash/sinks.py, on the packed arrays as one batch), or as they are."""
    if sinks is None:
        return out, lse
    from . import sinks as sinks_mod

    out, lse = sinks_mod.apply(out[None], lse[None], sinks)
    return out[0], lse[0]


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = False, softmax_scale: float | None = None, window_size=(-1, -1),
                     alignment: str = "bottom_right", softcap: float = 0.0, return_lse: bool = False,
                     deterministic: bool = False, backend: str | None = None, dropout_p: float = 0.0,
                     seed: int | None = None, alibi_slopes=None, score_mod=None, seqused_q=None, seqused_k=None,
                     block_table=None, sinks=None):
    """Attention over a batch of packed sequences of different lengths (module docstring: the layout,
    what is checked).

    q: (total_q, heads, head_dim); k, v: (total_k, heads_kv, head_dim) (heads_kv divides heads: GQA);
    float16 or bfloat16, contiguous in the last dimension. cu_seqlens_q / cu_seqlens_k: int32 arrays of
    batch + 1 offsets on q's device (int64 is converted). max_seqlen_q / max_seqlen_k: the longest
    sequence of each (host ints). causal / window_size / alignment / softcap / softmax_scale: as
    cuflash.attention, per sequence. Returns out (total_q, heads, head_dim), and with return_lse
    also lse float32 (heads, total_q) (FlashAttention's packed layout).
    CuPy arrays (the backward: attention_varlen_backward), torch tensors (differentiable when q, k or
    v require grad; deterministic=True makes that backward bitwise reproducible) and other DLPack
    arrays. backend: the forward's kernel, as cuflash.attention's (None: the Hopper one where it can
    run; "sm80" / "sm90" force one). dropout_p, seed: dropout on the attention probabilities, as
    cuflash.attention's (a Philox mask of `seed`, regenerated by the backward; torch autograd draws
    a seed from torch's generator when none is given; CuPy and DLPack callers must give one).
    alibi_slopes: ALiBi, as cuflash.attention's (float32 (heads,) or (batch, heads)), per sequence.
    score_mod: a cuflash.ScoreMod, as cuflash.attention's: b is the sequence, q_idx and kv_idx
    positions within it (a score snippet needs its grad snippet for the backward).
    seqused_q, seqused_k: integers (batch,) (FlashAttention 3's), on q's device or the host: sequence b
    uses only the first seqused_q[b] of its query rows and seqused_k[b] of its key rows (clipped to
    its rows; the others may hold any finite values and are never attended: NaN / Inf there can
    reach the used rows through the Hopper kernels' tiles, cuflash/seqused.py), the mask aligned to the used
    lengths; rows past seqused_q[b] get out 0 and lse -inf, and zero gradients. Host lengths are
    checked (none negative). No kernel of its own (cuflash/seqused.py: each sequence runs as
    three); not with score_mod; dropout's mask of sequence b is that of sequence index 3b.
    block_table: k and v are paged caches (num_pages, page_size, heads_kv, head_dim) (vLLM's and
    flash-attn's layout, any page size) and block_table (batch, pages per sequence) int32 names each
    sequence's pages in order, its key lengths still cu_seqlens_k's differences (or seqused_k):
    a prefill chunk against cached keys. Forward only (torch tensors that require grad are refused);
    the pages are gathered into one packing first (cuflash/paged_varlen.py). Host tables are
    checked; device ones are the caller's to keep in range (their entries are clipped into it).
    sinks: attention sinks (gpt-oss; transformers' s_aux), as cuflash.attention's: one logit per
    query head joining every row's softmax (cuflash/sinks.py rescales out and lse). Differentiable
    on torch tensors, sinks included; for CuPy arrays attention_varlen_backward with the out and
    lse returned here gives dq, dk, dv, and cuflash.sinks.grad(dout[None], out[None], lse[None],
    sinks) the sinks' gradient.
    """
    mask = MaskOptions.of(causal=causal, window_size=window_size, alignment=alignment, softcap=softcap)
    problem.check_flag(deterministic, "deterministic")
    families.check_backend(backend)
    names, arrays, fw, dev, optional, behind = _inputs(["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"],
                                                       [q, k, v, cu_seqlens_q, cu_seqlens_k], alibi_slopes,
                                                       seqused_q, seqused_k, block_table, sinks)
    if sinks is not None:
        from . import sinks as sinks_mod

        if len(getattr(q, "shape", ())) != 3:
            raise ValueError(f"q must be (total_q, heads, head_dim), got shape {tuple(getattr(q, 'shape', ()))}")
        sinks_mod.check(sinks, q.shape[1], q)
    needs_grad = fw == _interop.TORCH and _needs_grad(q, k, v, *(() if sinks is None else (sinks,)))
    if block_table is not None and needs_grad:
        raise NotImplementedError("attention_varlen with block_table (paged k and v) is forward only: call it "
                                  "under torch.no_grad() or on tensors that do not require grad")
    if fw == _interop.TORCH and dropout_p and seed is None:
        import torch

        seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())  # torch.manual_seed repeats it
    problem.resolve_dropout(dropout_p, seed)  # checked before any work
    if needs_grad:
        if score_mod is not None and score_mod.source.score is not None and score_mod.source.grad is None:
            raise ValueError("score_mod: a score snippet needs its derivative for autograd: ScoreMod(score=..., "
                             "grad=...) (d score_mod / d score), or call under torch.no_grad()")
        n_opt = len(optional) - (sinks is not None)  # (the sinks go as an argument of their own: a gradient)
        out, lse = _torch_function().apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask,
                                           softmax_scale, bool(deterministic), dev, backend, dropout_p, seed,
                                           (arrays[5:5 + n_opt], optional[:n_opt], behind), score_mod, sinks)
        return (out, lse) if return_lse else out

    def body(q, k, v, cu_q, cu_k, *rest):
        opt = _interop.rejoin(optional, rest, behind)
        used_k, max_k = opt["seqused_k"], max_seqlen_k
        if opt["block_table"] is not None:  # the pages gathered; their lengths become used lengths
            k, v, cu_k, lengths, max_k = _paged(q, k, v, cu_q, cu_k, opt["block_table"])
            used_k = lengths if used_k is None else used_k
        res = _forward_cupy(q, k, v, cu_q, cu_k, max_seqlen_q, max_k, mask, softmax_scale, backend=backend,
                            dropout_p=dropout_p, seed=seed, alibi_slopes=opt["alibi_slopes"], score_mod=score_mod,
                            seqused_q=opt["seqused_q"], seqused_k=used_k)
        return _with_sinks(*res, opt["sinks"])

    out, lse = body(*arrays) if fw == _interop.CUPY else _interop.run(body, arrays, fw, dev, names)
    return (out, lse) if return_lse else out


def _paged(q, k, v, cu_q, cu_k, block_table):
    """cuflash/paged_varlen.py's gather of CuPy pools k, v by block_table, after the checks of the
    offsets it reads (their shapes, dtype and device)."""
    from . import paged_varlen

    device = problem.describe(q, "q").device
    batch = _check_offsets(_offsets_info(cu_q, "cu_seqlens_q"), "cu_seqlens_q", device)
    if _check_offsets(_offsets_info(cu_k, "cu_seqlens_k"), "cu_seqlens_k", device) != batch:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got {batch + 1} "
                         f"and {cu_k.shape[0]}")
    return paged_varlen.gather(k, v, block_table, cu_k, batch, device)


def _needs_grad(*tensors) -> bool:
    import torch

    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


_TORCH_FUNCTION = None


def _torch_function():
    """The torch autograd.Function of attention_varlen (made once: a class is a reference cycle)."""
    global _TORCH_FUNCTION
    if _TORCH_FUNCTION is None:
        import torch

        names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")
        bwd_names = ("dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k")

        class VarlenAttention(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, mask, scale, deterministic, dev, backend, dropout_p,
                        seed, optional, score_mod, sinks):
                # optional: (tensors, their names, behind): the slopes and device lengths that travel
                # with the arrays (_inputs), and what stayed on the host; sinks: differentiable, apart
                extra, opt_names, behind = optional
                with_sinks = () if sinks is None else (sinks,)

                def body(q, k, v, cu_q, cu_k, *rest):
                    opt = _interop.rejoin(opt_names, rest, behind)
                    res = _forward_cupy(q, k, v, cu_q, cu_k, max_q, max_k, mask, scale, backend=backend,
                                        dropout_p=dropout_p, seed=seed, alibi_slopes=opt["alibi_slopes"],
                                        score_mod=score_mod, seqused_q=opt["seqused_q"], seqused_k=opt["seqused_k"])
                    return _with_sinks(*res, rest[-1] if with_sinks else None)

                out, lse = _interop.run(body, (q, k, v, cu_q, cu_k, *extra, *with_sinks), _interop.TORCH, dev,
                                        names + opt_names + (("sinks",) if with_sinks else ()))
                # out and lse are the sinks' rescaled ones: the ordinary backward takes them as they are
                ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, sinks, *extra)
                ctx.options = (max_q, max_k, mask, scale, deterministic, dev, dropout_p, seed, score_mod, opt_names,
                               behind)
                ctx.mark_non_differentiable(lse)
                return out, lse

            @staticmethod
            def backward(ctx, dout, dlse):
                q, k, v, out, lse, cu_q, cu_k, sinks, *extra = ctx.saved_tensors
                max_q, max_k, mask, scale, deterministic, dev, dropout_p, seed, score_mod, opt_names, behind = \
                    ctx.options

                def body(*a):
                    opt = _interop.rejoin(opt_names, a[8:], behind)
                    return _backward_cupy(*a[:8], max_q, max_k, mask, scale, deterministic, dropout_p, seed,
                                          opt["alibi_slopes"], score_mod, seqused_q=opt["seqused_q"],
                                          seqused_k=opt["seqused_k"])

                dout = dout.contiguous()
                dq, dk, dv = _interop.run(body, (dout, q, k, v, out, lse, cu_q, cu_k, *extra), _interop.TORCH, dev,
                                          bwd_names + opt_names)
                dsinks = None
                if sinks is not None and ctx.needs_input_grad[16]:
                    from . import sinks as sinks_mod

                    dsinks = sinks_mod.grad(dout[None], out[None], lse[None], sinks)
                return dq, dk, dv, *(None,) * 13, dsinks  # (q, k, v, 13 options, sinks)

        _TORCH_FUNCTION = VarlenAttention
    return _TORCH_FUNCTION
