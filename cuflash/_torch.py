"""PyTorch integration: cuflash's forward and backward as torch custom ops, with autograd.

    torch.ops.cuflash.attention_fwd(q, k, v, causal, softmax_scale, algorithm, deterministic, dropout_p, seed,
                                    backend) -> (out, lse)          # causal, ...: MaskOptions' fields
    torch.ops.cuflash.attention_bwd(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, dropout_p, seed)
        -> (dq, dk, dv)

`cuflash.attention` on torch tensors calls attention_fwd; its registered autograd formula calls
attention_bwd, so `out.backward()` works when q, k or v require grad. Both ops have fake (meta)
implementations, so torch.compile traces around them (they stay opaque calls in the graph).
Eager calls with plain tensors (no tracer, fake tensors, functorch transform or dispatch mode)
skip the dispatcher: the same implementations under a plain autograd.Function (_EagerAttention),
which saves the custom op's Python dispatch on every call.
`deterministic` is an argument of the forward op only so that autograd can hand it to the backward.

The kernels run on torch's current stream of the tensors' device (no synchronisation added), on
zero-copy CuPy views of the tensors; results are CuPy allocations handed to torch by DLPack.
The lse output is not differentiable (marked so): gradients flow through `out` only.
Schemas and autograd's option plumbing come from the argument lists in cuflash/signature.py; the
mask options (`causal`, ...) are the fields of cuflash.mask.MaskOptions, flat in the schemas and
gathered back into the record by the ops, whose Python implementations take the options as
*options (their __signature__ names them). Argument checks are cuflash/problem.py's and
MaskOptions', which the ops' real and fake implementations share.

This module imports torch, so cuflash imports it only when the first torch tensor arrives; the
ops are registered then, once per process. Needs torch >= 2.4 (torch.library.custom_op).
"""
import inspect

import torch

import numpy as np

from . import _forward, _interop, families, problem
from .api import forward_fn
from .launch import Plan
from .mask import MaskOptions
from .signature import (BWD_ARGS, BWD_ARRAYS, BWD_OPTIONS, BWD_SCHEMA, FWD_ARGS, FWD_ARRAYS, FWD_OPTIONS, FWD_SCHEMA,
                        OPTION_GRADS, backward_options, mask_and_options, op_options, parameters, split_options)

Tensor = torch.Tensor

# Outputs come from CuPy's memory pool, which CUDA-graph capture (torch.compile's "reduce-overhead")
# knows nothing about: let Inductor keep these ops out of captured graphs. Recent torch versions
# have the tag (and custom_op's `tags` argument); older ones go without.
_TAGS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


def _custom_op(name, schema):
    kw = {"tags": _TAGS} if _TAGS and "tags" in inspect.signature(torch.library.custom_op).parameters else {}
    return torch.library.custom_op(name, mutates_args=(), schema=schema, **kw)


_FWD_SIGNATURE = inspect.Signature(parameters(FWD_ARRAYS, FWD_OPTIONS))
_BWD_SIGNATURE = inspect.Signature(parameters(BWD_ARRAYS, BWD_OPTIONS))


def _signed(signature):
    """Give an implementation that takes (arrays..., *options) the op's parameter list as its signature."""
    def wrap(fn):
        fn.__signature__ = signature
        return fn

    return wrap


def _device(tensors, names) -> int:
    """Device ordinal shared by `tensors` (all torch tensors); errors name the argument."""
    for t in tensors:
        if not isinstance(t, Tensor):
            _interop.common_framework(tensors, names)  # raises the error naming the odd argument
            raise TypeError(f"{_interop._join(names)} must all be torch tensors")  # (not reached)
    d0 = tensors[0].device
    for t, n in zip(tensors, names):
        if t.device.type != "cuda":
            raise TypeError(f"{n} must be on a CUDA device, got a torch.Tensor on {t.device}")
    for t in tensors:
        if t.device != d0:
            devs = ", ".join(str(x.device) for x in tensors)
            raise ValueError(f"{_interop._join(names)} must be on one device, got devices {devs}")
    return d0.index  # a tensor's CUDA device always has an index


# seed travels as a signed 64-bit int (torch's `int`); _seed_in/_seed_out map [0, 2^64) onto it.
def _seed_in(seed: int) -> int:
    return seed - (1 << 64) if seed >= (1 << 63) else seed


