"""Arrays from other frameworks: zero-copy to CuPy through DLPack, results handed back zero-copy.

Supported callers: CuPy (used as is), PyTorch (`torch.Tensor`), JAX (`jax.Array`, eager only; under
jax.jit, cuflash/jax.py runs inside XLA's program instead) and any other object with
`__dlpack__`/`__dlpack_device__` on a CUDA device (results stay CuPy arrays, which implement
`__dlpack__` themselves). torch and jax are never imported here unless the caller's
objects come from them (the type's module is looked at first).

Streams and synchronisation:

* CuPy: CuPy's current stream, as everywhere in cuflash.
* PyTorch: the work runs on torch's current stream of the tensors' device (CuPy's current stream is
  set to it for the call), so torch orders it with the producer of the inputs and the consumers of
  the outputs as any torch op: no synchronisation is added. Inputs are taken as torch's DLPack
  capsules (`torch.utils.dlpack.to_dlpack`, no stream handshake needed on one stream); outputs go
  back by `torch.from_dlpack`, which passes torch's current stream, the one CuPy is on: no events.
* JAX: `cupy.from_dlpack` passes CuPy's current stream to `jax.Array.__dlpack__(stream=...)`, and
  JAX makes that stream wait until the buffer is ready (asynchronously). The way back,
  `jax.dlpack.from_dlpack`, passes JAX's stream to `cupy.ndarray.__dlpack__`, and CuPy makes it
  wait on an event recorded on our stream, so JAX does see finished results without a host sync.
  What the protocol does not cover is the lifetime of the INPUT buffers: JAX does not know that
  our stream still reads them once our DLPack views are released at the end of the call, and could
  reuse their memory (e.g. an input that was a temporary) for work on its own streams before our
  kernel has finished. So for JAX, and for other DLPack producers whose allocators we do not know,
  the call synchronises CuPy's current stream before returning: correct, but the host waits for
  the kernel (JAX's own async dispatch is lost for this call).

Memory for results comes from CuPy's memory pool (see docs/frameworks.md for sharing one pool
with PyTorch).
"""
from __future__ import annotations

import sys

CUPY, TORCH, JAX, DLPACK = "cupy", "torch", "jax", "dlpack"

# DLPack device types (dlpack.h, DLDeviceType)
KDL_CUDA, KDL_CUDA_MANAGED = 2, 13
_DL_DEVICE_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host (pinned host memory)", 4: "opencl", 7: "vulkan",
                    8: "metal", 9: "vpi", 10: "rocm", 11: "rocm_host", 12: "ext_dev", 13: "cuda_managed",
                    14: "oneapi", 15: "webgpu", 16: "hexagon", 17: "maia"}

_SUPPORTED = "a CuPy array, torch.Tensor, jax.Array or other DLPack array on a CUDA device"


def _type_name(x) -> str:
    t = type(x)
    root = (t.__module__ or "").partition(".")[0]
    if root == "torch":
        return "torch.Tensor" if t.__name__ in ("Tensor", "Parameter") else f"torch.{t.__name__}"
    if root in ("jax", "jaxlib"):
        return "jax.Array"
    return f"{t.__module__}.{t.__qualname__}" if t.__module__ not in (None, "builtins") else t.__qualname__


def _isinstance_of(x, module: str, attr: str) -> bool:
    m = sys.modules.get(module)  # only if the caller already imported it
    cls = getattr(m, attr, None) if m is not None else None
    return isinstance(cls, type) and isinstance(x, cls)


def _is_jax_tracer(x) -> bool:
    return any(c.__name__ == "Tracer" for c in type(x).__mro__)


def framework_of(x, name: str) -> str:
    """Which framework `x` comes from: CUPY, TORCH, JAX or DLPACK (any other `__dlpack__` object).

    Raises TypeError naming `name` for objects cuflash cannot use (host arrays, lists, JAX tracers).
    """
    t = type(x)
    root = (t.__module__ or "").partition(".")[0]
    if root == "cupy" and _isinstance_of(x, "cupy", "ndarray"):
        return CUPY
    if root == "torch" or _isinstance_of(x, "torch", "Tensor"):
        if not _isinstance_of(x, "torch", "Tensor"):  # torch.Size, a dtype, ...
            raise TypeError(f"{name} must be {_SUPPORTED}, got {t.__module__}.{t.__qualname__}")
        return TORCH
    if root in ("jax", "jaxlib") or _isinstance_of(x, "jax", "Array"):
        if _is_jax_tracer(x):
            raise TypeError(
                f"{name} is a JAX tracer ({t.__name__}): cuflash.attention runs eagerly on concrete device "
                f"buffers and cannot be traced by jax.jit, grad or vmap; under jit and grad use "
                f"cuflash.jax.attention (import cuflash.jax; see docs/frameworks.md)")
        if not hasattr(t, "__dlpack_device__"):
            raise TypeError(f"{name} must be {_SUPPORTED}, got {t.__module__}.{t.__qualname__}")
        return JAX
    if _isinstance_of(x, "cupy", "ndarray"):  # a subclass defined elsewhere
        return CUPY
    if root == "numpy":
        raise TypeError(f"{name} must be on a CUDA device, got a {_type_name(x)} in host memory; "
                        f"pass {_SUPPORTED}")
    if hasattr(t, "__dlpack__") and hasattr(t, "__dlpack_device__"):
        return DLPACK
    raise TypeError(f"{name} must be {_SUPPORTED}, got {_type_name(x)}")


