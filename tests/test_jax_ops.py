"""cuflash.jax's host side without jax or a GPU (cuflash/_jax_ops.py): option checks, trace-time shape
checks on abstract arrays, result shapes, and the callbacks' mapping of XLA's buffers and stream
onto cuflash's CuPy entry points (with fakes). The GPU behaviour: tests/gpu/test_jax_gpu.py."""
import subprocess
import sys
import types

import numpy as np
import pytest

from cuflash import _jax_ops as ops
from cuflash.mask import MaskOptions


def _abstract(shape, dtype="float16"):
    return types.SimpleNamespace(shape=shape, dtype=np.dtype(dtype))


def test_options_are_checked_and_hashable():
    o = ops.options(causal=True, window_size=(8, 0), softmax_scale=0.5, deterministic=1)
    assert o.mask == MaskOptions.of(causal=True, window_size=(8, 0)) and o.softmax_scale == 0.5
    assert o.deterministic is True and o.backend is None
    assert hash(o) == hash(ops.options(causal=True, window_size=(8, 0), softmax_scale=0.5, deterministic=True))
    with pytest.raises(TypeError, match="causal must be a bool"):
        ops.options(causal="yes")
    with pytest.raises(ValueError, match="window_size: the left side"):
        ops.options(window_size=(-2, 0))
    with pytest.raises(ValueError, match="alignment must be"):
        ops.options(alignment="centre")
    with pytest.raises(ValueError, match="softmax_scale"):
        ops.options(softmax_scale=-1.0)
    with pytest.raises(ValueError, match="backend must be"):
        ops.options(backend="sm70")
    with pytest.raises(NotImplementedError, match="dropout_p=0.1"):
        ops.options(dropout_p=0.1)
    with pytest.raises(TypeError, match="dropout_p"):
        ops.options(dropout_p=None)


def test_trace_time_checks_name_the_argument():
    o = ops.options(causal=True)
    q = _abstract((2, 128, 8, 64))
    kv = _abstract((2, 256, 2, 64))  # GQA: 2 k/v heads for 8 query heads
    p = ops.check_forward(q, kv, kv, o)
    assert (p.heads, p.heads_kv, p.seqlen_q, p.seqlen_k, p.group) == (8, 2, 128, 256, 4)
    assert p.offset == 128 and p.window_right == 0  # bottom-right causal
    with pytest.raises(ValueError, match="number of heads: q has 8, k and v have 3"):
        ops.check_forward(q, _abstract((2, 256, 3, 64)), _abstract((2, 256, 3, 64)), o)
    with pytest.raises(TypeError, match="k has dtype float32"):
        ops.check_forward(q, _abstract((2, 256, 2, 64), "float32"), kv, o)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 8"):
        ops.check_forward(_abstract((2, 128, 8, 100)), _abstract((2, 256, 2, 100)), _abstract((2, 256, 2, 100)), o)
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        ops.check_forward(_abstract((128, 8, 64)), kv, kv, o)
    with pytest.raises(TypeError, match="v must be a jax.Array"):
        ops.check_forward(q, kv, [1, 2], o)


def test_bfloat16_abstract_arrays():
    import ml_dtypes

    q = types.SimpleNamespace(shape=(1, 16, 2, 128), dtype=np.dtype(ml_dtypes.bfloat16))
    info = ops.info(q, "q")
    assert info.dtype == "bfloat16" and info.itemsize == 2
    assert info.strides == (16 * 2 * 128 * 2, 2 * 128 * 2, 128 * 2, 2)
    ops.check_forward(q, q, q, ops.options())


def test_result_shapes():
    q, k = _abstract((2, 100, 8, 64)), _abstract((2, 300, 2, 64))
    (out_shape, out_dtype), (lse_shape, lse_dtype) = ops.forward_results(q)
    assert out_shape == (2, 100, 8, 64) and out_dtype == np.float16
    assert lse_shape == (2, 8, 100) and lse_dtype == np.float32
    assert ops.backward_results(q, k, k) == (((2, 100, 8, 64), np.float16), ((2, 300, 2, 64), np.float16),
                                             ((2, 300, 2, 64), np.float16))


class _FakeBuffer:
    """What XLA hands a buffer_callback on a GPU: shape, dtype, DLPack device, CUDA array interface."""

    def __init__(self, shape, dtype, ptr, device=0):
        self.shape, self.dtype, self._ptr, self._device = shape, np.dtype(dtype), ptr, device

    def __dlpack_device__(self):
        return (2, self._device)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self._ptr, False), "version": 2}


