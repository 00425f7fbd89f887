"""Attention sinks (issue 13; gpt-oss's learned per-head sinks, transformers' `s_aux`): each query
head h has a logit `sinks[h]` that joins every row's softmax as one more column with no value:

    P = softmax([S, sink_h]) over the keys and the sink,  out = P[:, keys] V.

No kernel change is needed, exactly: with L = logsumexp(S) the kernels' lse and O their output,

    lse' = log(e^L + e^sink) = logaddexp(L, sink),    out' = O e^(L - lse'),

and the backward is the ordinary one run with (out', lse') in place of (O, L): P' = exp(S - lse')
are the sink softmax's probabilities of the keys, and D' = rowsum(dout o out') is sum_j P'_j dP_j
over the keys plus the sink's term, which is 0 (no value). The sink's own gradient is

    d sinks[h] = -sum over batch and queries of e^(sink_h - lse') D'.

Rows that see no key have L = -inf: out' = 0 and lse' = sink. Works on NumPy, CuPy and torch
arrays (each with its own array module); the rescale runs in float32 and rounds out' once.
"""
from __future__ import annotations

from .merge import _module


def check(sinks, heads: int, q) -> None:
    """sinks: a 1-D floating array of `heads` entries, of q's framework (and device)."""
    qkind = type(q).__module__.split(".")[0]
    kind = type(sinks).__module__.split(".")[0]
    if kind != qkind or not hasattr(sinks, "dtype") or not hasattr(sinks, "shape"):
        raise TypeError(f"sinks must be a {qkind} array like q, got {type(sinks).__module__}.{type(sinks).__qualname__}")
    shape = tuple(sinks.shape)
    if shape != (heads,):
        raise ValueError(f"sinks must have shape (heads={heads},) (one logit per query head), got {shape}")
    if "float" not in str(sinks.dtype):
        raise TypeError(f"sinks must be floating point, got {sinks.dtype}")
    dev, qdev = getattr(sinks, "device", None), getattr(q, "device", None)
    if kind in ("cupy", "torch") and str(dev) != str(qdev):
        raise ValueError(f"sinks is on {dev}, q on {qdev}")


def _f32(x, xp, kind):
    """x in at least float32 (16-bit arrays upcast; float64 kept: the NumPy reference's precision)."""
    if x.dtype.itemsize >= 4:
        return x
    return x.float() if kind == "torch" else x.astype(xp.float32)


def for_kernel(sinks):
    """sinks (a CuPy array, checked) as the kernels read them (cuflash._forward.run_forward's
    `sinks`): float32, contiguous; the array itself when it already is."""
    import cupy

    return cupy.ascontiguousarray(sinks if sinks.dtype == cupy.float32 else _f32(sinks, cupy, "cupy"), dtype=cupy.float32)


def apply(out, lse, sinks):
    """(out', lse'): out (batch, seqlen_q, heads, d) and lse (batch, heads, seqlen_q) of attention
    over the keys, rescaled to the softmax that includes the sinks. CuPy and torch arrays of the
    kernels' layout (16-bit out whose rows are contiguous, float32 lse in that order) take one fused
    kernel (_FUSED_SRC); others (NumPy, the reference) the array module's elementwise steps."""
    xp, kind = _module(out)
    if kind != "numpy" and _fusable(out, lse):
        return _on_device(kind, out, _fused_apply, out, lse, _f32(sinks, xp, kind))
    s = _f32(sinks, xp, kind)[None, :, None]
    lse2 = xp.logaddexp(lse, s)
    w = xp.exp(lse - lse2)  # 0 where lse = -inf (a row without keys)
    w = w.transpose(1, 2)[..., None] if kind == "torch" else xp.transpose(w, (0, 2, 1))[..., None]
    out2 = _f32(out, xp, kind) * w
    return (out2.to(out.dtype) if kind == "torch" else out2.astype(out.dtype)), lse2


