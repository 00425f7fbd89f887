"""User score and mask modifications (cuflash.ScoreMod), on the CPU: the snippets' C++, their compile
for every forward family (sm_80, sm_90a), errors that name the snippet's line, the kernel names and
plan inputs, the units the host sets, the reference's semantics."""
import types

import numpy as np
import pytest

from cuflash import _compile, families, problem, reference
from cuflash.features import Features
from cuflash.params import LOG2E, pack_fwd
from cuflash.score_mods import ModSource, ScoreMod, ScoreModError, compile_error

SOFTCAP = ModSource(score="30.f * tanhf(score / 30.f)")
BAND = ModSource(mask="kv_idx <= q_idx && q_idx - kv_idx < 256")
DOCS = ModSource(score="score + bias[h * 4096 + kv_idx]", mask="doc[q_idx] == doc[kv_idx]",
                 aux=(("bias", "float"), ("doc", "int")))
BODY = ModSource(score="float d = (float)(q_idx - kv_idx);\nreturn score - 0.125f * fabsf(d);")


def _nvrtc_available():
    from tests.test_compile import _nvrtc_available as probe

    return probe()


needs_nvrtc = pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not loadable (install nvidia-cuda-nvrtc)")


def test_snippets_become_one_specialisation_with_line_directives():
    cxx = DOCS.cxx()
    assert "template <> struct UserModDefs<true>" in cxx
    assert "static constexpr bool kScore = true;" in cxx and "static constexpr bool kMask = true;" in cxx
    assert 'static_cast<const float*>(cuflash_aux[0])' in cxx and 'static_cast<const int*>(cuflash_aux[1])' in cxx
    assert '#line 1 "score_mod"\nreturn (score + bias[h * 4096 + kv_idx]);' in cxx
    assert '#line 1 "mask_mod"\nreturn (doc[q_idx] == doc[kv_idx]);' in cxx
    # a body stays as written; a mask-only modification gets the identity score
    assert '#line 1 "score_mod"\nfloat d = (float)(q_idx - kv_idx);\nreturn score - 0.125f * fabsf(d);' in BODY.cxx()
    assert "static float score(float s, int, int, int, int, const void* const*) { return s; }" in BAND.cxx()
    assert "kScore = false" in BAND.cxx()


def test_each_snippet_is_its_own_kernel():
    names = set()
    for m in (SOFTCAP, BAND, DOCS, BODY):
        f = Features("bfloat16", 128, user_mod=True, mod=m)
        assert f.tag() == "_mod" + m.digest()
        names.add(_compile.kernel_name(families.FWD.default(128), f))
        assert f != Features("bfloat16", 128, user_mod=True, mod=ModSource(score=m.score, mask=m.mask, aux=()))  \
            or not m.aux
    assert len(names) == 4
    assert Features("bfloat16", 128).tag() == ""


def test_the_v2_families_take_user_modifications():
    f = Features("bfloat16", 128, user_mod=True, mod=SOFTCAP)
    assert sorted(fam.name for fam in families.REGISTRY.values() if fam.supports(f)) == ["bwd", "bwd_dq", "bwd_sm90",
                                                                                          "fwd", "fwd_sm90"]
    assert "user score/mask modifications (score_mod)" in families.FWD_V1._unsupported_part(f)
    bwd = _compile.kernel_source(families.BWD.default(128), f)
    assert bwd.rstrip().endswith("nullptr, nullptr, nullptr, mod_aux, nullptr, nullptr, p);\n}"), bwd[-300:]
    sm90b = _compile.kernel_source(families.BWD_SM90.default(128), f)
    assert "(tq, tk, tv, tdo, lse2, delta, dq_acc, dk, dv, dq_sem, nullptr, nullptr, nullptr, mod_aux, nullptr, nullptr, p);" in sm90b
    src = _compile.kernel_source(families.FWD.default(128), f)
    assert "const void* const* __restrict__ mod_aux, " in src
    assert "(q, k, v, out, lse, nullptr, nullptr, nullptr, nullptr, mod_aux, nullptr, nullptr, nullptr, p);" in src
    sm90 = _compile.kernel_source(families.FWD_SM90.default(128), f)
    assert "(tq, tk, tv, out, lse, tile_counter, nullptr, nullptr, nullptr, mod_aux, nullptr, nullptr, nullptr, p);" in sm90
    with pytest.raises(ValueError, match="needs its snippets"):
        _compile.kernel_source(families.FWD.default(128), Features("bfloat16", 128, user_mod=True))


