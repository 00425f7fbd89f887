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

A launch whose leading arguments are not the slots themselves (the Hopper forward takes TMA
descriptors of q, k, v, which embed their data pointers) gives a `bind`: a callable that takes the
run's slots (the caller's arrays and the allocated buffers) and returns the kernel's leading
arguments, called once per launch per run.
"""
from __future__ import annotations

import dataclasses
from operator import itemgetter
from typing import Callable

import numpy as np

from .params import KernelParams

# Grids are 1-D; blockIdx.x's limit is 2^31 - 1.
MAX_GRID_X = 2**31 - 1
NULL = np.uint64(0)  # a null pointer argument


def check_grid(n_blocks: int) -> None:
    if n_blocks > MAX_GRID_X:
        raise ValueError(f"problem too large: {n_blocks} thread blocks exceed the grid limit {MAX_GRID_X}")


@dataclasses.dataclass(frozen=True)
class Buffer:
    """An array the plan provides when the caller does not: allocated per call, uninitialised, from
    CuPy's pool on the current stream. shape None: nothing is allocated, kernels get a null pointer."""

    name: str
    shape: tuple | None
    dtype: object = np.float32


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

    __slots__ = ("device", "params", "_blank", "_alloc", "_launches", "_outputs")

    def __init__(self, device: int, inputs: tuple, buffers: tuple, launches: tuple, outputs: tuple,
                 params: np.ndarray):
        own = [b for b in buffers if b.name not in inputs]
        names = [*inputs, *(b.name for b in own)]
        index = {n: i for i, n in enumerate(names)}
        self.device = device
        self.params = KernelParams(params)
        self._blank = [NULL if b.shape is None else None for b in own]  # the plan's slots before allocation
        self._alloc = tuple((index[b.name], b.shape, b.dtype) for b in buffers if b.shape is not None)
        # take None: the kernel's pointers are all the slots, in order (the sm80 forwards), which
        # spares the per-call gather on the path whose host overhead matters most; a bind is the take
        self._launches = tuple((ln.kernel, ln.grid, ln.block, ln.smem, _take(ln, names, index)) for ln in launches)
        self._outputs = _getter([index[n] for n in outputs])

    def run(self, args: tuple, dropout_args: tuple | None = None) -> tuple:
        """args: the caller's arrays, in `inputs` order (None: allocate); dropout_args: None without
        dropout, else the kernels' (seed, threshold, scale) (problem.Dropout.kernel_args), set in a
        per-call copy of the parameter struct's fields."""
        import cupy

        params = self.params.arg if dropout_args is None else self.params.with_dropout(dropout_args)
        slots = [*args, *self._blank]
        with cupy.cuda.Device(self.device):
            for i, shape, dtype in self._alloc:
                if slots[i] is None:
                    slots[i] = cupy.empty(shape, dtype=dtype)
            for kernel, grid, block, smem, take in self._launches:
                kernel(grid, block, (*(slots if take is None else take(slots)), *params), shared_mem=smem)
        # Buffers that are not outputs go back to the pool when `slots` dies here; the pool reuses a
        # block only for work queued later on the same stream, so the running kernels keep them.
        return self._outputs(slots)


class FilledPlan:
    """A plan that launches nothing: each output is filled with a constant. The plan of a call with an
    empty dimension (a batch, heads or seqlen of 0; AttnProblem.empty): the outputs have their shapes,
    and where seqlen_k alone is 0 every query row sees no key (out 0, lse -inf; the backward's dq 0).

    outputs: (Buffer, value) pairs in output order; a Buffer named after one of `inputs` fills the
    caller's array when one is given there (contiguous, as the entry points check), else a new one."""

    __slots__ = ("device", "_outputs")

    def __init__(self, device: int, inputs: tuple, outputs: tuple):
        index = {n: i for i, n in enumerate(inputs)}
        self.device = device
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
