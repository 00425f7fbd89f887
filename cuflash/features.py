"""Features: the compile-time semantics of a call, as one hashable value.

A kernel family compiles one instance per (tile, features). Tiles are what the tuner varies;
features are what the caller asked for (dtype, head_dim, dropout, ...), and each one that changes
the kernel's inner loop, registers or addressing is a separate instantiation. `tag()` names the
variant in kernel names; `perf_class()` groups variants whose best tile is expected to differ,
and keys the tuned tables (tuning every feature combination is impossible, tuning per class is not).
"""
from __future__ import annotations

import dataclasses

# dtype name -> (kernel-name tag, the kernel template's BF16 argument)
_DTYPES = {"float16": ("f16", "false"), "bfloat16": ("bf16", "true")}
SUPPORTED_DTYPES = tuple(_DTYPES)
PERF_CLASSES = ("dense", "dropout")


@dataclasses.dataclass(frozen=True)
class Features:
    dtype: str  # "float16" | "bfloat16"
    head_dim: int
    dropout: bool = False  # fused Philox dropout: its own instantiation, so plain kernels carry no Philox code

    @property
    def dtype_tag(self) -> str:
        return _DTYPES[self.dtype][0]

    @property
    def bf16(self) -> str:
        """The template's BF16 argument (C++ bool literal)."""
        return _DTYPES[self.dtype][1]

    def tag(self) -> str:
        """The variant's suffix in kernel names ("" for the plain kernel, "_drop" with dropout)."""
        return "_drop" if self.dropout else ""

    def perf_class(self) -> str:
        """The tuning class: features that move the optimum get their own tuned tables."""
        return "dropout" if self.dropout else "dense"
