"""Every selectable backward config compiles with NVRTC for sm_80 and sm_90a, without a GPU (R15)."""
from __future__ import annotations

import pytest

from cuflash import _compile, _configs
from tests.test_compile import ARCHS, DTYPES, SMEM_OPTIN, _nvrtc_available, check_spill_free

pytestmark = pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not loadable (install nvidia-cuda-nvrtc)")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", _configs.selectable_bwd_configs(), ids=str)
def test_selectable_bwd_configs_compile_without_spills(cfg, dtype, arch, record_property):
    check_spill_free(cfg, dtype, arch, record_property)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["bwd_prep", "bwd_dq_convert"])
@pytest.mark.parametrize("d", _configs.SUPPORTED_HEAD_DIMS)
def test_aux_kernels_compile(name, d, dtype, arch):
    src, _ = _compile.aux_source(name, dtype, d)
    rep = _compile.compile_report(src, arch)
    assert rep["spill_stores"] == 0 and rep["registers"] > 0


def test_bwd_defaults_fit_each_arch():
    for arch, smem in SMEM_OPTIN.items():
        for d in _configs.SUPPORTED_HEAD_DIMS:
            for cfg in (_configs.default_bwd_config(d, smem), _configs.default_dq_config(d, smem)):
                assert cfg.smem_bytes <= smem
                assert cfg in _configs.selectable_bwd_configs()


@pytest.mark.slow
@pytest.mark.parametrize("d", _configs.SUPPORTED_HEAD_DIMS)
def test_whole_backward_space_compiles(d):
    """Every bwd / dq config the tuner may try compiles for sm_90a (spills allowed: the tuner prunes them)."""
    space = _configs.bwd_space(d, SMEM_OPTIN["sm_90a"]) + _configs.dq_space(d, SMEM_OPTIN["sm_90a"])
    assert len(space) >= 10
    for cfg in space:
        assert _compile.compile_report(_compile.kernel_source(cfg, "bfloat16"), "sm_90a")["registers"] > 0


def test_kernel_names_are_unique_across_kernels():
    cfgs = [c for d in _configs.SUPPORTED_HEAD_DIMS
            for c in _configs.fwd_space(d) + _configs.bwd_space(d) + _configs.dq_space(d)]
    names = {_compile.kernel_name(c, dt) for c in cfgs for dt in DTYPES}
    assert len(names) == len(cfgs) * len(DTYPES)