def _seed_out(dropout_p, seed: int):
    """The CuPy entry points' seed for the ops' (dropout_p, seed): None without dropout."""
    return seed & ((1 << 64) - 1) if dropout_p > 0 else None


def _dropout_options(dropout_p, seed):
    """(dropout_p, seed) for the ops, checked; a missing seed with dropout is drawn from torch's CPU
    generator (so torch.manual_seed makes runs repeatable), and autograd reuses it."""
    if dropout_p is None or (not isinstance(dropout_p, bool) and dropout_p == 0.0 and seed is None):
        problem.resolve_dropout(dropout_p, seed)  # raises for None
        return 0.0, 0
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
    problem.resolve_dropout(dropout_p, seed)  # checks both
    return float(dropout_p), _seed_in(int(seed))


# ------------------------------------------------------------------------------------------ the ops

@_signed(_FWD_SIGNATURE)
def _fwd_impl(q, k, v, *options):
    return _fwd_run(q, k, v, options)


def _fwd_run(q, k, v, options, remember=None, alibi_slopes=None, score_mod=None, block_mask=None, sinks=None):
    """The forward on CuPy views of the tensors; `remember`: a direct-launch key (_direct_key) under
    which to keep the plan the call ran, for the next calls of this signature; `alibi_slopes`: ALiBi's
    and `score_mod` a cuflash.ScoreMod (the v2 forward; no direct launches); `sinks`: attention sinks,
    joined in the v2 kernels (cuflash._forward.run_forward), applied after v1's (cuflash/sinks.py)."""
    mask, o = mask_and_options(FWD_OPTIONS, options)
    fwd = forward_fn(o["algorithm"])
    arrays, names = (q, k, v), FWD_ARRAYS
    if alibi_slopes is not None:
        arrays, names = (*arrays, alibi_slopes), (*names, "alibi_slopes")
    if sinks is not None:  # float32, as the kernels read them (a copy only where they are not)
        arrays, names = (*arrays, sinks.detach().float().contiguous()), (*names, "sinks")
    dev = _device(arrays, names)
    seed = _seed_out(o["dropout_p"], o["seed"])

    def run(cq, ck, cv, *rest):
        extra = {"alibi_slopes": rest[0]} if alibi_slopes is not None else {}
        if score_mod is not None:
            extra["score_mod"] = score_mod
        if block_mask is not None:
            extra["block_mask"] = block_mask
        if sinks is not None and o["algorithm"] == "v2":
            extra["sinks"] = rest[-1]
        res = fwd(cq, ck, cv, mask=mask, softmax_scale=o["softmax_scale"], dropout_p=o["dropout_p"], seed=seed,
                  backend=o["backend"], **extra)
        if sinks is not None and o["algorithm"] != "v2":
            from . import sinks as sinks_mod

            res = sinks_mod.apply(*res, rest[-1])
        if remember is not None and o["algorithm"] == "v2":
            dropout = problem.resolve_dropout(o["dropout_p"], seed) is not None
            _remember(remember, _forward._plans,
                      _forward.plan_key((cq, ck, cv), mask.key, o["softmax_scale"], dropout, o["backend"]), dev, dropout)
        return res

    out, lse = _interop.run(run, arrays, _interop.TORCH, dev, names)
    return out.contiguous(), lse.contiguous()  # as the fake promises (no-ops: fresh arrays)


@_signed(_BWD_SIGNATURE)
def _bwd_impl(dout, q, k, v, out, lse, *options):
    return _bwd_run(dout, q, k, v, out, lse, options)


def _bwd_run(dout, q, k, v, out, lse, options, remember=None, alibi_slopes=None, score_mod=None, block_mask=None):
    """The backward on CuPy views; `remember`, `alibi_slopes` and `score_mod` as _fwd_run's."""
    mask, o = mask_and_options(BWD_OPTIONS, options)
    dout = dout.contiguous()  # autograd may hand a zero-stride (expanded) or otherwise strided gradient
    tensors, names = (dout, q, k, v, out, lse), BWD_ARRAYS
    if alibi_slopes is not None:
        tensors, names = (*tensors, alibi_slopes), (*BWD_ARRAYS, "alibi_slopes")
    dev = _device(tensors, names)
    seed = _seed_out(o["dropout_p"], o["seed"])
    from . import _backward

    def run(*arrays):
        res = _backward.backward(*arrays[:6], mask=mask, softmax_scale=o["softmax_scale"],
                                 deterministic=o["deterministic"], dropout_p=o["dropout_p"], seed=seed,
                                 alibi_slopes=arrays[6] if len(arrays) > 6 else None, score_mod=score_mod,
                                 block_mask=block_mask)
        if remember is not None:
            dropout = problem.resolve_dropout(o["dropout_p"], seed) is not None
            _remember(remember, _backward._plans,
                      _backward.plan_key(arrays, mask.key, o["softmax_scale"], o["deterministic"], dropout, None), dev,
                      dropout)
        return res

    dq, dk, dv = _interop.run(run, tensors, _interop.TORCH, dev, names)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()  # the fake's layout, whatever the kernel's


