"""The head dims beyond 64/128 (issue 12): every selectable tile of the sm80 families compiles without
spills as its column-masking instance (Features.partial_d: a call's head dim below the instantiated
one), and the dropout defaults of those instances stay within test_compile_dropout's allowances.
(The plain instances of every selectable tile, 32/96/256 included, are tests/test_compile*.py's.)"""
from __future__ import annotations

import pytest

from cuflash import _compile, families, tiles
from cuflash.features import Features
from tests.test_compile import ARCHS, _nvrtc_available, check_spill_free
from tests.test_compile_bwd import LAST_RESORT_SPILL_BOUND
from tests.test_compile_dropout import allowance

pytestmark = pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not loadable (install nvidia-cuda-nvrtc)")

SM80 = (families.FWD, families.FWD_V1, families.BWD, families.BWD_DQ)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg", [t for f in SM80 for t in f.selectable() if t not in LAST_RESORT_SPILL_BOUND], ids=str)
def test_partial_head_dim_instances_compile_without_spills(cfg, arch, record_property):
    f = Features("bfloat16", cfg.head_dim, partial_d=True)
    if families.of(cfg).avoids(cfg, f):  # marked: selection passes it over for these instances
        pytest.skip(f"{cfg} is marked spilling for partial_d (families' `spilling`)")
    rep = _compile.compile_report(_compile.kernel_source(cfg, f), arch)
    record_property("resources", {k: v for k, v in rep.items() if k != "log"})
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["stack_bytes"] == 0, rep["log"]


def _partial_dropout_defaults():
    out = []
    for d in tiles.SUPPORTED_HEAD_DIMS:
        f = Features("bfloat16", d, dropout=True, partial_d=True)
        out += [fam.default(d, features=f) for fam in SM80 if d in fam.defaults]
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg", _partial_dropout_defaults(), ids=str)
def test_partial_head_dim_dropout_defaults_compile(cfg, arch):
    f = Features("bfloat16", cfg.head_dim, dropout=True, partial_d=True)
    assert _compile.kernel_name(cfg, f).endswith("_drop_pd")
    rep = _compile.compile_report(_compile.kernel_source(cfg, f), arch)
    allowed = allowance(families.of(cfg).name, cfg.head_dim, "dropout+partial_d")
    assert rep["spill_stores"] <= allowed and rep["spill_loads"] <= allowed, rep["log"]


@pytest.mark.parametrize("d", tiles.SUPPORTED_HEAD_DIMS)
def test_new_head_dims_have_spill_free_defaults_on_each_arch(d, record_property):
    """The default an A100 (163 KB), an H100/H200 (227 KB) and a ~99 KB GPU (sm_86) pick for each
    head dim compiles spill-free for the arch, but the d192 / d256 backward's ~99 KB last resorts,
    whose spills tests/test_compile_bwd.py bounds."""
    for arch, smem in (("sm_80", 163 * 1024), ("sm_90a", 227 * 1024), ("sm_86", 99 * 1024)):
        for fam in SM80:
            if d not in fam.defaults:
                continue  # no v1 past d128
            cfg = fam.default(d, smem)
            if cfg in LAST_RESORT_SPILL_BOUND:
                continue
            assert cfg.smem_bytes <= smem
            check_spill_free(cfg, "float16", arch, record_property)
