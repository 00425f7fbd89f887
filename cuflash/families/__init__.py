"""The registry of kernel families, and config selection for a call.

    tile = families.select(families.FWD, problem)   # tuned table first, then the family's heuristic

Families (cuflash/families/sm80.py):
  fwd     v2 forward             kernels_cu/flash_fwd.cuh     FwdConfig
  fwd_v1  v1 forward (FA1)       kernels_cu/flash_fwd_v1.cuh  V1Config
  bwd     backward dK/dV (+ dQ by atomics)  kernels_cu/flash_bwd.cuh  BwdConfig
  bwd_dq  deterministic dQ       kernels_cu/flash_bwd.cuh     DqConfig
"""
from __future__ import annotations

from .base import REG_ALLOC_UNIT, KernelFamily, register_cap
from .sm80 import BWD, BWD_DQ, FWD, FWD_V1

REGISTRY = {f.name: f for f in (FWD, BWD, BWD_DQ, FWD_V1)}
_BY_TILE = {f.tile_cls: f for f in REGISTRY.values()}

__all__ = ["KernelFamily", "REGISTRY", "FWD", "FWD_V1", "BWD", "BWD_DQ", "get", "of", "select", "register_cap", "REG_ALLOC_UNIT"]


def get(name: str) -> KernelFamily:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown kernel {name!r}; known: {', '.join(REGISTRY)}") from None


def of(tile) -> KernelFamily:
    """The family a tile belongs to (each family has its own tile class)."""
    try:
        return _BY_TILE[type(tile)]
    except KeyError:
        raise TypeError(f"not a kernel config: {tile!r}") from None


def select(family: KernelFamily, problem):
    """The tile to run `family` with for `problem` (an AttnProblem): the user's tuning cache, then
    the shipped tables, then the family's heuristic default for the device."""
    from .. import _tuned, device

    props = device.query(problem.device)
    tile = _tuned.lookup(family, problem, props)
    if tile is not None:
        return tile
    return family.default(problem.head_dim, props.smem_optin, problem.features)
