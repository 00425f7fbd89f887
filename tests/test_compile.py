"""Every selectable kernel config compiles with NVRTC for sm_80 and sm_90a, without a GPU (R15)."""
from __future__ import annotations

import shutil

import pytest

from cuflash import _compile, families, tiles
from cuflash.features import Features

ARCHS = ("sm_80", "sm_90a")
DTYPES = ("bfloat16", "float16")
# Shared memory a block may opt into: A100 (sm_80) and H100/H200 (sm_90).
SMEM_OPTIN = {"sm_80": 163 * 1024, "sm_90a": 227 * 1024}


def _nvrtc_available() -> bool:
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
        return True
    except Exception:  # noqa: BLE001
        return False


pytestmark = pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not loadable (install nvidia-cuda-nvrtc)")


def check_spill_free(cfg, dtype, arch, record_property):
    """Compile `cfg` for `arch`; assert no spills, no stack, registers that fit the block (any kernel)."""
    rep = _compile.compile_report(_compile.kernel_source(cfg, Features(dtype, cfg.head_dim)), arch)
    record_property("resources", {k: v for k, v in rep.items() if k != "log"} | {"smem_dynamic": cfg.smem_bytes})
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep["log"]
    assert rep["stack_bytes"] == 0, rep["log"]
    assert 0 < rep["registers"] <= 255
    assert rep["registers"] * cfg.threads <= 65536, "block needs more registers than an SM has"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", families.FWD.selectable(), ids=str)
def test_selectable_configs_compile_without_spills(cfg, dtype, arch, record_property):
    check_spill_free(cfg, dtype, arch, record_property)


def test_defaults_fit_each_arch():
    for arch, smem in SMEM_OPTIN.items():
        for d in tiles.SUPPORTED_HEAD_DIMS:
            cfg = families.FWD.default(d, smem)
            assert cfg.smem_bytes <= smem
            assert cfg in families.FWD.selectable()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("d", tiles.SUPPORTED_HEAD_DIMS)
def test_whole_search_space_compiles(d, arch):
    """Every config the tuner may try compiles (spills are allowed here: the tuner prunes them)."""
    space = families.FWD.space(d, SMEM_OPTIN[arch])
    assert len(space) >= 10
    table = []
    for cfg in space:
        rep = _compile.compile_report(_compile.kernel_source(cfg, Features("bfloat16", cfg.head_dim)), arch)
        table.append((cfg, rep["registers"], rep["spill_stores"]))
        assert rep["registers"] > 0
    print("\n".join(f"{arch} {c}: {r} regs, {s} B spilled" for c, r, s in table))


def test_source_carries_fingerprint_of_every_header(tmp_path, monkeypatch):
    """Editing an included header changes the generated source, so CuPy's disk cache cannot go stale."""
    cfg = families.FWD.default(128)
    src0 = _compile.kernel_source(cfg, Features("bfloat16", cfg.head_dim))
    assert _compile.source_fingerprint() in src0
    copy = tmp_path / "kernels_cu"
    shutil.copytree(_compile.kernel_dir(), copy)
    monkeypatch.setattr(_compile, "kernel_dir", lambda: copy)
    _compile.source_fingerprint.cache_clear()
    try:
        assert _compile.kernel_source(cfg, Features("bfloat16", cfg.head_dim)) == src0  # same bytes, same source
        with open(copy / "common.cuh", "a") as f:
            f.write("\n// edited\n")
        _compile.source_fingerprint.cache_clear()
        assert _compile.kernel_source(cfg, Features("bfloat16", cfg.head_dim)) != src0
    finally:
        _compile.source_fingerprint.cache_clear()


def test_invalid_config_is_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        _compile.kernel_source(tiles.FwdConfig(128, 128, 40, 4, 2), Features("bfloat16", 128))
    with pytest.raises(ValueError, match="block_q"):
        _compile.kernel_source(tiles.FwdConfig(128, 96, 64, 4, 2), Features("bfloat16", 128))


def test_kernel_names_are_distinct():
    names = {(_compile.kernel_name(c, Features(dt, c.head_dim))) for c in families.FWD.space(128) for dt in DTYPES}
    assert len(names) == 2 * len(families.FWD.space(128))
