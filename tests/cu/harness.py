"""Loading the per-header device harnesses of tests/cu/ (one `<name>.cu` per kernels_cu header).

Each `tests/cu/<name>.cu` includes ONE kernels_cu header (and what that header includes) and
defines a few tiny `extern "C"` kernels that expose the header's functions to NumPy: fragment
data in, fragment data out, one warp per case. `test_cu_<name>.py` launches them through CuPy
on the GPU (`@pytest.mark.gpu`) and compares with a NumPy statement of the contract;
`test_cu_compile.py` compiles every harness for sm_80 and sm_90a with NVRTC on the CPU, so the
harnesses stay in step with the headers in CI without a GPU.

CuPy's kernel cache keys on the source string only, not on the headers it includes, so the
source handed to CuPy starts with the fingerprint of kernels_cu/ (as cuflash._compile does for
the real kernels): editing a header can never reuse a stale harness binary.
"""
from __future__ import annotations

import functools
import pathlib

import numpy as np

from cuflash import _compile

HERE = pathlib.Path(__file__).resolve().parent
ARCHS = ("sm_80", "sm_90a")


def harness_names() -> list[str]:
    """Every harness in tests/cu/ (the stems of its .cu files)."""
    return sorted(p.stem for p in HERE.glob("*.cu"))


def harness_source(name: str) -> str:
    """The source of harness `name`, prefixed with the kernels_cu fingerprint (see module doc)."""
    text = (HERE / f"{name}.cu").read_text("utf-8")
    return f"// cuflash test harness {name}; kernels_cu sources {_compile.source_fingerprint()}\n{text}"


@functools.lru_cache(maxsize=None)
def load(name: str):
    """cupy.RawModule of harness `name`, compiled with the library's NVRTC options (GPU only)."""
    import cupy

    return cupy.RawModule(code=harness_source(name), options=_compile.nvrtc_options())


def kernel(name: str, fn: str):
    return load(name).get_function(fn)


# ---------------------------------------------------------------------------------------------
# The m16n8 C-fragment contract (core/frag.cuh, kernels_cu/README.md) in NumPy, used by every
# test that moves dense tiles in and out of fragments.

def frag_row(lane, mt, e):
    """Row of register e of m16 tile mt held by `lane`: 16 mt + g + 8 (e / 2), g = lane / 4."""
    return 16 * mt + lane // 4 + 8 * (e // 2)


def frag_col(lane, nt, e):
    """Column of register e of n8 tile nt held by `lane`: 8 nt + 2 t + e % 2, t = lane % 4."""
    return 8 * nt + 2 * (lane % 4) + e % 2


def frag_index(mt_count: int, nt_count: int):
    """Index arrays (row, col), each of shape (32, MT, NT, 4): the element of a warp tile
    acc[MT][NT][4] that register [mt][nt][e] of each lane holds."""
    lane, mt, nt, e = np.meshgrid(np.arange(32), np.arange(mt_count), np.arange(nt_count), np.arange(4),
                                  indexing="ij")
    return frag_row(lane, mt, e), frag_col(lane, nt, e)