def test_callbacks_map_buffers_and_stream(monkeypatch):
    from cuflash import _backward, _forward

    seen = {}
    entered = []

    class _Ctx:
        def __init__(self, *what):
            self.what = what

        def __enter__(self):
            entered.append(self.what)

        def __exit__(self, *exc):
            entered.append(("exit",) + self.what)

    import contextlib

    def fake_on_stream(ctx, device):
        stack = contextlib.ExitStack()
        stack.enter_context(_Ctx("device", device))
        stack.enter_context(_Ctx("stream", ctx.stream))
        return stack

    monkeypatch.setattr(ops, "_on_stream", fake_on_stream)
    monkeypatch.setattr(ops, "view", lambda buf: _View(buf._ptr, buf.shape))

    def fake_forward(q, k, v, **kw):
        seen["fwd"] = (q, k, v, kw)
        assert entered[-1] == ("stream", 0xABC)  # launched inside XLA's stream context

    monkeypatch.setattr(_forward, "forward", fake_forward)
    o = ops.options(causal=True, softmax_scale=0.25, backend="sm80")
    ctx = types.SimpleNamespace(stream=0xABC)
    bufs = [_FakeBuffer((1, 16, 2, 64), "float16", 1024 * i, device=1) for i in range(1, 4)]
    out, lse = _FakeBuffer((1, 16, 2, 64), "float16", 8192, 1), _FakeBuffer((1, 2, 16), "float32", 9216, 1)
    ops.forward_callback(ctx, (out, lse), *bufs, opts=o)
    q, k, v, kw = seen["fwd"]
    assert (q, k, v) == (("view", 1024, (1, 16, 2, 64)), ("view", 2048, (1, 16, 2, 64)), ("view", 3072, (1, 16, 2, 64)))
    assert kw == {"mask": o.mask, "softmax_scale": 0.25, "backend": "sm80", "out": ("view", 8192, (1, 16, 2, 64)),
                  "lse": ("view", 9216, (1, 2, 16))}
    assert entered[:2] == [("device", 1), ("stream", 0xABC)]

    copies = []

    class _Grad:
        def __init__(self, name):
            self.name = name

    def fake_backward(*arrays, **kw):
        seen["bwd"] = (arrays, kw)
        return _Grad("dq"), _Grad("dk"), _Grad("dv")

    monkeypatch.setattr(_backward, "backward", fake_backward)
    # the copy into XLA's results: checked through a fake view with a fake data pointer
    monkeypatch.setattr(ops, "view", lambda buf: _FakeDst(buf, copies) if buf._ptr >= 1 << 20 else
                        _View(buf._ptr, buf.shape))
    fake_cupy = types.SimpleNamespace(ascontiguousarray=lambda a: types.SimpleNamespace(data=a.name),
                                      cuda=types.SimpleNamespace(get_current_stream=lambda: "xla-stream"))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    grads = [_FakeBuffer((1, 16, 2, 64), "float16", (1 << 20) * i, 1) for i in range(1, 4)]
    ops.backward_callback(ctx, grads, bufs[0], *bufs, out, lse, opts=ops.options(deterministic=True))
    arrays, kw = seen["bwd"]
    assert [a[:2] for a in arrays] == [("view", 1024), ("view", 1024), ("view", 2048), ("view", 3072), ("view", 8192),
                                       ("view", 9216)]
    assert kw == {"mask": MaskOptions.of(), "softmax_scale": None, "deterministic": True}
    assert copies == [(1 << 20, "dq", 4096, "xla-stream"), (2 << 20, "dk", 4096, "xla-stream"),
                      (3 << 20, "dv", 4096, "xla-stream")]


class _View(tuple):
    """A fake CuPy view: ("view", ptr, shape), with ndim and reshape."""

    def __new__(cls, ptr, shape):
        return super().__new__(cls, ("view", ptr, tuple(shape)))

    @property
    def shape(self):
        return self[2]

    @property
    def ndim(self):
        return len(self[2])

    def reshape(self, shape):
        n = int(np.prod(self.shape))
        shape = tuple(n // -int(np.prod(shape)) if s == -1 else s for s in shape)
        assert int(np.prod(shape)) == n
        return _View(self[1], shape)


def test_vmapped_axes_fold_into_batch():
    assert ops.flat(_View(0, (1, 16, 2, 64)), 4) == ("view", 0, (1, 16, 2, 64))
    assert ops.flat(_View(0, (3, 2, 16, 2, 64)), 4) == ("view", 0, (6, 16, 2, 64))  # vmap over 3
    assert ops.flat(_View(0, (5, 3, 2, 16, 2, 64)), 4) == ("view", 0, (30, 16, 2, 64))  # nested vmaps
    assert ops.flat(_View(0, (3, 2, 2, 16)), 3) == ("view", 0, (6, 2, 16))  # lse


class _FakeDst:
    def __init__(self, buf, log):
        self.nbytes = int(np.prod(buf.shape)) * buf.dtype.itemsize
        ptr = buf._ptr
        self.data = types.SimpleNamespace(
            copy_from_device_async=lambda src, n, stream: log.append((ptr, src, n, stream)))


def test_view_reads_the_cuda_array_interface():
    cupy = pytest.importorskip("cupy")
    import ml_dtypes

    buf = _FakeBuffer((2, 3, 4, 64), ml_dtypes.bfloat16, 1 << 24, device=0)
    try:
        a = ops.view(buf)
    except Exception as e:  # some CuPy builds need a driver to make any array
        pytest.skip(f"CuPy cannot build an array view here: {e}")
    assert isinstance(a, cupy.ndarray) and a.data.ptr == 1 << 24 and a.shape == (2, 3, 4, 64)
    assert a.dtype == np.dtype(ml_dtypes.bfloat16) and a.flags.c_contiguous


def test_importing_cuflash_imports_neither_jax_nor_torch_nor_transformers():
    code = ("import sys, cuflash, cuflash._jax_ops, cuflash.api, cuflash.integrations.transformers; "
            "print(sorted(m for m in ('jax', 'torch', 'transformers') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"


def test_softcap_travels_in_the_mask_record():
    from cuflash import _jax_ops as ops

    assert ops.options(softcap=30.0).mask.softcap == 30.0
    assert ops.options().mask.softcap == 0.0
    with pytest.raises(ValueError, match="softcap"):
        ops.options(softcap=-1.0)