def grad(dout, out2, lse2, sinks):
    """d sinks (heads,) in sinks' dtype, from the output gradient and the sink-adjusted out', lse'.
    CuPy and torch arrays of the kernels' layout take one fused kernel (per row: e^(sink - lse')
    times rowsum(dout o out'), then a sum per head); others the array module's steps."""
    xp, kind = _module(out2)
    if kind != "numpy" and _fusable(out2, lse2) and _fusable(dout, lse2) and tuple(dout.shape) == tuple(out2.shape):
        g = _on_device(kind, out2, _fused_grad, dout, out2, lse2, _f32(sinks, xp, kind))[0]  # float32
        # copy=False: float32 sinks (the usual case) take the kernel's result as it is, no extra launch
        return g.to(sinks.dtype) if kind == "torch" else g.astype(sinks.dtype, copy=False)
    d = (_f32(dout, xp, kind) * _f32(out2, xp, kind)).sum(-1)  # D' (batch, seqlen_q, heads)
    d = d.transpose(1, 2) if kind == "torch" else xp.transpose(d, (0, 2, 1))
    p_sink = xp.exp(_f32(sinks, xp, kind)[None, :, None] - lse2)
    g = -(p_sink * d).sum((0, 2)) if kind == "torch" else -(p_sink * d).sum(axis=(0, 2))
    return g.to(sinks.dtype) if kind == "torch" else g.astype(sinks.dtype, copy=False)


# --------------------------------------------------------------------------- the fused kernels
# The elementwise form reads and writes out in float32 several times (an upcast, the product, the
# downcast: ~5 passes over out at 4-8 bytes an element, and as many for the gradient), which at
# seqlen 2048 cost a fifth of the forward's time; these read each 16-bit element once and write it
# once (apply), or read dout and out' once (grad).

def _fusable(x, lse) -> bool:
    """Whether x (batch, seqlen_q, heads, d) and lse (batch, heads, seqlen_q) fit the fused kernels:
    16-bit x with contiguous rows of a multiple of 8 elements at 16-byte aligned strides, float32
    C-contiguous lse of that shape, on one device."""
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 4 or tuple(getattr(lse, "shape", ())) != (shape[0], shape[2], shape[1]):
        return False
    if str(x.dtype) not in ("bfloat16", "float16", "torch.bfloat16", "torch.float16") or shape[3] % 8:
        return False
    if "float32" not in str(lse.dtype) or not _c_contiguous(lse):
        return False
    strides = _elem_strides(x)
    return strides[3] == 1 and all(s % 8 == 0 for s in strides[:3]) and _data_ptr(x) % 16 == 0


