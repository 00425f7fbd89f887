"""Every selectable Hopper forward instance compiles with NVRTC for sm_90a, without a GPU: bf16 and
fp16, plain and dropout, no register spills, no stack, and no wgmma serialisation (ptxas warns when
it has to serialise wgmma, e.g. when accumulator registers would cross a wgmma in flight).

Skipped until the kernel's entry header (kernels_cu/flash_fwd_sm90.cuh) exists."""
from __future__ import annotations

import dataclasses

import pytest

from cuflash import _compile, families
from cuflash.features import Features
from tests.test_compile import _nvrtc_available

FAMILY = families.FWD_SM90
HEADER_PRESENT = (_compile.kernel_dir() / FAMILY.header).is_file()

pytestmark = [
    pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not loadable (install nvidia-cuda-nvrtc)"),
    pytest.mark.skipif(not HEADER_PRESENT, reason=f"kernels_cu/{FAMILY.header} not written yet"),
]


# tile -> bytes of spill stores known and accepted for its plain instance (sm_90a). None today: the
# automatic d128 Hopper backward's store-warp tile spilled 16 B over its consumers' 240 registers
# until acc_dq stopped living around its loop (dq_wg, kernels_cu/sm90/bwd.cuh). A tile not listed
# must not spill; a listed one must not spill more.
KNOWN_SPILLS: dict = {}


def check(cfg, features, record_property):
    rep = _compile.compile_report(_compile.kernel_source(cfg, features), "sm_90a")
    record_property("resources", {k: v for k, v in rep.items() if k != "log"} | {"smem_dynamic": cfg.smem_bytes})
    log = rep["log"]
    assert rep["registers"] > 0, log
    known = KNOWN_SPILLS.get(cfg, 0)
    assert rep["spill_stores"] <= known and (known or rep["spill_loads"] == 0), log
    assert known or rep["stack_bytes"] == 0, log
    assert "serialized" not in log.lower(), log  # "wgmma.mma_async instructions are serialized ..."
    assert rep["smem_static_bytes"] + cfg.smem_bytes <= 227 * 1024, log
    return rep


def _picked_only_by(cfg) -> set | None:
    """The perf classes that may pick `cfg` where it is only some classes' default
    (FWD_SM90.class_defaults); None where it is a head dim's default, which every class may take."""
    if cfg in FAMILY.defaults[cfg.head_dim]:
        return None
    return {c for c, table in FAMILY.class_defaults.items() if cfg in table.get(cfg.head_dim, ())}


@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "dropout"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("cfg", FAMILY.selectable(), ids=str)
def test_selectable_sm90_configs_compile_for_sm90a(cfg, dtype, dropout, record_property):
    features = Features(dtype, cfg.head_dim, dropout)
    only = _picked_only_by(cfg)
    if dropout and only is not None and "dropout" not in only:
        # d64 softcap's three consumers without ping-pong spill 60 B with dropout under NVRTC 13.0
        # (none under 13.5): no dropout call runs them (test_class_default_tiles_compile_for_their_class)
        pytest.skip(f"{cfg} is the class default of {sorted(only)} only: no dropout call picks it")
    if FAMILY.avoids(cfg, features):
        # listed in the family's `spilling`: the default skips it for this class; keep the list honest
        rep = _compile.compile_report(_compile.kernel_source(cfg, features), "sm_90a")
        assert rep["spill_stores"] > 0 or "serialized" in rep["log"].lower(), \
            f"{cfg} no longer spills for {features.perf_class()}: drop it from FWD_SM90.spilling"
        return
    check(cfg, features, record_property)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("cls,cfg", [(c, t) for c, table in FAMILY.class_defaults.items() for ts in table.values()
                                     for t in ts], ids=str)
def test_class_default_tiles_compile_for_their_class(cls, cfg, dtype, record_property):
    """A perf class's own defaults (FWD_SM90.class_defaults) with the features that class is tuned
    with, both dtypes: no spills (what the class's untuned calls run)."""
    features = Features.of_class(dtype, cfg.head_dim, cls)
    assert not FAMILY.avoids(cfg, features)
    check(cfg, features, record_property)


