"""resolve_forward and resolve_dropout on ArrayInfo records: every argument rule, the canonical mask,
features; no GPU needed (R1). The backward's rules: test_problem_backward.py."""
import math

import numpy as np
import pytest

from cuflash.features import Features
from cuflash.mask import CAUSAL, NO_MASK, MaskOptions
from cuflash.problem import UNBOUNDED, ArrayInfo, Dropout, resolve_dropout, resolve_forward


def info(shape=(2, 64, 4, 128), dtype="bfloat16", strides=None, ptr=1 << 20, device=0):
    if strides is None:  # contiguous, in bytes
        strides, acc = [], 2
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    return ArrayInfo(tuple(shape), dtype, 2 if dtype in ("bfloat16", "float16") else 4, tuple(strides), ptr, device)


def ok(**kw):
    return resolve_forward(info(), info(), info(), MaskOptions.of(causal=kw.get("causal", False)), kw.get("softmax_scale"))


def test_valid_problem_and_default_scale():
    p = ok()
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.heads, p.head_dim) == (2, 64, 64, 4, 128)
    assert math.isclose(p.softmax_scale, 1 / math.sqrt(128))
    p = resolve_forward(info((2, 5, 4, 64)), info((2, 9, 4, 64)), info((2, 9, 4, 64)), CAUSAL, 0.5)
    assert (p.seqlen_q, p.seqlen_k, p.causal, p.softmax_scale) == (5, 9, True, 0.5)


@pytest.mark.parametrize("q,k,v,exc,words", [
    (info(dtype="float32"), info(), info(), TypeError, "q has dtype float32"),
    (info(), info(dtype="float16"), info(), TypeError, "one dtype"),
    (info((64, 4, 128)), info(), info(), ValueError, "q must have 4 dimensions"),
    (info((2, 64, 4, 128, 1)), info(), info(), ValueError, "4 dimensions"),
    (info(), info((3, 64, 4, 128)), info((3, 64, 4, 128)), ValueError, "batch size differs"),
    (info(), info((2, 64, 3, 128)), info((2, 64, 3, 128)), ValueError,
     r"number of heads: q has 4, k and v have 3; q's heads must be a multiple of k and v's"),
    (info((2, 64, 2, 128)), info(), info(), ValueError, "q has 2, k and v have 4"),  # more k/v heads than q's
    (info(), info((2, 64, 0, 128), strides=(0,) * 4), info((2, 64, 0, 128), strides=(0,) * 4), ValueError,
     "q has 4, k and v have 0"),
    (info(), info((2, 64, 2, 128)), info((2, 64, 4, 128)), ValueError, r"k and v must have the same \(batch, seqlen, heads\)"),
    (info(), info((2, 64, 4, 64)), info((2, 64, 4, 64)), ValueError, "head_dim differs"),
    (info((2, 64, 4, 84)), info((2, 64, 4, 84)), info((2, 64, 4, 84)), ValueError, "head_dim must be a multiple of 8 between 8 and 256, got 84"),
        (info((2, 64, 4, 264)), info((2, 64, 4, 264)), info((2, 64, 4, 264)), ValueError, "head_dim must be a multiple of 8 between 8 and 256, got 264"),
    (info(), info(), info((2, 65, 4, 128)), ValueError, r"k and v must have the same \(batch, seqlen, heads\)"),
    (info(strides=(2 * 64 * 4 * 128 * 2, 4 * 128 * 2, 128 * 2 * 2, 4)), info(), info(), ValueError, "contiguous in its last dimension"),
    (info(ptr=(1 << 20) + 2), info(), info(), ValueError, "16-byte aligned"),
    (info(), info(strides=(64 * 4 * 136 * 2, 4 * 136 * 2 + 2, 136 * 2, 2)), info(), ValueError, "seqlen stride"),
    # empty arrays (zero strides, as CuPy gives them) are still checked for dtype, rank and shapes
    (info((0, 64, 4, 128), dtype="float32", strides=(0,) * 4), info(), info(), TypeError, "q has dtype float32"),
    (info((2, 0, 4, 4), strides=(0,) * 4), info((2, 64, 4, 4)), info((2, 64, 4, 4)), ValueError,
     "head_dim must be a multiple of 8 between 8 and 256, got 4"),
    (info((0, 64, 4, 128), strides=(0,) * 4), info(), info(), ValueError, "batch size differs"),
    (info(), info((2, 0, 4, 128), strides=(0,) * 4), info((2, 1, 4, 128)), ValueError, "same \\(batch, seqlen"),
    (info(), info(device=1), info(), ValueError, "one device"),
])
def test_bad_arguments(q, k, v, exc, words):
    with pytest.raises(exc, match=words):
        resolve_forward(q, k, v, NO_MASK, None)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -1.0])
