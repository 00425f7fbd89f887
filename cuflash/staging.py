"""Small host arrays to the device without a host-side wait (the KV cache's per-step lengths).

`cupy.asarray(numpy_array)` copies from pageable memory, and a pageable host-to-device copy is
synchronous for the host: it returns once the copy has run, which is after every kernel queued
before it on the stream. In a decode loop that passes its cache lengths as host integers, that put
each step's launches behind the previous step's kernels: host and GPU ran one after the other,
about 120-165 us per call on the H200 whatever the cache size (2026-11-30, docs/perf-notes.md).

Here values go through page-locked host buffers and `cudaMemcpyAsync`, which returns at once. A
buffer is reused only after the copy that last read it has completed (a CUDA event per buffer, one
ring per device); with a ring of SLOTS buffers the host waits only when it runs SLOTS copies ahead
of the GPU.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

SLOTS = 32
_MIN_BYTES = 4096


class _Ring:
    def __init__(self):
        self.slots = [None] * SLOTS  # (pinned memory, its capacity in bytes, event of its last copy)
        self.next = 0


_rings: dict = {}
_lock = threading.Lock()


def upload(values: np.ndarray, what: str = "values"):
    """A new CuPy array on the current device holding `values` (a C-contiguous NumPy array), copied
    asynchronously on the current stream: kernels queued after this call on that stream see it.
    Not inside a CUDA graph capture (RuntimeError naming `what`, the caller's argument): the graph
    would copy from a pinned buffer that this ring reuses for later values."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    if stream.is_capturing():
        raise RuntimeError(f"{what} given on the host cannot be captured into a CUDA graph (each replay would copy "
                           f"it again from host memory that cuflash reuses): pass it as an int32 array on the GPU "
                           f"(cache_seqlens may also be one int)")
    values = np.ascontiguousarray(values)
    out = cupy.empty(values.shape, dtype=values.dtype)
    n = values.nbytes
    if n == 0:
        return out
    dev = cupy.cuda.Device().id
    with _lock:
        ring = _rings.setdefault(dev, _Ring())
        i = ring.next
        ring.next = (i + 1) % SLOTS
        slot = ring.slots[i]
        if slot is None or slot[1] < n:
            size = max(_MIN_BYTES, 1 << (n - 1).bit_length())
            slot = (cupy.cuda.alloc_pinned_memory(size), size, cupy.cuda.Event(block=False, disable_timing=True))
            ring.slots[i] = slot
        else:
            slot[2].synchronize()  # the copy that last read this buffer is done
        mem, _, event = slot
        np.frombuffer(mem, dtype=np.uint8, count=n)[:] = values.view(np.uint8).reshape(-1)
        out.data.copy_from_host_async(ctypes.c_void_p(mem.ptr), n, stream=stream)
        event.record(stream)
    return out
