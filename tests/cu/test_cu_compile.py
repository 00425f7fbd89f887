"""Every device harness in tests/cu/ compiles with NVRTC for sm_80 and sm_90a, on the CPU.

The GPU tests beside this file launch the harnesses; this one keeps them compiling against the
headers (same options as the library: cuflash._compile.nvrtc_options()) where no GPU is present.
"""
from __future__ import annotations

import re

import pytest

from cuflash import _compile
from tests.cu.harness import ARCHS, HERE, harness_names, harness_source
from tests.test_compile import _nvrtc_available

# The header each harness is about (the first include), and what it may include besides.
HARNESS_HEADERS = {
    "swizzle": ["core/swizzle.cuh"],
    "frag": ["core/frag.cuh"],
    "frag_mma": ["core/ptx_sm80.cuh", "core/convert.cuh"],  # the contract against mma.sync
    "mask": ["attn/mask.cuh"],
    "softmax": ["attn/softmax.cuh"],
    "dropout": ["attn/dropout.cuh"],
    "score_mod": ["attn/score_mod.cuh"],
}


def test_every_harness_is_known():
    assert harness_names() == sorted(HARNESS_HEADERS)


@pytest.mark.parametrize("name", sorted(HARNESS_HEADERS))
def test_harness_includes_only_its_header(name):
    includes = re.findall(r'^\s*#\s*include\s+"([^"]+)"', (HERE / f"{name}.cu").read_text(), flags=re.M)
    assert includes == HARNESS_HEADERS[name]
    assert all((_compile.kernel_dir() / inc).is_file() for inc in includes)


@pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not loadable (install nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(HARNESS_HEADERS))
def test_harness_compiles(name, arch):
    rep = _compile.compile_report(harness_source(name), arch)  # raises with NVRTC's log on error
    # The log can be empty: where the driver's compute cache (~/.nv/ComputeCache) already holds
    # the binary, NVRTC 13.0 skips ptxas and reports nothing (seen on an H200 host; a cold cache
    # or CUDA_CACHE_DISABLE=1 gives the ptxas lines). Resource checks apply only to a real log.
    log = rep["log"]
    if "ptxas info" in log:
        assert rep["registers"] > 0, log
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, log
    assert "warning" not in log.lower(), log
