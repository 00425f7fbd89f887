"""The Hopper forward's host side without a GPU: tensor-map geometry and preconditions (cuflash/tma.py),
the tile (Sm90FwdConfig), the family (families.FWD_SM90), its generated shell, its launch plan with
per-call descriptors, and the forward's backend dispatch (families.choose) with recorded device
properties."""
from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import sys
import types

import numpy as np
import pytest

from cuflash import _compile, _forward, _forward_sm90, device, families, launch, params, problem, tma
from cuflash.device import DeviceProps
from cuflash.features import Features
from cuflash.mask import CAUSAL
from cuflash.tiles import FwdConfig, Sm90FwdConfig, V1Config

FIX = pathlib.Path(__file__).parent / "fixtures" / "devices"
H200 = DeviceProps.from_json(FIX / "h200.json")
A100 = DeviceProps.from_json(FIX / "a100-80gb.json")
B200 = dataclasses.replace(H200, name="NVIDIA B200", cc=(10, 0))  # sm_90a code does not run there


def dense(shape, itemsize=2):
    strides, acc = [], itemsize
    for n in reversed(shape):
        strides.insert(0, acc)
        acc *= n
    return tuple(strides)


def info(shape, strides=None, dtype="bfloat16", ptr=1 << 20):
    return problem.ArrayInfo(tuple(shape), dtype, 2, strides or dense(shape), ptr, 0)


def fwd_problem(q=None, k=None, v=None, dropout=None, d=128, dtype="bfloat16"):
    q = q or info((2, 100, 3, d), dtype=dtype)
    k = k or info((2, 300, 3, d), dtype=dtype)
    v = v or info((2, 300, 3, d), dtype=dtype)
    return problem.resolve_forward(q, k, v, CAUSAL, None, dropout)


# ------------------------------------------------------------------------------- tensor maps

def test_map_geometry_of_a_contiguous_tensor():
    b, n, h, d = 2, 1000, 16, 128
    g = tma.map_geometry((b, n, h, d), dense((b, n, h, d)), "bfloat16", 128)
    assert g.data_type == 9
    assert g.dims == (64, n, 2, h, b)
    assert g.strides == (h * d * 2, 128, d * 2, n * h * d * 2)
    assert g.box == (64, 128, 2, 1, 1)
    assert tma.map_geometry((b, n, h, 64), dense((b, n, h, 64)), "float16", 176).box == (64, 176, 1, 1, 1)
    assert tma.map_geometry((b, n, h, 64), dense((b, n, h, 64)), "float16", 176).data_type == 6


def test_map_geometry_of_packed_qkv_slices_and_transposed_views():
    b, n, h, d = 2, 300, 4, 128
    packed = dense((b, n, 3, h, d))  # q = qkv[:, :, 0]: strides (sb, sn, sh, 1) of the packed array
    q_strides = (packed[0], packed[1], packed[3], packed[4])
    g = tma.map_geometry((b, n, h, d), q_strides, "bfloat16", 128)
    assert g.strides == (3 * h * d * 2, 128, d * 2, n * 3 * h * d * 2)
    assert tma.layout_problem((b, n, h, d), q_strides, "bfloat16", 2, "q") is None
    # (B, H, S, D) memory seen as (B, S, H, D): transpose(0, 2, 1, 3)
    bhsd = dense((b, h, n, d))
    view = (bhsd[0], bhsd[2], bhsd[1], bhsd[3])
    g = tma.map_geometry((b, n, h, d), view, "bfloat16", 64)
    assert g.strides == (d * 2, 128, n * d * 2, h * n * d * 2)
    assert tma.layout_problem((b, n, h, d), view, "bfloat16", 2, "k") is None


def test_map_geometry_of_a_column_masking_instance():
    """The rank-4 form (a head dim below the instance's: partial_d): the call's columns as dim 0,
    one 64-column box per load; any multiple of 8 columns (16-byte rows), where the chunked form
    needs whole 64-column chunks."""
    b, n, h, d = 2, 1000, 16, 160
    g = tma.map_geometry((b, n, h, d), dense((b, n, h, d)), "bfloat16", 112, partial=True)
    assert g.dims == (d, n, h, b) and g.box == (64, 112, 1, 1)
    assert g.strides == (h * d * 2, d * 2, n * h * d * 2)
    assert tma.layout_problem((b, n, h, d), dense((b, n, h, d)), "bfloat16", 2, "q", partial=True) is None
    assert "not a multiple of 64" in tma.layout_problem((b, n, h, d), dense((b, n, h, d)), "bfloat16", 2, "q")
    # a column-masking problem's maps take that form (q / k 160, run on the d192 instance)
    p = fwd_problem(d=160)
    assert p.features.partial_d and p.features.head_dim == 192
    assert tma.tensors_problem(p) is None
    from cuflash import _forward_sm90, families

    cfg = families.FWD_SM90.default(192)
    gq, gk, gv = _forward_sm90.geometries(p, cfg)
    assert gq.dims == (160, 100, 3, 2) and gq.box == (64, cfg.block_q, 1, 1)
    assert gk.dims == gv.dims == (160, 300, 3, 2) and gk.box == (64, cfg.block_k, 1, 1)


def test_extent_one_dimensions_take_dense_strides():
    # frameworks leave the stride of an extent-1 dimension arbitrary (0 here): it is never stepped along
    shape = (1, 1, 2, 64)
    g = tma.map_geometry(shape, (0, 0, 128, 2), "bfloat16", 64)
    assert g.strides == (2 * 64 * 2, 128, 128, 2 * 64 * 2)
    assert tma.layout_problem(shape, (0, 0, 128, 2), "bfloat16", 2) is None


@pytest.mark.parametrize("shape,strides,kw,words", [
    ((2, 10, 3, 128), (0, 768, 256, 2), {}, "batch stride is 0 bytes; TMA needs positive strides"),
    ((2, 10, 3, 128), (7680, 768, 0, 2), {}, "heads stride is 0 bytes"),  # k broadcast over heads
    ((2, 10, 3, 128), (7680, -768, 256, 2), {}, "seqlen stride is -768 bytes"),
    ((2, 10, 3, 128), (7680, 776, 256, 2), {}, "seqlen stride (776 bytes) is not a multiple of 16"),
    ((2, 10, 3, 128), (1 << 40, 768, 256, 2), {}, "batch stride (1099511627776 bytes) is not below 2^40"),
    ((2, 10, 3, 128), (7680, 768, 256, 4), {}, "not contiguous in head_dim"),
    ((2, 10, 3, 96), (5760, 576, 192, 2), {}, "head_dim 96 is not a multiple of 64"),
    ((2, 10, 3, 128), (7680, 768, 256, 2), {"ptr": 8}, "data pointer is not 16-byte aligned"),
    ((2, 10, 3, 128), (7680, 768, 256, 2), {"dtype": "float32"}, "dtype float32"),
])
def test_layout_problems_name_the_tensor_and_the_reason(shape, strides, kw, words):
    why = tma.layout_problem(shape, strides, kw.get("dtype", "bfloat16"), 2, "k", ptr=kw.get("ptr"))
    assert why is not None and why.startswith("k") and words in why


def test_call_problem_checks_q_k_v_of_a_problem(monkeypatch):
    monkeypatch.setattr(tma, "bindings_problem", lambda: None)
    assert tma.call_problem(fwd_problem()) is None
    b, n, h, d = 2, 300, 3, 128
    bcast = info((b, n, h, d), (n * d * 2, d * 2, 0, 2))  # one head's k shared by all heads (expand)
    assert "v's heads stride is 0 bytes" in tma.call_problem(fwd_problem(v=bcast))
    monkeypatch.setattr(tma, "bindings_problem", lambda: "cuda-bindings is not installed")
    assert tma.call_problem(fwd_problem()) == "cuda-bindings is not installed"


def test_missing_cuda_bindings_is_named(monkeypatch):
    tma._driver.cache_clear()
    tma.bindings_problem.cache_clear()
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # import fails
    try:
        why = tma.bindings_problem()
        assert why and "cuda-bindings" in why and "pip install" in why
        with pytest.raises(ImportError, match="cuda-bindings"):
            tma.encode(tma.map_geometry((1, 8, 1, 64), dense((1, 8, 1, 64)), "bfloat16", 64), 1 << 20)
    finally:
        tma._driver.cache_clear()
        tma.bindings_problem.cache_clear()