def test_bad_scale(scale):
    with pytest.raises(ValueError, match="softmax_scale"):
        ok(softmax_scale=scale)


def test_bad_scale_type_and_causal():
    for bad in ("big", "0.5", True, np.bool_(True), b"1"):  # float() would take all but the first
        with pytest.raises(TypeError, match="softmax_scale"):
            ok(softmax_scale=bad)
    assert ok(softmax_scale=np.float32(0.5)).softmax_scale == 0.5 and ok(softmax_scale=2).softmax_scale == 2.0
    with pytest.raises(TypeError, match="causal"):
        ok(causal="yes")


def test_non_cupy_input_named():
    pytest.importorskip("cupy")
    from cuflash.problem import describe

    with pytest.raises(TypeError, match="k must be a CuPy array"):
        describe(np.zeros((1, 1, 1, 64)), "k")


# ---------------------------------------------------------------------------- canonical mask

@pytest.mark.parametrize("nq,nk", [(5, 9), (9, 5), (64, 64)])
def test_canonical_mask(nq, nk):
    q, kv = info((1, nq, 1, 64)), info((1, nk, 1, 64))
    causal = resolve_forward(q, kv, kv, CAUSAL, None)
    assert (causal.window_left, causal.window_right, causal.offset) == (UNBOUNDED, 0, nk - nq)
    assert causal.causal is True
    full = resolve_forward(q, kv, kv, NO_MASK, None)
    assert (full.window_left, full.window_right, full.offset) == (UNBOUNDED, UNBOUNDED, nk - nq)
    assert full.causal is False


def _visible(p):
    """The 0/1 mask the canonical (window_left, window_right, offset) describes."""
    return [[int(i + p.offset - p.window_left <= j <= i + p.offset + p.window_right and j < p.seqlen_k)
             for j in range(p.seqlen_k)] for i in range(p.seqlen_q)]