def _elem_strides(x) -> tuple:
    st = x.stride() if callable(getattr(x, "stride", None)) else tuple(s // x.itemsize for s in x.strides)
    return tuple(int(s) for s in st)


def _c_contiguous(x) -> bool:
    return x.is_contiguous() if callable(getattr(x, "is_contiguous", None)) else bool(x.flags.c_contiguous)


def _data_ptr(x) -> int:
    return x.data_ptr() if callable(getattr(x, "data_ptr", None)) else int(x.data.ptr)


def _on_device(kind, like, fn, *arrays):
    """fn(*cupy views) on the arrays' device: CuPy's current stream for CuPy arrays, torch's current
    stream and allocator for torch tensors (cuflash._interop.run: no sync, capturable)."""
    from . import _interop

    if kind == "cupy":
        import cupy

        with cupy.cuda.Device(like.device.id):
            return fn(*arrays)
    return _interop.run(fn, arrays, _interop.TORCH, like.device.index)


_THREADS = 256
_module_cache: dict = {}  # device id -> cupy.RawModule


def _kernel(name: str, dtype_name: str):
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    mod = _module_cache.get(dev)
    if mod is None:
        mod = _module_cache[dev] = cupy.RawModule(code=_FUSED_SRC)
    return mod.get_function(f"cuflash_sinks_{name}_{dtype_name}")


def _sinks_f32(sinks, heads: int):
    import cupy

    s = cupy.ascontiguousarray(sinks, dtype=cupy.float32)
    if s.shape != (heads,):
        raise ValueError(f"sinks must have shape (heads={heads},), got {tuple(s.shape)}")
    return s


def _ptrs(*arrays) -> tuple:
    """The arrays' data pointers as the kernels' pointer arguments (whatever their dtype: bfloat16's
    ml_dtypes type included)."""
    import numpy as np

    return tuple(np.uint64(a.data.ptr) for a in arrays)


def _fused_apply(out, lse, sinks):
    import cupy

    b, n, h, d = out.shape
    out2 = cupy.empty((b, n, h, d), dtype=out.dtype)
    lse2 = cupy.empty((b, h, n), dtype=cupy.float32)
    total = b * n * h * (d // 8)
    if total:
        sb, sn, sh, _ = _elem_strides(out)
        k = _kernel("apply", "bfloat16" if out.dtype.name == "bfloat16" else "float16")
        k(((total + _THREADS - 1) // _THREADS,), (_THREADS,),
          (*_ptrs(out, lse, _sinks_f32(sinks, h), out2, lse2), cupy.int64(sb), cupy.int64(sn), cupy.int64(sh),
           cupy.int32(b), cupy.int32(n), cupy.int32(h), cupy.int32(d)))
    return out2, lse2


def _fused_grad(dout, out2, lse2, sinks):
    import cupy

    b, n, h, d = out2.shape
    contrib = cupy.empty((b, h, n), dtype=cupy.float32)  # e^(sink - lse') rowsum(dout o out') per row
    tpr = 1 << max(0, (d // 8 - 1).bit_length())  # threads per row: its 16-byte chunks, a power of two
    total = b * n * h * tpr
    if total:
        k = _kernel("grad", "bfloat16" if out2.dtype.name == "bfloat16" else "float16")
        args = _ptrs(dout, out2, lse2, _sinks_f32(sinks, h), contrib)
        args += tuple(cupy.int64(s) for s in (*_elem_strides(dout)[:3], *_elem_strides(out2)[:3]))
        k(((total + _THREADS - 1) // _THREADS,), (_THREADS,),
          (*args, cupy.int32(b), cupy.int32(n), cupy.int32(h), cupy.int32(d), cupy.int32(tpr)))
    return (-contrib.sum(axis=(0, 2)),)


# One thread per 8 columns of a row (b, i, h) (16 bytes). apply: lse' = logaddexp(lse, sink), out'
# = out e^(lse - lse') (0 where lse = -inf: a row without keys gets lse' = sink; a NaN lse gives a
# NaN row), rounded to nearest once; out' and lse' contiguous. grad: a row's threads (tpr, a power
# of two <= 32, so a warp holds whole rows) sum dout o out' in float32 and shuffle the sums together.
_FUSED_SRC = r"""
template <bool BF16> struct cf_half {
    static __device__ float load(unsigned short h) {
        float f;
        if (BF16) f = __uint_as_float((unsigned)h << 16);
        else asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
    }
    static __device__ unsigned short store(float x) {
        unsigned short h;
        if (BF16) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
        else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
        return h;
    }
};
template <bool BF16>
__device__ void cf_sinks_apply(const unsigned short* __restrict__ out, const float* __restrict__ lse,
                               const float* __restrict__ sinks, unsigned short* __restrict__ out2,
                               float* __restrict__ lse2, long long sb, long long sn, long long sh,
                               int batch, int n_q, int heads, int dim) {
    const int chunks = dim / 8;
    const long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (idx >= (long long)batch * n_q * heads * chunks) return;
    const int c = (int)(idx % chunks);
    const long long row = idx / chunks;  // (b * n_q + i) * heads + h
    const int h = (int)(row % heads);
    const long long bi = row / heads;
    const int i = (int)(bi % n_q), b = (int)(bi / n_q);
    const long long lrow = ((long long)b * heads + h) * n_q + i;
    const float l = lse[lrow], s = sinks[h];
    float l2, w;
    if (l == __int_as_float(0xff800000)) {
        l2 = s, w = 0.f;
    } else {
        l2 = fmaxf(l, s) + log1pf(expf(-fabsf(l - s)));  // NaN l: fabsf(NaN) makes l2 and w NaN
        w = expf(l - l2);
    }
    const uint4 x = *reinterpret_cast<const uint4*>(out + b * sb + i * sn + h * sh + 8 * c);
    const unsigned xs[4] = {x.x, x.y, x.z, x.w};
    unsigned ys[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const float lo = cf_half<BF16>::load((unsigned short)(xs[e] & 0xffffu)) * w;
        const float hi = cf_half<BF16>::load((unsigned short)(xs[e] >> 16)) * w;
        ys[e] = cf_half<BF16>::store(lo) | ((unsigned)cf_half<BF16>::store(hi) << 16);
    }
    *reinterpret_cast<uint4*>(out2 + row * dim + 8 * c) = make_uint4(ys[0], ys[1], ys[2], ys[3]);
    if (c == 0) lse2[lrow] = l2;
}
template <bool BF16>
__device__ void cf_sinks_grad(const unsigned short* __restrict__ dout, const unsigned short* __restrict__ out2,
                              const float* __restrict__ lse2, const float* __restrict__ sinks,
                              float* __restrict__ contrib, long long dsb, long long dsn, long long dsh,
                              long long osb, long long osn, long long osh, int batch, int n_q, int heads,
                              int dim, int tpr) {
    const long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long row = idx / tpr, rows = (long long)batch * n_q * heads;
    const int c = (int)(idx % tpr);
    const int h = (int)(row % heads);
    const long long bi = row / heads;
    const int i = (int)(bi % n_q), b = (int)(bi / n_q);
    float dot = 0.f;
    if (row < rows && c < dim / 8) {
        const uint4 x = *reinterpret_cast<const uint4*>(dout + b * dsb + i * dsn + h * dsh + 8 * c);
        const uint4 y = *reinterpret_cast<const uint4*>(out2 + b * osb + i * osn + h * osh + 8 * c);
        const unsigned xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            dot = fmaf(cf_half<BF16>::load((unsigned short)(xs[e] & 0xffffu)),
                       cf_half<BF16>::load((unsigned short)(ys[e] & 0xffffu)), dot);
            dot = fmaf(cf_half<BF16>::load((unsigned short)(xs[e] >> 16)),
                       cf_half<BF16>::load((unsigned short)(ys[e] >> 16)), dot);
        }
    }
    for (int s = 1; s < tpr; s *= 2) dot += __shfl_xor_sync(0xffffffffu, dot, s);
    if (row < rows && c == 0) {
        const long long lrow = ((long long)b * heads + h) * n_q + i;
        contrib[lrow] = expf(sinks[h] - lse2[lrow]) * dot;
    }
}
#define CF_SINKS(DT, BF16) \
extern "C" __global__ void cuflash_sinks_apply_##DT(const unsigned short* out, const float* lse, const float* sinks, \
        unsigned short* out2, float* lse2, long long sb, long long sn, long long sh, int batch, int n_q, int heads, \
        int dim) { \
    cf_sinks_apply<BF16>(out, lse, sinks, out2, lse2, sb, sn, sh, batch, n_q, heads, dim); \
} \
extern "C" __global__ void cuflash_sinks_grad_##DT(const unsigned short* dout, const unsigned short* out2, \
        const float* lse2, const float* sinks, float* contrib, long long dsb, long long dsn, long long dsh, \
        long long osb, long long osn, long long osh, int batch, int n_q, int heads, int dim, int tpr) { \
    cf_sinks_grad<BF16>(dout, out2, lse2, sinks, contrib, dsb, dsn, dsh, osb, osn, osh, batch, n_q, heads, dim, tpr); \
}
CF_SINKS(bfloat16, true)
CF_SINKS(float16, false)
"""
