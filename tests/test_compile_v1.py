"""The v1 forward kernel (kernels_cu/flash_fwd_v1.cuh) compiles with NVRTC for sm_80 and sm_90a, without a GPU.

Every config of its space compiles; the selectable ones (defaults) have no spills. Also its config
class and the launch module's CPU-side behaviour.
"""
from __future__ import annotations

import numpy as np
import pytest

from cuflash import _compile, families
from cuflash.features import Features
from cuflash.tiles import V1Config

from tests.test_compile import ARCHS, DTYPES, SMEM_OPTIN, _nvrtc_available, check_spill_free

needs_nvrtc = pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not loadable (install nvidia-cuda-nvrtc)")


@needs_nvrtc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", families.FWD_V1.selectable(), ids=str)
def test_selectable_v1_configs_compile_without_spills(cfg, dtype, arch, record_property):
    check_spill_free(cfg, dtype, arch, record_property)


@needs_nvrtc
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("d", sorted(families.FWD_V1.defaults))
def test_whole_v1_space_compiles(d, arch):
    """Every v1 config of the space compiles (spills allowed: 4-warp, 32-row configs at d=128 spill, as in v2)."""
    space = families.FWD_V1.space(d, SMEM_OPTIN[arch])
    assert len(space) >= 10
    table = []
    for cfg in space:
        rep = _compile.compile_report(_compile.kernel_source(cfg, Features("bfloat16", cfg.head_dim)), arch)
        table.append((cfg, rep["registers"], rep["spill_stores"]))
        assert rep["registers"] > 0
    print("\n".join(f"{arch} {c}: {r} regs, {s} B spilled" for c, r, s in table))


@needs_nvrtc
def test_smem_formula_matches_the_kernel():
    """V1Config.smem_bytes equals FwdV1Shape::SMEM_BYTES for every config (static_assert under NVRTC)."""
    from cupy_backends.cuda.libs import nvrtc

    cfgs = families.FWD_V1.space(64) + families.FWD_V1.space(128)
    lines = [f"static_assert(cuflash::FwdV1Shape<{c.head_dim}, {c.block_q}, {c.block_k}, {c.warps}, {c.stages}>"
             f"::SMEM_BYTES == {c.smem_bytes}, \"{c}\");" for c in cfgs]
    src = '#include "flash_fwd_v1.cuh"\n' + "\n".join(lines) + "\n"
    prog = nvrtc.createProgram(src, "v1_smem_check.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(_compile.nvrtc_options(("--gpu-architecture=sm_80",))))
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)


def test_registered_and_named():
    fam = families.FWD_V1
    assert (fam.header, fam.template, fam.params) == ("flash_fwd_v1.cuh", "cuflash::flash_fwd_v1", "FwdParams")
    assert [n for _, n in fam.pointers] == ["q", "k", "v", "out", "lse", "ws_o", "ws_ml"]
    assert (_compile.kernel_dir() / "flash_fwd_v1.cuh").is_file()
    cfg = families.FWD_V1.default(128)
    src = _compile.kernel_source(cfg, Features("bfloat16", cfg.head_dim))
    assert '#include "flash_fwd_v1.cuh"' in src and "cuflash::flash_fwd_v1<true, 128, " in src
    assert _compile.kernel_name(cfg, Features("bfloat16", cfg.head_dim)).startswith("cuflash_fwd_v1_bf16_d128_")
    names = {_compile.kernel_name(c, Features(dt, c.head_dim)) for c in families.FWD_V1.space(128) for dt in DTYPES}
    assert len(names) == 2 * len(families.FWD_V1.space(128))
    # distinct from every v2 forward kernel name
    assert not names & {_compile.kernel_name(c, Features(dt, c.head_dim)) for c in families.FWD.space(128) for dt in DTYPES}


