"""cuflash.integrations.transformers without torch, transformers or a GPU: the mask decision, the
mapping of transformers' attention call onto cuflash.attention, the fallbacks and the refusals
(fakes stand in for tensors and transformers.masking_utils). On the GPU, with real models:
tests/gpu/test_transformers_gpu.py."""
import inspect
import types
import warnings

import pytest

from cuflash.integrations import transformers as hf


def causal_mask_function(b, h, q, kv):
    return kv <= q


def bidirectional_mask_function(b, h, q, kv):
    return q >= 0


MU = types.SimpleNamespace(causal_mask_function=causal_mask_function,
                           bidirectional_mask_function=bidirectional_mask_function, is_tracing=lambda x: False)


class _Padding:
    ndim = 2

    def __init__(self, all_true):
        self._all = all_true

    def all(self):
        return self._all


def _kw(**kw):
    base = {"mask_function": causal_mask_function, "q_offset": 0, "kv_offset": 0, "allow_is_causal_skip": True}
    base.update(kw)
    return base


def test_kernel_masks_plain_causal_and_cache():
    assert hf.kernel_masks(MU, 128, 128, _kw())
    assert hf.kernel_masks(MU, 128, 128, _kw(attention_mask=_Padding(True)))  # a 2D mask with no padding
    assert not hf.kernel_masks(MU, 128, 128, _kw(attention_mask=_Padding(False)))  # padding: sdpa's mask
    assert hf.kernel_masks(MU, 1, 65, _kw(q_offset=64))  # decoding with a cache: bottom-right
    assert hf.kernel_masks(MU, 16, 80, _kw(q_offset=64))  # chunked prefill
    assert not hf.kernel_masks(MU, 16, 80, _kw(q_offset=10))  # the query's end is not the keys' end
    assert not hf.kernel_masks(MU, 128, 128, _kw(allow_is_causal_skip=False))  # packed / overlays / static cache
    assert not hf.kernel_masks(MU, 128, 128, _kw(q_offset=types.SimpleNamespace()))  # a tensor offset
    tracing = types.SimpleNamespace(**{**vars(MU), "is_tracing": lambda x: True})
    assert not hf.kernel_masks(tracing, 128, 128, _kw(attention_mask=_Padding(True)))


def test_kernel_masks_sliding_chunked_bidirectional():
    def sliding(b, h, q, kv):
        return kv > q - 32

    mistral = types.SimpleNamespace(sliding_window=32)
    assert hf.kernel_masks(MU, 128, 128, _kw(mask_function=sliding, local_size=32, config=mistral))
    assert hf.kernel_masks(MU, 1, 40, _kw(mask_function=sliding, local_size=32, config=mistral, q_offset=100,
                                          kv_offset=61))  # a sliding cache keeps the last keys only
    assert not hf.kernel_masks(MU, 128, 128, _kw(mask_function=sliding, local_size=16, config=mistral))
    llama4 = types.SimpleNamespace(sliding_window=None, attention_chunk_size=32)
    assert not hf.kernel_masks(MU, 128, 128, _kw(mask_function=sliding, local_size=32, config=llama4))
    both = types.SimpleNamespace(sliding_window=32, attention_chunk_size=32)
    assert not hf.kernel_masks(MU, 128, 128, _kw(mask_function=sliding, local_size=32, config=both))
    assert not hf.kernel_masks(MU, 128, 128, _kw(mask_function=sliding))  # unknown pattern, no local_size
    bidir = _kw(mask_function=bidirectional_mask_function, allow_is_causal_skip=False, allow_is_bidirectional_skip=True)
    assert hf.kernel_masks(MU, 100, 300, bidir)
    assert not hf.kernel_masks(MU, 100, 300, {**bidir, "attention_mask": _Padding(False)})
    assert not hf.kernel_masks(MU, 100, 300, {**bidir, "allow_is_bidirectional_skip": False})


class _Device:
    def __init__(self, type_):
        self.type = type_

    def __str__(self):
        return self.type


