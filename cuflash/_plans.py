"""Launch plans cached per call signature, shared by the forward (v1, v2) and backward entry points.

A plan holds everything about a launch that depends only on shapes, strides, dtypes, device and
options (validation included); the data pointers are not part of the key, only their alignment.
A repeated call then costs one dict hit, its allocations and the launches.
"""
from __future__ import annotations

from typing import Callable

from .problem import ALIGN_BYTES


def array_key(arrays) -> tuple:
    """Shapes, strides, dtypes and devices of CuPy arrays, and the alignment of their pointers
    (alignment decides validity; the pointers themselves do not matter)."""
    ptr_bits = 0
    for a in arrays:
        ptr_bits |= a.data.ptr
    return (tuple((a.shape, a.strides, a.dtype, a.data.device_id) for a in arrays), ptr_bits % ALIGN_BYTES)


class PlanCache:
    """Plans by key; emptied when full (many distinct shapes, e.g. serving), so memory stays bounded."""

    def __init__(self, max_plans: int = 4096):
        self._plans: dict = {}
        self._max = max_plans
        # bumped whenever entries go: holders of a plan outside the cache (the torch direct
        # launches, cuflash/_torch.py) drop theirs when it changes (a test's clear, a new backend)
        self.generation = 0

    def get(self, key_fn: Callable[[], tuple], build: Callable[[], object]):
        try:
            key = key_fn()
            plan = self._plans.get(key)
        except TypeError:  # an unhashable option: build() validates it and names it
            key = plan = None
        if plan is None:
            plan = build()
            if key is not None:
                if len(self._plans) >= self._max:
                    self.clear()
                self._plans[key] = plan
        return plan

    def lookup(self, key):
        """The entry stored under `key` (None when absent, or when key is None or unhashable)."""
        if key is None:
            return None
        try:
            return self._plans.get(key)
        except TypeError:
            return None

    def put(self, key, value) -> None:
        if len(self._plans) >= self._max:
            self.clear()
        self._plans[key] = value

    def clear(self) -> None:
        self._plans.clear()
        self.generation += 1

    def __len__(self) -> int:
        return len(self._plans)
