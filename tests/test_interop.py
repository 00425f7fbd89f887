"""Framework detection and dispatch (DLPack interop), on fake objects: no GPU, torch or jax needed."""
import subprocess
import sys
import types

import numpy as np
import pytest

import cuflash
from cuflash import _interop
from cuflash.mask import CAUSAL, NO_MASK


# ------------------------------------------------------------------------------------ fake objects

class _Device:
    def __init__(self, type_, index=None):
        self.type, self.index = type_, index

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __eq__(self, other):
        return (self.type, self.index) == (other.type, other.index)


@pytest.fixture
def fake_torch(monkeypatch):
    """A stand-in `torch` module in sys.modules with a Tensor class (only what detection looks at)."""
    mod = types.ModuleType("torch")
    Tensor = type("Tensor", (), {"__module__": "torch", "requires_grad": False})
    Parameter = type("Parameter", (Tensor,), {"__module__": "torch.nn.parameter"})
    mod.Tensor = Tensor
    monkeypatch.setitem(sys.modules, "torch", mod)

    def make(device="cuda", index=0, cls=Tensor):
        t = cls()
        t.device = _Device(device, index if device == "cuda" else None)
        return t

    make.Tensor, make.Parameter = Tensor, Parameter
    return make


class _DLPackArray:
    """Any producer with the DLPack protocol; `dev` is what __dlpack_device__ reports."""

    def __init__(self, dev=(2, 0)):
        self.dev = dev

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        raise AssertionError("not called on CPU")

    def __dlpack_device__(self):
        return self.dev


FakeJaxArray = type("ArrayImpl", (_DLPackArray,), {"__module__": "jaxlib._jax"})
_Tracer = type("Tracer", (), {"__module__": "jax._src.core"})
FakeTracer = type("DynamicJaxprTracer", (_Tracer,), {"__module__": "jax._src.interpreters.partial_eval"})


# ---------------------------------------------------------------------------------------- detection