class _T:
    """A fake (batch, heads, seq, head_dim) tensor: shape, dtype, device, transpose(1, 2)."""

    def __init__(self, shape, dtype="torch.bfloat16", device="cuda", name="t", transposed=False):
        self.shape, self.dtype, self.name, self.transposed = shape, dtype, name, transposed
        self.device = _Device(device)

    def transpose(self, a, b):
        assert (a, b) == (1, 2)
        s = self.shape
        return _T((s[0], s[2], s[1], s[3]), self.dtype, self.device.type, self.name, not self.transposed)


@pytest.fixture
def calls(monkeypatch):
    monkeypatch.setattr(hf, "sdpa_mask_for", lambda q, k, causal, window: (("dense", causal, window), False))
    log = []
    monkeypatch.setattr(hf, "_cuflash", lambda q, k, v, **o: log.append(("cuflash", q, k, v, o)) or "out")
    monkeypatch.setattr(hf, "_sdpa", lambda m, q, k, v, mask, d, s, c, kw: log.append(("sdpa", mask, c, kw)) or
                        ("sdpa-out", None))
    monkeypatch.setattr(hf, "_warned", set())
    return log


def _qkv(h=8, hk=2, n=128, d=64, **kw):
    return _T((2, h, n, d), name="q", **kw), _T((2, hk, n, d), name="k", **kw), _T((2, hk, n, d), name="v", **kw)


def test_signature_is_transformers_attention_function():
    params = list(inspect.signature(hf.attention_forward).parameters)
    assert params[:5] == ["module", "query", "key", "value", "attention_mask"]
    assert {"dropout", "scaling", "is_causal", "sliding_window", "softcap", "kwargs"} <= set(params)


def test_gqa_causal_maps_to_cuflash_layout(calls):
    module = types.SimpleNamespace(is_causal=True)
    q, k, v = _qkv()
    out, weights = hf.attention_forward(module, q, k, v, None, dropout=0.0, scaling=0.125, position_ids=object())
    assert (out, weights) == ("out", None)
    _, cq, ck, cv, opts = calls[0]
    assert (cq.shape, ck.shape, cv.shape) == ((2, 128, 8, 64), (2, 128, 2, 64), (2, 128, 2, 64))  # k/v not repeated
    assert cq.transposed and ck.transposed and cv.transposed
    assert opts == {"causal": True, "softmax_scale": 0.125, "window_size": (-1, -1), "dropout_p": 0.0, "softcap": 0.0}


def test_sliding_window_dropout_and_is_causal(calls):
    module = types.SimpleNamespace(is_causal=True)
    hf.attention_forward(module, *_qkv(), None, dropout=0.1, sliding_window=4096)
    assert calls[-1][4] == {"causal": True, "softmax_scale": None, "window_size": (4095, 0), "dropout_p": 0.1, "softcap": 0.0}
    hf.attention_forward(types.SimpleNamespace(is_causal=False), *_qkv(), None)  # an encoder's attention
    assert calls[-1][4]["causal"] is False
    hf.attention_forward(module, *_qkv(), None, is_causal=False)  # the call's is_causal wins
    assert calls[-1][4]["causal"] is False


