"""Features (cuflash/features.py) and its C++ mirror cuflash::Variant (kernels_cu/attn/features.cuh):
kernel-name tags, the template argument of the generated shells and its static_assert, the
perf classes; the `local` (bounded left window edge) instances of every family compile on CPU;
the parameter packer refuses a bounded left edge for features without `local`."""
from __future__ import annotations

import dataclasses

import pytest

from cuflash import _compile, families, params, problem
from cuflash.features import Features
from cuflash.mask import CAUSAL
from tests.test_compile import _nvrtc_available
from tests.test_params import _compile_ok

needs_nvrtc = pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not loadable (install nvidia-cuda-nvrtc)")


def test_variant_fields_tags_and_perf_class():
    assert [f.name for f in Features.variant_fields()] == ["dropout", "local", "softcap", "partial_d", "seqused_k", "varlen", "split_kv", "paged", "alibi", "user_mod", "block_mask", "group_loop", "sinks"]
    cases = {(False, False): ("", "dense"), (True, False): ("_drop", "dropout"),
             (False, True): ("_local", "dense"), (True, True): ("_drop_local", "dropout")}
    for (drop, local), (tag, pc) in cases.items():
        f = Features("bfloat16", 64, dropout=drop, local=local)
        assert (f.tag(), f.perf_class()) == (tag, pc)
        assert f.cxx() == f"cuflash::Variant<{str(drop).lower()}, {str(local).lower()}, false, false, false, false, false, false, false, false, false, false, false>"
    assert Features("float16", 128) == Features("float16", 128, False, False, False, False)
    # softcap has its own class, but with dropout it keeps dropout's (local keeps its call's)
    assert Features("bfloat16", 64, local=True, softcap=True).perf_class() == "softcap"
    sc = Features("bfloat16", 64, dropout=True, local=True, softcap=True)
    assert (sc.tag(), sc.perf_class(), sc.cxx()) == ("_drop_local_softcap", "dropout",
                                                     "cuflash::Variant<true, true, true, false, false, false, false, false, false, false, false, false, false>")
    f = Features("bfloat16", 64, dropout=True, partial_d=True)  # a head dim below 64 on the d64 instance
    assert (f.tag(), f.perf_class(), f.cxx()) == ("_drop_pd", "dropout", "cuflash::Variant<true, false, false, true, false, false, false, false, false, false, false, false, false>")


def test_every_shell_passes_and_checks_the_variant():
    for fam in families.REGISTRY.values():
        cfg = fam.default(64)
        f = Features("bfloat16", 64, dropout=True, local=True)
        src = _compile.kernel_source(cfg, f)
        assert f"{fam.template}<true, {', '.join(map(str, cfg.template_args()))}, {f.cxx()}>" in src
        assert f.cxx_asserts() in src
        assert _compile.kernel_name(cfg, f).endswith("_drop_local")


@needs_nvrtc
def test_the_assert_catches_a_mirror_that_drifted():
    f = Features("bfloat16", 64, dropout=True)
    ok, log = _compile_ok('#include "attn/features.cuh"\n' + f.cxx_asserts())
    assert ok, log
    # the Python side listing the members in another order than the C++ template
    swapped = f.cxx_asserts().replace("Variant<true, false, false, false, false, false, false, false, false, false, false, false, false>", "Variant<false, true, false, false, false, false, false, false, false, false, false, false, false>")
    ok, log = _compile_ok('#include "attn/features.cuh"\n' + swapped)
    assert not ok and "cuflash::Variant differs from cuflash/features.py" in log


# (family, head_dim) -> spill bytes known for its windowed dropout instance: the Hopper backward's
# d128 tile, 12 B under NVRTC 13.5 with the store-warp dQ default (8 B with dq_bulk 2; none under
# 13.0 either way: the Philox rounds beside dK, dV, S^T and dP^T)
KNOWN_LOCAL_DROPOUT_SPILLS = {("bwd_sm90", 128): 12}


