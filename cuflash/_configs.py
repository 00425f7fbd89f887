"""Kernel configurations: what a forward config is, which ones exist, which one runs by default.

A config fixes the compile-time constants of one kernel instance. The tuner (issue 4) searches the
space built here; the heuristic defaults below serve until a tuned table exists.
"""
from __future__ import annotations

import dataclasses
import itertools

SUPPORTED_HEAD_DIMS = (64, 128)
DTYPE_NAMES = ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True, order=True)
class FwdConfig:
    """Compile-time shape of the v2 forward kernel (kernels_cu/flash_fwd.cuh)."""

    head_dim: int
    block_q: int  # BR: query rows per thread block
    block_k: int  # BC: key rows per K/V tile
    warps: int  # warps per block; each owns block_q / warps query rows
    stages: int  # depth of the cp.async K/V ring

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def smem_bytes(self) -> int:
        # Q tile + STAGES x (K tile + V tile), 16-bit elements (mirrors FwdShape::SMEM_BYTES).
        return 2 * self.head_dim * (self.block_q + 2 * self.stages * self.block_k)

    def structural_problem(self) -> str | None:
        """Why this config can never compile (mirrors the static_asserts), or None."""
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            return f"head_dim {self.head_dim} not in {SUPPORTED_HEAD_DIMS}"
        if self.block_q % (16 * self.warps):
            return f"block_q {self.block_q} is not a multiple of 16*warps ({16 * self.warps})"
        if self.block_k % 16:
            return f"block_k {self.block_k} is not a multiple of 16"
        if self.stages < 2:
            return "stages must be >= 2"
        step = self.threads // (self.head_dim // 8)  # rows one pass of the tile copy covers
        if step % 8 or self.block_q % step or self.block_k % step:
            return f"tiles of {self.block_q}/{self.block_k} rows do not split into copy passes of {step} rows"
        return None

    def fits(self, smem_optin_bytes: int) -> bool:
        return self.structural_problem() is None and self.smem_bytes <= smem_optin_bytes


def fwd_space(head_dim: int, smem_optin_bytes: int = 227 * 1024) -> list[FwdConfig]:
    """Every forward config for `head_dim` that is structurally valid and fits in shared memory."""
    out = []
    for bq, bk, w, s in itertools.product((64, 128, 192), (32, 48, 64, 96, 128), (4, 8), (2, 3)):
        cfg = FwdConfig(head_dim, bq, bk, w, s)
        if cfg.fits(smem_optin_bytes):
            out.append(cfg)
    return out


# Heuristic defaults (before any tuning), in order of preference; the first that fits the device's
# shared memory wins. Measured on an H200 (docs/perf-notes.md, 2026-11-29): the fastest configs
# that compile with no register spills for sm_80 and sm_90a. Later entries serve GPUs with less
# shared memory (A100: 163 KB, L4 / RTX 4090: ~99 KB per block).
_DEFAULTS = {
    64: (FwdConfig(64, 128, 64, 4, 2), FwdConfig(64, 64, 64, 4, 2)),
    128: (FwdConfig(128, 128, 128, 8, 3), FwdConfig(128, 128, 128, 8, 2), FwdConfig(128, 128, 64, 8, 2),
          FwdConfig(128, 64, 64, 4, 2)),
}


def default_fwd_config(head_dim: int, smem_optin_bytes: int = 227 * 1024) -> FwdConfig:
    for cfg in _DEFAULTS[head_dim]:
        if cfg.fits(smem_optin_bytes):
            return cfg
    raise RuntimeError(f"no forward config for head_dim {head_dim} fits in {smem_optin_bytes} bytes of shared memory")


def selectable_fwd_configs() -> list[FwdConfig]:
    """Configs the package may pick at run time without tuning (the CPU compile test covers these)."""
    return sorted({c for cands in _DEFAULTS.values() for c in cands})
