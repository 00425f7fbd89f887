"""cuflash.flash_attn_interface without a GPU: flash-attn 2's signatures, and unsupported options
refused before any work (the GPU behaviour: tests/gpu/test_flash_attn_interface_gpu.py)."""
import inspect

import pytest

from cuflash import flash_attn_interface as fai

# flash-attn 2.7's parameter lists (flash_attn/flash_attn_interface.py)
SIGNATURES = {
    "flash_attn_func": ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                        "alibi_slopes", "deterministic", "return_attn_probs"],
    "flash_attn_qkvpacked_func": ["qkv", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                                  "alibi_slopes", "deterministic", "return_attn_probs"],
    "flash_attn_kvpacked_func": ["q", "kv", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                                 "alibi_slopes", "deterministic", "return_attn_probs"],
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signatures_are_flash_attn_2s(name):
    params = list(inspect.signature(getattr(fai, name)).parameters)
    assert params == SIGNATURES[name]
    defaults = {p.name: p.default for p in inspect.signature(getattr(fai, name)).parameters.values()}
    assert defaults["dropout_p"] == 0.0 and defaults["causal"] is False and defaults["window_size"] == (-1, -1)


def test_softcap_reaches_attention(monkeypatch):
    """softcap is supported (issue 13): every entry point hands it to cuflash.attention."""
    from cuflash import api

    seen = []
    monkeypatch.setattr(api, "attention", lambda *a, **kw: seen.append(kw["softcap"]) or "out")
    assert fai.flash_attn_func(1, 2, 3, softcap=30.0) == "out"
    fai.flash_attn_qkvpacked_func(FakePacked(), softcap=5.0)
    fai.flash_attn_kvpacked_func(1, FakePacked(), softcap=0.0)
    fai.flash_attn_with_kvcache(1, 2, 3, softcap=2.5)
    assert seen == [30.0, 5.0, 0.0, 2.5]


class FakePacked:
    def __getitem__(self, index):
        return index


def test_dense_entry_points_pass_alibi_slopes_on(monkeypatch):
    from cuflash import api

    seen = []
    monkeypatch.setattr(api, "attention", lambda *a, **kw: seen.append(kw["alibi_slopes"]) or "out")
    slopes = object()
    assert fai.flash_attn_func(None, None, None, alibi_slopes=slopes) == "out"
    assert fai.flash_attn_qkvpacked_func(FakePacked(), alibi_slopes=slopes) == "out"
    assert fai.flash_attn_kvpacked_func(None, FakePacked(), alibi_slopes=slopes) == "out"
    assert seen == [slopes] * 3
    from cuflash import varlen

    monkeypatch.setattr(varlen, "attention_varlen", lambda *a, **kw: seen.append(kw["alibi_slopes"]) or "out")
    assert fai.flash_attn_varlen_func(None, None, None, None, None, 1, 1, alibi_slopes=slopes) == "out"
    assert seen == [slopes] * 4


def test_varlen_block_table_reaches_attention_varlen(monkeypatch):
    """flash_attn_varlen_func's block_table (paged k and v) is attention_varlen's."""
    from cuflash import varlen

    seen = []
    monkeypatch.setattr(varlen, "attention_varlen", lambda *a, **kw: seen.append(kw["block_table"]) or "out")
    assert fai.flash_attn_varlen_func(None, None, None, None, None, 1, 1, block_table="table") == "out"
    assert fai.flash_attn_varlen_func(None, None, None, None, None, 1, 1) == "out"
    assert seen == ["table", None]


def test_incomplete_kvcache_options_name_themselves():
    with pytest.raises(ValueError, match="block_table.*cache_seqlens"):  # paged caches need the lengths
        fai.flash_attn_with_kvcache(None, None, None, block_table=object())
    with pytest.raises(ValueError, match="cache_seqlens"):
        fai.flash_attn_with_kvcache(None, None, None, k=object(), v=object())


def test_kvcache_arguments_reach_attention_with_kvcache(monkeypatch):
    """cache_seqlens, k, v (issue 17) map to cuflash.attention_with_kvcache's keywords."""
    from cuflash import kvcache

    seen = []
    monkeypatch.setattr(kvcache, "attention_with_kvcache", lambda *a, **kw: seen.append((a, kw)) or "out")
    assert fai.flash_attn_with_kvcache(1, 2, 3, k=4, v=5, cache_seqlens=6, causal=True, window_size=[2, 0],
                                       softcap=1.5, return_softmax_lse=True, num_splits=7, block_table=8,
                                       alibi_slopes=9) == "out"
    (args, kw), = seen
    assert args == (1, 2, 3)
    assert kw == dict(cache_seqlens=6, k_new=4, v_new=5, causal=True, softmax_scale=None, window_size=(2, 0),
                      softcap=1.5, return_lse=True, num_splits=7, rotary_cos=None, rotary_sin=None,
                      rotary_interleaved=True, block_table=8, alibi_slopes=9, cache_batch_idx=None,
                      cache_leftpad=None)
    assert set(fai.__all__) <= set(dir(fai))


def test_cache_batch_idx_reaches_attention_with_kvcache(monkeypatch):
    """cache_batch_idx maps to attention_with_kvcache's; without cache_seqlens and k / v every batch
    attends to its whole cache sequence (flash-attn's meaning of cache_seqlens=None)."""
    import numpy as np

    from cuflash import kvcache

    seen = []
    monkeypatch.setattr(kvcache, "attention_with_kvcache", lambda *a, **kw: seen.append(kw) or "out")
    caches = np.zeros((5, 48, 1, 8))
    assert fai.flash_attn_with_kvcache(1, caches, caches, cache_seqlens=6, cache_batch_idx=[4, 0]) == "out"
    assert fai.flash_attn_with_kvcache(1, caches, caches, cache_batch_idx=[4, 0], causal=True) == "out"
    assert [(kw["cache_seqlens"], kw["cache_batch_idx"], kw["k_new"]) for kw in seen] == [(6, [4, 0], None),
                                                                                          (48, [4, 0], None)]
    with pytest.raises(ValueError, match="rotary embedding needs cache_seqlens"):
        fai.flash_attn_with_kvcache(1, caches, caches, cache_batch_idx=[4, 0], rotary_cos=2, rotary_sin=3)


def test_cache_leftpad_reaches_attention_with_kvcache(monkeypatch):
    """cache_leftpad maps to attention_with_kvcache's; without cache_seqlens and k / v every batch
    attends from its pad to the end of its cache sequence."""
    import numpy as np

    from cuflash import kvcache

    seen = []
    monkeypatch.setattr(kvcache, "attention_with_kvcache", lambda *a, **kw: seen.append(kw) or "out")
    caches = np.zeros((2, 48, 1, 8))
    assert fai.flash_attn_with_kvcache(1, caches, caches, cache_seqlens=[9, 6], cache_leftpad=[3, 0]) == "out"
    assert fai.flash_attn_with_kvcache(1, caches, caches, cache_leftpad=[5, 1]) == "out"
    assert [(kw["cache_seqlens"], kw["cache_leftpad"]) for kw in seen] == [([9, 6], [3, 0]), (48, [5, 1])]