@needs_nvrtc
@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("fam", list(families.REGISTRY.values()), ids=lambda f: f.name)
def test_local_instances_compile(fam, drop):
    """The sliding-window (local) instances of every family's defaults compile for the family's
    target, with no spills on the sm90 families (whose consumers have a fixed register budget) but
    the known ones."""
    arch = "sm_90a" if fam.arch_specific else "sm_80"
    for d in (64, 128):
        features = Features("bfloat16", d, drop, local=True)
        if not fam.supports(features):
            continue
        cfg = fam.default(d, features=features)
        rep = _compile.compile_report(_compile.kernel_source(cfg, features), arch)
        assert rep["registers"] > 0, rep["log"]
        if fam.arch_specific:
            known = KNOWN_LOCAL_DROPOUT_SPILLS.get((fam.name, d), 0) if drop else 0
            assert rep["spill_stores"] <= known and "serialized" not in rep["log"].lower(), (cfg, rep["log"][-2000:])


def _causal_problem():
    def info(shape):
        strides, acc = [], 2
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
        return problem.ArrayInfo(shape, "float16", 2, tuple(strides), 1 << 20, 0)

    return problem.resolve_forward(info((2, 100, 3, 64)), info((2, 120, 3, 64)), info((2, 120, 3, 64)), CAUSAL, None)


def test_bounded_left_edge_selects_local_features():
    """The compile-time features follow the geometry: a bounded left edge (what a sliding window
    resolves to) selects the `local` kernels, which read window_left from the params struct."""
    p = _causal_problem()
    p = dataclasses.replace(p, strides={**p.strides, "out": p.strides["q"], "dout": p.strides["q"]})  # as a backward's
    assert not p.features.local
    windowed = dataclasses.replace(p, window_left=16)  # a sliding window of 17 keys
    assert windowed.features == dataclasses.replace(p.features, local=True)
    assert windowed.features.perf_class() == p.features.perf_class()  # same tuned tables
    for pack in (lambda q: params.pack_fwd(q, 2), lambda q: params.pack_bwd(q, 128, 1, 1)):
        assert pack(p)[0]["window_left"] == problem.UNBOUNDED
        assert pack(windowed)[0]["window_left"] == 16


def test_each_perf_class_has_the_features_it_is_tuned_with():
    from cuflash.features import PERF_CLASSES

    for pc in PERF_CLASSES:
        f = Features.of_class("bfloat16", 128, pc)
        assert f.perf_class() == pc and f.dtype == "bfloat16" and f.head_dim == 128
    assert Features.of_class("float16", 64, "softcap") == Features("float16", 64, softcap=True)
    assert Features.of_class("float16", 64, "alibi") == Features("float16", 64, alibi=True)
    with pytest.raises(ValueError, match="unknown perf class 'sinks'"):
        Features.of_class("float16", 64, "sinks")
    # ALiBi is its own class only beside no class of its own: dropout's and softcap's keep it
    assert Features("bfloat16", 64, alibi=True, local=True).perf_class() == "alibi"
    assert Features("bfloat16", 64, alibi=True, softcap=True).perf_class() == "softcap"
    assert Features("bfloat16", 64, alibi=True, dropout=True).perf_class() == "dropout"


def test_softcap_prefers_its_class_default_on_the_sm90_forward():
    """Softcap's class default (families.sm90: the 128-key tile without ping-pong, two Q stages, at d128, three
    consumers without ping-pong at d64, measured faster for softcap); other classes keep the head
    dim's defaults, and spilling tiles stay avoided (d64's ping-pong three consumers spill with softcap)."""
    fam = families.REGISTRY["fwd_sm90"]
    sc = fam.default(128, features=Features("bfloat16", 128, softcap=True))
    assert (sc.block_k, sc.pingpong, sc.q_stages) == (128, 0, 2)
    assert fam.default(128, features=Features("bfloat16", 128)) == fam.defaults[128][0]
    sc64 = fam.default(64, features=Features("bfloat16", 64, softcap=True))
    assert (sc64.consumers, sc64.pingpong, sc64.q_stages) == (3, 0, 2)
    assert not fam.avoids(sc64, Features("bfloat16", 64, softcap=True))
    assert fam.default(64, features=Features("bfloat16", 64)) == fam.defaults[64][0]
    assert sc in fam.selectable()