@needs_nvrtc
@pytest.mark.parametrize("mod", [SOFTCAP, BAND, DOCS, BODY], ids=["softcap", "band", "docs", "body"])
@pytest.mark.parametrize("fam", [families.FWD, families.FWD_SM90], ids=lambda f: f.name)
@pytest.mark.parametrize("d", [64, 128])
def test_snippets_compile_and_some_tile_does_not_spill(fam, d, mod):
    """Every snippet compiles in every forward family; the per-snippet tile choice
    (families._tile_for_snippet) finds a default tile that does not spill with it."""
    f = Features("bfloat16", d, user_mod=True, mod=mod)
    arch = "sm_90a" if fam.arch_specific else "sm_90"
    props = types.SimpleNamespace(smem_optin=227 * 1024, arch="sm_90", arch_specific="sm_90a")
    tile = families._tile_for_snippet(fam, types.SimpleNamespace(features=f), props, None)
    rep = _compile.compile_report(_compile.kernel_source(tile, f), arch)
    assert rep["registers"] > 0 and rep["spill_stores"] == 0, (tile, rep["log"][-1500:])


@needs_nvrtc
def test_the_tile_check_keeps_its_cubin_for_the_load():
    """A snippet's tile check (compile_report) keeps the cubin it compiled, so that the first call
    loads it instead of compiling the same source again (_compile.get_kernel); only a few are kept."""
    # a snippet no other test compiles: compile_report is cached per process, and an earlier test's
    # cubin of a shared source may have been dropped since (8 kept)
    mod = ModSource(mask="kv_idx <= q_idx + 4321")
    f = Features("bfloat16", 64, user_mod=True, mod=mod)
    src = _compile.kernel_source(families.FWD_SM90.default(64), f)
    _compile.compile_report(src, "sm_90a")
    cubin = _compile._kept_cubin(src, "sm_90a")
    assert cubin is not None and cubin[:4] == b"\x7fELF"
    assert _compile._kept_cubin(src, "sm_90") is None  # another target's binary is never taken
    plain = _compile.kernel_source(families.FWD_SM90.default(64), Features("bfloat16", 64))
    _compile.compile_report(plain, "sm_90a")
    assert _compile._kept_cubin(plain, "sm_90a") is None  # plain instances load through CuPy's cache
    for i in range(_compile._CUBINS_KEPT + 1):
        _compile._keep_cubin(("x", str(i)), b"")
    assert len(_compile._cubins) == _compile._CUBINS_KEPT and _compile._kept_cubin(src, "sm_90a") is None


CAP_GRAD = ModSource(score="30.f * tanhf(score / 30.f)", grad="const float t = tanhf(score / 30.f);\nreturn 1.f - t * t;")
BIAS_GRAD = ModSource(score="score + bias[h * 4096 + kv_idx]", grad="1.f", mask="doc[q_idx] == doc[kv_idx]",
                      aux=(("bias", "float"), ("doc", "int")))


@needs_nvrtc
@pytest.mark.parametrize("mod", [CAP_GRAD, BAND, BIAS_GRAD], ids=["cap", "band", "bias+docs"])
@pytest.mark.parametrize("fam", [families.BWD, families.BWD_DQ, families.BWD_SM90], ids=lambda f: f.name)
@pytest.mark.parametrize("d", [64, 128])
def test_backward_snippets_compile(fam, d, mod):
    """The backward families compile every kind of snippet; the sm80 ones find a tile without spills
    for the cap and the band (NVRTC 13.5: with a bias and a document mask, three aux loads per score,
    the d128 dQ tiles spill 24-36 B and the sm90 backward's 48-80 B; the least spilling is taken)."""
    f = Features("bfloat16", d, user_mod=True, mod=mod)
    props = types.SimpleNamespace(smem_optin=227 * 1024, arch="sm_90", arch_specific="sm_90a")
    tile = families._tile_for_snippet(fam, types.SimpleNamespace(features=f), props, None)
    rep = _compile.compile_report(_compile.kernel_source(tile, f), "sm_90a" if fam.arch_specific else "sm_90")
    assert rep["registers"] > 0
    if not fam.arch_specific and mod is not BIAS_GRAD:
        assert rep["spill_stores"] == 0, (tile, rep["log"][-1500:])
    assert "#line 1 \"score_grad\"" in mod.cxx() or mod.grad is None