# The ops: the implementations above behind torch's dispatcher (torch.compile, fake tensors, the
# schema); eager calls take the fast path below instead.
attention_fwd = _custom_op("cuflash::attention_fwd", FWD_SCHEMA)(_fwd_impl)
attention_bwd = _custom_op("cuflash::attention_bwd", BWD_SCHEMA)(_bwd_impl)


# ----------------------------------------------------------------------------- fake (meta) versions
# They check what the real ops check (problem.resolve_*), from tensor metadata. Not dropout: under
# torch.compile dropout_p may be symbolic; the public entry point checked it before tracing, and the
# real op checks it again when it runs.

def _info(t, name, contiguous=False):
    """ArrayInfo from tensor metadata (no data access: works on fake tensors); None if symbolic."""
    shape, strides = tuple(t.shape), tuple(t.stride())
    if not all(type(s) is int for s in shape + strides):
        return None  # dynamic shapes: the real call validates
    it = t.element_size()
    if contiguous:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    dtype = str(t.dtype).rpartition(".")[2]
    return problem.ArrayInfo(shape, dtype, it, tuple(s * it for s in strides), 0, t.device.index or 0)


@attention_fwd.register_fake
@_signed(_FWD_SIGNATURE)
def _attention_fwd_fake(q, k, v, *options):
    mask, o = split_options(FWD_OPTIONS, options)
    problem.check_algorithm(o["algorithm"])
    families.check_backend(o["backend"])  # whether it can run is the device's business: the real op says
    infos = [_info(t, n) for t, n in zip((q, k, v), FWD_ARRAYS)]
    if None not in infos:
        problem.resolve_forward(*infos, MaskOptions.of(**mask), o["softmax_scale"])
    b, nq, h, _ = q.shape
    return q.new_empty((b, nq, h, v.shape[-1])), q.new_empty((b, h, nq), dtype=torch.float32)  # out: v's head dim


@attention_bwd.register_fake
@_signed(_BWD_SIGNATURE)
def _attention_bwd_fake(dout, q, k, v, out, lse, *options):
    mask, o = split_options(BWD_OPTIONS, options)
    infos = [_info(t, n, contiguous=(n == "dout")) for t, n in zip((dout, q, k, v, out, lse), BWD_ARRAYS)]
    if None not in infos:
        problem.resolve_backward(*infos, MaskOptions.of(**mask), o["softmax_scale"], o["deterministic"])
    # dk, dv follow k and v: heads_kv heads under GQA/MQA (each the sum over its group of query heads)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ------------------------------------------------------------------------------------------ autograd

def _setup_context(ctx, inputs, output):
    q, k, v = inputs[:len(FWD_ARRAYS)]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = backward_options(inputs)  # dropout's p and seed included: the backward regenerates the mask
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    # dlse is ignored: lse is marked non-differentiable (autograd hands zeros or None here).
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_bwd(dout, q, k, v, out, lse, *ctx.options)
    return (dq, dk, dv, *OPTION_GRADS)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)

_fwd_op = torch.ops.cuflash.attention_fwd.default
_bwd_op = torch.ops.cuflash.attention_bwd.default


# ------------------------------------------------------------------------------ eager fast path
# Measured on the H200 (docs/perf-notes.md, per-call overhead): a custom op's Python dispatch (the
# autograd wrapper, redispatch, the dynamo-disable wrapper around the implementation) was about a
# quarter of a small forward call's host time. Outside tracing, with plain tensors, the same
# implementations run under a plain autograd.Function: same kernels, outputs and gradients.

