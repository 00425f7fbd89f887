"""The backward's argument checks (resolve_backward) on ArrayInfo records: no GPU needed."""
import math

import pytest

from cuflash.mask import MaskOptions
from cuflash.problem import UNBOUNDED, ArrayInfo, resolve_backward

B, NQ, NK, H, D = 2, 64, 80, 4, 128


def info(shape, dtype="bfloat16", strides=None, ptr=1 << 20, device=0):
    """A (batch, seqlen, heads, head_dim) array record, contiguous unless strides (bytes) are given."""
    itemsize = 4 if dtype == "float32" else 2
    if strides is None:
        strides, acc = [], itemsize
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    return ArrayInfo(tuple(shape), dtype, itemsize, tuple(strides), ptr, device)


def lse_info(shape=(B, H, NQ), dtype="float32", strides=None, ptr=1 << 21, device=0):
    """The lse record: float32 (batch, heads, seqlen_q) unless told otherwise."""
    return info(shape, dtype, strides, ptr, device)


def args(**over):
    a = dict(dout=info((B, NQ, H, D)), q=info((B, NQ, H, D)), k=info((B, NK, H, D)), v=info((B, NK, H, D)),
             out=info((B, NQ, H, D)), lse=lse_info())
    a.update(over)
    return a


def call(causal=False, softmax_scale=None, deterministic=False, **over):
    a = args(**over)
    return resolve_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], MaskOptions.of(causal=causal), softmax_scale,
                            deterministic)


def test_valid_problem():
    p = call()
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.heads, p.head_dim, p.dtype) == (B, NQ, NK, H, D, "bfloat16")
    assert math.isclose(p.softmax_scale, 1 / math.sqrt(D)) and p.causal is False
    p = call(causal=True, softmax_scale=0.25)
    assert p.causal is True and p.softmax_scale == 0.25


def test_strided_dout_and_out_allowed():
    # a slice of a packed (B, N, 2, H, D) array: contiguous last dim, 16-byte aligned strides
    s = (NQ * 2 * H * D * 2, 2 * H * D * 2, D * 2, 2)
    call(dout=info((B, NQ, H, D), strides=s), out=info((B, NQ, H, D), strides=s, ptr=(1 << 20) + H * D * 2))


def test_lse_size_one_dims_any_stride():
    call(lse=lse_info((B, H, NQ)), q=info((B, NQ, H, D)))
    # heads == 1: the heads stride does not matter
    one = dict(q=info((B, NQ, 1, D)), k=info((B, NK, 1, D)), v=info((B, NK, 1, D)), dout=info((B, NQ, 1, D)),
               out=info((B, NQ, 1, D)), lse=lse_info((B, 1, NQ), strides=(NQ * 4, 12345, 4)))
    call(**one)


@pytest.mark.parametrize("over,exc,words", [
    (dict(dout=info((B, NQ, H, D), dtype="float16")), TypeError, "dout must have q's dtype bfloat16, got float16"),
    (dict(out=info((B, NQ, H, D), dtype="float32")), TypeError, "out must have q's dtype"),
    (dict(dout=info((B, NQ + 1, H, D))), ValueError, r"dout must have q's shape \(2, 64, 4, 128\), got shape \(2, 65, 4, 128\)"),
    (dict(out=info((B, NQ, H, 64))), ValueError, "out must have q's shape"),
    (dict(dout=info((B, NQ, H, D), strides=(NQ * H * D * 4, H * D * 4, D * 4, 4))), ValueError,
     "dout must be contiguous in its last dimension"),
    (dict(dout=info((B, NQ, H, D), strides=(0, 0, 0, 0))), ValueError, "dout must be contiguous in its last dimension"),
    (dict(out=info((B, NQ, H, D), ptr=(1 << 20) + 2)), ValueError, "out's data pointer is not 16-byte aligned"),
    (dict(dout=info((B, NQ, H, D), device=1)), ValueError, "dout must be on q's device 0, got device 1"),
    (dict(out=info((B, NQ, H, D), device=1)), ValueError, "out must be on q's device"),
    (dict(lse=lse_info(dtype="float16")), TypeError, "lse must be float32"),
    (dict(lse=lse_info((B, NQ, H))), ValueError, r"lse must have shape \(batch, heads, seqlen_q\) = \(2, 4, 64\)"),
    (dict(lse=lse_info((B, H, NQ, 1))), ValueError, "lse must have shape"),
    (dict(lse=lse_info(strides=(4, B * 4, B * H * 4))), ValueError, "lse must be C-contiguous"),
    (dict(lse=lse_info(strides=(H * NQ * 8, NQ * 8, 8))), ValueError, "lse must be C-contiguous"),
    (dict(lse=lse_info(ptr=(1 << 21) + 2)), ValueError, "lse's data pointer is not 4-byte aligned"),
    (dict(lse=lse_info(device=1)), ValueError, "lse must be on q's device 0, got device 1"),
    # q, k, v themselves: resolve_forward's rules apply
    (dict(k=info((B, NK, H, 64)), v=info((B, NK, H, 64))), ValueError, "head_dim differs"),
    (dict(q=info((B, NQ, H, D), dtype="float32")), TypeError, "q has dtype float32"),
])
def test_bad_backward_arguments(over, exc, words):
    with pytest.raises(exc, match=words):
        call(**over)


def test_bad_options():
    with pytest.raises(TypeError, match="causal must be a bool"):
        call(causal="yes")
    with pytest.raises(ValueError, match="softmax_scale"):
        call(softmax_scale=-1.0)
    with pytest.raises(TypeError, match="softmax_scale"):
        call(softmax_scale="big")


def test_problem_fields():
    p = call(causal=True, deterministic=1)
    assert p.deterministic is True
    assert (p.window_left, p.window_right, p.offset) == (UNBOUNDED, 0, NK - NQ)
    s = (NQ * H * D, H * D, D)
    assert p.strides == {"q": s, "k": (NK * H * D, H * D, D), "v": (NK * H * D, H * D, D), "dout": s, "out": s}


def test_deterministic_checked_last():
    with pytest.raises(TypeError, match="deterministic must be a bool, got 'yes'"):
        call(deterministic="yes")
    with pytest.raises(ValueError, match="dout must have q's shape"):  # array errors first, as before
        call(deterministic="yes", dout=info((B, NQ + 1, H, D)))


@pytest.mark.parametrize("hkv", [1, 2])
def test_gqa_backward_problem(hkv):
    """GQA/MQA: k, v with heads_kv heads; dout, out and lse follow q's heads."""
    kv = info((B, NK, hkv, D))
    p = call(k=kv, v=kv)
    assert (p.heads, p.heads_kv, p.group) == (H, hkv, H // hkv)
    with pytest.raises(ValueError, match=r"lse must have shape \(batch, heads, seqlen_q\) = \(2, 4, 64\)"):
        call(k=kv, v=kv, lse=lse_info((B, hkv, NQ)))
    with pytest.raises(ValueError, match="out must have q's shape"):
        call(k=kv, v=kv, out=info((B, NQ, hkv, D)))
    bad = info((B, NK, 3, D))
    with pytest.raises(ValueError, match="q has 4, k and v have 3"):
        call(k=bad, v=bad)