def test_masks_fall_back_to_sdpa_with_one_warning(calls):
    module = types.SimpleNamespace(is_causal=True)
    mask = object()
    with pytest.warns(UserWarning, match="attention mask"):
        res = hf.attention_forward(module, *_qkv(), mask, is_causal=None, output_attentions=False)
    assert res == ("sdpa-out", None) and calls[-1] == ("sdpa", mask, None, {"output_attentions": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time: no warning
        hf.attention_forward(module, *_qkv(), mask)


@pytest.mark.parametrize("tensors, why", [
    (_qkv(dtype="torch.float32"), "dtype float32"),
    (_qkv(d=100), "head_dim 100"),
    (_qkv(device="cpu"), "tensors on cpu"),
    (_qkv(h=6, hk=4), "multiple"),
])
def test_unsupported_tensors_fall_back_with_cuflash_mask(calls, tensors, why):
    module = types.SimpleNamespace(is_causal=True)
    with pytest.warns(UserWarning, match=why):
        hf.attention_forward(module, *tensors, None, sliding_window=16)
    kind, mask, is_causal, _ = calls[-1]
    assert kind == "sdpa" and mask == ("dense", True, (15, 0)) and is_causal is False


def test_sdpa_mask_for_uses_flags_where_they_agree(monkeypatch):
    q, k = _T((1, 2, 64, 64)), _T((1, 2, 64, 64))
    assert hf.sdpa_mask_for(q, k, False, (-1, -1)) == (None, False)
    assert hf.sdpa_mask_for(q, k, True, (-1, -1)) == (None, True)  # seq_q == seq_k: top-left is bottom-right
    assert hf.sdpa_mask_for(_T((1, 2, 1, 64)), _T((1, 2, 90, 64)), True, (-1, -1)) == (None, True)  # decoding


def test_refusals_name_the_option(calls):
    module = types.SimpleNamespace(is_causal=True)
    hf.attention_forward(module, *_qkv(), None, softcap=50.0)  # cuflash's softcap
    assert calls[-1][0] == "cuflash" and calls.pop()[4]["softcap"] == 50.0
    with pytest.raises(NotImplementedError, match="softcap=50.0"):  # sdpa would drop it
        hf.attention_forward(module, *_qkv(), object(), softcap=50.0)
    sinks = object()
    hf.attention_forward(module, *_qkv(), None, s_aux=sinks)  # gpt-oss's sinks: cuflash's sinks
    assert calls[-1][0] == "cuflash" and calls.pop()[4]["sinks"] is sinks
    with pytest.raises(NotImplementedError, match="s_aux"):  # sdpa has no sinks
        hf.attention_forward(module, *_qkv(), object(), s_aux=sinks)
    with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k must be given together"):
        hf.attention_forward(module, *_qkv(), None, cu_seq_lens_q=object())
    with pytest.raises(NotImplementedError, match="packing needs batch 1"):
        hf.attention_forward(module, *_qkv(), None, cu_seq_lens_q=object(), cu_seq_lens_k=object())
    hf.attention_forward(module, *_qkv(), None, softcap=None, cu_seq_lens_q=None)  # None/0 are "off"
    hf.attention_forward(module, *_qkv(), None, softcap=0.0)
    assert [c[0] for c in calls] == ["cuflash", "cuflash"]
    with pytest.warns(UserWarning):  # with a mask, packing kwargs go to sdpa, which has the mask
        hf.attention_forward(module, *_qkv(), object(), cu_seq_lens_q=object())
    assert calls[-1][0] == "sdpa"


def test_register_without_transformers_says_so():
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            hf.register()
    else:
        pytest.skip("transformers installed: registration is tested on the GPU")


@pytest.mark.parametrize("name", ["cuflash", "my_flash", "", None])
def test_register_refuses_names_transformers_takes_for_flash_attn(name):
    with pytest.raises(ValueError, match="without 'flash'"):
        hf.register(name)


class _Packed(_T):
    """A fake packed tensor: indexing [0] drops the batch, [None] adds it back."""

    def __getitem__(self, i):
        s = self.shape
        return _Packed(s[1:] if i == 0 else (1, *s), self.dtype, self.device.type, self.name, self.transposed)

    def transpose(self, a, b):
        t = super().transpose(a, b)
        return _Packed(t.shape, t.dtype, t.device.type, t.name, t.transposed)


def test_packed_sequences_run_on_attention_varlen(monkeypatch):
    log = []
    monkeypatch.setattr(hf, "_cuflash_varlen", lambda q, k, v, cu_q, cu_k, mq, mk, **o:
                        log.append((q, k, v, cu_q, cu_k, mq, mk, o)) or q)
    module = types.SimpleNamespace(is_causal=True)
    q, k, v = (_Packed((1, 4 if n == "q" else 2, 300, 64), name=n) for n in "qkv")
    out, weights = hf.attention_forward(module, q, k, v, None, scaling=0.125, sliding_window=64, cu_seq_lens_q="cq",
                                        cu_seq_lens_k="ck", max_length_q=200, max_length_k=200)
    (lq, lk, lv, cq, ck, mq, mk, o), = log
    assert lq.shape == (300, 4, 64) and lk.shape == (300, 2, 64) and (cq, ck, mq, mk) == ("cq", "ck", 200, 200)
    assert o == dict(causal=True, softmax_scale=0.125, window_size=(63, 0), dropout_p=0.0, softcap=0.0)
    assert out.shape == (1, 300, 4, 64) and weights is None


class _MarkedMask:
    """sdpa's mask as the mask function marks it: (offsets, longest, used lengths, window left, causal)."""

    def __init__(self, cu=None, longest=128, lengths=None, left=None, causal=True):
        self._cuflash_rows = (cu, longest, lengths, left, causal)


@pytest.fixture
def rows(monkeypatch):
    """_cuflash_rows' calls: the marked masks' path."""
    log = []
    monkeypatch.setattr(hf, "_cuflash_rows", lambda q, k, v, cu, longest, lengths, **o:
                        log.append((q, cu, longest, lengths, o)) or "rows")
    return log


def test_padded_batches_run_on_cuflash_varlen(calls, rows):
    module = types.SimpleNamespace(is_causal=True)
    mask = _MarkedMask(lengths="lengths", left=15)
    assert hf.attention_forward(module, *_qkv(), mask, sliding_window=16, softcap=30.0) == ("rows", None)
    (q, cu, longest, lengths, opts), = rows
    assert q.name == "q" and not q.transposed and lengths == "lengths"  # (transformers' layout: it transposes)
    assert (cu, longest) == (None, 128)  # one span per row
    assert opts == {"causal": True, "softmax_scale": None, "window_size": (15, 0), "dropout_p": 0.0, "softcap": 30.0}
    # what it cannot take goes to sdpa's mask (or is refused, as any masked call)
    with pytest.warns(UserWarning, match="attention mask"):
        hf.attention_forward(module, *_qkv(d=100), mask)
    assert calls[-1][:2] == ("sdpa", mask)
    sinks = object()
    hf.attention_forward(module, *_qkv(), mask, sliding_window=16, s_aux=sinks)  # gpt-oss: sinks on varlen
    assert rows.pop()[4]["sinks"] is sinks
    with pytest.raises(NotImplementedError, match="s_aux"):  # a mask cuflash cannot take: sdpa has no sinks
        hf.attention_forward(module, *_qkv(), object(), s_aux=sinks)
    hf.attention_forward(types.SimpleNamespace(is_causal=False), *_qkv(), mask, sliding_window=16)  # not causal
    hf.attention_forward(module, *_qkv(), mask)  # a window the mask has and the call not
    assert [c[:2] for c in calls[-3:]] == [("sdpa", mask)] * 3 and len(rows) == 1
    encoder = _MarkedMask(lengths="lengths", causal=False)  # bidirectional attention over padded rows
    assert hf.attention_forward(types.SimpleNamespace(is_causal=False), *_qkv(), encoder) == ("rows", None)
    assert rows[-1][4]["causal"] is False


def test_packed_rows_run_on_cuflash_varlen_with_the_masks_window(calls, rows):
    module = types.SimpleNamespace(is_causal=True)
    full, sliding = _MarkedMask("cu", 70), _MarkedMask("cu", 70, left=15)
    hf.attention_forward(module, *_qkv(), full)
    hf.attention_forward(module, *_qkv(), sliding, sliding_window=16)
    assert [(r[1], r[2], r[3], r[4]["window_size"]) for r in rows] == [("cu", 70, None, (-1, -1)), ("cu", 70, None, (15, 0))]
    with pytest.warns(UserWarning, match="attention mask"):  # a call whose window is not the mask's: sdpa
        hf.attention_forward(module, *_qkv(), full, sliding_window=16)
    hf.attention_forward(module, *_qkv(), sliding)
    hf.attention_forward(types.SimpleNamespace(is_causal=False), *_qkv(), full)  # not causal: not a causal mask's
    assert [c[:2] for c in calls] == [("sdpa", full), ("sdpa", sliding), ("sdpa", full)] and len(rows) == 2


@pytest.mark.parametrize("chunk", [1 << 26, 25])  # 25 mask entries: a row or two of the batch at a time
def test_packed_offsets_test_the_hypothesis_on_the_mask(chunk, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(hf, "_MASK_CHUNK", chunk)
    n = 10
    i = torch.arange(n)

    def block_causal(starts, left=None):
        block = torch.tensor([max(s for s in starts if s <= r) for r in range(n)])
        lo = block if left is None else torch.maximum(block, i - left)
        return ((i[None, :] >= lo[:, None]) & (i[None, :] <= i[:, None]))[None, None]

    two_rows = torch.cat([block_causal([0, 4, 7]), block_causal([0])])  # batch 2: three sequences, then one
    cu, longest, lengths, left, causal = hf.packed_offsets(MU, n, n, _kw(allow_is_causal_skip=False), two_rows)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 4, 7, 10, 20] and longest == 10
    assert (lengths, left, causal) == (None, None, True)
    mistral = types.SimpleNamespace(sliding_window=3)
    kw = _kw(allow_is_causal_skip=False, local_size=3, config=mistral)
    cu, longest, _, left, _ = hf.packed_offsets(MU, n, n, kw, block_causal([0, 6], left=2))
    assert cu.tolist() == [0, 6, 10] and longest == 6 and left == 2
    assert hf.packed_offsets(MU, n, n, kw, block_causal([0, 6])) is None  # no window in the mask: not this hypothesis
    odd = block_causal([0, 5]).clone()
    odd[0, 0, 7, 2] = True  # a row that also sees a key of the previous sequence
    assert hf.packed_offsets(MU, n, n, _kw(), odd) is None
    assert hf.packed_offsets(MU, n, n, _kw(attention_mask=torch.ones(1, n)), block_causal([0])) is None  # padding
    assert hf.packed_offsets(MU, n - 2, n, _kw(kv_offset=0), block_causal([0])[..., 2:, :]) is None  # a cache


def test_padded_rows_read_the_padding():
    torch = pytest.importorskip("torch")
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    cu, longest, lengths, left, causal = hf.padded_rows(MU, 4, 4, _kw(attention_mask=right))
    assert cu is None and longest == 4 and lengths.dtype == torch.int32 and lengths.tolist() == [3, 4, 0]
    assert (left, causal) == (None, True)
    # left padding: each row's sequence starts at its first real token, the next row's padding its
    # unused tail; an empty first sequence over row 0's padding
    pad_left = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]])
    cu, longest, lengths, _, _ = hf.padded_rows(MU, 4, 4, _kw(attention_mask=pad_left))
    assert cu.tolist() == [0, 1, 4, 10, 12] and longest == 4 and lengths.tolist() == [0, 3, 4, 2]
    middle = torch.tensor([[1, 0, 1, 1]])
    assert hf.padded_rows(MU, 4, 4, _kw(attention_mask=middle)) is None
    assert hf.padded_rows(MU, 1, 5, _kw(attention_mask=torch.ones(3, 5), q_offset=4)) is None  # a cache
    assert hf.padded_rows(MU, 4, 4, _kw(attention_mask=right, allow_is_causal_skip=False)) is None  # packed
    assert hf.padded_rows(MU, 4, 4, _kw()) is None
    mistral = types.SimpleNamespace(sliding_window=3)
    sliding = _kw(attention_mask=right, mask_function=lambda *a: None, local_size=3, config=mistral)
    assert hf.padded_rows(MU, 4, 4, sliding)[3:] == (2, True)
    encoder = {"mask_function": bidirectional_mask_function, "allow_is_bidirectional_skip": True, "attention_mask": right}
    assert hf.padded_rows(MU, 4, 4, encoder)[3:] == (None, False)