class _EagerAttention(torch.autograd.Function):
    # the options travel as one tuple: autograd unwraps, checks and returns a gradient slot per
    # argument, and 10 flat options were 10 more of each per call
    @staticmethod
    def forward(ctx, q, k, v, options):
        key, ptrs = _direct_key((q, k, v), options, _FWD_SEED)
        out, lse = _fwd_eager(q, k, v, options, key, ptrs)
        ctx.fwd_key = key  # the backward's key builds on it (out and lse are laid out by the forward's plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = backward_options((q, k, v, *options))
        ctx.mark_non_differentiable(lse)
        # lse has no gradient: without this autograd would allocate and zero-fill one per backward
        # (a fill kernel and an allocation on every step, for an argument the backward ignores)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:  # out took no gradient (not materialised): none flows to q, k, v
            return None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        return (*_bwd_eager(dout, q, k, v, out, lse, ctx.options, ctx.fwd_key), None)


# ------------------------------------------------------------------------------ direct launches
# What an eager call still cost over the CuPy path (docs/perf-notes.md, per-call overhead): DLPack
# both ways for every tensor, CuPy's device, stream and allocator contexts, the options parsed back
# into a MaskOptions, the CuPy path's description of the arrays. A call whose signature (every
# tensor's shape, strides, dtype and device, the pointers' alignment, the options but the dropout
# seed) was seen before runs the plan that the CuPy path built for that signature, directly: the
# outputs and workspaces from torch's allocator (torch.empty on the current stream: capturable),
# the tensors' data_ptr(), the kernels on torch's current raw stream. The first call of a
# signature takes the full path (its checks, errors and plan) and leaves the plan here.

_FWD_SEED = FWD_ARGS.index("seed") - len(FWD_ARRAYS)
_FWD_DROP = FWD_ARGS.index("dropout_p") - len(FWD_ARRAYS)
_BWD_SEED = BWD_ARGS.index("seed") - len(BWD_ARRAYS)
_BWD_DROP = BWD_ARGS.index("dropout_p") - len(BWD_ARRAYS)
_MAX_DIRECT = 1024
_direct: dict = {}  # _direct_key -> (plan, device, its allocator, dropout on, its PlanCache, generation, CuPy device)
# the ops' options of calls without dropout, by the public arguments they came from (checked once):
# (mask, softmax_scale, its type, algorithm, deterministic, backend) -> options
_no_dropout_options: dict = {}
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8}
_torch_dtypes: dict = {}  # a plan's buffer dtype (NumPy's, or CuPy's bfloat16) -> torch's
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(dev: int) -> int:
    return _raw_stream(dev) if _raw_stream is not None else torch.cuda.current_stream(dev).cuda_stream


def _direct_key(tensors, options, seed_at: int):
    """(key, the tensors' data pointers): the pointers are read once, for the key's alignment and the launch."""
    ptrs = [t.data_ptr() for t in tensors]
    low = 0
    for p in ptrs:
        low |= p
    return (tuple([(t.shape, t.stride(), t.dtype, t.get_device()) for t in tensors]), low % 16,
            options[:seed_at], options[seed_at + 1:]), ptrs


def _remember(key, plans, plan_key, dev: int, dropout: bool) -> None:
    """Keep the plan the CuPy path ran (its cache entry under `plan_key`, the key it used)."""
    plan = plans.lookup(plan_key)
    if isinstance(plan, Plan):  # not FilledPlan (empty problems): those stay on the full path
        if len(_direct) >= _MAX_DIRECT:
            _direct.clear()
        import cupy

        try:
            _direct[key] = (plan, dev, _empty_on(torch.device("cuda", dev)), dropout, plans, plans.generation,
                            cupy.cuda.Device(dev))
        except TypeError:  # an unhashable option value (the call still ran): not kept
            pass


def _empty_on(tdev):
    """Plan.run_external's allocator on torch device `tdev`: (tensor, its data pointer)."""
    def empty(shape, dtype):
        td = _torch_dtypes.get(dtype)
        if td is None:
            td = _torch_dtypes[dtype] = _TORCH_DTYPES[np.dtype(dtype).name]
        t = torch.empty(shape, dtype=td, device=tdev)
        return t, t.data_ptr()

    return empty


