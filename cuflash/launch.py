"""A launch plan: the kernels one call runs, and the arrays it allocates, fixed once per call signature.

A `Plan` is built from an AttnProblem and tiles (cuflash/_forward.py, _forward_v1.py, _backward.py),
cached (cuflash/_plans.py), and run per call with the caller's arrays:

    plan.run((q, k, v, None, None), dropout_args) -> (out, lse)   # dropout_args: None (off) or
                                                                  # Dropout.kernel_args

Arrays are named: first the caller's (a None asks the plan to allocate it), then the plan's own
buffers. Each `Launch` names the arrays its kernel takes as leading pointers, in parameter order
(its family's `pointers`); after them every kernel of the plan takes the fields of the pass's
parameter struct (cuflash/params.py), packed once when the plan is built. Dropout's (seed,
threshold, scale) are not part of a plan: with dropout on, a run passes the fields with those
three replaced; with dropout off, the plan's own as they are.
The names resolve to indices at build, so a run costs one list, the allocations and the launches.

Launches go to the driver directly (cuLaunchKernel through CuPy's binding), not through CuPy's
kernel call: each launch keeps its arguments packed in one buffer (_ArgBuffer: the parameter
struct's fields once, the leading pointers and TMA maps rewritten per run) with the array of
per-parameter pointers the driver reads. CuPy's call converts every argument per launch (about 40
here), which was most of a small call's host time (docs/perf-notes.md). Kernels that are not CuPy
functions (the CPU tests' recorders) are called as before, with the same arguments.

A launch whose leading arguments are not the slots themselves (the Hopper forward takes TMA
descriptors of q, k, v, which embed their data pointers) gives a `bind`: a callable that takes the
run's slots (the caller's arrays and the allocated buffers) and returns the kernel's leading
arguments, called once per launch per run.
"""
from __future__ import annotations

import dataclasses
import struct
import threading
from operator import itemgetter
from typing import Callable

import numpy as np

from . import stream_scratch
from .params import KernelParams

# Grids are 1-D; blockIdx.x's limit is 2^31 - 1. (The row-wise varlen kernels and the block-mask
# passes put heads or (batch, head) pairs on y / z, limit 65,535, and stride over what is past it.)
MAX_GRID_X = 2**31 - 1
GRID_YZ_MAX = 65535
NULL = np.uint64(0)  # a null pointer argument


def check_grid(n_blocks: int) -> None:
    if n_blocks > MAX_GRID_X:
        raise ValueError(f"problem too large: {n_blocks} thread blocks exceed the grid limit {MAX_GRID_X}")


@dataclasses.dataclass(frozen=True)
class Buffer:
    """An array the plan provides when the caller does not: allocated per call, uninitialised (zeroed:
    set to 0 on the launches' stream first), from CuPy's pool on the current stream. shape None:
    nothing is allocated, kernels get a null pointer. per_stream: not allocated per call but int32
    words of cuflash/stream_scratch.py, one set per (device, stream): state its kernels return to zero
    before they finish (the sm90 forward's drawn tile counter), which launches on one stream may share
    because they run one after another."""

    name: str
    shape: tuple | None
    dtype: object = np.float32
    zeroed: bool = False
    per_stream: bool = False

    def __post_init__(self):
        if self.per_stream and np.dtype(self.dtype) != np.int32:
            raise ValueError(f"per-stream buffer {self.name}: int32 words, got {np.dtype(self.dtype)}")


def _memset_zero(ptr: int, nbytes: int, stream: int) -> None:
    """cudaMemsetAsync(ptr, 0, nbytes) on `stream` (a raw handle): a zeroed Buffer that another
    framework allocated (Plan.run_external)."""
    import cupy

    if nbytes:
        cupy.cuda.runtime.memsetAsync(ptr, 0, nbytes, stream)


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: object  # a loaded CuPy RawKernel
    grid: tuple
    block: tuple
    smem: int  # dynamic shared memory, bytes
    pointers: tuple  # slot names, in the kernel's parameter order; the plan's parameter struct follows
    # slots -> the kernel's leading arguments, per run (None: the `pointers` slots as they are);
    # with a bind, `pointers` names the slots it reads
    bind: Callable | None = None
    # the launch's own scalar arguments (numpy scalars, after the pointers) instead of the plan's
    # parameter struct: a helper kernel of another signature in the same plan (the split-KV combine,
    # cuflash/kvcache.py); dropout's per-run fields never apply to them
    params: tuple | None = None


