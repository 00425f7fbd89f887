"""The registry of kernel families, config selection for a call, and the forward's backend choice.

    family = families.choose(families.FORWARDS, problem, backend)   # the sm90 forward where it can run
    tile = families.select(family, problem)   # tuned table first, then the family's heuristic

Families (cuflash/families/sm80.py, sm90.py):
  fwd       v2 forward (mma.sync)      kernels_cu/flash_fwd.cuh       FwdConfig       cc >= 8.0
  fwd_sm90  v2 forward (TMA + wgmma)   kernels_cu/flash_fwd_sm90.cuh  Sm90FwdConfig   cc 9.0 (sm_90a)
  fwd_v1    v1 forward (FA1)           kernels_cu/flash_fwd_v1.cuh    V1Config        cc >= 8.0
  bwd       backward dK/dV (+ dQ by atomics)  kernels_cu/flash_bwd.cuh  BwdConfig   cc >= 8.0
  bwd_sm90  backward dK/dV (TMA + wgmma)  kernels_cu/flash_bwd_sm90.cuh  Sm90BwdConfig  cc 9.0 (auto at d64, d128)
  bwd_dq    deterministic dQ           kernels_cu/flash_bwd.cuh       DqConfig        cc >= 8.0
  decode    KV-cache decoding (GQA group packed)  kernels_cu/flash_decode.cuh  DecodeConfig  cc >= 8.0
"""
from __future__ import annotations

import os

from .base import REG_ALLOC_UNIT, KernelFamily, register_cap
from .sm80 import BWD, BWD_DQ, DECODE, FWD, FWD_V1
from .sm90 import BWD_SM90, FWD_SM90

REGISTRY = {f.name: f for f in (FWD, FWD_SM90, BWD, BWD_SM90, BWD_DQ, FWD_V1, DECODE)}
_BY_TILE = {f.tile_cls: f for f in REGISTRY.values()}

# The v2 forward's families, in order of preference: the first that can run a call does.
FORWARDS = (FWD_SM90, FWD)
# The backward's dK/dV families, in order of preference. The automatic choice takes the Hopper one
# at head_dim 64, 128 and 256 (BWD_SM90.auto_head_dims: 1.4-1.7x the sm80 kernel on the H200 there;
# docs/perf-notes.md); the deterministic mode with block masks or above head_dim 128 falls to sm80.
BACKWARDS = (BWD_SM90, BWD)
BACKENDS = ("sm80", "sm90")  # values of attention(backend=...) and of CUFLASH_BACKEND
BACKEND_ENV = "CUFLASH_BACKEND"

__all__ = ["KernelFamily", "REGISTRY", "FWD", "FWD_SM90", "FWD_V1", "BWD", "BWD_SM90", "BWD_DQ", "DECODE", "FORWARDS",
           "BACKWARDS", "BACKENDS",
           "BACKEND_ENV", "get", "of", "select", "choose", "check_backend", "register_cap", "REG_ALLOC_UNIT"]


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

    props = device.supported(problem.device)  # UnsupportedDeviceError on a GPU older than cc 8.0
    tile = _tuned.lookup(family, problem, props)
    # Variable-length batches and split-KV are not tuned: a tuned tile that spills in their
    # instances (the family's `spilling` marks) gives way to the default that does not. (The older
    # variants, windows and softcap, keep their class's tuned tile, as they were measured with it.)
    untuned = problem.features.varlen or problem.features.split_kv
    if problem.features.user_mod:  # each snippet is its own kernel: pick by its own compile report
        tile = _tile_for_snippet(family, problem, props, tile)
    elif tile is None or (untuned and family.avoids(tile, problem.features)):
        try:
            tile = family.untuned(problem.features.head_dim, props.smem_optin, problem.features, problem.causal)
        except RuntimeError as e:  # no tile fits the device's shared memory: say which GPU
            raise RuntimeError(f"{e} per block on {props.name} (cc {props.cc_str})") from None
        if family.paged_tile is not None and problem.paged:
            tile = family.paged_tile(tile, problem, props)
    if problem.features.varlen and family.varlen_tile is not None:
        tile = family.varlen_tile(tile)
    return tile