class FakeDriver:
    """cuda.bindings.driver's calls that tma.encode makes, recording the arguments."""

    class CUresult:
        CUDA_SUCCESS = 0

    def __init__(self, err=0):
        import ctypes

        self.calls, self.err = [], err
        self.buf = ctypes.create_string_buffer(bytes(range(128)), 128)
        for name in ("CUtensorMapDataType", "CUtensorMapInterleave", "CUtensorMapSwizzle", "CUtensorMapL2promotion",
                     "CUtensorMapFloatOOBfill", "cuuint64_t", "cuuint32_t"):
            setattr(self, name, lambda x, n=name: (n, int(x)))

    def cuTensorMapEncodeTiled(self, *args):
        import ctypes

        self.calls.append(args)
        addr = ctypes.addressof(self.buf)
        return self.err, types.SimpleNamespace(getPtr=lambda: addr)


def test_encode_passes_the_geometry_and_returns_the_128_bytes(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(tma, "_driver", lambda: fake)
    g = tma.map_geometry((2, 100, 3, 128), dense((2, 100, 3, 128)), "float16", 128)
    m = tma.encode(g, 0x7F0000001000)
    assert m.dtype == tma.MAP_DTYPE and m.shape == (1,) and m.nbytes == 128 and m.dtype.itemsize == 128
    assert m.tobytes() == bytes(range(128))
    [(dtype, rank, ptr, dims, strides, box, estrides, inter, swz, l2, oob)] = fake.calls
    assert (dtype, rank, ptr) == (("CUtensorMapDataType", 6), 5, 0x7F0000001000)
    assert [x[1] for x in dims] == list(g.dims) and [x[1] for x in strides] == list(g.strides)
    assert [x[1] for x in box] == list(g.box) and [x[1] for x in estrides] == [1] * 5
    assert (inter[1], swz[1], l2[1], oob[1]) == (0, 3, 2, 0)
    monkeypatch.setattr(tma, "_driver", lambda: FakeDriver(err=1))
    with pytest.raises(RuntimeError, match="cuTensorMapEncodeTiled failed"):
        tma.encode(g, 0x1000)


def test_enum_values_match_cuda_bindings():
    cu = pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings not installed")
    assert int(cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16) == tma.DATA_TYPES["bfloat16"]
    assert int(cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16) == tma.DATA_TYPES["float16"]
    assert int(cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B) == tma.SWIZZLE_128B
    assert int(cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B) == tma.L2_PROMOTION_L2_128B
    assert int(cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE) == tma.INTERLEAVE_NONE
    assert int(cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == tma.OOB_FILL_NONE


def test_map_cache_encodes_once_per_pointer_and_keeps_the_last_few():
    seen = []
    cache = tma.MapCache("geometry", size=2, encoder=lambda g, p: seen.append(p) or (g, p))
    assert cache.get(16) == ("geometry", 16) and cache.get(16) == ("geometry", 16) and seen == [16]
    cache.get(32)
    cache.get(48)  # evicts 16, the oldest
    assert len(cache) == 2 and seen == [16, 32, 48]
    cache.get(16)
    assert seen == [16, 32, 48, 16]


# ------------------------------------------------------------------------------------ the tile

def test_tile_fields_are_the_template_arguments():
    t = Sm90FwdConfig(128, 176, 2, 2, 1, 0, 1, 0)  # (not a valid tile: pingpong needs overlap)
    assert t.template_args() == (128, 176, 2, 2, 1, 0, 1)
    assert Sm90FwdConfig.axes() == ("block_k", "consumers", "stages", "pingpong", "overlap", "q_stages", "persistent")
    assert Sm90FwdConfig(128, 176, 2, 2, 1, 1, 1, 1).template_args() == (128, 176, 2, 2, 1, 1, 1)  # persistent: host-only
    assert (t.block_q, t.threads) == (128, 384)
    assert Sm90FwdConfig(64, 64, 3, 2, 1, 1, 1, 0).threads == 512
    assert t.tag() == "d128_bc176_c2_s2_pp1_ov0_q1_p0" and t.label() == "128x176 c2 s2 pp1 ov0 q1 p0"
    assert t.launch_bounds() == "__launch_bounds__(384, 1)"
    assert FwdConfig(128, 128, 128, 8, 3).launch_bounds() == "__launch_bounds__(256)"


def test_smem_is_q_and_the_kv_ring_and_two_spare_kib():
    # Q 128x128 + 2 stages x (K + V) 128x128, bf16: 160 KiB; + 1 KiB alignment, + 1 KiB barriers
    assert Sm90FwdConfig(128, 128, 2, 2, 1, 1, 1, 0).smem_bytes == 2 * 128 * (128 + 4 * 128) + 2048 == 165888
    assert Sm90FwdConfig(64, 192, 3, 2, 0, 0, 1, 0).smem_bytes == 2 * 64 * (192 + 4 * 192) + 2048
    assert Sm90FwdConfig(128, 192, 2, 2, 1, 1, 1, 0).smem_bytes <= 227 * 1024  # the largest d128 tile fits an H200


@pytest.mark.parametrize("tile,words", [
    (Sm90FwdConfig(96, 128, 2, 2, 0, 0, 1, 0), "head_dim 96"),
    (Sm90FwdConfig(128, 128, 4, 2, 0, 0, 1, 0), "consumers must be 1, 2 or 3"),
    (Sm90FwdConfig(128, 120, 2, 2, 0, 0, 1, 0), "block_k must be a multiple of 16"),
    (Sm90FwdConfig(128, 48, 2, 2, 0, 0, 1, 0), "block_k must be a multiple of 16 in [64, 256]"),
    (Sm90FwdConfig(128, 272, 2, 2, 0, 0, 1, 0), "block_k must be a multiple of 16 in [64, 256]"),
    (Sm90FwdConfig(128, 128, 2, 5, 0, 0, 1, 0), "stages must be 2, 3 or 4"),
    (Sm90FwdConfig(128, 128, 2, 2, 2, 1, 1, 0), "pingpong and overlap are 0 or 1"),
    (Sm90FwdConfig(128, 128, 2, 2, 1, 1, 1, 3), "persistent must be 0"),
    (Sm90FwdConfig(128, 128, 1, 2, 1, 1, 1, 0), "pingpong needs at least 2 consumer warpgroups"),
    (Sm90FwdConfig(128, 128, 2, 2, 1, 0, 1, 0), "pingpong needs at least 2 consumer warpgroups and the overlapped loop"),
])
def test_structural_problems(tile, words):
    why = tile.structural_problem()
    assert why is not None and words in why
    with pytest.raises(ValueError, match="invalid fwd_sm90 config"):
        _compile.kernel_source(tile, Features("bfloat16", tile.head_dim))


def test_structurally_valid_tiles():
    for t in (Sm90FwdConfig(64, 64, 1, 4, 0, 1, 1, 0), Sm90FwdConfig(128, 256, 2, 2, 1, 1, 1, 0), Sm90FwdConfig(64, 64, 3, 3, 1, 1, 1, 0)):
        assert t.structural_problem() is None, t


# ---------------------------------------------------------------------------------- the family

def test_family_is_registered():
    f = families.FWD_SM90
    assert families.REGISTRY["fwd_sm90"] is f and families.get("fwd_sm90") is f
    assert families.of(Sm90FwdConfig(128, 128, 2, 2, 1, 1, 1, 0)) is f
    assert families.FORWARDS == (families.FWD_SM90, families.FWD)
    assert (f.backend, families.FWD.backend, families.FWD_V1.backend) == ("sm90", "sm80", "sm80")
    assert f.arch_specific and f.nvrtc_arch(H200) == "sm_90a" and f.min_cc == f.max_cc == (9, 0)
    assert f.pass_ == "forward" and f.params == "FwdParams" and f.plan is not None and f.run is not None
    assert [n for _, n in f.pointers] == ["tq", "tk", "tv", "out", "lse", "tile_counter"]


def test_defaults_are_selectable_and_implementable_on_hopper():
    f = families.FWD_SM90
    for d in (64, 128):
        assert f.default(d, H200.smem_optin) == f.defaults[d][0]
        dropout = Features("bfloat16", d, True)  # the first default that does not spill for dropout
        assert f.default(d, H200.smem_optin, dropout) == next(t for t in f.defaults[d] if not f.avoids(t, dropout))
        class_tiles = [t for table in f.class_defaults.values() for t in table.get(d, ())]
        for t in (*f.defaults[d], *class_tiles):
            assert t in f.space(d, H200.smem_optin) and f.can_implement(t, H200) is None
    assert f.selectable() == sorted({t for table in (f.defaults, *f.class_defaults.values())
                                     for ts in table.values() for t in ts})


def test_register_estimate_uses_the_consumer_budget():
    f = families.FWD_SM90
    t = Sm90FwdConfig(128, 176, 2, 2, 1, 1, 1, 0)
    assert f.accumulator_registers(t) == 88 + 44 + 64  # S, P, O of 64 rows over 128 threads
    assert f.register_cap(t, H200) == 240 - 24
    assert f.register_cap(Sm90FwdConfig(64, 64, 3, 2, 1, 1, 1, 0), H200) == 160 - 24
    assert f.register_cap(Sm90FwdConfig(64, 64, 1, 2, 0, 0, 1, 0), H200) == 255 - 24
    assert f.can_implement(t, H200) is None
    assert f.can_implement(Sm90FwdConfig(128, 192, 2, 2, 1, 1, 1, 0), H200) is None  # 96 + 48 + 64 = 208 <= 216
    assert f.can_implement(Sm90FwdConfig(64, 128, 3, 2, 1, 1, 1, 0), H200) is None  # 64 + 32 + 32 = 128 <= 136
    why = f.can_implement(Sm90FwdConfig(64, 192, 3, 2, 1, 1, 1, 0), H200)  # 96 + 48 + 32 = 176 > 136
    assert why and "176 registers per thread > 136" in why
    # the sm80 families keep ptxas' cap for their block size
    assert families.FWD.register_cap(FwdConfig(128, 128, 128, 8, 2), H200) == families.register_cap(256, H200)


@pytest.mark.parametrize("props,words", [(A100, "compute capability 8.0 < 9.0"),
                                         (B200, "compute capability 10.0 > 9.0 (wgmma and setmaxnreg are sm_90a-only")])
def test_only_compute_capability_9_0_runs_it(props, words):
    f = families.FWD_SM90
    assert words in f.device_problem(props)
    assert words in f.can_implement(f.defaults[128][0], props)
    assert families.FWD.device_problem(props) is None
    assert f.device_problem(H200) is None


def test_kernel_source_declares_the_maps_by_value_and_launch_bounds_for_setmaxnreg():
    t = Sm90FwdConfig(128, 128, 2, 2, 1, 1, 1, 0)
    src = _compile.kernel_source(t, Features("bfloat16", 128, True))
    name = _compile.kernel_name(t, Features("bfloat16", 128, True))
    assert name == "cuflash_fwd_sm90_bf16_d128_bc128_c2_s2_pp1_ov1_q1_p0_drop"
    assert '#include "flash_fwd_sm90.cuh"' in src
    assert (f'extern "C" __global__ void __launch_bounds__(384, 1) {name}(const __grid_constant__ cuflash::TmaMap tq, '
            "const __grid_constant__ cuflash::TmaMap tk, const __grid_constant__ cuflash::TmaMap tv, "
            "cuflash::elem_t* __restrict__ out, float* __restrict__ lse, int* tile_counter, long long q_sb_, ") in src
    assert "cuflash::flash_fwd_sm90<true, 128, 128, 2, 2, 1, 1, 1, cuflash::Variant<true, false, false, false, false, false, false, false, false, false, false, false, false>>(tq, tk, tv, out, lse, tile_counter, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, p);" in src
    decl = ", ".join(f"{ctype} {f}_" for f, ctype in params.fields("FwdParams"))
    assert decl + ") {" in src
    # the sm80 shells keep their single-argument launch bounds
    assert "__launch_bounds__(256) cuflash_fwd_bf16" in _compile.kernel_source(FwdConfig(128, 128, 128, 8, 3),
                                                                               Features("bfloat16", 128))


# ------------------------------------------------------------------------------ the launch plan

class Recorder:
    def __init__(self, calls):
        self.calls = calls

    def __call__(self, grid, block, args, shared_mem=0):
        self.calls.append((grid, block, args, shared_mem))


@pytest.fixture
def calls(monkeypatch):
    cupy = pytest.importorskip("cupy")
    rec = []
    monkeypatch.setattr(_compile, "get_kernel", lambda cfg, f, dev: Recorder(rec))
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=None: ("alloc", tuple(shape), np.dtype(dtype).name))
    monkeypatch.setattr(launch, "_capturing", lambda: False)  # no GPU: no capture
    monkeypatch.setattr(cupy.cuda, "Device", lambda d: contextlib.nullcontext())
    return rec


def arr(ptr):
    return types.SimpleNamespace(data=types.SimpleNamespace(ptr=ptr))


def test_plan_binds_fresh_maps_per_pointer(calls):
    p = fwd_problem(dropout=problem.resolve_dropout(0.1, 3))
    cfg = Sm90FwdConfig(128, 128, 2, 2, 1, 1, 1, 0)
    encoded = []
    plan = _forward_sm90.plan(p, cfg, np.float16, encoder=lambda g, ptr: encoded.append((g, ptr)) or f"map@{ptr:#x}")
    q, k, v = arr(0x1000), arr(0x2000), arr(0x3000)
    out, lse = plan.run((q, k, v, None, None), p.dropout.kernel_args)
    assert out == ("alloc", (2, 100, 3, 128), "float16") and lse == ("alloc", (2, 3, 100), "float32")
    [(grid, block, args, smem)] = calls
    m_blocks = -(-100 // 128)
    assert grid == (m_blocks * 3 * 2,) and block == (384,) and smem == cfg.smem_bytes
    assert args[:6] == ("map@0x1000", "map@0x2000", "map@0x3000", out, lse, launch.NULL)  # no tile counter: persistent 0
    f = params.unpack(args[6:], "FwdParams")  # the sm80 forward's struct, as pack_fwd makes it
    assert int(f["m_blocks"]) == m_blocks and (int(f["heads"]), int(f["seqlen_q"]), int(f["seqlen_k"])) == (3, 100, 300)
    assert (f["drop_seed"], f["drop_threshold"], f["drop_scale"]) == p.dropout.kernel_args
    gq, gk, gv = (g for g, _ in encoded)
    assert gq.box == (64, 128, 2, 1, 1) and gk.box == gv.box == (64, 128, 2, 1, 1)
    assert gq.dims == (64, 100, 2, 3, 2) and gk.dims == (64, 300, 2, 3, 2)
    # same pointers: no encoding; a new q pointer: one
    plan.run((q, k, v, "out", "lse"), p.dropout.kernel_args)
    assert len(encoded) == 3 and calls[-1][2][:5] == ("map@0x1000", "map@0x2000", "map@0x3000", "out", "lse")
    plan.run((arr(0x4000), k, v, "out", "lse"), p.dropout.kernel_args)
    assert len(encoded) == 4 and calls[-1][2][0] == "map@0x4000"


def test_run_external_binds_maps_of_plain_int_pointers(calls):
    """The torch direct path (Plan.run_external) hands the caller's pointers as ints, and its
    allocations' as ints: the TMA bind encodes maps of those addresses (launch.address)."""
    p = fwd_problem()
    cfg = Sm90FwdConfig(128, 128, 2, 2, 1, 1, 1, 0)
    encoded = []
    plan = _forward_sm90.plan(p, cfg, np.float16, encoder=lambda g, ptr: encoded.append(ptr) or f"map@{ptr:#x}")
    made = []

    def empty(shape, dtype):
        made.append(shape)
        return f"t{len(made)}", 0x9000 * len(made)

    out, lse = plan.run_external([0x1000, 0x2000, 0x3000], empty, 0)
    assert (out, lse) == ("t1", "t2") and encoded == [0x1000, 0x2000, 0x3000]
    [(_, _, args, _)] = calls
    assert args[:5] == ("map@0x1000", "map@0x2000", "map@0x3000", 0x9000, 0x12000)
    from cuflash.launch import Ptr

    plan.run_external([Ptr(0x1000), Ptr(0x2000), Ptr(0x4000)], empty, 0)  # Ptr slots: the same maps
    assert encoded == [0x1000, 0x2000, 0x3000, 0x4000]

def test_drawn_tile_order_gets_a_counter_per_stream(calls, monkeypatch):
    """persistent 2: a persistent grid whose CTAs draw tiles from an int after lse, a word of
    cuflash/stream_scratch.py per (device, stream) (the kernel leaves it at 0); persistent 0 and 1
    pass null."""
    from cuflash import stream_scratch

    given = {}
    monkeypatch.setattr(stream_scratch, "reserve", lambda dev: given.setdefault("reserved", dev))
    monkeypatch.setattr(stream_scratch, "words", lambda dev, s, name, n=1: given.setdefault((dev, s, name, n), f"w{len(given)}"))
    cupy = pytest.importorskip("cupy")
    stream = types.SimpleNamespace(ptr=0x77)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: stream)
    monkeypatch.setattr(_forward_sm90.device, "query", lambda i=0: H200)
    p = fwd_problem()
    cfg = Sm90FwdConfig(128, 128, 2, 2, 1, 1, 1, 2)
    plan = _forward_sm90.plan(p, cfg, np.float16, encoder=lambda g, ptr: f"map@{ptr:#x}")
    assert given == {"reserved": p.device}  # the pool made when the plan is built
    q, k, v = arr(0x1000), arr(0x2000), arr(0x3000)
    for _ in range(2):
        plan.run((q, k, v, "out", "lse"))
    assert [c[2][5] for c in calls] == ["w1", "w1"] and (p.device, 0x77, "tile_counter", 1) in given
    assert calls[0][0] == (min(1 * 3 * 2, H200.sm_count),)
    stream.ptr = 0x88  # another stream: its own word
    plan.run((q, k, v, "out", "lse"))
    assert calls[-1][2][5] == "w2"
    strided = _forward_sm90.plan(p, dataclasses.replace(cfg, persistent=1), np.float16, encoder=lambda g, ptr: "m")
    strided.run((q, k, v, "out", "lse"))
    assert calls[-1][2][5] is launch.NULL and len(given) == 3


def test_varlen_calls_draw_their_tiles(monkeypatch):
    """A variable-length call runs the dense call's tile (its tuned one here) with the drawn order
    (FWD_SM90.varlen_tile); dense calls and the sm80 family keep the tile as chosen."""
    from cuflash import _tuned, device

    monkeypatch.setattr(device, "supported", lambda i=0: H200)
    tuned = Sm90FwdConfig(128, 176, 2, 2, 0, 1, 1, 1)
    monkeypatch.setattr(_tuned, "lookup", lambda fam, p, props: tuned if fam is families.FWD_SM90 else None)
    call = lambda **kw: types.SimpleNamespace(device=0, causal=False, features=Features("bfloat16", 128, **kw))  # noqa: E731
    assert families.select(families.FWD_SM90, call(varlen=True)) == dataclasses.replace(tuned, persistent=2)
    assert families.select(families.FWD_SM90, call()) == tuned
    assert families.select(families.FWD, call(varlen=True)) == families.select(families.FWD, call())


def test_untuned_causal_calls_draw_their_tiles(monkeypatch):
    """Where no tuned tile applies, a causal call runs the default with the drawn order
    (FWD_SM90.causal_tile, what every tuned causal entry of the H200 table chose); a tuned tile and
    a call without the causal mask keep the tile as chosen."""
    from cuflash import _tuned, device

    monkeypatch.setattr(device, "supported", lambda i=0: H200)
    call = lambda causal, **kw: types.SimpleNamespace(device=0, causal=causal, features=Features("bfloat16", 128, **kw))  # noqa: E731
    monkeypatch.setattr(_tuned, "lookup", lambda fam, p, props: None)
    default = families.FWD_SM90.default(128, H200.smem_optin, Features("bfloat16", 128))
    assert default.persistent != 2
    assert families.select(families.FWD_SM90, call(True)) == dataclasses.replace(default, persistent=2)
    assert families.select(families.FWD_SM90, call(False)) == default
    tuned = Sm90FwdConfig(128, 176, 2, 2, 0, 1, 1, 1)
    monkeypatch.setattr(_tuned, "lookup", lambda fam, p, props: tuned)
    assert families.select(families.FWD_SM90, call(True)) == tuned


def test_plan_boxes_follow_the_tile():
    p = fwd_problem(d=64)
    gq, gk, gv = _forward_sm90.geometries(p, Sm90FwdConfig(64, 176, 3, 2, 1, 1, 1, 0))
    assert gq.box == (64, 192, 1, 1, 1) and gk.box == gv.box == (64, 176, 1, 1, 1)


def test_plan_refuses_tensors_tma_cannot_describe(calls):
    b, n, h, d = 2, 300, 3, 128
    p = fwd_problem(k=info((b, n, h, d), (n * d * 2, d * 2, 0, 2)))
    with pytest.raises(ValueError, match="k's heads stride is 0 bytes"):
        _forward_sm90.plan(p, Sm90FwdConfig(128, 128, 2, 2, 1, 1, 1, 0), np.float16, encoder=lambda g, ptr: None)


def test_sm80_plans_keep_the_gather_free_fast_path(calls):
    plan = families.FWD.plan(fwd_problem(), FwdConfig(128, 128, 64, 8, 2), np.float16)
    assert plan._launches[0][4] is None  # take None: the slots are the kernel's pointers


# ------------------------------------------------------------------------------------ dispatch

@pytest.fixture
def bindings(monkeypatch):
    """cuda-bindings present (the default here) or missing (set .missing)."""
    state = types.SimpleNamespace(missing=None)
    monkeypatch.setattr(tma, "bindings_problem", lambda: state.missing)
    monkeypatch.delenv(families.BACKEND_ENV, raising=False)
    return state


def choose(props, backend=None, p=None, candidates=families.FORWARDS):
    return families.choose(candidates, p or fwd_problem(), backend, props)


def test_auto_prefers_sm90_on_hopper_and_sm80_elsewhere(bindings):
    assert choose(H200) is families.FWD_SM90
    assert choose(A100) is families.FWD is choose(B200)
    for d, dtype in ((64, "float16"), (128, "bfloat16")):
        assert choose(H200, p=fwd_problem(d=d, dtype=dtype)) is families.FWD_SM90
    assert choose(H200, p=fwd_problem(dropout=problem.resolve_dropout(0.2, 1))) is families.FWD_SM90


def test_auto_falls_back_when_tma_cannot_take_the_call(bindings):
    b, n, h, d = 2, 300, 3, 128
    bcast = info((b, n, h, d), (n * d * 2, d * 2, 0, 2))
    assert choose(H200, p=fwd_problem(k=bcast)) is families.FWD
    bindings.missing = "cuda-bindings is not installed: pip install ..."
    assert choose(H200) is families.FWD


def test_forced_backends(bindings):
    assert choose(H200, "sm80") is families.FWD
    assert choose(H200, "sm90") is families.FWD_SM90
    assert choose(A100, "sm80") is families.FWD
    with pytest.raises(ValueError, match=r"backend='sm90' cannot run this call on NVIDIA A100.*compute capability 8\.0"):
        choose(A100, "sm90")
    b, n, h, d = 2, 300, 3, 128
    with pytest.raises(ValueError, match="backend='sm90' cannot run this call.*k's heads stride is 0 bytes"):
        choose(H200, "sm90", p=fwd_problem(k=info((b, n, h, d), (n * d * 2, d * 2, 0, 2))))
    bindings.missing = "cuda-bindings is not installed"
    with pytest.raises(ValueError, match="cuda-bindings is not installed"):
        choose(H200, "sm90")
    for bad in ("sm100", "SM90", 90, ""):
        with pytest.raises(ValueError, match="backend must be None, 'sm80' or 'sm90'"):
            choose(H200, bad)


def test_environment_variable_sets_the_default_and_the_argument_wins(bindings, monkeypatch):
    monkeypatch.setenv("CUFLASH_BACKEND", "sm80")
    assert choose(H200) is families.FWD
    assert choose(H200, "sm90") is families.FWD_SM90  # the argument wins
    monkeypatch.setenv("CUFLASH_BACKEND", " SM90 ")
    assert choose(H200) is families.FWD_SM90
    with pytest.raises(ValueError, match="CUFLASH_BACKEND='sm90' cannot run this call.*compute capability 8.0"):
        choose(A100)
    assert choose(A100, "sm80") is families.FWD
    monkeypatch.setenv("CUFLASH_BACKEND", "auto")
    assert choose(A100) is families.FWD and choose(H200) is families.FWD_SM90
    monkeypatch.setenv("CUFLASH_BACKEND", "hopper")
    with pytest.raises(ValueError, match="CUFLASH_BACKEND must be 'sm80', 'sm90' or 'auto'"):
        choose(H200)


def test_v1_has_only_the_sm80_kernel(bindings, monkeypatch):
    v1 = (families.FWD_V1,)
    assert choose(H200, candidates=v1) is families.FWD_V1
    assert choose(H200, "sm80", candidates=v1) is families.FWD_V1
    with pytest.raises(ValueError, match="backend='sm90': v1 forward has no sm90 kernel"):
        choose(H200, "sm90", candidates=v1)
    monkeypatch.setenv("CUFLASH_BACKEND", "sm90")  # a preference for the calls that have an sm90 kernel
    assert choose(H200, candidates=v1) is families.FWD_V1


def test_no_kernel_for_old_gpus_is_a_clear_error(bindings):
    from cuflash.device import UnsupportedDeviceError

    volta = dataclasses.replace(A100, name="Tesla V100", cc=(7, 0))
    for backend in (None, "sm80", "sm90"):
        with pytest.raises(UnsupportedDeviceError, match=r"compute capability 8\.0 or newer.*device 0 is Tesla V100 "
                                                         r"with compute capability 7\.0"):
            choose(volta, backend)


def test_explicit_configs_pick_their_family(bindings, monkeypatch):
    from cuflash import device

    props = {"dev": H200}
    monkeypatch.setattr(device, "query", lambda i=0: props["dev"])
    p = fwd_problem()
    sm90, sm80 = Sm90FwdConfig(128, 128, 2, 2, 0, 0, 1, 0), FwdConfig(128, 128, 64, 8, 2)
    assert _forward._explicit_family(families.FORWARDS, sm90, p, None) is families.FWD_SM90
    assert _forward._explicit_family(families.FORWARDS, sm80, p, None) is families.FWD
    assert _forward._explicit_family(families.FORWARDS, sm90, p, "sm90") is families.FWD_SM90
    with pytest.raises(ValueError, match="is a sm80 config, but backend='sm90'"):
        _forward._explicit_family(families.FORWARDS, sm80, p, "sm90")
    with pytest.raises(TypeError, match="config must be a Sm90FwdConfig or FwdConfig, got V1Config"):
        _forward._explicit_family(families.FORWARDS, V1Config(128, 128, 64, 8, 2), p, None)
    with pytest.raises(ValueError, match="head_dim 64"):
        _forward._explicit_family(families.FORWARDS, Sm90FwdConfig(64, 128, 2, 2, 0, 0, 1, 0), p, None)
    props["dev"] = A100
    with pytest.raises(ValueError, match="cannot run this call on NVIDIA A100.*compute capability 8.0 < 9.0"):
        _forward._explicit_family(families.FORWARDS, sm90, p, None)
    assert _forward._explicit_family(families.FORWARDS, sm80, p, None) is families.FWD


def test_explicit_configs_past_the_devices_shared_memory_fail_before_launch(bindings, monkeypatch):
    """A caller's tile that needs more shared memory than the GPU's opt-in limit raises ValueError
    naming both, before any launch (it used to pass the checks and fail in the driver with
    CUDA_ERROR_INVALID_VALUE: the d128 3-stage backward tiles with a dQ staging)."""
    from cuflash import _backward, device
    from cuflash.tiles import Sm90BwdConfig

    monkeypatch.setattr(device, "query", lambda i=0: H200)
    big = Sm90FwdConfig(128, 256, 2, 4, 1, 1, 2, 0)
    assert big.smem_bytes > H200.smem_optin
    with pytest.raises(ValueError, match=rf"cannot run this call on NVIDIA H200.*shared memory {big.smem_bytes} B "
                                         rf"> opt-in limit {H200.smem_optin} B"):
        _forward._explicit_family(families.FORWARDS, big, fwd_problem(), None)
    p = _problem_bwd(d=128)
    for dqb in (2, 4):
        tile = Sm90BwdConfig(128, 64, 2, 3, dqb, 1)
        with pytest.raises(ValueError, match=rf"config .* cannot run on NVIDIA H200.*shared memory {tile.smem_bytes} B"):
            _backward._tile(families.BWD_SM90, tile, p)
    assert _backward._tile(families.BWD_SM90, Sm90BwdConfig(128, 64, 2, 3, 0, 1), p) == Sm90BwdConfig(128, 64, 2, 3, 0, 1)


# ------------------------------------------------------------------------------------- the tuner

def test_tuner_skips_the_family_off_hopper(monkeypatch):
    from cuflash.tune import __main__ as cli
    from cuflash.tune import space

    monkeypatch.setattr(_compile, "kernel_fingerprint", lambda fam: "0123456789abcdef")  # sources "present"
    assert "fwd_sm90" in cli.available_kernels(H200) and "fwd_sm90" not in cli.available_kernels(A100)
    assert "fwd" in cli.available_kernels(A100)
    sp = space.build_space(families.FWD_SM90, 128, A100)
    assert sp.default is None and not sp.candidates and all("compute capability" in r for r in sp.pruned.values())
    sp = space.build_space(families.FWD_SM90, 128, H200)
    assert sp.default == families.FWD_SM90.defaults[128][0] and sp.default in sp.candidates
    assert Sm90FwdConfig(64, 192, 3, 2, 1, 1, 1, 0) in space.build_space(families.FWD_SM90, 64, H200).pruned  # registers


def test_tuner_reports_a_family_that_does_not_run_on_the_device(monkeypatch):
    from cuflash.tune import tuner

    monkeypatch.setattr(_compile, "kernel_fingerprint", lambda fam: "0123456789abcdef")
    o = tuner.Options(kernels=("fwd_sm90",), head_dims=(128,), seqlens=(1024,), causal=(False,), write_cache=False)
    reports = tuner.tune(o, worker=None, props=A100)
    assert len(reports) == 1 and "fwd_sm90 does not run on this device: compute capability 8.0" in reports[0].error


def test_dry_run_lists_the_sm90_space(capsys):
    from cuflash.tune import __main__ as cli

    assert cli.main(["--dry-run", "--props", str(FIX / "h200.json"), "--kernels", "fwd_sm90"]) == 0
    out = capsys.readouterr().out
    assert "fwd_sm90 d128:" in out and "default 128x128 c2 s2 pp1 ov1" in out
    assert "192x192 c3 s2 pp1 ov1" in out and "176 registers per thread > 136" in out


# ----------------------------------------------------------------------------- the sm90 backward
def _problem_bwd(d=64):
    q = info((2, 100, 3, d))
    kv = info((2, 300, 3, d))
    lse = problem.ArrayInfo((2, 3, 100), "float32", 4, (3 * 100 * 4, 100 * 4, 4), 1 << 20, 0)
    return problem.resolve_backward(q, q, kv, kv, q, lse, CAUSAL, None)


class _Fake:
    def __init__(self, ptr):
        self.data = types.SimpleNamespace(ptr=ptr)


def test_sm90_backward_family():
    from cuflash.tiles import Sm90BwdConfig

    f = families.BWD_SM90
    assert f in families.BACKWARDS and families.REGISTRY["bwd_sm90"] is f and f.tuned_by_default
    t = Sm90BwdConfig(128, 64, 2, 2, 0, 0)
    assert (t.block_k, t.threads, t.launch_bounds()) == (128, 384, "__launch_bounds__(384, 1)")
    assert t.template_args() == (128, 64, 2, 2, 0, 0)
    # K, V (128 x 128), 2 x (Q + dO) (64 x 128), two dS^T images (128 x 64), 16-bit; 2 x (lse2 +
    # delta) (64 fp32 each); + slack
    assert t.smem_bytes == 2 * 2 * 128 * 128 + 2 * 2 * 2 * 64 * 128 + 2 * 2 * 128 * 64 + 2 * 2 * 64 * 4 + 2048
    assert "block_q must be 64" in Sm90BwdConfig(128, 128, 2, 2, 0, 0).structural_problem()
    # with the dQ staging of the store warp: two consumers x 64 rows x (256 + 16) B
    assert Sm90BwdConfig(128, 64, 2, 2, 1, 0).smem_bytes == t.smem_bytes + 2 * 64 * 272
    assert f.supports(Features("bfloat16", 128, True)) and f.supports(Features("bfloat16", 128))  # dropout too
    # dq_bulk 3 (the deterministic twin of a tile, not searched): the fragment order's staging
    assert Sm90BwdConfig(128, 64, 2, 2, 3, 1).smem_bytes == Sm90BwdConfig(128, 64, 2, 2, 2, 1).smem_bytes
    # dq_bulk 4 (the fragment order's reductions issued by the store warp): searched, the same staging
    assert Sm90BwdConfig(128, 64, 2, 2, 4, 1) in f.domain(128)
    assert Sm90BwdConfig(128, 64, 2, 2, 4, 1).smem_bytes == Sm90BwdConfig(128, 64, 2, 2, 2, 1).smem_bytes
    assert Sm90BwdConfig(128, 64, 2, 2, 3, 1) not in f.domain(128) and "dq_bulk" in Sm90BwdConfig(128, 64, 2, 2, 5, 1).structural_problem()
    src = _compile.kernel_source(t, Features("float16", 128))
    assert ("const __grid_constant__ cuflash::TmaMap tdo, const float* __restrict__ lse2" in src
            and "cuflash::flash_bwd_sm90<false, 128, 64, 2, 2, 0, 0, cuflash::Variant<false, false, false, false, false, false, false, false, false, false, false, false, false>>" in src)


def test_sm90_backward_binds_four_maps_and_the_workspaces():
    from cuflash import _backward_sm90
    from cuflash.tiles import Sm90BwdConfig

    p = _problem_bwd()
    seen = []
    slots, bind = _backward_sm90.main_args(p, Sm90BwdConfig(64, 64, 2, 2, 0, 0))
    assert slots == ("q", "k", "v", "dout", "lse2", "delta", "dq_acc", "dk", "dv", "dq_sem")
    # boxes: block_q rows for q and dout, 128 keys for k and v
    assert [c.geometry.box[1] for c in bind.caches] == [64, 128, 128, 64]
    for c in bind.caches:
        c._encode = lambda g, ptr: seen.append(ptr) or ptr
    arrays = [_Fake(100 + i) for i in range(4)] + ["lse2", "delta", "dq_acc", "dk", "dv", "dq_sem"]
    assert bind(arrays) == (100, 101, 102, 103, "lse2", "delta", "dq_acc", "dk", "dv", "dq_sem")


def test_sm90_backward_is_automatic_at_d64_d128_d256_and_says_why_it_cannot_run(monkeypatch):
    from cuflash import _backward, _backward_sm90, device

    p = _problem_bwd()
    monkeypatch.setattr(device, "query", lambda *_a, **_k: H200)
    monkeypatch.setattr(tma, "bindings_problem", lambda: None)
    assert _backward._main_family(p, None, "sm90") is families.BWD_SM90
    assert _backward._main_family(p, None, "sm80") is families.BWD
    d128 = _problem_bwd(d=128)
    assert _backward._main_family(d128, None, None) is families.BWD_SM90
    # d64 too since the overlapped tile (1.44x the sm80 kernel on the H200); the deterministic mode
    # too (its dq_bulk 3 twin: 1.2-1.5x the sm80 deterministic backward), but not with a block mask
    assert p.features.head_dim == 64 and _backward._main_family(p, None, None) is families.BWD_SM90
    assert _backward._main_family(_problem_bwd(d=96), None, None) is families.BWD  # no sm90 instance
    det = dataclasses.replace(d128, deterministic=True)
    assert _backward._main_family(det, None, None) is families.BWD_SM90
    # d256: the split-head-dim tile (1.7x the sm80 kernel on the H200), whose dQ goes by atomics, so
    # its deterministic calls fall to the sm80 backward
    d256 = _problem_bwd(d=256)
    assert _backward._main_family(d256, None, None) is families.BWD_SM90
    assert _backward._main_family(dataclasses.replace(d256, deterministic=True), None, None) is families.BWD
    # variable-length batches too (each sequence takes its own order), block masks not
    # (this fixture's varlen flag lacks the packed layout's strides: only the mode's own refusal is asked)
    assert "deterministic" not in (_backward_sm90.call_problem(dataclasses.replace(det, varlen=True)) or "")
    assert _backward_sm90.call_problem(dataclasses.replace(det, block_mask=object())) == \
        "the sm90 backward's deterministic mode does not take block masks"
    monkeypatch.setenv(families.BACKEND_ENV, "sm80")
    assert _backward._main_family(d128, None, None) is families.BWD
    with pytest.raises(ValueError, match="backend must be"):
        _backward._main_family(p, None, "sm100")


# ----------------------------------------------------------------------------- GQA / MQA
@pytest.mark.parametrize("hkv", [1, 2])
def test_gqa_forward_maps_have_the_kv_heads(calls, hkv):
    """The k and v maps describe k and v as they are (heads_kv heads: the kernel loads k/v head
    h / group); q's map keeps q's heads; FwdParams carries heads_kv and the group."""
    q, kv = info((2, 100, 4, 128)), info((2, 300, hkv, 128))
    p = problem.resolve_forward(q, kv, kv, CAUSAL, None)
    assert tma.tensor_layout(p, "k") == ((2, 300, hkv, 128), dense((2, 300, hkv, 128)))
    assert tma.call_problem(p) is None or "cuda-bindings" in tma.call_problem(p)
    encoded = []
    plan = _forward_sm90.plan(p, Sm90FwdConfig(128, 128, 2, 2, 1, 1, 1, 0), np.float16,
                              encoder=lambda g, ptr: encoded.append(g) or ptr)
    out, lse = plan.run((arr(0x1000), arr(0x2000), arr(0x3000), None, None))
    assert out == ("alloc", (2, 100, 4, 128), "float16") and lse == ("alloc", (2, 4, 100), "float32")
    gq, gk, gv = encoded
    assert gq.dims == (64, 100, 2, 4, 2) and gk.dims == gv.dims == (64, 300, 2, hkv, 2)
    assert gk.strides == (hkv * 128 * 2, 128, 128 * 2, 300 * hkv * 128 * 2)
    f = params.unpack(calls[0][2][6:], "FwdParams")
    assert (int(f["heads"]), int(f["heads_kv"]), int(f["group"])) == (4, hkv, 4 // hkv)
    assert int(f["tiles"]) == 1 * 4 * 2  # work tiles over the query heads


def _gqa_sm90_backward_plan(monkeypatch, fused: bool):
    """(plan outputs, launches, the main kernel's features) of a GQA plan (4 query heads, 1 K/V head)
    of the Hopper dK/dV kernel, with the group loop (`fused`) or, forced off, the expanded buffers."""
    cupy = pytest.importorskip("cupy")
    from cuflash import _backward
    from cuflash.tiles import Sm90BwdConfig

    rec, feats = [], []

    def kernel(cfg, f, dev):
        feats.append(f)
        return Recorder(rec)

    monkeypatch.setattr(_compile, "get_kernel", kernel)
    monkeypatch.setattr(_compile, "get_aux_kernel", lambda name, f, dev: Recorder(rec))
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=None: ("alloc", tuple(shape), np.dtype(dtype).name))
    monkeypatch.setattr(launch, "_capturing", lambda: False)  # no GPU: no capture
    monkeypatch.setattr(cupy.cuda, "Device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(tma, "encode", lambda g, ptr: ("map", g.dims, ptr))
    # 3 key blocks x 1 K/V head x 2 batches = 6 CTAs: 4 waves on a GPU of one SM
    monkeypatch.setattr(device, "query", lambda i=0: dataclasses.replace(H200, sm_count=1))
    if not fused:
        monkeypatch.setattr(_backward, "group_loop", lambda p, cfg, dq_cfg: False)
    q, kv = info((2, 100, 4, 64)), info((2, 300, 1, 64))
    lse = problem.ArrayInfo((2, 4, 100), "float32", 4, (4 * 100 * 4, 100 * 4, 4), 1 << 20, 0)
    p = problem.resolve_backward(q, q, kv, kv, q, lse, CAUSAL, None)
    assert _backward.group_loop(p, Sm90BwdConfig(64, 64, 2, 2, 0, 0), None) == fused
    plan = _backward._plan(p, Sm90BwdConfig(64, 64, 2, 2, 0, 0), None, np.float16)
    return plan.run(tuple(arr(0x1000 * (i + 1)) for i in range(6))), rec, feats


def test_gqa_sm90_backward_sums_the_group_in_the_kernel(monkeypatch):
    """GQA on the Hopper dK/dV kernel (no dropout, ALiBi, user mod, block mask, deterministic dQ):
    its group-loop instance on a grid of K/V heads writes dk, dv directly; no bwd_dkdv_reduce."""
    (dq, dk, dv), rec, feats = _gqa_sm90_backward_plan(monkeypatch, True)
    assert dk == dv == ("alloc", (2, 300, 1, 64), "float16") and dq == ("alloc", (2, 100, 4, 64), "float16")
    assert len(rec) == 3  # prep, the main kernel, the dQ convert
    grid, _, main, _ = rec[1]
    assert feats[0].group_loop and grid == (-(-300 // 128) * 1 * 2,)
    assert main[1] == ("map", (64, 300, 1, 1, 2), 0x3000) and main[0] == ("map", (64, 100, 1, 4, 2), 0x2000)
    assert main[7:9] == (dk, dv)
    f = params.unpack(main[10:], "BwdParams")  # dk, dv's own layout (1 K/V head), nothing to reduce
    assert (int(f["dk_sn"]), int(f["dk_sh"]), int(f["dv_sn"]), int(f["kv_rows"])) == (64, 64, 64, 0)
    assert int(f["head_chunk"]) == 2  # causal: a small problem's whole grid is one L2 section


def test_gqa_causal_chunk_keeps_a_section_of_q_and_do():
    """params.gqa_causal_chunk: (batch, K/V head)s per chunk so their groups' Q and dO stay within
    GQA_L2_SECTION_BYTES (32 MB): 2 at GQA 32 / 8, d128, N8192 (16 MB each), at least 1."""
    import types

    def shape(group, n, d):
        return types.SimpleNamespace(group=group, seqlen_q=n, head_dim=d)

    assert params.gqa_causal_chunk(shape(4, 8192, 128)) == 2
    assert params.gqa_causal_chunk(shape(4, 2048, 128)) == 8
    assert params.gqa_causal_chunk(shape(8, 131072, 256)) == 1
    assert params.GQA_CAUSAL_HEAD_CHUNK is None  # the rule, unless a caller (scripts/bench_gqa_bwd.py) sets one


def test_gqa_group_loop_needs_enough_ctas(monkeypatch):
    """The group loop's grid is `group` times smaller: below GROUP_LOOP_MIN_WAVES waves of CTAs
    (here 6 CTAs on 132 SMs) the expanded buffers and the reduce pass stay."""
    from cuflash import _backward
    from cuflash.tiles import Sm90BwdConfig

    monkeypatch.setattr(device, "query", lambda i=0: H200)
    q, kv = info((2, 100, 4, 64)), info((2, 300, 1, 64))
    lse = problem.ArrayInfo((2, 4, 100), "float32", 4, (4 * 100 * 4, 100 * 4, 4), 1 << 20, 0)
    p = problem.resolve_backward(q, q, kv, kv, q, lse, CAUSAL, None)
    assert not _backward.group_loop(p, Sm90BwdConfig(64, 64, 2, 2, 0, 0), None)
    monkeypatch.setattr(device, "query", lambda i=0: dataclasses.replace(H200, sm_count=1))
    assert _backward.group_loop(p, Sm90BwdConfig(64, 64, 2, 2, 0, 0), None)


def test_gqa_sm90_backward_writes_the_expanded_buffers(monkeypatch):
    """Without the group loop (dropout, ALiBi, ...): k, v maps of heads_kv heads, dK/dV slots renamed
    to the expanded buffers, and bwd_dkdv_reduce after the dQ convert."""
    (dq, dk, dv), rec, feats = _gqa_sm90_backward_plan(monkeypatch, False)
    assert dk == dv == ("alloc", (2, 300, 1, 64), "float16") and dq == ("alloc", (2, 100, 4, 64), "float16")
    assert not feats[0].group_loop and rec[1][0] == (-(-300 // 128) * 4 * 2,)
    main, reduce = rec[1][2], rec[3][2]
    assert main[1] == ("map", (64, 300, 1, 1, 2), 0x3000) and main[0] == ("map", (64, 100, 1, 4, 2), 0x2000)
    expanded = ("alloc", (2, 300, 4, 64), "float16")
    assert main[7:9] == (expanded, expanded) and reduce[:4] == (main[7], main[8], dk, dv)
    f = params.unpack(main[10:], "BwdParams")  # (after dq_sem, null)
    assert (int(f["group"]), int(f["heads_kv"]), int(f["kv_rows"]), int(f["dk_sn"])) == (4, 1, 2 * 300, 4 * 64)


@pytest.fixture
def fake_backward_plan(monkeypatch):
    """(aux kernel names, launches) of a backward plan built and run without a GPU: kernels record
    their launches, allocations and TMA maps are tuples describing themselves."""
    cupy = pytest.importorskip("cupy")
    names, rec = [], []
    monkeypatch.setattr(_compile, "get_kernel", lambda cfg, f, dev: Recorder(rec))
    monkeypatch.setattr(_compile, "get_aux_kernel", lambda name, f, dev: names.append(name) or Recorder(rec))
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=None: ("alloc", tuple(shape), np.dtype(dtype).name))
    monkeypatch.setattr(launch, "_capturing", lambda: False)  # no GPU: no capture
    monkeypatch.setattr(cupy.cuda, "Device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(tma, "encode", lambda g, ptr: ("map", g.dims, ptr))
    return names, rec


def test_fragment_order_dq_plan_converts_with_the_fragment_kernel(fake_backward_plan):
    """dq_bulk 2: the plan's dQ convert is bwd_dq_convert_frag, one thread per two rows x 8 columns of
    dq_acc (batch x heads x padded rows x the instantiated head dim / 16), after the dK/dV kernel."""
    from cuflash import _backward
    from cuflash.tiles import Sm90BwdConfig

    names, rec = fake_backward_plan
    p = _problem_bwd(d=128)
    plan = _backward._plan(p, Sm90BwdConfig(128, 64, 2, 2, 2, 1), None, np.float16)
    plan.run(tuple(arr(0x1000 * (i + 1)) for i in range(6)))
    assert names == ["bwd_prep", "bwd_dq_convert_frag"]
    pad = -(-100 // _backward._ROW_PAD) * _backward._ROW_PAD
    assert rec[2][0] == (-(-2 * 3 * pad * 128 // 16 // _backward._AUX_THREADS),)
    assert Sm90BwdConfig(128, 64, 2, 2, 2, 1).smem_bytes == Sm90BwdConfig(128, 64, 2, 2, 0, 1).smem_bytes + 2 * 64 * 64 * 4


def test_deterministic_sm90_plan_orders_dq_behind_zeroed_turn_counters(fake_backward_plan, monkeypatch):
    """dq_bulk 3 (the deterministic twin): dq_acc in fragment order and the fragment convert, as
    dq_bulk 2, plus a zeroed int32 dq_sem of one counter per 64 x 64 dQ block after dv; the other
    tiles get a null dq_sem."""
    cupy = pytest.importorskip("cupy")
    from cuflash import _backward
    from cuflash.launch import NULL
    from cuflash.tiles import Sm90BwdConfig

    monkeypatch.setattr(cupy, "zeros", lambda shape, dtype=None: ("zeros", tuple(shape), np.dtype(dtype).name))
    sms = {"count": 132}
    monkeypatch.setattr(_backward.device, "query", lambda dev: types.SimpleNamespace(sm_count=sms["count"]))
    names, rec = fake_backward_plan
    p = dataclasses.replace(_problem_bwd(d=128), deterministic=True)
    plan = _backward._plan(p, Sm90BwdConfig(128, 64, 2, 2, 3, 1), None, np.float16)
    # causal, 3 key blocks: the rotated order where they fit on the GPU at once, else the staircase
    assert plan.params.packed["det_rotate"][0] == 1
    plan.run(tuple(arr(0x1000 * (i + 1)) for i in range(6)))
    assert names == ["bwd_prep", "bwd_dq_convert_frag"]
    pad = -(-100 // _backward._ROW_PAD) * _backward._ROW_PAD
    main = rec[1][2]
    assert main[6] == ("alloc", (2 * 3 * pad * 128,), "float32")  # dq_acc
    assert main[9] == ("zeros", (2 * 3 * pad // 64 * 2,), "int32")  # dq_sem: blocks x the D / 64 dQ consumers
    names.clear(), rec.clear()
    _backward._plan(_problem_bwd(d=128), Sm90BwdConfig(128, 64, 2, 2, 2, 1), None, np.float16).run(
        tuple(arr(0x1000 * (i + 1)) for i in range(6)))
    assert rec[1][2][9] == NULL
    sms["count"] = 2
    assert _backward._plan(p, Sm90BwdConfig(128, 64, 2, 2, 3, 1), None, np.float16).params.packed["det_rotate"][0] == 0


def test_fragment_order_dq_round_trip():
    """The fragment order of dq_acc, as kernels_cu/sm90/bwd.cuh writes it (thread ctid's acc_dq[nt][e],
    the wgmma accumulator element at row 16 warp + g + 8 (e / 2), column 8 nt + 2 t + e % 2, to float
    (nt * 128 + ctid) * 4 + e of its 64 x 64 block) and as rowwise/bwd_post.cuh's bwd_dq_convert_frag
    reads it back (a thread per row pair and 8 columns, 256 per block, nt fastest: the four float4
    32 warp + 4 g + t of nt, x y to row 16 warp + g, z w to row + 8): a bijection whose round trip is
    the identity, block by block ((bh * pad / 64 + m) * D / 64 + c)."""
    rng = np.random.default_rng(0)
    bh, pad, d = 3, 128, 128
    dq = rng.standard_normal((bh, pad, d)).astype(np.float32)
    acc = np.full(bh * pad * d, np.nan, np.float32)
    for b in range(bh):
        for m in range(pad // 64):
            for c in range(d // 64):
                base = ((b * (pad // 64) + m) * (d // 64) + c) * 4096
                for ctid in range(128):
                    w, g, t = ctid // 32, ctid % 32 // 4, ctid % 4
                    for nt in range(8):
                        for e in range(4):
                            row, col = m * 64 + 16 * w + g + 8 * (e // 2), 64 * c + 8 * nt + 2 * t + e % 2
                            assert np.isnan(acc[base + (nt * 128 + ctid) * 4 + e])
                            acc[base + (nt * 128 + ctid) * 4 + e] = dq[b, row, col]
    assert not np.isnan(acc).any()
    back = np.full_like(dq, np.nan)
    for gt in range(bh * pad * d // 16):  # the convert kernel's threads
        within, blk = gt % 256, gt // 256
        nt, warp, g = within % 8, within // 8 // 8, within // 8 % 8
        c, bm = blk % (d // 64), blk // (d // 64)
        b, m = bm // (pad // 64), bm % (pad // 64)
        row, col = m * 64 + 16 * warp + g, 64 * c + 8 * nt
        f4 = blk * 1024 + nt * 128 + 32 * warp + 4 * g  # the first of its four float4
        a = acc[4 * f4:4 * f4 + 16].reshape(4, 4)  # [t][x y z w]
        assert np.isnan(back[b, row, col:col + 8]).all() and np.isnan(back[b, row + 8, col:col + 8]).all()
        back[b, row, col:col + 8], back[b, row + 8, col:col + 8] = a[:, :2].ravel(), a[:, 2:].ravel()
    np.testing.assert_array_equal(back, dq)


def test_varlen_sm90_backward_plan_binds_the_offsets_after_dv(fake_backward_plan, monkeypatch):
    """A forced Hopper backward of a variable-length batch: its maps over the packed rows (one batch),
    the offsets after dv and before the slopes, n_blocks of the longest sequence's keys, the varlen dQ
    convert of the tile's dq_acc layout (row-major for atomics, fragment order for dq_bulk 2, 4 and
    3, the deterministic twin: with its zeroed turn counters, one per 64 x 64 block of the varlen
    workspace, and the rotated order allowed: 3 key blocks of the longest sequence fit)."""
    cupy = pytest.importorskip("cupy")
    from cuflash import _backward
    from cuflash.tiles import Sm90BwdConfig
    from cuflash._backward import varlen_ws_rows_per_head
    from cuflash.varlen import resolve_backward

    monkeypatch.setattr(cupy, "zeros", lambda shape, dtype=None: ("zeros", tuple(shape), np.dtype(dtype).name))
    monkeypatch.setattr(_backward.device, "query", lambda dev: types.SimpleNamespace(sm_count=132))
    names, rec = fake_backward_plan
    qi, ki = info((300, 4, 128)), info((500, 4, 128))
    cu = problem.ArrayInfo((4,), "int32", 4, (4,), 1 << 20, 0)
    lse = problem.ArrayInfo((4, 300), "float32", 4, (300 * 4, 4), 1 << 20, 0)
    p = resolve_backward(qi, qi, ki, ki, qi, lse, cu, cu, 200, 260, CAUSAL, None)
    for dqb in (0, 2, 4, 3):
        names.clear(), rec.clear()
        if dqb == 3:
            p = dataclasses.replace(p, deterministic=True)
        plan = _backward._plan(p, Sm90BwdConfig(128, 64, 2, 2, dqb, 1), None, np.float16)
        if dqb == 3:
            assert plan.params.packed["det_rotate"][0] == 1
            ws_rows = 4 * varlen_ws_rows_per_head(p)
        else:
            assert plan.params.packed["det_rotate"][0] == 0
        plan.run(tuple(arr(0x1000 * (i + 1)) for i in range(8)))
        assert names == ["bwd_prep_varlen", "bwd_dq_convert_frag_varlen" if dqb else "bwd_dq_convert_varlen"]
        grid, _, args, _ = rec[1]
        assert grid == (-(-260 // 128) * 4 * 3,)  # key blocks of the longest sequence x heads x sequences
        assert args[0] == ("map", (64, 300, 2, 4, 1), 0x2000) and args[1] == ("map", (64, 500, 2, 4, 1), 0x3000)
        assert tuple(a.data.ptr for a in args[10:12]) == (0x7000, 0x8000)  # cu_seqlens_q, _k after dk, dv, dq_sem
        if dqb == 3:
            assert args[9] == ("zeros", (ws_rows // 64 * 2,), "int32")  # dq_sem: blocks x the D / 64 dQ consumers



def _grouped(bid, n_blocks, bh_total, group):
    """attn/scheduler.cuh schedule_blocks_grouped, transcribed: blockIdx -> (key block, bh)."""
    g = bid // (n_blocks * group)
    rem = bid - g * n_blocks * group
    heads_in = min(group, bh_total - g * group)
    return rem // heads_in, g * group + rem % heads_in


@pytest.mark.parametrize("n_blocks,bh_total,group", [(64, 32, 17), (16, 128, 66), (64, 1, 1), (5, 7, 3), (3, 4, 4),
                                                     (1, 9, 2)])
def test_deterministic_schedule_is_a_bijection_waiting_only_on_lower_indices(n_blocks, bh_total, group):
    """The deterministic Hopper backward's grouped schedule covers every (key block, head) once, and a
    CTA's predecessor in every dQ block's turn (the same head's previous key block) has a lower
    blockIdx, so it was dispatched no later (no deadlock); a wave of the first CTAs holds about
    group heads' first key blocks."""
    total = n_blocks * bh_total
    index = {_grouped(b, n_blocks, bh_total, group): b for b in range(total)}
    assert len(index) == total and set(index) == {(n, h) for n in range(n_blocks) for h in range(bh_total)}
    assert all(index[(n - 1, h)] < b for (n, h), b in index.items() if n > 0)
    first = [_grouped(b, n_blocks, bh_total, group) for b in range(min(total, n_blocks * group))]
    assert max(n for n, _ in first) == -(-len(first) // min(group, bh_total)) - 1
