"""Every selectable backward config compiles with NVRTC for sm_80 and sm_90a, without a GPU (R15)."""
from __future__ import annotations

import pytest

from cuflash import _compile, families, tiles
from cuflash.features import Features
from tests.test_compile import ARCHS, DTYPES, SMEM_OPTIN, _nvrtc_available, check_spill_free

pytestmark = pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not loadable (install nvidia-cuda-nvrtc)")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", (families.BWD.selectable() + families.BWD_DQ.selectable()), ids=str)
def test_selectable_bwd_configs_compile_without_spills(cfg, dtype, arch, record_property):
    check_spill_free(cfg, dtype, arch, record_property)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["bwd_prep", "bwd_dq_convert", "bwd_dkdv_reduce"])
@pytest.mark.parametrize("d", tiles.SUPPORTED_HEAD_DIMS)
def test_aux_kernels_compile(name, d, dtype, arch):
    src, _ = _compile.aux_source(name, dtype, d)
    rep = _compile.compile_report(src, arch)
    assert rep["spill_stores"] == 0 and rep["registers"] > 0


def test_bwd_defaults_fit_each_arch():
    for arch, smem in SMEM_OPTIN.items():
        for d in tiles.SUPPORTED_HEAD_DIMS:
            for cfg in (families.BWD.default(d, smem), families.BWD_DQ.default(d, smem)):
                assert cfg.smem_bytes <= smem
                assert cfg in (families.BWD.selectable() + families.BWD_DQ.selectable())


@pytest.mark.slow
@pytest.mark.parametrize("d", tiles.SUPPORTED_HEAD_DIMS)
def test_whole_backward_space_compiles(d):
    """Every bwd / dq config the tuner may try compiles for sm_90a (spills allowed: the tuner prunes them)."""
    space = families.BWD.space(d, SMEM_OPTIN["sm_90a"]) + families.BWD_DQ.space(d, SMEM_OPTIN["sm_90a"])
    assert len(space) >= 10
    for cfg in space:
        assert _compile.compile_report(_compile.kernel_source(cfg, Features("bfloat16", cfg.head_dim)), "sm_90a")["registers"] > 0


def test_kernel_names_are_unique_across_kernels():
    cfgs = [c for d in tiles.SUPPORTED_HEAD_DIMS
            for c in families.FWD.space(d) + families.BWD.space(d) + families.BWD_DQ.space(d)]
    names = {_compile.kernel_name(c, Features(dt, c.head_dim)) for c in cfgs for dt in DTYPES}
    assert len(names) == len(cfgs) * len(DTYPES)