def test_import_does_not_import_frameworks():
    code = ("import sys, numpy, cuflash, cuflash._interop, cuflash.problem\n"
            "try:\n    cuflash.attention(numpy.zeros((1, 8, 1, 64)), 1, 2)\nexcept TypeError:\n    pass\n"
            "print(sorted(m for m in ('torch', 'jax', 'jaxlib', 'cupy') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_torch_tensor_detected_and_cpu_rejected(fake_torch):
    t = fake_torch("cuda", 1)
    assert _interop.framework_of(t, "q") == _interop.TORCH
    assert _interop.device_of(t, "q", _interop.TORCH) == 1
    assert _interop.framework_of(fake_torch(cls=fake_torch.Parameter), "q") == _interop.TORCH  # subclass
    with pytest.raises(TypeError, match="^q must be on a CUDA device, got a torch.Tensor on cpu$"):
        _interop.common_framework([fake_torch("cpu")], ["q"])
    with pytest.raises(TypeError, match="k must be on a CUDA device, got a torch.Tensor on meta"):
        _interop.common_framework([fake_torch(), fake_torch("meta")], ["q", "k"])


def test_non_tensor_from_torch_module_rejected(fake_torch):
    size = type("Size", (tuple,), {"__module__": "torch"})((1, 2))
    with pytest.raises(TypeError, match="v must be a CuPy array, torch.Tensor, jax.Array or other DLPack array"):
        _interop.framework_of(size, "v")


def test_jax_array_detected_tracer_rejected():
    assert _interop.framework_of(FakeJaxArray(), "q") == _interop.JAX
    assert _interop.device_of(FakeJaxArray((2, 3)), "q", _interop.JAX) == 3
    with pytest.raises(TypeError, match="q must be on a CUDA device, got a jax.Array on cpu"):
        _interop.common_framework([FakeJaxArray((1, 0))], ["q"])
    with pytest.raises(TypeError, match=r"k is a JAX tracer.*jax.jit.*cuflash.jax.attention"):
        _interop.framework_of(FakeTracer(), "k")


@pytest.mark.parametrize("dev,ok", [((2, 0), True), ((13, 0), True), ((1, 0), "cpu"), ((3, 0), "cuda_host"),
                                    ((10, 0), "rocm"), ((99, 0), "DLPack device type 99")])
def test_generic_dlpack_devices(dev, ok):
    x = _DLPackArray(dev)
    assert _interop.framework_of(x, "q") == _interop.DLPACK
    if ok is True:
        assert _interop.common_framework([x, x, x], ["q", "k", "v"]) == (_interop.DLPACK, 0)
    else:
        with pytest.raises(TypeError, match=f"q must be on a CUDA device, got a .*_DLPackArray on {ok}"):
            _interop.common_framework([x], ["q"])


@pytest.mark.parametrize("x,words", [
    (np.zeros((1, 8, 1, 64), dtype=np.float16), "q must be on a CUDA device, got a numpy.ndarray in host memory; pass a CuPy array"),
    ([[1.0]], "q must be a CuPy array, torch.Tensor, jax.Array or other DLPack array on a CUDA device, got list"),
    (object(), "got object"),
    (None, "got NoneType"),
])
def test_unusable_inputs_named(x, words):
    with pytest.raises(TypeError, match=words):
        _interop.framework_of(x, "q")


def test_mixed_frameworks_rejected(fake_torch):
    with pytest.raises(TypeError, match=r"q, k and v must all come from one framework, got q: torch.Tensor, "
                                        r"k: jax.Array, v: torch.Tensor"):
        _interop.common_framework([fake_torch(), FakeJaxArray(), fake_torch()], ["q", "k", "v"])


def test_mixed_devices_rejected():
    with pytest.raises(ValueError, match="q, k and v must be on one device, got devices 0, 1, 0"):
        _interop.common_framework([_DLPackArray((2, 0)), _DLPackArray((2, 1)), _DLPackArray((2, 0))], ["q", "k", "v"])


def test_host_error_comes_before_mixed_error():
    # a NumPy copy of one CuPy input (q.get()) is named as host memory, not as a framework mix
    with pytest.raises(TypeError, match="q must be on a CUDA device.*host memory"):
        cuflash.attention(np.zeros((1, 8, 1, 64)), _DLPackArray(), _DLPackArray())


# ----------------------------------------------------------------------------------------- dispatch

def test_bad_algorithm_and_flag_before_anything():
    with pytest.raises(ValueError, match="algorithm must be 'v1' or 'v2', got 'v3'"):
        cuflash.attention(None, None, None, algorithm="v3")
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cuflash.attention(None, None, None, deterministic="yes")
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cuflash.attention_backward(None, None, None, None, None, None, deterministic=2)


def test_cupy_fast_path_calls_forward_directly(monkeypatch):
    Arr = type("ndarray", (), {})
    calls = []
    monkeypatch.setattr(cuflash.api, "_ndarray", Arr)
    monkeypatch.setattr(cuflash.api, "_fwd", lambda q, k, v, **kw: calls.append(kw) or ("out", "lse"))
    monkeypatch.setattr(cuflash.api, "_attention", None)  # the slow path must not be taken
    q = Arr()
    assert cuflash.attention(q, q, q) == "out"
    assert cuflash.attention(q, q, q, causal=True, softmax_scale=0.5, return_lse=True, deterministic=True) == ("out", "lse")
    assert cuflash.attention(q, q, q, backend="sm90") == "out"  # the backend rides the fast path too
    # the mask keywords arrive as one record (cuflash/mask.py), the same object for today's two masks
    assert calls == [dict(mask=NO_MASK, softmax_scale=None, dropout_p=0.0, seed=None, backend=None),
                     dict(mask=CAUSAL, softmax_scale=0.5, dropout_p=0.0, seed=None, backend=None),
                     dict(mask=NO_MASK, softmax_scale=None, dropout_p=0.0, seed=None, backend="sm90")]
    assert calls[1]["mask"] is CAUSAL


def test_torch_inputs_go_to_the_torch_module(fake_torch, monkeypatch):
    calls = []
    fake_mod = types.SimpleNamespace(
        Tensor=fake_torch.Tensor,
        attention=lambda *a: calls.append(("fwd", a)) or "out",
        attention_backward=lambda *a: calls.append(("bwd", a)) or ("dq", "dk", "dv"))
    monkeypatch.setattr(cuflash.api, "_tmod", fake_mod)
    t = fake_torch()
    assert cuflash.attention(t, t, t, causal=True, algorithm="v1", deterministic=True) == "out"
    assert calls[-1] == ("fwd", (t, t, t, CAUSAL, None, False, "v1", True, 0.0, None, None))
    assert cuflash.attention(t, t, t, backend="sm80") == "out"
    assert calls[-1] == ("fwd", (t, t, t, NO_MASK, None, False, "v2", False, 0.0, None, "sm80"))
    with pytest.raises(ValueError, match="backend must be None, 'sm80' or 'sm90', got 'sm100'"):
        cuflash.attention(t, t, t, backend="sm100")  # checked before the torch op
    assert cuflash.attention_backward(t, t, t, t, t, t, softmax_scale=0.1) == ("dq", "dk", "dv")
    # no alibi_slopes, score_mod or block_mask
    assert calls[-1] == ("bwd", (t, t, t, t, t, t, NO_MASK, 0.1, False, 0.0, None, None, None, None))


def test_dlpack_inputs_run_through_interop(monkeypatch):
    pytest.importorskip("cupy")  # imported (not used on the device) by the forward module
    seen = []

    def fake_run(fn, arrays, fw, dev, names):
        seen.append((fw, dev, names, len(arrays)))
        return ("out", "lse")

    monkeypatch.setattr(_interop, "run", fake_run)
    x = FakeJaxArray((2, 2))
    assert cuflash.attention(x, x, x, return_lse=True) == ("out", "lse")
    assert seen[-1] == (_interop.JAX, 2, ("q", "k", "v"), 3)
    y = _DLPackArray((2, 0))
    assert cuflash.attention(y, y, y) == "out"
    assert seen[-1] == (_interop.DLPACK, 0, ("q", "k", "v"), 3)


def test_backward_errors_name_the_argument():
    with pytest.raises(TypeError, match="lse must be on a CUDA device.*numpy.ndarray in host memory"):
        cuflash.attention_backward(*[_DLPackArray()] * 5, np.zeros((1, 1, 8), np.float32))
    with pytest.raises(TypeError, match="dout, q, k, v, out and lse must all come from one framework"):
        cuflash.attention_backward(FakeJaxArray(), *[_DLPackArray()] * 5)


# ------------------------------------------------------------------------------------------- misc

def test_cupy_exchanges_bf16_through_dlpack():
    cupy = pytest.importorskip("cupy")
    major = int(cupy.__version__.split(".")[0])
    if major < 14:
        pytest.skip(f"CuPy {cupy.__version__}: the torch path uses an int16 view for bf16")
    assert _interop.cupy_dlpack_bf16(), "CuPy >= 14 with ml_dtypes should import/export kDLBfloat"


def test_stream_wrapper_cached_and_keeps_handle():
    pytest.importorskip("cupy")
    s = _interop.cupy_stream(123456)
    assert s is _interop.cupy_stream(123456)
    assert s.ptr == 123456