@pytest.mark.parametrize("cfg", FAMILY.selectable(), ids=str)
def test_column_masking_sm90_instances_compile_for_sm90a(cfg, record_property):
    """The rank-4-map (partial_d) instances of every selectable tile: a head dim between the
    instances' or v's own; the same register budget (their chunk loads are the producer's, the
    column test in the epilogue the consumers')."""
    features = Features("bfloat16", cfg.head_dim, partial_d=True)
    assert FAMILY.supports(features) and not FAMILY.avoids(cfg, features)
    check(cfg, features, record_property)


@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "dropout"])
@pytest.mark.parametrize("tile", [t for t in FAMILY.selectable() if FAMILY.causal_tile(t) not in FAMILY.selectable()],
                         ids=str)
def test_drawn_variants_of_the_defaults_compile_for_sm90a(tile, dropout, record_property):
    """What an untuned causal call (FWD_SM90.causal_tile) or a ragged batch (varlen_tile) runs: the
    defaults with the drawn tile order, whose instances are not in `selectable()`."""
    features = Features("bfloat16", tile.head_dim, dropout)
    if FAMILY.avoids(tile, features):
        pytest.skip(f"{tile} spills with {features.perf_class()}: the default never picks it")
    check(FAMILY.causal_tile(tile), features, record_property)


@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 128])
def test_whole_sm90_space_compiles(d, record_property):
    """Every tile the tuner may try on an H200 compiles (spills allowed here: the tuner prunes them)."""
    from cuflash.device import DeviceProps
    from tests.test_sm90_host import FIX

    h200 = DeviceProps.from_json(FIX / "h200.json")
    table = []
    for cfg in FAMILY.space(d, h200.smem_optin):
        if FAMILY.can_implement(cfg, h200) is not None:
            continue
        rep = _compile.compile_report(_compile.kernel_source(cfg, Features("bfloat16", d)), "sm_90a")
        table.append((cfg, rep["registers"], rep["spill_stores"]))
        assert rep["registers"] > 0
    print("\n".join(f"sm_90a {c}: {r} regs, {s} B spilled" for c, r, s in table))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("cfg", families.BWD_SM90.selectable(), ids=str)
def test_selectable_sm90_backward_configs_compile_for_sm90a(cfg, dtype, record_property):
    """The Hopper backward, plain and with dropout (a tile the family marks as spilling with
    dropout must really spill: the default passes it over)."""
    check(cfg, Features(dtype, cfg.head_dim), record_property)
    drop = Features(dtype, cfg.head_dim, True)
    assert families.BWD_SM90.supports(drop)
    if families.BWD_SM90.avoids(cfg, drop):
        if dtype == "bfloat16":  # (the marks are measured in bf16; fp16 allocates apart)
            rep = _compile.compile_report(_compile.kernel_source(cfg, drop), "sm_90a")
            assert rep["spill_stores"] > 0, f"{cfg} no longer spills with dropout: drop it from BWD_SM90.spilling"
        return
    check(cfg, drop, record_property)


@pytest.mark.parametrize("variant", [{}, {"local": True, "softcap": True, "varlen": True}], ids=["plain", "local+softcap+varlen"])
@pytest.mark.parametrize("cfg", families.BWD_SM90.selectable(), ids=str)
def test_group_loop_sm90_backward_instances_compile(cfg, variant, record_property):
    """GQA's group-loop instances (kGroupLoop: a CTA per K/V head runs the group's query heads),
    every selectable tile, with the features the loop takes: no spills (NVRTC 13.0 and 13.5)."""
    features = Features("bfloat16", cfg.head_dim, group_loop=True, **variant)
    assert families.BWD_SM90.supports(features) and not families.FWD_SM90.supports(features)
    check(cfg, features, record_property)


# The deterministic twins (dq_bulk 3) of the selectable tiles: bytes of spill stores known with
# dropout (NVRTC 13.5; none under 13.0); plain, windowed and softcapped ones spill nothing.
KNOWN_DETERMINISTIC_DROPOUT_SPILLS = {128: 4}


@pytest.mark.parametrize("variant", ["plain", "local", "softcap", "dropout"])
@pytest.mark.parametrize("cfg", sorted({dataclasses.replace(t, dq_bulk=3) for t in families.BWD_SM90.selectable()
                                         if not t.split_d}), ids=str)
