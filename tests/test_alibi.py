"""ALiBi (issue 13) without a GPU: the reference's bias, the slopes' checks, the kernel parameters,
the generated shells and the compiles of the instances the package would pick."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cuflash import _compile, families, params
from cuflash.features import Features
from cuflash.mask import NO_MASK, MaskOptions
from cuflash.problem import check_alibi_slopes, resolve_forward, with_alibi
from cuflash.reference import alibi_bias, attention_naive
from tests.test_problem_backward import info  # ArrayInfo of a C-contiguous array

B, NQ, NK, H, D = 2, 5, 9, 4, 64


def test_bias_is_minus_slope_times_distance_to_the_diagonal():
    slopes = np.array([0.5, 0.25, 0.125, 1.0])
    bias = alibi_bias(NQ, NK, slopes, B, H)
    assert bias.shape == (B, H, NQ, NK)
    for b in range(B):
        for h in range(H):
            for i in range(NQ):
                for j in range(NK):
                    assert bias[b, h, i, j] == -slopes[h] * abs(i + NK - NQ - j)
    top = alibi_bias(NQ, NK, slopes, B, H, "top_left")
    assert top[0, 1, 3, 1] == -0.25 * 2
    per_batch = np.arange(B * H, dtype=np.float64).reshape(B, H) / 8
    assert alibi_bias(NQ, NK, per_batch, B, H)[1, 2, 0, 0] == -per_batch[1, 2] * (NK - NQ)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        alibi_bias(NQ, NK, np.ones(H + 1), B, H)


def test_reference_adds_the_bias_after_softcap_and_before_the_mask():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, n, H, D)) for n in (NQ, NK, NK))
    slopes = rng.uniform(0.05, 1.0, H)
    mask = MaskOptions.of(causal=True, softcap=3.0)
    out, lse = attention_naive(q, k, v, causal=mask, alibi_slopes=slopes)
    scale = 1 / math.sqrt(D)
    for b, h, i in ((0, 0, 0), (1, 3, NQ - 1), (1, 2, 2)):
        s = 3.0 * np.tanh(scale * (k[b, :, h] @ q[b, i, h]) / 3.0) - slopes[h] * np.abs(i + NK - NQ - np.arange(NK))
        s[np.arange(NK) > i + NK - NQ] = -np.inf
        p = np.exp(s - s.max())
        np.testing.assert_allclose(out[b, i, h], (p / p.sum()) @ v[b, :, h], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[b, h, i], s.max() + np.log(p.sum()), rtol=1e-12)
    plain = attention_naive(q, k, v, causal=True)[0]
    np.testing.assert_array_equal(attention_naive(q, k, v, causal=True, alibi_slopes=np.zeros(H))[0], plain)


def test_slopes_are_checked_naming_the_argument():
    p = resolve_forward(info((B, NQ, H, D)), info((B, NK, H, D)), info((B, NK, H, D)), NO_MASK, None)
    assert with_alibi(p, None) is p
    assert (with_alibi(p, info((H,), "float32")).alibi_sb, with_alibi(p, info((B, H), "float32")).alibi_sb) == (0, H)
    assert with_alibi(p, info((H,), "float32")).features.alibi
    bad = [(info((H,), "float16"), TypeError, "alibi_slopes must be float32"),
           (info((H + 1,), "float32"), ValueError, r"shape \(heads,\) = \(4,\) or \(batch, heads\) = \(2, 4\)"),
           (info((H, B), "float32"), ValueError, "alibi_slopes must have shape"),
           (info((B, H), "float32", strides=(4, 8)), ValueError, "C-contiguous"),
           (info((H,), "float32", ptr=(1 << 20) + 2), ValueError, "4-byte aligned"),
           (info((H,), "float32", device=1), ValueError, "on q's device 0")]
    for slopes, err, match in bad:
        with pytest.raises(err, match=match):
            check_alibi_slopes(slopes, B, H, 0)


def test_params_carry_the_scale_to_score_units_and_the_batch_stride():
    base = resolve_forward(info((B, NQ, H, D)), info((B, NK, H, D)), info((B, NK, H, D)), NO_MASK, 0.2)
    a = params.pack_fwd(with_alibi(base, info((B, H), "float32")), 1)[0]
    assert (a["alibi_scale"], a["alibi_sb"]) == (np.float32(1 / 0.2), H)
    capped = resolve_forward(info((B, NQ, H, D)), info((B, NK, H, D)), info((B, NK, H, D)),
                             MaskOptions.of(softcap=30.0), 0.2)
    assert params.pack_fwd(with_alibi(capped, info((H,), "float32")), 1)[0]["alibi_scale"] == np.float32(1 / 30.0)
    plain = params.pack_fwd(base, 1)[0]
    assert (plain["alibi_scale"], plain["alibi_sb"]) == (0, 0)


def test_the_v2_families_take_alibi_and_their_shells_pass_nullptr_for_the_rest():
    f = Features("bfloat16", 128, alibi=True)
    assert sorted(fam.name for fam in families.REGISTRY.values() if fam.supports(f)) == ["bwd", "bwd_dq", "bwd_sm90",
                                                                                          "fwd", "fwd_sm90"]
    for fam in (families.BWD, families.BWD_DQ):
        src = _compile.kernel_source(fam.default(128, features=f), f)
        assert src.rstrip().endswith("nullptr, nullptr, alibi_slopes, nullptr, nullptr, nullptr, p);\n}"), src[-300:]
    assert "ALiBi (alibi_slopes)" in families.FWD_V1._unsupported_part(f)
    sm90 = _compile.kernel_source(families.FWD_SM90.default(128, features=f), f)
    assert "(tq, tk, tv, out, lse, tile_counter, nullptr, nullptr, alibi_slopes, nullptr, nullptr, nullptr, nullptr, p);" in sm90
    sm90b = _compile.kernel_source(families.BWD_SM90.default(128, features=f), f)
    assert "(tq, tk, tv, tdo, lse2, delta, dq_acc, dk, dv, dq_sem, nullptr, nullptr, alibi_slopes, nullptr, nullptr, nullptr, p);" in sm90b
    cfg = families.FWD.default(128, features=f)
    src = _compile.kernel_source(cfg, f)
    assert "const float* __restrict__ alibi_slopes, " in src and "_alibi(" in src
    assert "(q, k, v, out, lse, nullptr, nullptr, nullptr, alibi_slopes, nullptr, nullptr, nullptr, nullptr, p);" in src
    varlen = _compile.kernel_source(cfg, Features("bfloat16", 128, varlen=True))
    assert "(q, k, v, out, lse, nullptr, cu_seqlens_q, cu_seqlens_k, nullptr, nullptr, nullptr, nullptr, nullptr, p);" in varlen
    assert "alibi_slopes" not in varlen.split("{")[0]  # not a kernel parameter without ALiBi
    # d64's first default (252 registers plain) fits ALiBi since the distance is converted once per row
    assert families.FWD.default(64, features=Features("bfloat16", 64, alibi=True)) == families.FWD.defaults[64][0]


def _nvrtc_available():
    from tests.test_compile import _nvrtc_available as probe

    return probe()


# (head dim, extra variants): every head dim alone, the combinations at 64, 128 and 256
CASES = [(d, ()) for d in (32, 64, 96, 128, 192, 256)] + [
    (d, extra) for d in (64, 128, 256)
    for extra in (("softcap",), ("local",), ("dropout",), ("varlen",), ("seqused_k", "split_kv"), ("local", "softcap"))]


# The sm90 backward's default tiles with ALiBi and these extras: known spill bytes (none since acc_dq
# stopped living around the consumers' loop, NVRTC 13.0 and 13.5; they spilled 4-20 B), but for
# variable-length batches at d128: 4 B under NVRTC 13.0 (the H200's; none under 13.5), the same
# for every tile since varlen adds dQ by atomics whatever its dq_bulk
KNOWN_SM90_BWD_SPILLS: dict = {(128, ("varlen",)): 4,
                               # and with dropout (the Philox rounds): 8 B under 13.5 (none under 13.0),
                               # 12-24 B with softcap too; the store-warp dQ tile (dq_bulk 4) 12 B under
                               # 13.5 (none under 13.0; 8-20 B with softcap)
                               (128, ("dropout",)): 12, (128, ("dropout", "softcap")): 24}


# The sm90 forward's d64 default (three consumers, 128-key ping-pong tile) with ALiBi's split form,
# which ran 3-7% faster than the whole bias per score despite these (kernels_cu/sm90/fwd.cuh
# kAlibiSplit; H100, docs/bench/h100-alibi-split3c-ab-2026-12-06b.log): spill bytes, NVRTC 13.0 and 13.5
KNOWN_SM90_FWD_SPILLS: dict = {(64, ()): 12, (64, ("local",)): 16}


@pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not loadable (install nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("d,extra", CASES + [(d, ("dropout", "softcap")) for d in (64, 128)],
                         ids=lambda x: "+".join(x) if isinstance(x, tuple) else str(x))
@pytest.mark.parametrize("fam", [families.FWD, families.FWD_SM90, families.BWD, families.BWD_DQ, families.BWD_SM90],
                         ids=lambda f: f.name)
def test_alibi_instances_compile_without_spills(fam, d, extra):
    """The tile the package picks for an ALiBi call (the family's default for the call's features,
    which skips the tiles marked as spilling) compiles for sm_80 and sm_90a without spills (the sm90
    backward and the sm90 forward at d64: no more than their known ones)."""
    f = Features("bfloat16", d, alibi=True, **{e: True for e in extra})
    if not fam.supports(f):
        pytest.skip(f"{fam.name} has no instance for {f}")
    cfg = fam.default(d, features=f)
    for arch in ("sm_90a",) if fam.arch_specific else ("sm_80", "sm_90a"):
        rep = _compile.compile_report(_compile.kernel_source(cfg, f), arch)
        assert rep["registers"] > 0, rep["log"][-2000:]
        known = (KNOWN_SM90_BWD_SPILLS.get((d, extra), 0) if fam is families.BWD_SM90
                 else KNOWN_SM90_FWD_SPILLS.get((d, extra), 0) if fam is families.FWD_SM90 else 0)
        assert rep["spill_stores"] <= known, (cfg, f, arch, rep["log"][-2000:])
        assert "serialized" not in rep["log"].lower(), (cfg, rep["log"][-2000:])