def test_v1_space_and_defaults():
    assert sorted(families.FWD_V1.defaults) == [32, 64, 96, 128]  # no d192, d256: every v1 tile spills there
    assert families.FWD_V1.space(256) == [] == families.FWD_V1.space(192)
    for limit in (99 * 1024, 163 * 1024, 227 * 1024):
        for d in families.FWD_V1.defaults:
            space = families.FWD_V1.space(d, limit)
            assert space
            assert all(c.smem_bytes <= limit and c.structural_problem() is None for c in space)
            cfg = families.FWD_V1.default(d, limit)
            assert cfg.fits(limit) and cfg in families.FWD_V1.selectable()
    assert V1Config(128, 128, 128, 8, 2).smem_bytes == 2 * 128 * (2 * 128 + 2 * 128) == 131072
    assert families.of(V1Config(128, 128, 128, 8, 2)) is families.FWD_V1
    # v1's defaults use v2's default tile shapes, so the comparison isolates the algorithm (not at
    # d96, where v1's 128x128 spills)
    for d in (32, 64, 128):
        v1, v2 = families.FWD_V1.default(d), families.FWD.default(d)
        assert (v1.block_q, v1.block_k) == (v2.block_q, v2.block_k)


def test_invalid_v1_config_is_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        _compile.kernel_source(V1Config(128, 128, 40, 8, 2), Features("bfloat16", 128))
    with pytest.raises(ValueError, match="block_q"):
        _compile.kernel_source(V1Config(128, 96, 64, 4, 2), Features("bfloat16", 128))
    with pytest.raises(ValueError, match="stages"):
        _compile.kernel_source(V1Config(128, 128, 64, 8, 1), Features("bfloat16", 128))


def test_forward_v1_validates_before_any_launch():
    """Non-CuPy inputs are refused with the v2 forward's messages (no GPU needed)."""
    from cuflash._forward_v1 import forward_v1, workspace_elements

    x = np.zeros((1, 8, 1, 64), dtype=np.float16)
    with pytest.raises(TypeError, match="q must be a CuPy array"):
        forward_v1(x, x, x)
    cfg = V1Config(128, 128, 64, 8, 2)
    assert workspace_elements(2, 3, 100, 64, cfg) == (1, 1)  # one K/V tile: no workspace traffic
    assert workspace_elements(2, 3, 100, 65, cfg) == (2 * 3 * 100 * 128, 2 * 3 * 100 * 2)


def _ptx(source: str, arch: str = "sm_90a") -> str:
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, "cuflash_shell.cu", [], [])
    try:
        nvrtc.compileProgram(prog, list(_compile.nvrtc_options((f"--gpu-architecture={arch}",))))
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return ptx if isinstance(ptx, str) else ptx.decode()


@needs_nvrtc
@pytest.mark.parametrize("fam", [families.FWD, families.FWD_V1], ids=lambda f: f.name)
def test_lse_rounding_is_pinned(fam):
    """lse = (m c + log2 l) ln 2 is written with .rn operations, which ptxas never re-contracts:
    one fma everywhere but in v1 at d = 128, where the rounded product m c is added (what the
    pre-restructure kernels compiled to, so their golden output bits hold; attn/softmax.cuh)."""
    for cfg in fam.selectable():
        ptx = _ptx(_compile.kernel_source(cfg, Features("bfloat16", cfg.head_dim)))
        fused = not (fam is families.FWD_V1 and cfg.head_dim == 128)
        lg2 = [i for i, line in enumerate(ptx.splitlines()) if "lg2.approx" in line]
        assert lg2, cfg
        for i in lg2:
            after = "\n".join(ptx.splitlines()[i + 1:i + 4])
            if fused:
                assert "fma.rn.ftz.f32" in after and "add.rn" not in after, (cfg, after)
            else:
                assert "mul.rn.ftz.f32" in "\n".join(ptx.splitlines()[i - 3:i + 4]) and "add.rn.ftz.f32" in after, (cfg, after)
