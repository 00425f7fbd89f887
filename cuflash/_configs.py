"""Kernel configurations: what a config of each kernel is, which ones exist, which one runs by default.

A config fixes the compile-time constants of one kernel instance. The tuner searches the spaces
built here; the heuristic defaults below serve until a tuned table exists.

Kernels (the `KERNEL` name of each config class):
  "fwd"      FwdConfig   kernels_cu/flash_fwd.cuh   forward, v2 algorithm
  "bwd"      BwdConfig   kernels_cu/flash_bwd.cuh   backward main kernel: dK, dV (and dQ by atomics)
  "bwd_dq"   DqConfig    kernels_cu/flash_bwd.cuh   deterministic backward: dQ without atomics
  "fwd_v1"   V1Config    kernels_cu/flash_fwd_v1.cuh  forward, v1 algorithm (FlashAttention-1, Algorithm 1)
"""
from __future__ import annotations

import dataclasses
import itertools

SUPPORTED_HEAD_DIMS = (64, 128)
DTYPE_NAMES = ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True, order=True)
class _TileConfig:
    """The compile-time constants every kernel template takes: <D, BR, BC, WARPS, STAGES>.

    Subclasses say what the tiles mean for their kernel (KERNEL, smem_bytes, structural_problem).
    """

    KERNEL = ""

    head_dim: int
    block_q: int  # BR
    block_k: int  # BC
    warps: int
    stages: int  # depth of the kernel's cp.async ring

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def smem_bytes(self) -> int:
        raise NotImplementedError

    def structural_problem(self) -> str | None:
        """Why this config can never compile (mirrors the kernel's static_asserts), or None."""
        raise NotImplementedError

    def _common_problem(self) -> str | None:
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            return f"head_dim {self.head_dim} not in {SUPPORTED_HEAD_DIMS}"
        if self.stages < 2:
            return "stages must be >= 2 (the single-barrier pipeline)"
        return None

    def fits(self, smem_optin_bytes: int) -> bool:
        return self.structural_problem() is None and self.smem_bytes <= smem_optin_bytes


def _space(make, *axes) -> list:
    """Every config make(*choice) over the product of `axes` that is valid and fits (make returns
    None for a config it rules out)."""
    return [c for choice in itertools.product(*axes) if (c := make(*choice)) is not None]


@dataclasses.dataclass(frozen=True, order=True)
class FwdConfig(_TileConfig):
    """Compile-time shape of the v2 forward kernel (kernels_cu/flash_fwd.cuh).

    block_q: query rows per thread block, block_q / warps per warp; block_k: key rows per K/V
    tile; stages: depth of the cp.async K/V ring.
    """

    KERNEL = "fwd"

    @property
    def smem_bytes(self) -> int:
        # Q tile + STAGES x (K tile + V tile), 16-bit elements (mirrors FwdShape::SMEM_BYTES).
        return 2 * self.head_dim * (self.block_q + 2 * self.stages * self.block_k)

    def structural_problem(self) -> str | None:
        if problem := self._common_problem():
            return problem
        if self.block_q % (16 * self.warps):
            return f"block_q {self.block_q} is not a multiple of 16*warps ({16 * self.warps})"
        if self.block_k % 16:
            return f"block_k {self.block_k} is not a multiple of 16"
        return _copy_problem(self.threads, self.head_dim, self.block_q, self.block_k)


def _fitting(cfg, smem_optin_bytes):
    return cfg if cfg.fits(smem_optin_bytes) else None


def fwd_space(head_dim: int, smem_optin_bytes: int = 227 * 1024) -> list[FwdConfig]:
    """Every forward config for `head_dim` that is structurally valid and fits in shared memory."""
    return _space(lambda bq, bk, w, s: _fitting(FwdConfig(head_dim, bq, bk, w, s), smem_optin_bytes),
                  (64, 128, 192), (32, 48, 64, 96, 128), (4, 8), (2, 3))


# Heuristic defaults (before any tuning), in order of preference; the first that fits the device's
# shared memory wins. Measured on an H200 (docs/perf-notes.md and the tuner's exhaustive sweep,
# tuning/nvidia-h200.json, 2026-11-29): the fastest configs
# that compile with no register spills for sm_80 and sm_90a. Later entries serve GPUs with less
# shared memory (A100: 163 KB, L4 / RTX 4090: ~99 KB per block).
_DEFAULTS = {
    64: (FwdConfig(64, 128, 96, 4, 2), FwdConfig(64, 128, 64, 4, 2), FwdConfig(64, 64, 64, 4, 2)),
    128: (FwdConfig(128, 128, 128, 8, 3), FwdConfig(128, 128, 128, 8, 2), FwdConfig(128, 128, 64, 8, 2),
          FwdConfig(128, 64, 64, 4, 2)),
}


