"""MaskOptions (cuflash/mask.py): the record of the mask keywords, its checks, its canonical
geometry, and the torch op arguments derived from its fields. No GPU needed."""
import dataclasses

import pytest

from cuflash import signature
from cuflash.mask import CAUSAL, FIELD_NAMES, NO_MASK, UNBOUNDED, MaskOptions
from cuflash.problem import ArrayInfo, resolve_backward, resolve_forward


def test_of_interns_todays_masks():
    assert MaskOptions.of() is NO_MASK and MaskOptions.of(causal=False) is NO_MASK
    assert MaskOptions.of(causal=True) is CAUSAL
    # other spellings of a bool are checked and normalised, and equal the interned record
    one = MaskOptions.of(causal=1)
    assert one == CAUSAL and one.causal is True and hash(one) == hash(CAUSAL) and one.key == CAUSAL.key
    assert MaskOptions.of(causal=0) == NO_MASK


@pytest.mark.parametrize("bad", ["yes", 2, 1.0, None, [True]])
def test_bad_values_name_the_argument(bad):
    with pytest.raises(TypeError, match=r"causal must be a bool, got "):
        MaskOptions.of(causal=bad)
    with pytest.raises(TypeError, match=r"causal must be a bool"):
        MaskOptions(causal=bad)  # direct construction checks too


def test_frozen_and_replace_rechecks():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CAUSAL.causal = False
    assert dataclasses.replace(CAUSAL, causal=0) == NO_MASK
    with pytest.raises(TypeError, match="causal"):
        dataclasses.replace(CAUSAL, causal="no")


def test_key_is_the_field_values():
    assert FIELD_NAMES == tuple(f.name for f in dataclasses.fields(MaskOptions))
    for m in (NO_MASK, CAUSAL):
        assert m.key == tuple(getattr(m, n) for n in FIELD_NAMES)
        assert type(m.key) is tuple


def test_given_takes_the_record_or_the_keywords():
    assert MaskOptions.given(None, {}) is NO_MASK
    assert MaskOptions.given(CAUSAL, {}) is CAUSAL
    assert MaskOptions.given(None, {"causal": True}) is CAUSAL
    with pytest.raises(TypeError, match="not both"):
        MaskOptions.given(CAUSAL, {"causal": True})
    with pytest.raises(TypeError, match="unexpected keyword argument 'casual'"):
        MaskOptions.given(None, {"casual": True})
    with pytest.raises(TypeError, match="mask must be a cuflash.mask.MaskOptions, got bool"):
        MaskOptions.given(True, {})
    with pytest.raises(TypeError, match="causal must be a bool"):
        MaskOptions.given(None, {"causal": "yes"})


@pytest.mark.parametrize("nq,nk", [(5, 9), (9, 5), (64, 64), (1, 1)])
def test_geometry_is_todays_canonical_mask(nq, nk):
    assert CAUSAL.geometry(nq, nk) == (UNBOUNDED, 0, nk - nq)  # bottom-right causal
    assert NO_MASK.geometry(nq, nk) == (UNBOUNDED, UNBOUNDED, nk - nq)


def _info(shape):
    strides, acc = [], 2
    for n in reversed(shape):
        strides.insert(0, acc)
        acc *= n
    return ArrayInfo(tuple(shape), "bfloat16", 2, tuple(strides), 1 << 20, 0)


@pytest.mark.parametrize("nq,nk", [(5, 9), (9, 5), (64, 64)])
def test_resolve_unchanged_for_causal_and_full(nq, nk):
    """resolve_* produce exactly the former geometry and features for causal / non-causal."""
    q, kv = _info((2, nq, 3, 64)), _info((2, nk, 3, 64))
    lse = ArrayInfo((2, 3, nq), "float32", 4, (3 * nq * 4, nq * 4, 4), 1 << 20, 0)
    for mask, right in ((CAUSAL, 0), (NO_MASK, UNBOUNDED)):
        for p in (resolve_forward(q, kv, kv, mask, None), resolve_backward(q, q, kv, kv, q, lse, mask, None)):
            assert (p.window_left, p.window_right, p.offset) == (UNBOUNDED, right, nk - nq)
            assert p.causal is mask.causal
            assert p.features.local is False and p.features.dropout is False


def test_resolve_wants_the_record():
    q = _info((1, 8, 1, 64))
    with pytest.raises(TypeError, match="mask must be a cuflash.mask.MaskOptions .*got True"):
        resolve_forward(q, q, q, True, None)


# ------------------------------------------------------------------ torch op arguments (no torch)

def test_schema_mask_arguments_are_the_fields():
    opts = MaskOptions.schema_options()
    assert opts == (("causal", "bool"), ("window_size", "int[]", "[-1, -1]"), ("alignment", "str", '"bottom_right"'),
                    ("softcap", "float", "0.0"))
    for options in (signature.FWD_OPTIONS, signature.BWD_OPTIONS):
        for o in opts:
            assert o in options
        assert f"{opts[0][1]} {opts[0][0]}" in signature.FWD_SCHEMA
        # a field added after the first release: with its default, after the older options
    assert "int[] window_size=[-1, -1]" in signature.FWD_SCHEMA and "int[] window_size=[-1, -1]" in signature.BWD_SCHEMA