@needs_nvrtc
def test_a_broken_snippet_names_its_own_line():
    bad = ModSource(score="float x = score * 2.f;\nreturn x + undefined_thing;")
    f = Features("bfloat16", 128, user_mod=True, mod=bad)
    with pytest.raises(ScoreModError) as e:
        _compile.compile_report(_compile.kernel_source(families.FWD.default(128), f), "sm_80")
    msg = str(e.value)
    assert "score_mod(2)" in msg and "undefined_thing" in msg and "score_mod line 2: return x + undefined_thing;" in msg
    grad_bad = ModSource(score="score", grad="return nope;")
    with pytest.raises(ScoreModError, match=r"score_grad\(1\).*nope"):
        _compile.compile_report(_compile.kernel_source(families.BWD.default(128),
                                                       Features("bfloat16", 128, user_mod=True, mod=grad_bad)), "sm_80")
    mask_bad = ModSource(mask="doc[q_idx] == doc[kv_idx]")
    with pytest.raises(ScoreModError, match=r"mask_mod\(1\).*doc"):
        _compile.compile_report(_compile.kernel_source(families.FWD_SM90.default(128),
                                                       Features("bfloat16", 128, user_mod=True, mod=mask_bad)), "sm_90a")


def test_compile_error_ignores_logs_that_blame_no_snippet():
    assert compile_error("cuflash_shell.cu(12): error: something else", SOFTCAP) is None


def test_score_mod_arguments_are_checked():
    with pytest.raises(ValueError, match="needs a score snippet, a mask snippet or both"):
        ScoreMod()
    with pytest.raises(ValueError, match="score must be a non-empty string"):
        ScoreMod("   ")
    with pytest.raises(ValueError, match="mask must be a non-empty string"):
        ScoreMod(mask=3)
    with pytest.raises(ValueError, match="give score too"):
        ScoreMod(mask="true", grad="1.f")
    for name in ("q_idx", "2x", "a-b", "__x", "cuflash"):
        with pytest.raises(ValueError, match="must be a C identifier"):
            ScoreMod("score", aux={name: None})
    with pytest.raises(ValueError, match="at most 8"):
        ScoreMod("score", aux={f"a{i}": None for i in range(9)})
    with pytest.raises(TypeError, match="must be a CuPy array or support DLPack"):
        ScoreMod("score", aux={"bias": [1.0, 2.0]})
    m = ScoreMod("score * 2.f", mask="kv_idx <= q_idx")
    assert m.source == ModSource(score="score * 2.f", mask="kv_idx <= q_idx") and m.aux == ()
    assert "ScoreMod(score='score * 2.f', mask='kv_idx <= q_idx')" == repr(m)


def _problem(**kw):
    from cuflash.mask import MaskOptions
    from tests.test_problem_backward import info

    q, k, v = (info((2, 64, 4, 128)) for _ in range(3))
    return problem.resolve_forward(q, k, v, MaskOptions.of(**kw), None, None)


def test_a_score_snippet_runs_in_softmax_units_and_replaces_softcap():
    p = _problem()
    with pytest.raises(TypeError, match="score_mod must be a cuflash.ScoreMod"):
        problem.with_score_mod(p, "score")
    pm = problem.with_score_mod(p, ScoreMod("score * 0.5f"))
    assert pm.features.user_mod and pm.features.mod.score == "score * 0.5f"
    a = pack_fwd(pm, 1)
    assert a["scale_log2"][0] == np.float32(LOG2E) and a["softcap_scale"][0] == np.float32(p.softmax_scale)
    masked = pack_fwd(problem.with_score_mod(p, ScoreMod(mask="kv_idx <= q_idx")), 1)
    assert masked["scale_log2"][0] == np.float32(p.softmax_scale * LOG2E) and masked["softcap_scale"][0] == 0
    capped = _problem(softcap=5.0)
    with pytest.raises(ValueError, match="write the cap in the snippet"):
        problem.with_score_mod(capped, ScoreMod("score"))
    assert problem.with_score_mod(capped, ScoreMod(mask="kv_idx <= q_idx")).features.softcap


def test_plans_take_the_aux_table_after_the_slopes():
    from cuflash._forward import with_mod_inputs

    p = _problem()
    assert with_mod_inputs(p, ("q",)) == ("q",)
    pm = problem.with_score_mod(p, ScoreMod(mask="kv_idx <= q_idx"))
    assert with_mod_inputs(pm, ("q",)) == ("q", "mod_aux")


def test_the_reference_applies_a_modification_before_the_mask_and_alibi():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 9, 3, 16)) for _ in range(3))
    slopes = np.array([0.5, 0.25, 0.125])
    capped = reference.attention_naive(q, k, v, causal=True, softcap=4.0, alibi_slopes=slopes)
    mod = reference.attention_naive(q, k, v, causal=True, alibi_slopes=slopes,
                                    score_mod=lambda s, b, h, qi, kj: 4.0 * np.tanh(s / 4.0))
    np.testing.assert_array_equal(capped[0], mod[0])
    band = reference.attention_naive(q, k, v, window_size=(3, 0))
    as_mask = reference.attention_naive(q, k, v, mask_mod=lambda b, h, qi, kj: (kj <= qi) & (qi - kj <= 3))
    np.testing.assert_array_equal(band[0], as_mask[0])
