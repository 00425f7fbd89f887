"""The host side of cuflash.jax without importing jax: options, trace-time checks, buffer callbacks.

cuflash/jax.py wraps cuflash's forward and backward in `jax.experimental.buffer_callback`s. XLA runs
a callback when the compiled program reaches it, handing it an execution context (`ctx.stream`:
the CUDA stream XLA runs the program on) and the device buffers: the results to fill first, then
the operands. The callbacks here view those buffers as CuPy arrays (zero-copy, from their
`__cuda_array_interface__` pointers) and run cuflash's CuPy entry points on XLA's stream, so the
kernels are ordered with the rest of the program without any synchronisation: XLA has made the
operands ready on that stream and reads the results from it after the callback returns.

The forward writes `out` and `lse` straight into XLA's result buffers. The backward's dq, dk, dv
come from the backward's own allocations (CuPy's pool, like its workspaces) and are copied into
XLA's result buffers on the same stream (one device-to-device copy each).

Everything here is checkable without jax or a GPU (tests/test_jax_ops.py uses fakes); the parts
that touch CuPy import it when a callback runs.
"""
from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from . import families, problem
from .mask import MaskOptions, check_flag

LSE_DTYPE = np.float32


@dataclasses.dataclass(frozen=True)
class JaxOptions:
    """cuflash.jax.attention's static options, checked: hashable, so that they can be a custom_vjp
    non-differentiable argument and a key of the cached callbacks."""

    mask: MaskOptions
    softmax_scale: float | None
    deterministic: bool
    backend: str | None


def options(causal=False, softmax_scale=None, window_size=(-1, -1), alignment="bottom_right", deterministic=False,
            dropout_p=0.0, backend=None, softcap=0.0) -> JaxOptions:
    """The checked options of a call; TypeError / ValueError naming the argument, NotImplementedError
    for dropout (its Philox seed would have to be a traced value read on the host inside the
    callback, which needs a device-to-host copy; not done yet)."""
    mask = MaskOptions.of(causal=causal, window_size=window_size, alignment=alignment, softcap=softcap)
    scale = problem.check_softmax_scale(softmax_scale)
    deterministic = check_flag(deterministic, "deterministic")
    families.check_backend(backend)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if dropout_p != 0:
        raise NotImplementedError(f"cuflash.jax.attention: dropout_p={dropout_p!r} is not supported yet (dropout "
                                  f"runs on CuPy and torch arrays; under JAX use dropout_p=0.0)")
    return JaxOptions(mask, scale, deterministic, backend)


def info(x, name: str) -> problem.ArrayInfo:
    """ArrayInfo of an abstract array (a jax.Array, tracer or ShapeDtypeStruct: only `shape` and
    `dtype` are read), as the C-contiguous buffer XLA hands the callback. Pointer 0, device 0: the
    layout rules they feed are met by every XLA buffer (XLA aligns buffers to at least 16 bytes)."""
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"{name} must be a jax.Array, got {type(x).__module__}.{type(x).__qualname__}")
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        raise TypeError(f"{name} has a symbolic shape {tuple(shape)}; cuflash.jax needs concrete shapes") from None
    dt = np.dtype(dtype)
    strides, acc = [], dt.itemsize
    for n in reversed(shape):
        strides.insert(0, acc)
        acc *= n
    return problem.ArrayInfo(shape, dt.name, dt.itemsize, tuple(strides), 0, 0)


def check_forward(q, k, v, opts: JaxOptions) -> problem.AttnProblem:
    """The forward's problem from abstract q, k, v; the CuPy forward's errors, before tracing on."""
    return problem.resolve_forward(info(q, "q"), info(k, "k"), info(v, "v"), opts.mask, opts.softmax_scale)


def forward_results(q, v=None) -> tuple:
    """(shape, dtype) of the forward's results: out like q with v's head dim, lse float32 (batch,
    heads, seqlen_q)."""
    b, nq, h, d = q.shape
    return ((b, nq, h, d if v is None else v.shape[-1]), q.dtype), ((b, h, nq), LSE_DTYPE)


def backward_results(q, k, v) -> tuple:
    """(shape, dtype) of dq, dk, dv: those of q, k, v (GQA: dk, dv have k's heads)."""
    return tuple((tuple(x.shape), x.dtype) for x in (q, k, v))


# ------------------------------------------------------------------------------------- in the callback

def device_of(buf) -> int:
    """The CUDA device ordinal of an XLA buffer (its DLPack device)."""
    dev_type, dev_id = buf.__dlpack_device__()
    if int(dev_type) not in (2, 13):  # kDLCUDA, kDLCUDAManaged
        raise TypeError(f"cuflash.jax runs on CUDA GPUs; this buffer is on DLPack device type {int(dev_type)}")
    return int(dev_id)


def view(buf):
    """A CuPy array on `buf`'s memory (no copy): C-contiguous, `buf`'s shape and dtype. Only valid
    while the callback runs (XLA owns the memory)."""
    import cupy

    ptr = int(buf.__cuda_array_interface__["data"][0])
    shape = tuple(int(s) for s in buf.shape)
    dtype = np.dtype(buf.dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, buf, device_of(buf))
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))


def flat(a, core_ndim: int):
    """`a` with every leading axis beyond its `core_ndim` merged into the first (a view: XLA's buffers
    are C-contiguous). Under jax.vmap the callbacks are batched with vmap_method="broadcast_all",
    so each mapped axis arrives as a leading axis of every buffer; merged into batch, one launch
    serves the whole vmap."""
    if a.ndim <= core_ndim:
        return a
    return a.reshape((-1,) + tuple(a.shape[a.ndim - core_ndim + 1:]))


def _on_stream(ctx, device: int):
    """Context managers: `device` current, XLA's stream (ctx.stream, a cudaStream_t) CuPy's current."""
    import contextlib

    import cupy

    from ._interop import cupy_stream

    stack = contextlib.ExitStack()
    stack.enter_context(cupy.cuda.Device(device))
    stack.enter_context(cupy_stream(int(ctx.stream)))
    return stack


def forward_callback(ctx, outs, q, k, v, *, opts: JaxOptions):
    """buffer_callback body of the forward: out and lse written in place into XLA's results."""
    from . import _forward

    out, lse = outs
    with _on_stream(ctx, device_of(q)):
        q, k, v, out = (flat(view(b), 4) for b in (q, k, v, out))
        _forward.forward(q, k, v, mask=opts.mask, softmax_scale=opts.softmax_scale, backend=opts.backend,
                         out=out, lse=flat(view(lse), 3))


def backward_callback(ctx, outs, dout, q, k, v, out, lse, *, opts: JaxOptions):
    """buffer_callback body of the backward: cuflash's backward, then dq, dk, dv copied into XLA's
    results on XLA's stream."""
    import cupy

    from . import _backward

    with _on_stream(ctx, device_of(q)):
        arrays = [flat(view(b), 4) for b in (dout, q, k, v, out)] + [flat(view(lse), 3)]
        grads = _backward.backward(*arrays, mask=opts.mask, softmax_scale=opts.softmax_scale,
                                   deterministic=opts.deterministic)
        stream = cupy.cuda.get_current_stream()
        for dst, src in zip(outs, grads):
            dst = view(dst)  # the bytes of src's shape (vmapped axes merged), C-contiguous
            if dst.nbytes:
                src = cupy.ascontiguousarray(src)
                dst.data.copy_from_device_async(src.data, dst.nbytes, stream)