MAP_BYTES, MAP_ALIGN = 128, 64  # a TMA map parameter (cuflash/tma.py: CUtensorMap, __grid_constant__)


def _is_map(v) -> bool:
    return isinstance(v, np.ndarray) and v.dtype.itemsize == MAP_BYTES and v.size == 1


class OwnParams:
    """A launch's own scalars (Launch.params) in KernelParams' shape: `arg` as given, `packed` a
    (1,) structured array laid out as C lays out the parameters (each at its natural alignment), which
    _ArgBuffer copies; `with_dropout` is never asked of them."""

    __slots__ = ("packed", "arg")

    def __init__(self, scalars: tuple):
        scalars = tuple(np.asarray(x)[()] for x in scalars)
        dt = np.dtype([(f"a{i}", x.dtype) for i, x in enumerate(scalars)], align=True)
        self.packed = np.zeros(1, dt)
        for i, x in enumerate(scalars):
            self.packed[f"a{i}"] = x
        self.arg = scalars


class _ArgBuffer:
    """One launch's kernel arguments for cuLaunchKernel's kernelParams: every parameter's bytes in one
    buffer and an array of pointers to them, in parameter order. The driver copies the parameters
    at the launch call, so the buffer is rewritten per run (under a lock: plans are shared by
    threads): the leading pointers (8 bytes), TMA maps (128 bytes, when another map comes) and
    dropout's three fields; the parameter struct's other fields are written once. `lead_maps`: per leading argument,
    whether it is a TMA map (else a device pointer)."""

    __slots__ = ("view", "argv", "argv_ptr", "lead", "record", "base", "lock", "func", "maps", "_mem",
                 "_drop_dirty", "_runs", "_map_at", "dims")

    def __init__(self, lead_maps: tuple, params: KernelParams | OwnParams, dims: tuple = (1,) * 6):
        packed = params.packed
        offsets, off = [], 0
        for is_map in lead_maps:
            size, align = (MAP_BYTES, MAP_ALIGN) if is_map else (8, 8)
            off = -(-off // align) * align
            offsets.append(off)
            off += size
        self.func = 0  # the kernel's CUfunction, set by the plan when it makes the buffer
        base = -(-off // MAP_ALIGN) * MAP_ALIGN  # the struct image, its fields at the mirror's offsets
        total = base + -(-packed.dtype.itemsize // 8) * 8  # whole 8-byte words (own scalars may end short)
        self._mem = np.zeros(total + MAP_ALIGN, np.uint8)
        shift = (-self._mem.ctypes.data) % MAP_ALIGN
        self.view = self._mem[shift:shift + total]
        self.view[base:base + packed.dtype.itemsize] = packed.view(np.uint8)
        self.record = self.view[base:base + packed.dtype.itemsize].view(packed.dtype)  # (1,) structured view
        addr = self.view.ctypes.data
        fields = [packed.dtype.fields[n][1] for n in packed.dtype.names]
        self.argv = np.array([addr + o for o in offsets] + [addr + base + f for f in fields], dtype=np.uint64)
        self.argv_ptr = self.argv.ctypes.data
        self.lead = tuple(zip(lead_maps, offsets))
        self.maps = [None] * len(lead_maps)  # per leading argument, the TMA map last copied in (its array)
        self.base = base
        self.lock = threading.Lock()
        self._drop_dirty = False
        self.dims = dims  # the launch's grid and block, three each (cuLaunchKernel's order)
        # the leading pointers by runs of consecutive ones, each written by one pack_into (a NumPy
        # item assignment per pointer was ~4 us of a launch's host time): (its Struct, its byte
        # offset in _mem, first and end argument)
        self._runs, i = [], 0
        while i < len(lead_maps):
            j = i
            while j < len(lead_maps) and not lead_maps[j]:
                j += 1
            if j > i:
                self._runs.append((struct.Struct(f"<{j - i}Q"), shift + offsets[i], i, j))
            i = j + 1
        self._map_at = tuple(i for i, m in enumerate(lead_maps) if m)

    def fill(self, values, dropout_args, params: KernelParams) -> None:
        """Write the leading arguments (device pointers as ints, TMA maps as their arrays) and
        dropout's fields (or restore the plan's after a dropout run). Hold self.lock."""
        mem, last = self._mem, self.maps
        for st, at, i, j in self._runs:
            st.pack_into(mem, at, *values[i:j])
        for i in self._map_at:
            v = values[i]
            if last[i] is not v:  # a map is encoded once per pointer and never changed: copy it when it changes
                off = self.lead[i][1]
                self.view[off:off + MAP_BYTES] = v.view(np.uint8).reshape(-1)
                last[i] = v
        if dropout_args is not None:
            r = self.record
            r["drop_seed"], r["drop_threshold"], r["drop_scale"] = dropout_args
            self._drop_dirty = True
        elif self._drop_dirty:
            self.view[self.base:self.base + params.packed.dtype.itemsize] = params.packed.view(np.uint8)
            self._drop_dirty = False


def _pointer(v) -> int:
    """A leading argument as the driver takes it: a CuPy array's data pointer, or the int itself
    (NULL, a pointer a bind computed, run_external's slots); a TMA map (a NumPy array) as it is."""
    if type(v) is int:
        return v
    if type(v) is Ptr:
        return v.ptr
    if type(v) is np.ndarray:
        return v
    data = getattr(v, "data", None)
    return int(v) if data is None or isinstance(v, np.generic) else data.ptr


def address(v) -> int:
    """A slot's device address: the int itself (run_external's slots), else `.data.ptr` (a CuPy
    array, a Ptr): what binds read of the slots they turn into TMA maps."""
    return v if type(v) is int else v.data.ptr


def _getter(indices):
    """slots -> tuple of slots[i] for i in indices (itemgetter returns a bare item for one index)."""
    if len(indices) == 1:
        i = indices[0]
        return lambda s: (s[i],)
    return itemgetter(*indices)


def _take(ln: Launch, names: list, index: dict):
    unknown = [n for n in ln.pointers if n not in index]
    if unknown:
        raise ValueError(f"launch reads unknown slots {unknown}; the plan has {names}")
    gather = None if list(ln.pointers) == names else _getter([index[n] for n in ln.pointers])
    if ln.bind is not None:  # the bind takes the `pointers` slots, in order
        bind = ln.bind
        return bind if gather is None else (lambda slots: bind(gather(slots)))
    return gather


class Plan:
    """Launches in order on CuPy's current stream of `device`; run() returns the `outputs` arrays.
    `params`: the pass's packed parameter struct (params.pack_fwd / pack_bwd); its fields follow
    every launch's pointers."""

    __slots__ = ("device", "inputs", "params", "_blank", "_alloc", "_per_stream", "_launches", "_own", "_outputs",
                 "_out_idx", "_args", "_n_inputs", "_scratch", "_arena", "_out_alloc")

    def __init__(self, device: int, inputs: tuple, buffers: tuple, launches: tuple, outputs: tuple,
                 params: np.ndarray):
        own = [b for b in buffers if b.name not in inputs]
        names = [*inputs, *(b.name for b in own)]
        index = {n: i for i, n in enumerate(names)}
        self.device = device
        self.inputs = tuple(inputs)  # the names of run()'s args, in order
        self.params = KernelParams(params)
        self._blank = [NULL if b.shape is None else None for b in own]  # the plan's slots before allocation
        self._n_inputs = len(inputs)
        self._alloc = tuple((index[b.name], b.shape, b.dtype, b.zeroed) for b in buffers
                            if b.shape is not None and not b.per_stream)
        self._per_stream = tuple((index[b.name], b.name, int(np.prod(b.shape))) for b in buffers
                                 if b.shape is not None and b.per_stream)
        if self._per_stream:
            stream_scratch.reserve(device)
        # take None: the kernel's pointers are all the slots, in order (the sm80 forwards), which
        # spares the per-call gather on the path whose host overhead matters most; a bind is the take
        self._launches = tuple((ln.kernel, ln.grid, ln.block, ln.smem, _take(ln, names, index),
                                _is_cupy_function(ln.kernel)) for ln in launches)
        self._own = tuple(None if ln.params is None else OwnParams(ln.params) for ln in launches)
        self._out_idx = tuple(index[n] for n in outputs)
        self._outputs = _getter(self._out_idx)
        # the slots run() allocates and drops at its end (workspaces: not outputs); see _graph_owned
        self._scratch = frozenset(i for i, *_ in self._alloc) - set(self._out_idx)
        self._arena = _arena_layout([a for a in self._alloc if a[0] in self._scratch])
        # run_external's own allocations of outputs: (slot, shape, dtype, zeroed, bytes)
        self._out_alloc = tuple((i, shape, dtype, zeroed, int(np.prod(shape)) * np.dtype(dtype).itemsize)
                                for i, shape, dtype, zeroed in self._alloc if i not in self._scratch)
        self._args = [None] * len(launches)  # per launch: its _ArgBuffer, made at its first run

    def run(self, args: tuple, dropout_args: tuple | None = None) -> tuple:
        """args: the caller's arrays, in `inputs` order (None: allocate); dropout_args: None without
        dropout, else the kernels' (seed, threshold, scale) (problem.Dropout.kernel_args), the
        parameter struct's fields for this run (the plan's own struct is not changed)."""
        import cupy

        slots = [*args, *self._blank]
        with cupy.cuda.Device(self.device):
            graph = bool(self._scratch) and _capturing()  # (torch's capture: torch's allocator already)
            for i, shape, dtype, zeroed in self._alloc:
                if slots[i] is None:
                    if graph and i in self._scratch:
                        slots[i] = _graph_owned(shape, dtype, zeroed)
                    else:
                        slots[i] = (cupy.zeros if zeroed else cupy.empty)(shape, dtype=dtype)
            if self._per_stream:
                stream = cupy.cuda.get_current_stream().ptr
                for i, name, n in self._per_stream:
                    slots[i] = stream_scratch.words(self.device, stream, name, n)
            self._launch_all(slots, dropout_args, None)
        # Buffers that are not outputs go back to the pool when `slots` dies here; the pool reuses a
        # block only for work queued later on the same stream, so the running kernels keep them.
        # (Under a graph capture they are the graph's own: _graph_owned.)
        return self._outputs(slots)

    def run_external(self, args: list, empty: Callable, stream: int, dropout_args: tuple | None = None) -> tuple:
        """run() for another framework's arrays (the torch fast path, cuflash/_torch.py): `args` the
        caller's slots as Ptr (None, or missing at the end: the plan allocates), `empty(shape, numpy dtype)` -> (array, its
        data pointer) allocates in that framework (stream-ordered on `stream`, the raw stream the
        kernels go to). Returns the outputs as `empty` made them. The caller makes the plan's device
        current."""
        slots = [*args, *(None,) * (self._n_inputs - len(args)), *self._blank]
        owned = {}
        for i, shape, dtype, zeroed, nbytes in self._out_alloc:  # the outputs: the framework's arrays, returned
            if slots[i] is None:
                owned[i], ptr = empty(shape, dtype)
                if zeroed:
                    _memset_zero(ptr, nbytes, stream)
                slots[i] = ptr
        places, nbytes, zeroed_bytes = self._arena
        if places:  # (the caller's slots are the plan's inputs: its workspaces are always unset here)
            # the workspaces: one allocation carved at 256-byte offsets (each framework allocation
            # is a few us of host time on the small calls whose overhead is the whole cost), the
            # zeroed ones first, under one memset; it goes back to the framework's stream-ordered
            # allocator when this call returns, after the launches that use it are queued
            arena = empty((nbytes,), np.uint8)  # (array, pointer): the array lives until the return
            base = arena[1]
            _memset_zero(base, zeroed_bytes, stream)
            for i, off in places:
                if slots[i] is None:
                    slots[i] = base + off
        for i, name, n in self._per_stream:
            slots[i] = stream_scratch.words(self.device, stream, name, n).data.ptr
        self._launch_all(slots, dropout_args, stream)
        return tuple([owned[i] for i in self._out_idx])

    def _launch_all(self, slots: list, dropout_args, stream) -> None:
        """Every launch, in order, on `stream` (None: CuPy's current stream)."""
        ready = False
        for j, (kernel, grid, block, smem, take, raw) in enumerate(self._launches):
            lead = slots if take is None else take(slots)
            own = self._own[j]
            params, drop = (self.params, dropout_args) if own is None else (own, None)
            if not raw:  # not a CuPy kernel (the CPU tests' recorders)
                scalars = params.arg if drop is None else params.with_dropout(drop)
                kernel(grid, block, (*lead, *scalars), shared_mem=smem)
                continue
            if not ready:  # once per run, before its first driver launch
                if stream is None:
                    import cupy

                    stream = cupy.cuda.get_current_stream().ptr
                _ensure_context(self.device)
                ready = True
            buf = self._args[j]
            if buf is None:
                buf = _ArgBuffer(tuple(_is_map(v) for v in lead), params,
                                 (*grid, *(1,) * (3 - len(grid)), *block, *(1,) * (3 - len(block))))
                buf.func = _function_handle(kernel)
                self._args[j] = buf
            values = [v if type(v) is int else _pointer(v) for v in lead]
            with buf.lock:
                buf.fill(values, drop, params)
                _launch_kernel(buf.func, *buf.dims, smem, stream, buf.argv_ptr, 0)


_ARENA_ALIGN = 256


def _arena_layout(allocs: list) -> tuple:
    """(((slot, byte offset), ...), total bytes, bytes to zero) of workspaces carved from one
    allocation (Plan.run_external): the zeroed ones first, so one memset of the leading bytes
    clears them all; every offset a multiple of _ARENA_ALIGN (the kernels' 16-byte loads and TMA)."""
    places, off, zeroed_end = [], 0, 0
    for i, shape, dtype, zeroed in sorted(allocs, key=lambda a: not a[3]):
        places.append((i, off))
        off += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // _ARENA_ALIGN) * _ARENA_ALIGN
        if zeroed:
            zeroed_end = off
    return tuple(places), off, zeroed_end


def _capturing() -> bool:
    """Whether a call's temporaries need the graph's memory: CuPy's current stream is being captured
    into a CUDA graph and CuPy allocates from its default pool. (torch calls run with torch's
    allocator, cuflash/_interop.py, which keeps a captured graph's blocks in the graph's own pool;
    a caller's own allocator is left to do as it does.)"""
    import cupy

    return cupy.cuda.get_current_stream().is_capturing() and \
        cupy.cuda.get_allocator() == cupy.get_default_memory_pool().malloc


_graph_pool = None


def graph_malloc(nbytes: int):
    """A CuPy allocator (cupy.cuda.using_allocator) for the temporaries of a call being captured
    into a CUDA graph: cudaMallocAsync on the capturing stream, so the graph gets an allocation node
    and, when the array dies before the capture ends, a free node, and each replay has the memory to
    itself. From CuPy's pool the block would go back to the pool when the call drops it and be
    handed to a later array on that stream, which every replay of the graph would then overwrite.
    (torch's capture needs none of this: its allocator keeps a graph's blocks in the graph's pool.)
    Only for arrays that die inside the capture: never an output the caller keeps."""
    global _graph_pool
    import cupy

    if _graph_pool is None:
        _graph_pool = cupy.cuda.MemoryAsyncPool()
    try:
        return _graph_pool.malloc(max(nbytes, 1))
    except RuntimeError as e:  # no stream-ordered allocation on this device / driver
        raise RuntimeError(f"cuflash cannot capture this call into a CUDA graph on device "
                           f"{cupy.cuda.Device().id}: its temporaries need stream-ordered allocation "
                           f"(cudaMallocAsync) inside the capture ({e})") from None


def graph_temporaries():
    """A context in which CuPy allocates through graph_malloc while the current stream is being
    captured, else nothing: around a call's temporaries (lengths, gathered pages, rotated inputs),
    not around the allocation of its outputs."""
    import contextlib

    if not _capturing():
        return contextlib.nullcontext()
    import cupy

    return cupy.cuda.using_allocator(graph_malloc)


def _graph_owned(shape, dtype, zeroed: bool):
    """A plan's workspace inside a capture (graph_malloc's memory)."""
    import cupy

    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    a = cupy.ndarray(shape, dtype=dtype, memptr=graph_malloc(nbytes))
    if zeroed:
        a.fill(0)
    return a


class Ptr:
    """A raw device pointer where a plan expects an array: `.data.ptr` is the pointer (what plans and
    TMA binds read of a CuPy array)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    @property
    def data(self):
        return self


def _launch_kernel(*args):
    """cuLaunchKernel (CuPy's binding), imported on the first launch: `import cuflash` imports no
    framework (tests/test_package.py); later calls go to the binding directly."""
    global _launch_kernel
    from cupy_backends.cuda.api.driver import launchKernel

    _launch_kernel = launchKernel
    return launchKernel(*args)


_tls = threading.local()


def _ensure_context(device: int) -> None:
    """The driver launch needs a CUDA context current on the calling thread, which CuPy's own
    launches make sure of (a runtime call once per thread and device): a thread that reaches a
    launch without any runtime call before would otherwise get CUDA_ERROR_INVALID_CONTEXT."""
    done = getattr(_tls, "devices", None)
    if done is None:
        done = _tls.devices = set()
    if device not in done:
        from cupy.cuda import runtime

        runtime.memGetInfo()  # establishes the device's primary context on this thread
        done.add(device)


def _is_cupy_function(kernel) -> bool:
    """A CuPy kernel (cupy.RawKernel, what RawModule.get_function returns, or a loaded
    cupy.cuda.function.Function), whose handle the driver launch takes; anything else (the CPU tests'
    recorders) is called as CuPy's kernels used to be."""
    t = type(kernel)
    return (t.__name__, t.__module__) in (("RawKernel", "cupy._core.raw"), ("Function", "cupy.cuda.function"))


def _function_handle(kernel) -> int:
    """The CUfunction of a CuPy kernel on the current device: a RawKernel's loaded Function (loaded once
    per device by CuPy, with the dynamic shared memory attribute _compile set on it), else the
    Function's own handle."""
    return getattr(kernel, "kernel", kernel).ptr


class FilledPlan:
    """A plan that launches nothing: each output is filled with a constant. The plan of a call with an
    empty dimension (a batch, heads or seqlen of 0; AttnProblem.empty): the outputs have their shapes,
    and where seqlen_k alone is 0 every query row sees no key (out 0, lse -inf; the backward's dq 0).

    outputs: (Buffer, value) pairs in output order; a Buffer named after one of `inputs` fills the
    caller's array when one is given there (contiguous, as the entry points check), else a new one."""

    __slots__ = ("device", "inputs", "_outputs")

    def __init__(self, device: int, inputs: tuple, outputs: tuple):
        index = {n: i for i, n in enumerate(inputs)}
        self.device = device
        self.inputs = tuple(inputs)
        self._outputs = tuple((index.get(b.name), b.shape, b.dtype, value) for b, value in outputs)

    def run(self, args: tuple, dropout_args: tuple | None = None) -> tuple:
        import cupy

        results = []
        with cupy.cuda.Device(self.device):
            for i, shape, dtype, value in self._outputs:
                a = None if i is None else args[i]
                if a is None:
                    a = cupy.zeros(shape, dtype=dtype) if value == 0 else cupy.full(shape, value, dtype=dtype)
                elif a.size and value == 0:
                    a.data.memset_async(0, a.nbytes)
                elif a.size:
                    a.fill(value)
                results.append(a)
        return tuple(results)