def device_of(x, name: str, fw: str) -> int:
    """CUDA device ordinal of `x`; TypeError naming `name` if it is not on a CUDA device."""
    if fw == CUPY:
        return x.device.id
    if fw == TORCH:
        d = x.device
        if d.type != "cuda":
            raise TypeError(f"{name} must be on a CUDA device, got a {_type_name(x)} on {d}")
        return d.index  # a tensor's CUDA device always has an index
    dev_type, dev_id = x.__dlpack_device__()
    dev_type, dev_id = int(dev_type), int(dev_id)
    if dev_type not in (KDL_CUDA, KDL_CUDA_MANAGED):
        where = _DL_DEVICE_NAMES.get(dev_type, f"DLPack device type {dev_type}")
        raise TypeError(f"{name} must be on a CUDA device, got a {_type_name(x)} on {where}")
    return dev_id


def common_framework(arrays, names) -> tuple[str, int]:
    """(framework, device) shared by all `arrays`; TypeError/ValueError naming the odd one out."""
    fws = [framework_of(x, n) for x, n in zip(arrays, names)]
    devs = [device_of(x, n, f) for x, n, f in zip(arrays, names, fws)]
    if any(f != fws[0] for f in fws):
        got = ", ".join(f"{n}: {_type_name(x)}" for x, n in zip(arrays, names))
        raise TypeError(f"{_join(names)} must all come from one framework, got {got}")
    if any(d != devs[0] for d in devs):
        raise ValueError(f"{_join(names)} must be on one device, got devices {', '.join(map(str, devs))}")
    return fws[0], devs[0]


def on_cuda(x) -> bool:
    """Whether x (not a CuPy array) is a CUDA array by DLPack (a torch.cuda tensor, another producer)."""
    dev = getattr(x, "__dlpack_device__", None)
    if dev is None:
        return False
    try:
        return dev()[0] in (KDL_CUDA, KDL_CUDA_MANAGED)
    except Exception:  # a CPU tensor whose __dlpack_device__ still answers: host
        return False


def optional_inputs(fw: str, names: list, arrays: list, **given) -> dict:
    """An entry point's optional integer arguments (lengths, tables, indices; None: not given), for a
    call whose arrays are of framework `fw`: a CUDA array of a framework other than CuPy is appended
    to `names` / `arrays` (it travels with them: its CuPy view reaches the body); a CPU torch tensor
    becomes a NumPy array; anything else stays as given (host integers, or a CuPy array in a CuPy
    call, which the body takes as is). Returns {name: value} of those that stay behind; the body
    takes the others from its trailing arrays (rejoin)."""
    behind = {}
    for name, x in given.items():
        if x is not None and fw != CUPY and on_cuda(x):
            names.append(name)
            arrays.append(x)
        elif x is not None and type(x).__module__.split(".")[0] == "torch":
            behind[name] = x.numpy()  # a CPU tensor: host values, checked as such
        else:
            behind[name] = x
    return behind


def rejoin(names, trailing, behind: dict) -> dict:
    """optional_inputs' arguments again: those that stayed behind, and those among the body's trailing
    arrays (named by `names`, the trailing arrays' names in order)."""
    out = dict(behind)
    out.update(zip(names, trailing))
    return out


def _join(names) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


# ---------------------------------------------------------------------------------------------- bf16

_bf16_native = None


def cupy_dlpack_bf16() -> bool:
    """Whether this CuPy exchanges bfloat16 through DLPack (CuPy >= 14 with ml_dtypes installed).

    Older CuPy rejects (or, in 13.x, crashes on) kDLBfloat; the torch path then goes through a
    16-bit integer view, which is still zero-copy.
    """
    global _bf16_native
    if _bf16_native is None:
        try:
            import ml_dtypes  # noqa: F401  (CuPy picks bfloat16 up from it when its dlpack module loads)
            from cupy._core import dlpack as _dl

            _bf16_native = getattr(_dl, "bfloat16", None) is not None
        except Exception:
            _bf16_native = False
    return _bf16_native