def test_deterministic_sm90_backward_twins_compile(cfg, variant, record_property):
    """What _backward runs for deterministic=True on the Hopper backward: the selected tile with
    dq_bulk 3 (turn counters, waited-for bulk reductions)."""
    features = Features("bfloat16", cfg.head_dim, **({} if variant == "plain" else {variant: True}))
    if variant != "dropout":
        check(cfg, features, record_property)
        return
    rep = _compile.compile_report(_compile.kernel_source(cfg, features), "sm_90a")
    assert rep["registers"] > 0, rep["log"]
    assert rep["spill_stores"] <= KNOWN_DETERMINISTIC_DROPOUT_SPILLS.get(cfg.head_dim, 0), rep["log"][-2000:]
    assert "serialized" not in rep["log"].lower()


@pytest.mark.parametrize("d", [64, 128])
def test_whole_sm90_backward_space_compiles_without_spills(d, record_property):
    """Every tile of the sm90 backward's domain (stages, dQ by atomics or the store warp, overlapped
    or not), plain bf16: no spills, no wgmma serialisation."""
    from cuflash.device import DeviceProps
    from tests.test_sm90_host import FIX

    h200 = DeviceProps.from_json(FIX / "h200.json")
    tried = 0
    for cfg in families.BWD_SM90.space(d, h200.smem_optin):
        if families.BWD_SM90.can_implement(cfg, h200) is not None:
            continue
        check(cfg, Features("bfloat16", d), record_property)
        tried += 1
    assert tried >= 6  # 2 or 3 stages x atomics or store warp x overlapped or not, less what overflows 227 KB



@pytest.mark.parametrize("extra", [(), ("local",), ("softcap",), ("local", "softcap")], ids=lambda e: "+".join(e) or "plain")
@pytest.mark.parametrize("d", [64, 128])
def test_sm90_backward_varlen_defaults_compile_without_spills(d, extra, record_property):
    """The Hopper backward's variable-length instances (forced with backend="sm90" until run on a
    GPU) on the default tile: no spills, no wgmma serialisation."""
    f = Features("bfloat16", d, varlen=True, **{e: True for e in extra})
    assert families.BWD_SM90.supports(f)
    check(families.BWD_SM90.default(d, features=f), f, record_property)


@pytest.mark.parametrize("extra", [("local",), ("softcap",), ("dropout",), ("alibi",), ("varlen",), ("local", "softcap"),
                                   ("dropout", "softcap", "local")], ids="+".join)
@pytest.mark.parametrize("dq_bulk", [0, 4])
def test_split_head_dim_sm90_backward_compiles_without_spills(dq_bulk, extra, record_property):
    """The split-head-dim tile (head_dim 256, Sm90BwdTraits::kSplitD; the automatic choice at d256
    on Hopper since it ran on the H200), with each of its dQ paths (dq_bulk 4, the default, and 0), with each feature its score path has: no spills, no wgmma serialisation.
    (Plain bf16 and fp16: the selectable-configs test.)"""
    f = Features("bfloat16", 256, **{e: True for e in extra})
    assert families.BWD_SM90.supports(f)
    # dq_bulk 4: the default (dQ staged over the block's own Q / dO images, kDqInStage); 0: atomics
    tile = dataclasses.replace(families.BWD_SM90.default(256, features=f), dq_bulk=dq_bulk)
    assert tile in families.BWD_SM90.domain(256)
    check(tile, f, record_property)


@pytest.mark.parametrize("extra", [(), ("local",), ("softcap",), ("dropout",)], ids=lambda e: "+".join(e) or "plain")
@pytest.mark.parametrize("d", [64, 128])
def test_sm90_deterministic_varlen_twins_compile_without_spills(d, extra, record_property):
    """deterministic=True on a variable-length batch: the selected tile's dq_bulk 3 twin, its
    sequence-by-sequence order (sm90/det_order.cuh det_stride) and turn counters: no spills, no
    wgmma serialisation (dropout: within the dense twins' known bytes)."""
    f = Features("bfloat16", d, varlen=True, **{e: True for e in extra})
    cfg = dataclasses.replace(families.BWD_SM90.default(d, features=f), dq_bulk=3)
    if "dropout" not in extra:
        check(cfg, f, record_property)
        return
    rep = _compile.compile_report(_compile.kernel_source(cfg, f), "sm_90a")
    assert rep["registers"] > 0, rep["log"]
    assert rep["spill_stores"] <= KNOWN_DETERMINISTIC_DROPOUT_SPILLS.get(d, 0), rep["log"][-2000:]
    assert "serialized" not in rep["log"].lower()