def test_canonical_mask_is_bottom_right_causal():
    q, kv = info((1, 3, 1, 64)), info((1, 5, 1, 64))
    assert _visible(resolve_forward(q, kv, kv, CAUSAL, None)) == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert _visible(resolve_forward(kv, q, q, CAUSAL, None)) == [[0, 0, 0], [0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert _visible(resolve_forward(q, kv, kv, NO_MASK, None)) == [[1] * 5] * 3
    assert UNBOUNDED == 1 << 30  # the value the kernels will share (2^31 - 1 would overflow i + offset + it)


# ------------------------------------------------------------------------- layout and features

def test_strides_in_elements():
    # q a slice of a packed (B, N, 3, H, D) qkv array: element strides, head_dim's left out
    packed = (64 * 3 * 4 * 128 * 2, 3 * 4 * 128 * 2, 128 * 2, 2)
    p = resolve_forward(info(strides=packed), info(), info(), NO_MASK, None)
    assert p.strides == {"q": (64 * 3 * 4 * 128, 3 * 4 * 128, 128), "k": (64 * 4 * 128, 4 * 128, 128),
                         "v": (64 * 4 * 128, 4 * 128, 128)}
    assert (p.dtype, p.device, p.deterministic, p.dropout) == ("bfloat16", 0, False, None)


def test_features_and_perf_class():
    p = ok()
    assert p.features == Features("bfloat16", 128, False)
    assert (p.features.tag(), p.features.perf_class()) == ("", "dense")
    drop = resolve_dropout(0.1, 7)
    p = resolve_forward(info(dtype="float16"), info(dtype="float16"), info(dtype="float16"), CAUSAL, None, drop)
    assert p.features == Features("float16", 128, True) and p.dropout is drop
    assert (p.features.tag(), p.features.perf_class()) == ("_drop", "dropout")


# ------------------------------------------------------------------------------------ dropout

def test_dropout_resolution():
    assert resolve_dropout(0.0, None) is None
    assert resolve_dropout(0, 5) is None  # a seed without dropout is checked, then unused
    assert resolve_dropout(1e-6, 3) is None  # below the 1/65536 quantum: nothing is dropped
    d = resolve_dropout(0.25, 2**64 - 1)
    assert isinstance(d, Dropout) and (d.p, d.seed) == (0.25, 2**64 - 1)
    seed, threshold, scale = d.kernel_args
    assert (seed.dtype, threshold.dtype, scale.dtype) == (np.uint64, np.uint32, np.float32)
    assert (int(seed), int(threshold), scale) == (2**64 - 1, 16384, np.float32(65536 / (65536 - 16384)))


@pytest.mark.parametrize("p,seed,exc,words", [
    (None, None, TypeError, r"dropout_p must be a float in \[0, 1\), got None"),
    (True, 1, TypeError, "dropout_p must be a float"),
    (1.0, 1, ValueError, "dropout_p must be a float"),
    (float("nan"), 1, ValueError, "dropout_p must be a float"),
    (0.1, None, ValueError, "seed is required when dropout_p > 0"),
    (0.1, -1, ValueError, "seed must be an int"),
    (0.1, 1.5, TypeError, "seed must be an int"),
])
def test_bad_dropout(p, seed, exc, words):
    with pytest.raises(exc, match=words):
        resolve_dropout(p, seed)


@pytest.mark.parametrize("flag", [np.bool_(True), np.bool_(False), np.int64(1), np.uint8(0)])
def test_numpy_scalars_are_accepted_as_flags(flag):
    from cuflash.problem import check_flag

    assert check_flag(flag, "causal") is bool(flag)
    assert ok(causal=flag).causal is bool(flag)


def test_numpy_scalars_are_rejected_when_not_bools():
    from cuflash.problem import check_flag

    for bad in (np.int64(2), np.float64(1.0), np.array([True])):
        with pytest.raises(TypeError, match="causal must be a bool"):
            check_flag(bad, "causal")


@pytest.mark.parametrize("seed", [np.uint64(2**64 - 1), np.int64(7), np.uint32(3)])
def test_numpy_integer_seeds(seed):
    d = resolve_dropout(np.float32(0.25), seed)
    assert d.seed == int(seed) and type(d.seed) is int


Z = (0, 0, 0, 0)  # CuPy's strides for an empty array


@pytest.mark.parametrize("qs,ks", [
    ((0, 64, 4, 128), (0, 64, 4, 128)),  # batch 0
    ((2, 0, 4, 128), (2, 64, 4, 128)),  # seqlen_q 0
    ((2, 64, 4, 128), (2, 0, 4, 128)),  # seqlen_k 0: every row sees no key
    ((2, 0, 4, 128), (2, 0, 4, 128)),
    ((2, 64, 0, 128), (2, 64, 0, 128)),  # no heads
])
@pytest.mark.parametrize("causal", [False, True])
def test_empty_problems_resolve(qs, ks, causal):
    """Empty arrays are valid (FlashAttention and PyTorch accept them): whatever their strides and
    pointer, the problem is `empty` and nothing is launched (tests/gpu/test_empty_gpu.py)."""
    q = info(qs, strides=Z if 0 in qs else None, ptr=0 if 0 in qs else 1 << 20)
    kv = info(ks, strides=Z if 0 in ks else None, ptr=0 if 0 in ks else 1 << 20)
    p = resolve_forward(q, kv, kv, MaskOptions.of(causal=causal), None)
    assert p.empty and (p.batch, p.seqlen_q, p.seqlen_k, p.heads) == (qs[0], qs[1], ks[1], qs[2])
    assert not ok().empty


@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 2), (8, 1), (32, 8), (6, 3)])
@pytest.mark.parametrize("nq,nk", [(64, 64), (17, 130), (130, 17)])
def test_gqa_problems(h, hkv, nq, nk):
    """k and v may have fewer heads than q when they divide them (GQA; MQA with one): heads_kv and
    the group; everything else as for MHA (square or not)."""
    p = resolve_forward(info((2, nq, h, 64)), info((2, nk, hkv, 64)), info((2, nk, hkv, 64)), CAUSAL, None)
    assert (p.heads, p.heads_kv, p.group) == (h, hkv, h // hkv)
    assert (p.seqlen_q, p.seqlen_k, p.offset) == (nq, nk, nk - nq)
    assert p.strides["k"] == p.strides["v"] == (nk * hkv * 64, hkv * 64, 64)
    assert p.features == Features("bfloat16", 64, False)  # no new instantiation: the group is a runtime value


def test_gqa_empty_problems():
    p = resolve_forward(info((2, 64, 0, 128), strides=Z), info((2, 64, 2, 128)), info((2, 64, 2, 128)), NO_MASK, None)
    assert p.empty
    p = resolve_forward(info((0, 64, 4, 128), strides=Z), info((0, 64, 1, 128), strides=Z),
                        info((0, 64, 1, 128), strides=Z), NO_MASK, None)
    assert p.empty and p.group == 4