def _run_direct(entry, ptrs, options, drop_at: int, seed_at: int):
    plan, dev, empty, dropout, _, _, cdev = entry
    drop = None
    if dropout:
        p = options[drop_at]
        drop = problem.resolve_dropout(p, _seed_out(p, options[seed_at])).kernel_args
    with cdev:
        return plan.run_external(ptrs, empty, _stream(dev), drop)


def _lookup(key):
    try:
        return _direct.get(key)
    except TypeError:  # an unhashable option: the full path checks it
        return None


def _fwd_eager(q, k, v, options, key=None, ptrs=None):
    if key is None:
        key, ptrs = _direct_key((q, k, v), options, _FWD_SEED)
    entry = _lookup(key)
    if entry is None or entry[5] != entry[4].generation:  # new, or its plan cache was cleared since
        return _fwd_run(q, k, v, options, remember=key)
    return _run_direct(entry, ptrs, options, _FWD_DROP, _FWD_SEED)


def _bwd_eager(dout, q, k, v, out, lse, options, fwd_key=None):
    """The backward's direct launch. `fwd_key`: the forward's _direct_key (autograd's backward of
    that forward): q, k, v's layouts and the options are in it, and out and lse are the forward
    plan's contiguous outputs, so only dout's layout and every pointer's alignment are added (six
    tensors' shapes and strides were a tenth of a small backward's host time)."""
    dout = dout.contiguous()
    if fwd_key is None:
        key, ptrs = _direct_key((dout, q, k, v, out, lse), options, _BWD_SEED)
        key = ("bwd", key)
    else:
        ptrs = [dout.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()]
        low = 0
        for p in ptrs:
            low |= p
        key = ("bwd_of", fwd_key, dout.shape, dout.dtype, low % 16, options[:_BWD_SEED], options[_BWD_SEED + 1:])
    entry = _lookup(key)
    if entry is None or entry[5] != entry[4].generation:
        return _bwd_run(dout, q, k, v, out, lse, options, remember=key)
    return _run_direct(entry, ptrs, options, _BWD_DROP, _BWD_SEED)


_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
from torch.utils._python_dispatch import _get_current_dispatch_mode  # noqa: E402  (per call below: no import there)


def _eager(tensors) -> bool:
    """Whether a call may skip the dispatcher: not under torch.compile or another tracer, plain
    torch.Tensor arguments (no fake or subclass tensors), no functorch transform, no dispatch mode."""
    if torch.compiler.is_compiling() or _functorch_active():
        return False
    for t in tensors:
        if type(t) is not Tensor:
            return False
    return _get_current_dispatch_mode() is None


# ------------------------------------------------------------------------------ public entry points
# The options are checked here, once, because the ops' schema types cannot carry a wrong one to
# the checks below them (a str for `causal` would fail in the dispatcher, not with our message):
# the mask was checked when the caller built its record.

def attention(q, k, v, mask: MaskOptions, softmax_scale, return_lse, algorithm, deterministic, dropout_p=0.0,
              seed=None, backend=None):
    """cuflash.attention for torch tensors (differentiable). Arguments checked by the caller:
    the mask (a MaskOptions), algorithm, deterministic and backend; checked here: types, devices,
    softmax_scale, dropout."""
    options = okey = None
    if (seed is None and dropout_p == 0 and type(dropout_p) in (float, int)  # no dropout: options seen before?
            and type(q) is Tensor and type(k) is Tensor and type(v) is Tensor):
        okey = (mask, softmax_scale, type(softmax_scale), algorithm, deterministic, backend)
        try:
            options = _no_dropout_options.get(okey)
        except TypeError:  # an unhashable option: the checks below say what is wrong with it
            okey = None
    if options is None:  # (else: plain tensors, whose devices _fwd_run checks where it describes them)
        _device((q, k, v), FWD_ARRAYS)
        scale = problem.check_softmax_scale(softmax_scale)
        dropout_p, seed = _dropout_options(dropout_p, seed)
        options = op_options(FWD_OPTIONS, mask, softmax_scale=scale, algorithm=algorithm,
                             deterministic=bool(deterministic), dropout_p=dropout_p, seed=seed, backend=backend)
        if seed == 0 and dropout_p == 0 and okey is not None and len(_no_dropout_options) < _MAX_DIRECT:
            _no_dropout_options[okey] = options
    if not _eager((q, k, v)):
        out, lse = _fwd_op(q, k, v, *options)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _EagerAttention.apply(q, k, v, options)
    else:  # no gradient to record (inference, torch.no_grad): the forward without autograd's Function
        out, lse = _fwd_eager(q, k, v, options)
    return (out, lse) if return_lse else out