# ---------------------------------------------------------------------------------------- conversions

def to_cupy(x, fw: str, name: str = "array"):
    """Zero-copy CuPy view of `x` (same data pointer). Call inside the stream context of the call."""
    if fw == CUPY:
        return x
    import cupy

    if fw == TORCH:
        import torch

        if x.requires_grad:
            x = x.detach()  # DLPack export refuses tensors that require grad; same storage
        bf16_view = x.dtype == torch.bfloat16 and not cupy_dlpack_bf16()
        if bf16_view:
            x = x.view(torch.int16)
        # torch's capsule without its __dlpack__ stream handshake: the caller runs on torch's current
        # stream (run() makes it CuPy's), so there is nothing to order; this also skips
        # Tensor.__dlpack__'s demand that the tensor be on torch's current device.
        a = cupy.from_dlpack(torch.utils.dlpack.to_dlpack(x))
        if bf16_view:
            import ml_dtypes

            a = a.view(ml_dtypes.bfloat16)
        return a
    if not cupy_dlpack_bf16() and str(getattr(x, "dtype", "")) == "bfloat16":
        raise TypeError(f"{name} is bfloat16, which this CuPy cannot import through DLPack; "
                        f"CuPy >= 14 with ml_dtypes installed can")
    return cupy.from_dlpack(x)


def from_cupy(a, fw: str):
    """`a` (a CuPy array) in framework `fw`, zero-copy. Call inside the stream context of the call."""
    if fw == CUPY or fw == DLPACK:
        return a
    if fw == TORCH:
        import torch

        if not cupy_dlpack_bf16() and a.dtype.name == "bfloat16":
            import cupy

            return torch.from_dlpack(a.view(cupy.int16)).view(torch.bfloat16)
        return torch.from_dlpack(a)
    if fw == JAX:
        import jax.dlpack

        return jax.dlpack.from_dlpack(a)
    raise AssertionError(fw)


# -------------------------------------------------------------------------------------------- streams

class _StreamRef:
    """The CUDA stream protocol (`__cuda_stream__`) for a raw stream handle."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


_streams: dict = {}


def cupy_stream(ptr: int):
    """A CuPy stream object for the raw handle `ptr` (cached: handles of live streams are stable)."""
    s = _streams.get(ptr)
    if s is None:
        import cupy

        from_external = getattr(cupy.cuda.Stream, "from_external", None)
        if from_external is not None:  # CuPy >= 14 (ExternalStream is deprecated there)
            s = from_external(_StreamRef(ptr))
        else:
            s = cupy.cuda.ExternalStream(ptr)
        if len(_streams) > 256:
            _streams.clear()
        _streams[ptr] = s
    return s


def torch_stream(device: int):
    """CuPy stream object for torch's current stream on `device`."""
    import torch

    return cupy_stream(torch.cuda.current_stream(device).cuda_stream)


def _torch_malloc(size: int):
    """CuPy allocator backed by torch's caching allocator: `size` bytes as a torch uint8 tensor on the
    current device and torch's current stream, owned by the returned CuPy memory (freed when CuPy
    drops it, stream-ordered by torch). torch's allocator is CUDA-graph aware: under
    torch.cuda.graph the plan's outputs and workspaces come from the graph's private pool, where
    CuPy's own pool would call cudaMalloc during the capture and break it."""
    import cupy
    import torch

    dev = cupy.cuda.runtime.getDevice()
    t = torch.empty(max(size, 1), dtype=torch.uint8, device=f"cuda:{dev}")
    return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(t.data_ptr(), size, t, dev), 0)


def run(fn, arrays, fw: str, device: int, names=None):
    """fn(*cupy_views) -> tuple of CuPy arrays, run for arrays of framework `fw` on `device`.

    Returns the results in `fw`, zero-copy. Torch: on torch's current stream, no sync, every array the
    call allocates from torch's caching allocator (_torch_malloc: capturable in a CUDA graph). JAX
    and other DLPack producers: on CuPy's current stream, synchronised before returning (see module
    docstring).
    """
    import cupy

    names = names or ("array",) * len(arrays)
    with cupy.cuda.Device(device):
        if fw == TORCH:
            with torch_stream(device), cupy.cuda.using_allocator(_torch_malloc):
                views = [to_cupy(x, fw, n) for x, n in zip(arrays, names)]
                return tuple(from_cupy(r, fw) for r in fn(*views))
        views = [to_cupy(x, fw, n) for x, n in zip(arrays, names)]
        results = fn(*views)
        if fw != CUPY:
            cupy.cuda.get_current_stream().synchronize()
        return tuple(from_cupy(r, fw) for r in results)
