"""Argument validation on ArrayInfo records: every rule, no GPU needed (R1)."""
import math

import pytest

from cuflash._validate import ArrayInfo, check_forward


def info(shape=(2, 64, 4, 128), dtype="bfloat16", strides=None, ptr=1 << 20, device=0):
    if strides is None:  # contiguous, in bytes
        strides, acc = [], 2
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    return ArrayInfo(tuple(shape), dtype, 2 if dtype in ("bfloat16", "float16") else 4, tuple(strides), ptr, device)


def ok(**kw):
    return check_forward(info(), info(), info(), kw.get("causal", False), kw.get("softmax_scale"))


def test_valid_problem_and_default_scale():
    p = ok()
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.heads, p.head_dim) == (2, 64, 64, 4, 128)
    assert math.isclose(p.softmax_scale, 1 / math.sqrt(128))
    p = check_forward(info((2, 5, 4, 64)), info((2, 9, 4, 64)), info((2, 9, 4, 64)), True, 0.5)
    assert (p.seqlen_q, p.seqlen_k, p.causal, p.softmax_scale) == (5, 9, True, 0.5)


@pytest.mark.parametrize("q,k,v,exc,words", [
    (info(dtype="float32"), info(), info(), TypeError, "q has dtype float32"),
    (info(), info(dtype="float16"), info(), TypeError, "one dtype"),
    (info((64, 4, 128)), info(), info(), ValueError, "q must have 4 dimensions"),
    (info((2, 64, 4, 128, 1)), info(), info(), ValueError, "4 dimensions"),
    (info(), info((3, 64, 4, 128)), info((3, 64, 4, 128)), ValueError, "batch size differs"),
    (info(), info((2, 64, 2, 128)), info((2, 64, 2, 128)), ValueError, "number of heads differs"),
    (info(), info((2, 64, 4, 64)), info((2, 64, 4, 64)), ValueError, "head_dim differs"),
    (info((2, 64, 4, 96)), info((2, 64, 4, 96)), info((2, 64, 4, 96)), ValueError, "head_dim 96 is not supported; supported head dims: 64, 128"),
    (info(), info(), info((2, 65, 4, 128)), ValueError, "k and v must have the same shape"),
    (info(strides=(2 * 64 * 4 * 128 * 2, 4 * 128 * 2, 128 * 2 * 2, 4)), info(), info(), ValueError, "contiguous in its last dimension"),
    (info(ptr=(1 << 20) + 2), info(), info(), ValueError, "16-byte aligned"),
    (info(), info(strides=(64 * 4 * 136 * 2, 4 * 136 * 2 + 2, 136 * 2, 2)), info(), ValueError, "seqlen stride"),
    (info((2, 0, 4, 128)), info(), info(), ValueError, "seqlen of q must be >= 1"),
    (info(), info((2, 0, 4, 128)), info((2, 0, 4, 128)), ValueError, "seqlen of k and v must be >= 1"),
    (info((0, 64, 4, 128)), info((0, 64, 4, 128)), info((0, 64, 4, 128)), ValueError, "batch size must be >= 1"),
    (info(), info(device=1), info(), ValueError, "one device"),
])
def test_bad_arguments(q, k, v, exc, words):
    with pytest.raises(exc, match=words):
        check_forward(q, k, v, False, None)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 0.0, -1.0])
def test_bad_scale(scale):
    with pytest.raises(ValueError, match="softmax_scale"):
        ok(softmax_scale=scale)


def test_bad_scale_type_and_causal():
    with pytest.raises(TypeError, match="softmax_scale"):
        ok(softmax_scale="big")
    with pytest.raises(TypeError, match="causal"):
        ok(causal="yes")


def test_non_cupy_input_named():
    np = pytest.importorskip("numpy")
    pytest.importorskip("cupy")
    from cuflash._validate import describe

    with pytest.raises(TypeError, match="k must be a CuPy array"):
        describe(np.zeros((1, 1, 1, 64)), "k")