class _SinkAttention(torch.autograd.Function):
    """attention with sinks (cuflash/sinks.py), ALiBi slopes and / or a user modification (a
    cuflash.ScoreMod; any may be None): the kernels' forward (with the slopes and the snippets), its
    (out, lse) rescaled by the sinks; the backward is the ordinary one (with the slopes and the
    snippets) fed the rescaled (out', lse'), plus the sinks' gradient. The slopes and the
    modification's aux arrays get none (FlashAttention's slopes are not trained either)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, slopes, score_mod, block_mask, *options):
        out, lse = _fwd_run(q, k, v, options, alibi_slopes=slopes, score_mod=score_mod, block_mask=block_mask,
                            sinks=sinks)  # out and lse rescaled by the sinks
        ctx.save_for_backward(q, k, v, out, lse, sinks, slopes)
        ctx.score_mod, ctx.block_mask = score_mod, block_mask
        ctx.options = backward_options((q, k, v, *options))
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from . import sinks as sinks_mod

        q, k, v, out, lse, sinks, slopes = ctx.saved_tensors
        dq, dk, dv = _bwd_run(dout, q, k, v, out, lse, ctx.options, alibi_slopes=slopes, score_mod=ctx.score_mod,
                              block_mask=ctx.block_mask)
        dsinks = sinks_mod.grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        return (dq, dk, dv, dsinks, None, None, None, *OPTION_GRADS)


def attention_sinks(q, k, v, sinks, mask: MaskOptions, softmax_scale, return_lse, algorithm, deterministic,
                    dropout_p=0.0, seed=None, backend=None, alibi_slopes=None, score_mod=None, block_mask=None):
    """cuflash.attention(..., sinks=, alibi_slopes=, score_mod=) for torch tensors (any may be None),
    differentiable in q, k, v and sinks (an autograd.Function around the ops' implementations: not
    traced by torch.compile yet). A score snippet without its grad snippet is refused here when a
    gradient will be needed, not at the backward."""
    if (score_mod is not None and score_mod.source.score is not None and score_mod.source.grad is None
            and torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, sinks))):
        raise ValueError("score_mod: a score snippet needs its derivative for autograd: ScoreMod(score=..., "
                         "grad=...) (d score_mod / d score), or call under torch.no_grad()")
    if alibi_slopes is not None:
        _device((q, k, v, alibi_slopes), (*FWD_ARRAYS, "alibi_slopes"))
    _device((q, k, v), FWD_ARRAYS)
    scale = problem.check_softmax_scale(softmax_scale)
    dropout_p, seed = _dropout_options(dropout_p, seed)
    options = op_options(FWD_OPTIONS, mask, softmax_scale=scale, algorithm=algorithm,
                         deterministic=bool(deterministic), dropout_p=dropout_p, seed=seed, backend=backend)
    out, lse = _SinkAttention.apply(q, k, v, sinks, alibi_slopes, score_mod, block_mask, *options)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, mask: MaskOptions, softmax_scale, deterministic, dropout_p=0.0,
                       seed=None, alibi_slopes=None, score_mod=None, block_mask=None):
    """cuflash.attention_backward for torch tensors: (dq, dk, dv), not itself differentiable."""
    _device((dout, q, k, v, out, lse), BWD_ARRAYS)
    if dropout_p and seed is None:
        raise ValueError("seed is required with dropout_p > 0: pass the seed the forward used")
    scale = problem.check_softmax_scale(softmax_scale)
    dropout_p, seed = _dropout_options(dropout_p, seed)
    options = op_options(BWD_OPTIONS, mask, softmax_scale=scale, deterministic=bool(deterministic),
                         dropout_p=dropout_p, seed=seed)
    with torch.no_grad():
        arrays = (dout, q, k, v, out, lse)
        if alibi_slopes is not None or score_mod is not None or block_mask is not None:  # not op arguments yet: eagerly
            return _bwd_run(*arrays, options, alibi_slopes=alibi_slopes, score_mod=score_mod, block_mask=block_mask)
        return _bwd_impl(*arrays, *options) if _eager(arrays) else _bwd_op(*arrays, *options)
