"""Per-stream scratch words: state a kernel leaves at zero when it finishes (the sm90 forward's drawn tile
order keeps its tile counter here, kernels_cu/sm90/tile_feed.cuh).

Launches on one stream run one after another, so they may share such a word; launches on two streams
may run at once, so each (device, stream) gets its own. The words come from one zeroed int32 pool per
device, made when the first plan that needs one is built (`reserve`, outside any call that might be
captured into a CUDA graph): a later call on a new stream, a graph capture on torch's or CuPy's
capture stream included, only takes the pool's next free words (no allocation, which capture forbids).
A stream handle the driver reuses for a new stream finds its words at zero. Past the pool's words,
another pool is allocated (outside a capture: inside one, a RuntimeError says why).
"""
from __future__ import annotations

import threading

import numpy as np

POOL_WORDS = 256  # int32 words per pool: 256 streams of one word


class _Pool:
    __slots__ = ("arrays", "used", "given")

    def __init__(self):
        self.arrays = []  # zeroed int32 CuPy arrays of POOL_WORDS
        self.used = POOL_WORDS  # words taken from the last array (full: none yet)
        self.given = {}  # (stream, name) -> int32 view


_pools: dict = {}
_lock = threading.Lock()


def _grow(pool: _Pool, device: int) -> None:
    import cupy

    with cupy.cuda.Device(device):
        current = cupy.cuda.get_current_stream()
        if current.is_capturing():
            raise RuntimeError("cuflash needs a per-stream scratch word that it cannot allocate while a CUDA graph "
                               "is being captured: call once on this device before capturing")
        arr = cupy.zeros(POOL_WORDS, dtype=np.int32)
        current.synchronize()  # zero before any stream's kernel reads it
    pool.arrays.append(arr)
    pool.used = 0


def reserve(device: int) -> None:
    """Make `device`'s pool if it has none (a plan that takes scratch words, when it is built)."""
    with _lock:
        pool = _pools.setdefault(device, _Pool())
        if not pool.arrays:
            _grow(pool, device)


def words(device: int, stream: int, name: str, n: int = 1):
    """The `n` int32 scratch words `name` of (device, stream) (a raw stream handle), as a CuPy view."""
    if not 0 < n <= POOL_WORDS:
        raise ValueError(f"scratch words: 1 to {POOL_WORDS} per stream, got {n}")
    pool = _pools.get(device)
    got = None if pool is None else pool.given.get((stream, name))
    if got is not None:
        return got
    with _lock:
        pool = _pools.setdefault(device, _Pool())
        got = pool.given.get((stream, name))
        if got is None:
            if pool.used + n > POOL_WORDS:
                _grow(pool, device)
            got = pool.arrays[-1][pool.used:pool.used + n]
            pool.used += n
            pool.given[(stream, name)] = got
    return got


def handed_out(device: int) -> dict:
    """(stream, name) -> view of the words given on `device` so far (tests: every word back at 0)."""
    pool = _pools.get(device)
    return {} if pool is None else dict(pool.given)