def _tile_for_snippet(family: KernelFamily, problem, props, tuned):
    """A user modification's tile: the first of (the class's tuned tile, then the family's defaults
    that fit the device) whose instance with the caller's snippets compiles without spilling
    registers (ptxas' report, one NVRTC compile of ~0.5 s each, cached per process: a snippet's
    register use cannot be known in advance); the least spilling one if every candidate spills."""
    from .. import _compile

    f = problem.features
    cands = [] if tuned is None else [tuned]
    cands += [t for t in family.fitting_defaults(f.head_dim, props.smem_optin)
              if t not in cands and not family.avoids(t, f)]
    if not cands:
        return family.default(f.head_dim, props.smem_optin, f)  # one that spills, or raises naming the head dim
    spills = []
    for t in cands:
        rep = _compile.compile_report(_compile.kernel_source(t, f), family.nvrtc_arch(props))
        if rep["spill_stores"] == 0:
            return t
        spills.append((rep["spill_stores"], t))
    return min(spills, key=lambda x: x[0])[1]


# ----------------------------------------------------------------------------- backends

def check_backend(backend) -> str | None:
    """The `backend` argument: None (automatic), "sm80" or "sm90"; ValueError otherwise."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None, 'sm80' or 'sm90', got {backend!r}")
    return backend


def env_backend() -> str | None:
    """CUFLASH_BACKEND: "sm80" or "sm90" forces that backend where a call has one; unset, empty or
    "auto": automatic. Another value raises ValueError naming the variable."""
    raw = os.environ.get(BACKEND_ENV, "")
    value = raw.strip().lower()
    if value in ("", "auto"):
        return None
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV} must be 'sm80', 'sm90' or 'auto' (or unset), got {raw!r}")
    return value


def choose(candidates: tuple, problem, backend: str | None = None, props=None) -> KernelFamily:
    """The family of `candidates` (in order of preference) that runs `problem` (an AttnProblem).

    backend "sm80"/"sm90" forces that family: ValueError naming the reason when it cannot run the
    call (or when the candidates have no such backend, e.g. the v1 forward and "sm90"). backend None
    reads CUFLASH_BACKEND (env_backend; it applies only where a candidate has that backend), else
    takes the first candidate that can run the call. Runs once per launch plan, never per call.
    """
    from .. import device

    check_backend(backend)
    props = props if props is not None else device.query(problem.device)
    device.check_supported(props, problem.device)  # the GPU itself first: one clear message for old GPUs
    source = "backend"
    if backend is None:
        env = env_backend()
        if env is not None and any(f.backend == env for f in candidates):
            backend, source = env, BACKEND_ENV
    if backend is not None:
        fam = next((f for f in candidates if f.backend == backend), None)
        if fam is None:
            have = ", ".join(repr(f.backend) for f in candidates)
            raise ValueError(f"backend={backend!r}: {candidates[0].what} has no {backend} kernel (backends: {have})")
        why = fam.cannot_run(problem, props)
        if why:
            raise ValueError(f"{source}={backend!r} cannot run this call on {props.name} (cc {props.cc_str}): {why}")
        return fam
    reasons = []
    for fam in candidates:
        if fam.auto_head_dims is not None and problem.features.head_dim not in fam.auto_head_dims:
            reasons.append(f"{fam.name}: not chosen automatically at head_dim {problem.features.head_dim}")
            continue
        why = fam.cannot_run(problem, props)
        if why is None:
            return fam
        reasons.append(f"{fam.name}: {why}")
    raise RuntimeError(f"no kernel can run this call on {props.name} (cc {props.cc_str}): " + "; ".join(reasons))