def test_op_options_round_trip():
    others = dict(softmax_scale=0.5, algorithm="v1", deterministic=True, dropout_p=0.1, seed=-3, backend="sm80")
    for mask in (NO_MASK, CAUSAL):
        values = signature.op_options(signature.FWD_OPTIONS, mask, **others)
        assert values == (mask.causal, 0.5, "v1", True, 0.1, -3, "sm80", (-1, -1), "bottom_right", 0.0)
        got, rest = signature.mask_and_options(signature.FWD_OPTIONS, values)
        assert got is mask and rest == others
    bwd = signature.op_options(signature.BWD_OPTIONS, CAUSAL, softmax_scale=None, deterministic=False,
                               dropout_p=0.0, seed=0)
    assert bwd == (True, None, False, 0.0, 0, (-1, -1), "bottom_right", 0.0)
    # the dispatcher may drop trailing arguments equal to their schema default (backend=None)
    got, rest = signature.mask_and_options(signature.FWD_OPTIONS, (True, None, "v2", False, 0.0, 0))
    assert got is CAUSAL and rest["backend"] is None
    with pytest.raises(TypeError, match="causal must be a bool"):  # a direct op call with a bad mask value
        signature.mask_and_options(signature.BWD_OPTIONS, ("yes", None, False, 0.0, 0))


def test_signature_of_the_op_implementations():
    import inspect

    sig = inspect.Signature(signature.parameters(signature.FWD_ARRAYS, signature.FWD_OPTIONS))
    assert tuple(sig.parameters) == signature.FWD_ARGS
    assert sig.parameters["backend"].default is None
    assert sig.parameters["causal"].default is inspect.Parameter.empty


def test_options_with_schema_defaults_go_last():
    """A mask field added later (with a schema default) joins the schema after every option of the
    first release, so positional calls written for the older schema still bind."""
    opts = (("causal", "bool"), ("window_left", "int", "-1"), ("softmax_scale", "float?"), ("seed", "int"),
            ("backend", "str?", "None"))
    ordered = (("causal", "bool"), ("softmax_scale", "float?"), ("seed", "int"), ("backend", "str?", "None"),
               ("window_left", "int", "-1"))
    monkey = pytest.MonkeyPatch()
    monkey.setattr(signature, "MASK_NAMES", ("causal", "window_left"))
    try:
        assert signature._defaults_last(opts) == ordered
    finally:
        monkey.undo()
    assert signature._python_default("-1") == -1 and signature._python_default("0.5") == 0.5


# ------------------------------------------------------------------ sliding window (issue 13)

def test_window_geometry_is_the_reference_mask():
    """The canonical (window_left, window_right, offset) the kernels take and the reference's mask,
    written independently, agree for every mix of causal, window sides and seqlens."""
    import numpy as np

    from cuflash.reference import visible

    for nq, nk in [(7, 7), (5, 9), (9, 5), (1, 6), (6, 1)]:
        for causal in (False, True):
            for ws in [(-1, -1), (2, 1), (0, 0), (3, -1), (-1, 2), (10, 10)]:
                m = MaskOptions.of(causal=causal, window_size=ws)
                left, right, off = m.geometry(nq, nk)
                i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
                canon = (j >= i + off - left) & (j <= i + off + right)
                ref = visible(nq, nk, m)
                assert (ref is None and canon.all()) or (ref == canon).all(), (nq, nk, causal, ws)


def test_window_options_checked_and_normalised():
    from cuflash.mask import UNBOUNDED

    assert MaskOptions.of(window_size=[4, 0]).window_size == (4, 0)
    assert MaskOptions.of(window_size=(UNBOUNDED + 5, 3)).window_size == (-1, 3)  # past every key: no limit
    assert MaskOptions.of(window_size=(-1, -1)) is NO_MASK and MaskOptions.of(causal=True, window_size=[-1, -1]) is CAUSAL
    assert MaskOptions.of(causal=True, window_size=(8, 5)).geometry(10, 10) == (8, 0, 0)  # causal caps the right side
    for bad, err in [((1,), ValueError), ((-2, 0), ValueError), ((1.5, 0), TypeError), (7, TypeError), ((True, 0), TypeError)]:
        with pytest.raises(err, match="window_size"):
            MaskOptions.of(window_size=bad)


def test_window_selects_local_features_and_packs_the_left_edge():
    from cuflash import params
    from cuflash.problem import resolve_forward

    q = _info((1, 100, 2, 64))
    p = resolve_forward(q, q, q, MaskOptions.of(causal=True, window_size=(16, 0)), None)
    assert p.features.local and (p.window_left, p.window_right, p.offset) == (16, 0, 0)
    a = params.pack_fwd(p, 1)
    assert int(a["window_left"][0]) == 16 and int(a["window_right"][0]) == 0
    assert not resolve_forward(q, q, q, CAUSAL, None).features.local


def test_top_left_alignment():
    import numpy as np

    from cuflash.reference import visible

    m = MaskOptions.of(causal=True, alignment="top_left")
    assert m.geometry(3, 5) == (MaskOptions.of().geometry(3, 5)[0], 0, 0)
    assert visible(3, 5, m).tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert visible(3, 5, CAUSAL).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # seqlen_q > seqlen_k: top-left rows past the keys see them all, bottom-right's first rows none
    assert visible(4, 2, m).tolist() == [[1, 0], [1, 1], [1, 1], [1, 1]]
    w = MaskOptions.of(window_size=(1, 1), alignment="top_left")
    i, j = np.arange(4)[:, None], np.arange(6)[None, :]
    assert (visible(4, 6, w) == (abs(j - i) <= 1)).all() and w.geometry(4, 6) == (1, 1, 0)
    with pytest.raises(ValueError, match="alignment must be 'bottom_right'"):
        MaskOptions.of(causal=True, alignment="center")