# Configs whose DROPOUT instantiation spills registers (ptxas, sm_80 and sm_90a): with dropout on,
# the next default is used instead (tests/test_compile_dropout.py keeps this list honest).
_DROPOUT_AVOID = {FwdConfig(64, 128, 96, 4, 2)}


def default_fwd_config(head_dim: int, smem_optin_bytes: int = 227 * 1024, dropout: bool = False) -> FwdConfig:
    for cfg in _DEFAULTS[head_dim]:
        if cfg.fits(smem_optin_bytes) and not (dropout and cfg in _DROPOUT_AVOID):
            return cfg
    raise RuntimeError(f"no forward config for head_dim {head_dim} fits in {smem_optin_bytes} bytes of shared memory")


def selectable_fwd_configs() -> list[FwdConfig]:
    """Configs the package may pick at run time without tuning (the CPU compile test covers these)."""
    return sorted({c for cands in _DEFAULTS.values() for c in cands})


# ----------------------------------------------------------------------------- backward

def _copy_problem(threads: int, head_dim: int, *tiles: int) -> str | None:
    step = threads // (head_dim // 8)  # rows one pass of a tile copy covers
    if step % 8 or any(t % step for t in tiles):
        return f"tiles of {'/'.join(map(str, tiles))} rows do not split into copy passes of {step} rows"
    return None


