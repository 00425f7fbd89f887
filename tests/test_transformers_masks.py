"""The transformers integration's mask marks on real transformers models, on the CPU: right-padded
batches and sequences packed by position_ids (plain, and Mistral's sliding window) reach
cuflash's variable-length path with the offsets and used lengths that reproduce transformers'
masks. The cuflash call is emulated in float32 torch from exactly those arguments (attention of
each sequence's used rows, the mask aligned to them), so the logits at the real positions must
equal the sdpa model's to float32 rounding; left padding must stay on sdpa. Needs torch and
transformers (skipped without them); tests/gpu/test_transformers_gpu.py runs the real kernels."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cuflash.integrations import transformers as cuflash_hf  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=512, attention_dropout=0.0)


def _emulated_rows(query, key, value, cu, longest, lengths, *, causal, softmax_scale, window_size, dropout_p,
                   softcap):
    """What cuflash._cuflash_rows computes, in float32 torch: attention_varlen over the batch's rows
    (offsets cu, None: one per row; used lengths `lengths`), rows no sequence uses 0."""
    assert causal and dropout_p == 0 and not softcap
    b, h, n, d = query.shape
    group = h // key.shape[1]
    q = query.transpose(1, 2).reshape(b * n, h, d)
    k, v = (x.repeat_interleave(group, dim=1).transpose(1, 2).reshape(b * n, h, d) for x in (key, value))
    cu = torch.arange(b + 1) * n if cu is None else cu.cpu()
    out = torch.zeros_like(q)
    for s in range(len(cu) - 1):
        lo, hi = int(cu[s]), int(cu[s + 1])
        used = hi - lo if lengths is None else min(int(lengths[s]), hi - lo)
        if used == 0:
            continue
        i = torch.arange(used)
        seen = i[None, :] <= i[:, None]
        if window_size[0] >= 0:
            seen &= i[None, :] >= i[:, None] - window_size[0]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[lo:lo + used].transpose(0, 1), k[lo:lo + used].transpose(0, 1), v[lo:lo + used].transpose(0, 1),
            attn_mask=seen, scale=softmax_scale)
        out[lo:lo + used] = o.transpose(0, 1)
    return out.reshape(b, n, h, d)


def _emulated_leftpad(query, key, value, pads, *, causal, softmax_scale, window_size, softcap):
    """What cuflash._cuflash_leftpad computes, in float32 torch: row b's queries (the last positions)
    attend to its keys from pads[b] on, the mask aligned to the last key."""
    assert not softcap
    b, h, nq, d = query.shape
    group = h // key.shape[1]
    k, v = (x.repeat_interleave(group, dim=1) for x in (key, value))
    nk = k.shape[2]
    out = torch.empty(b, nq, h, d)
    i = torch.arange(nq)[:, None] + nk - nq  # each query's own key (bottom-right alignment)
    for r in range(b):
        j = torch.arange(int(pads[r]), nk)[None, :]
        seen = (j <= i) if causal else torch.ones_like(j <= i)
        if window_size[0] >= 0:
            seen &= j >= i - window_size[0]
        o = torch.nn.functional.scaled_dot_product_attention(query[r], k[r, :, int(pads[r]):],
                                                             v[r, :, int(pads[r]):], attn_mask=seen,
                                                             scale=softmax_scale)
        out[r] = o.transpose(0, 1)
    return out


@pytest.fixture
def emulated(monkeypatch):
    """cuflash's calls emulated on the CPU: (log of the marked-rows calls, of the sdpa fallbacks)."""
    log = {"rows": [], "sdpa": 0, "cuflash": 0, "leftpad": []}
    real_sdpa = cuflash_hf._sdpa

    def leftpad(*args, **options):
        log["leftpad"].append((args[3].tolist(), args[0].shape[2], args[1].shape[2]))
        return _emulated_leftpad(*args, **options)

    def rows(*args, **options):
        log["rows"].append(args[3:6])
        return _emulated_rows(*args, **options)

    def sdpa(*args):
        log["sdpa"] += 1
        return real_sdpa(*args)

    monkeypatch.setattr(cuflash_hf, "unsupported", lambda q, k, v: None)  # float32 CPU tensors: taken as cuflash's
    monkeypatch.setattr(cuflash_hf, "_cuflash_rows", rows)
    monkeypatch.setattr(cuflash_hf, "_cuflash_leftpad", leftpad)
    monkeypatch.setattr(cuflash_hf, "_sdpa", sdpa)
    monkeypatch.setattr(cuflash_hf, "_cuflash", lambda *a, **o: log.__setitem__("cuflash", log["cuflash"] + 1))
    monkeypatch.setattr(cuflash_hf, "_warned", set())
    return log