@dataclasses.dataclass(frozen=True, order=True)
class BwdConfig(_TileConfig):
    """Compile-time shape of the backward main kernel (kernels_cu/flash_bwd.cuh, flash_bwd_dkdv).

    One thread block owns block_k keys (16 per warp) and keeps their dK, dV in registers while it
    walks the query tiles of block_q rows through a cp.async ring of `stages` slots.
    """

    KERNEL = "bwd"
    # block_q: query rows per step of the inner loop; block_k: keys the block owns, 16 per warp;
    # stages: depth of the cp.async Q / dO ring

    @property
    def smem_bytes(self) -> int:
        # K, V tiles + STAGES x (Q, dO tiles) + 2 x dS^T tile (16-bit, double-buffered)
        # + STAGES x (lse, delta) rows (fp32)  (mirrors BwdShape::SMEM_BYTES)
        d, br, bc, s = self.head_dim, self.block_q, self.block_k, self.stages
        return 2 * d * (2 * bc + 2 * s * br) + 2 * 2 * bc * br + 2 * s * br * 4

    def structural_problem(self) -> str | None:
        if problem := self._common_problem():
            return problem
        if self.block_k != 16 * self.warps:
            return f"block_k must be 16*warps ({16 * self.warps}), got {self.block_k}"
        if self.block_q % 64:
            return f"block_q {self.block_q} is not a multiple of 64"
        wm = min(self.warps, self.block_q // 16)  # dQ = dS K split over warps: wm x wn
        wn = self.warps // wm
        if self.warps % wm or (self.head_dim // wn) % 16:
            return f"dQ tile {self.block_q}x{self.head_dim} does not split over {self.warps} warps"
        return _copy_problem(self.threads, self.head_dim, self.block_q, self.block_k)


@dataclasses.dataclass(frozen=True, order=True)
class DqConfig(_TileConfig):
    """Compile-time shape of the deterministic dQ kernel (kernels_cu/flash_bwd.cuh, flash_bwd_dq).

    Laid out like the forward: warps own query rows, K/V tiles stream through a cp.async ring.
    """

    KERNEL = "bwd_dq"
    # block_q: query rows per block, 16 per warp; block_k: key rows per K/V tile;
    # stages: depth of the cp.async K / V ring

    @property
    def smem_bytes(self) -> int:
        # Q, dO tiles + STAGES x (K, V tiles) (mirrors DqShape::SMEM_BYTES)
        return 2 * self.head_dim * (2 * self.block_q + 2 * self.stages * self.block_k)

    def structural_problem(self) -> str | None:
        if problem := self._common_problem():
            return problem
        if self.block_q != 16 * self.warps:
            return f"block_q must be 16*warps ({16 * self.warps}), got {self.block_q}"
        if self.block_k % 16:
            return f"block_k {self.block_k} is not a multiple of 16"
        return _copy_problem(self.threads, self.head_dim, self.block_q, self.block_k)


def bwd_space(head_dim: int, smem_optin_bytes: int = 227 * 1024) -> list[BwdConfig]:
    return _space(lambda bq, w, s: _fitting(BwdConfig(head_dim, bq, 16 * w, w, s), smem_optin_bytes),
                  (64, 128), (4, 8), (2, 3))


def dq_space(head_dim: int, smem_optin_bytes: int = 227 * 1024) -> list[DqConfig]:
    return _space(lambda w, bk, s: _fitting(DqConfig(head_dim, 16 * w, bk, w, s), smem_optin_bytes),
                  (4, 8), (32, 64, 128), (2, 3))


# Measured on an H200 (scripts/sweep_bwd.py, docs/perf-notes.md); first that fits wins. The 4-warp
# configs are not here: their dQ tile (64 fp32 registers per thread on top of dK, dV) spills on
# sm_80. No d=128 backward config fits the ~99 KB of an L4 / RTX 4090 yet.
_BWD_DEFAULTS = {
    64: (BwdConfig(64, 128, 128, 8, 3), BwdConfig(64, 128, 128, 8, 2), BwdConfig(64, 64, 128, 8, 2)),
    128: (BwdConfig(128, 64, 128, 8, 3), BwdConfig(128, 64, 128, 8, 2)),
}
_DQ_DEFAULTS = {
    64: (DqConfig(64, 64, 64, 4, 2), DqConfig(64, 128, 64, 8, 2)),
    128: (DqConfig(128, 64, 64, 4, 2), DqConfig(128, 128, 64, 8, 2)),
}


def _first_fit(table, head_dim, smem_optin_bytes, what):
    for cfg in table[head_dim]:
        if cfg.fits(smem_optin_bytes):
            return cfg
    raise RuntimeError(f"no {what} config for head_dim {head_dim} fits in {smem_optin_bytes} bytes of shared memory")


def default_bwd_config(head_dim: int, smem_optin_bytes: int = 227 * 1024) -> BwdConfig:
    return _first_fit(_BWD_DEFAULTS, head_dim, smem_optin_bytes, "backward")


def default_dq_config(head_dim: int, smem_optin_bytes: int = 227 * 1024) -> DqConfig:
    return _first_fit(_DQ_DEFAULTS, head_dim, smem_optin_bytes, "deterministic dQ")


def selectable_bwd_configs() -> list:
    return sorted({c for t in (_BWD_DEFAULTS, _DQ_DEFAULTS) for cands in t.values() for c in cands},
                  key=lambda c: (c.KERNEL, c))


# ----------------------------------------------------------------------------- v1 forward


@dataclasses.dataclass(frozen=True, order=True)
class V1Config(_TileConfig):
    """Compile-time shape of the v1 forward kernel (kernels_cu/flash_fwd_v1.cuh).

    FlashAttention-1's Algorithm 1: one thread block per (batch, head); K/V tiles of block_k rows
    in the outer loop (single-buffered in shared memory), Q tiles of block_q rows in the inner
    loop through a cp.async ring of `stages` slots; O, m, l in an fp32 workspace in device memory.
    """

    KERNEL = "fwd_v1"
    # block_q: query rows per inner step, block_q / warps per warp; block_k: key rows per outer
    # step; stages: depth of the cp.async Q ring

    @property
    def smem_bytes(self) -> int:
        # K tile + V tile + STAGES Q tiles, 16-bit elements (mirrors FwdV1Shape::SMEM_BYTES)
        return 2 * self.head_dim * (2 * self.block_k + self.stages * self.block_q)

    def structural_problem(self) -> str | None:
        if problem := self._common_problem():
            return problem
        if self.block_q % (16 * self.warps):
            return f"block_q {self.block_q} is not a multiple of 16*warps ({16 * self.warps})"
        if self.block_k % 16:
            return f"block_k {self.block_k} is not a multiple of 16"
        return _copy_problem(self.threads, self.head_dim, self.block_q, self.block_k)


def v1_space(head_dim: int, smem_optin_bytes: int = 227 * 1024) -> list[V1Config]:
    """Every v1 forward config for `head_dim` that is structurally valid and fits in shared memory."""
    return _space(lambda bq, bk, w, s: _fitting(V1Config(head_dim, bq, bk, w, s), smem_optin_bytes),
                  (64, 128), (32, 64, 96, 128), (4, 8), (2, 3))


# The v1 kernel exists to be compared with v2, so its defaults use v2's default tile shapes
# (block_q x block_k); first that fits wins. At d=64 it takes 8 warps where v2 takes 4: v1 runs
# only batch*heads blocks, one per SM, and 4 warps of 32 rows sit at 255 registers.
_V1_DEFAULTS = {
    64: (V1Config(64, 128, 96, 8, 2), V1Config(64, 128, 64, 8, 2), V1Config(64, 64, 64, 4, 2)),
    128: (V1Config(128, 128, 128, 8, 2), V1Config(128, 128, 64, 8, 2), V1Config(128, 64, 64, 4, 2)),
}


def default_v1_config(head_dim: int, smem_optin_bytes: int = 227 * 1024) -> V1Config:
    return _first_fit(_V1_DEFAULTS, head_dim, smem_optin_bytes, "v1 forward")


def selectable_v1_configs() -> list[V1Config]:
    """v1 configs the package may pick without tuning (the CPU compile test asserts no spills)."""
    return sorted({c for cands in _V1_DEFAULTS.values() for c in cands})