def _pair(config):
    """(sdpa model, cuflash model) with the same random weights, float32, CPU, eval."""
    torch.manual_seed(0)
    sdpa = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    cu = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                       attn_implementation=cuflash_hf.register()).eval()
    cu.load_state_dict(sdpa.state_dict())
    return sdpa, cu


def _llama():
    return transformers.LlamaConfig(num_key_value_heads=2, **COMMON)


def _mistral():
    return transformers.MistralConfig(num_key_value_heads=2, sliding_window=12, **COMMON)


def _gemma2():  # sliding and full layers alternate
    return transformers.Gemma2Config(num_key_value_heads=2, sliding_window=12, attn_logit_softcapping=None,
                                     final_logit_softcapping=None, head_dim=16, query_pre_attn_scalar=16, **COMMON)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("config", [_llama, _mistral, _gemma2])
def test_padded_batches_take_the_rows_path(config, side, emulated):
    sdpa, cu = _pair(config())
    ids = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(1))
    lengths = [25, 40, 9]
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    if side == "left":
        mask = mask.flip(-1)
    with torch.no_grad():
        want = sdpa(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = cu(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert emulated["sdpa"] == 0 and len(emulated["rows"]) == 2, emulated
    for c, n, used in emulated["rows"]:
        if side == "right":
            assert c is None and n == 40 and used.tolist() == lengths
        else:  # each row's sequence from its first real token, the next row's padding its tail
            assert c.tolist() == [0, 15, 40, 111, 120] and n == 40 and used.tolist() == [0, *lengths]
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config", [_llama, _mistral, _gemma2])
def test_sequences_packed_by_position_ids_take_the_rows_path(config, emulated):
    sdpa, cu = _pair(config())
    ids = torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(2))
    pos = torch.cat([torch.arange(20), torch.arange(7), torch.arange(23)])[None]
    with torch.no_grad():
        want = sdpa(input_ids=ids, position_ids=pos, use_cache=False).logits
        got = cu(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert emulated["sdpa"] == 0 and len(emulated["rows"]) == 2, emulated
    assert all(c.tolist() == [0, 20, 27, 50] and n == 23 and lens is None for c, n, lens in emulated["rows"])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_padding_in_the_middle_stays_on_sdpa(emulated):
    sdpa, cu = _pair(_llama())
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 6:9] = 0
    with torch.no_grad(), pytest.warns(UserWarning, match="attention mask"):
        got = cu(input_ids=ids, attention_mask=mask, use_cache=False).logits
    want = sdpa(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert emulated["sdpa"] == 2 and not emulated["rows"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("config,prompt,on_cuflash", [(_llama, 20, True), (_mistral, 8, True), (_mistral, 20, False)])
def test_generation_with_left_padding(config, prompt, on_cuflash, emulated):
    """generate() pads on the left: its prefill (a cache that holds nothing yet; Mistral's sliding
    cache with a prompt past its window) takes the rows path, the decoding steps (a mask over a
    left-padded cache) the KV cache's path with each row's pad (Mistral's within its window too),
    as long as the cache starts at position 0 (Mistral's sliding cache past its window of 12:
    sdpa's); the tokens are sdpa's."""
    sdpa, cu = _pair(config())
    ids = torch.randint(0, 128, (2, prompt), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = cu.generate(ids, **kw)
    want = sdpa.generate(ids, **kw)
    assert len(emulated["rows"]) == 2, emulated  # 2 layers: the prefill
    steps = [([5, 0], 1, prompt + 1 + t) for t in range(3) for _ in range(2)]  # 2 layers: 3 decoding steps
    assert (emulated["leftpad"], emulated["sdpa"]) == ((steps, 0) if on_cuflash else ([], 6)), emulated
    assert torch.equal(got, want)


def test_left_padded_cache_chunks_and_holes():
    """left_padded_cache's mark on hand-made masks: pads per row where every row is padded at its
    start and its queries are real; None for a hole, right padding, padded queries, no cache yet or
    a cache past position 0."""
    from transformers import masking_utils as mu

    def mark(padding, q_length, **kw):
        return cuflash_hf.left_padded_cache(mu, q_length, padding.shape[1], dict(
            attention_mask=padding, q_offset=padding.shape[1] - q_length, **kw))

    left = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    pads, window, causal = mark(left, 2)
    assert pads.tolist() == [2, 0] and pads.dtype == torch.int32 and window is None and causal
    hole = torch.tensor([[1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    right = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    assert mark(hole, 1) is None and mark(right, 1) is None
    assert mark(left, 5) is None  # row 0's first query is padding
    assert mark(left, 6) is None  # no cache yet: padded_rows' case
    assert cuflash_hf.left_padded_cache(mu, 1, 6, dict(attention_mask=left, q_offset=6, kv_offset=1)) is None
