"""cuflash as a transformers attention implementation, on the GPU, against transformers' sdpa.

Randomly initialised small models: Llama-style (GQA: 4 query heads, 2 k/v heads), Mistral-style
(MQA and a sliding window shorter than the sequence) and Gemma-2-style (hybrid sliding/full layers,
query_pre_attn_scalar scaling); Gemma 2 with its attention softcap against transformers' eager
attention (sdpa ignores softcap).

Tolerance: FlashAttention's 2x rule at the model level. A float32 copy of the model running sdpa
is the reference; the half-precision model with cuflash may be at most twice as far from it as
the same half-precision model with sdpa, plus the half-precision rounding at the tensor's
magnitude (2 eps * max|ref|), for the logits and for every parameter's gradient after one
backward pass. Most of either model's error comes from the layers they share (matmuls, norms in
bf16/fp16), so the rule has room for attention's own error and no more.
"""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="torch not installed: transformers integration not tested")
transformers = pytest.importorskip("transformers", reason="transformers not installed: integration not tested")

from cuflash.integrations import transformers as cuflash_hf  # noqa: E402

pytestmark = pytest.mark.gpu

COMMON = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              head_dim=64, max_position_embeddings=1024)


def llama():
    return transformers.LlamaConfig(num_key_value_heads=2, **COMMON)


def mistral():
    return transformers.MistralConfig(num_key_value_heads=1, sliding_window=48, **COMMON)


def gemma2():
    return transformers.Gemma2Config(num_key_value_heads=2, sliding_window=48, attn_logit_softcapping=None,
                                     final_logit_softcapping=None, query_pre_attn_scalar=128, **COMMON)


CONFIGS = {"llama-gqa": (llama, torch.bfloat16), "mistral-window-fp16": (mistral, torch.float16),
           "gemma2-hybrid": (gemma2, torch.bfloat16)}


@pytest.fixture
def spy(monkeypatch):
    """Counts the calls that ran on cuflash (with their options) and those that fell back to sdpa."""
    log = {"cuflash": [], "sdpa": 0, "rows": 0}
    real_cuflash, real_sdpa, real_rows = cuflash_hf._cuflash, cuflash_hf._sdpa, cuflash_hf._cuflash_rows

    def run_cuflash(q, k, v, **options):
        log["cuflash"].append(options)
        return real_cuflash(q, k, v, **options)

    def run_rows(*args, **options):  # right padding, packed rows: attention_varlen over the rows
        log["rows"] += 1
        return real_rows(*args, **options)

    def run_sdpa(*args):
        log["sdpa"] += 1
        return real_sdpa(*args)

    monkeypatch.setattr(cuflash_hf, "_cuflash", run_cuflash)
    monkeypatch.setattr(cuflash_hf, "_sdpa", run_sdpa)
    monkeypatch.setattr(cuflash_hf, "_cuflash_rows", run_rows)
    monkeypatch.setattr(cuflash_hf, "_warned", set())
    return log


def _models(config_fn, dtype, impl="sdpa"):
    """(float32 `impl` reference, half-precision `impl`, half-precision cuflash), the same weights."""
    name = cuflash_hf.register()
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config_fn(), attn_implementation=impl).cuda().float()
    models = [ref]
    for impl in (impl, name):
        m = transformers.AutoModelForCausalLM.from_config(config_fn(), attn_implementation=impl)
        m.load_state_dict(copy.deepcopy(ref.state_dict()))
        m = m.cuda().to(dtype)
        assert m.config._attn_implementation == impl
        models.append(m)
    for m in models:
        m.train()  # dropout is 0 in these configs; train mode as in a training step
    return models


def _allowed(got, ref, same, factor=2.0):
    ref = ref.float()
    err = (got.float() - ref).abs().max().item()
    pt = (same.float() - ref).abs().max().item()
    atol = 2 * torch.finfo(got.dtype).eps * ref.abs().max().item()
    return err, pt, factor * pt + atol


def _step(model, ids, labels=None, **kw):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids if labels is None else labels, **kw)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _steps(models, spy, ids, labels=None, **kw):
    """A training step of each of (float32 reference, sdpa, cuflash) models: their (logits, grads),
    and how many calls of the cuflash step fell back to sdpa."""
    ref, sdpa, cu = models
    steps = [_step(ref, ids, labels, **kw), _step(sdpa, ids, labels, **kw)]
    n_sdpa = spy["sdpa"]
    steps.append(_step(cu, ids, labels, **kw))
    return (*steps, spy["sdpa"] - n_sdpa)


def _assert_steps_agree(ref, sdpa, cu, real=None):
    """cuflash's logits (at the `real` positions, None: all) and gradients within the 2x rule of
    sdpa's error against the float32 reference."""
    pick = (lambda x: x) if real is None else (lambda x: x[real])
    err, pt, allowed = _allowed(pick(cu[0]), pick(ref[0]), pick(sdpa[0]))
    assert err <= allowed, f"logits: err {err:.3e} > allowed {allowed:.3e} (sdpa's {pt:.3e})"
    assert cu[1].keys() == ref[1].keys()
    bad = []
    for name in ref[1]:
        err, pt, allowed = _allowed(cu[1][name], ref[1][name], sdpa[1][name])
        if err > allowed:
            bad.append(f"{name}: err {err:.3e} > allowed {allowed:.3e} (sdpa's {pt:.3e})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_logits_and_gradients_match_sdpa(which, spy):
    config_fn, dtype = CONFIGS[which]
    ids = torch.randint(0, 256, (2, 192), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    ref, sdpa, cu, fallbacks = _steps(_models(config_fn, dtype), spy, ids)
    assert not fallbacks, "cuflash fell back to sdpa on a plain causal batch"
    assert len(spy["cuflash"]) == config_fn().num_hidden_layers  # forward calls; backward is autograd's
    windows = {o["window_size"] for o in spy["cuflash"]}
    if which.startswith("mistral"):
        assert windows == {(47, 0)}
    elif which.startswith("gemma2"):
        assert windows == {(47, 0), (-1, -1)}  # sliding and full layers alternate
        assert all(o["softmax_scale"] == pytest.approx(128 ** -0.5) for o in spy["cuflash"])
    else:
        assert windows == {(-1, -1)}
    _assert_steps_agree(ref, sdpa, cu)


@pytest.mark.parametrize("which", ["llama-gqa", "mistral-window-fp16"])
def test_cached_decoding_matches_sdpa(which, spy):
    """Prefill then token-by-token decoding with a DynamicCache: cuflash's bottom-right masks need no
    mask tensor (q_len 1 against the whole cache; Mistral's sliding cache keeps the window's keys)."""
    config_fn, dtype = CONFIGS[which]
    ref, sdpa, cu = _models(config_fn, dtype)
    ids = torch.randint(0, 256, (2, 104), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    logits = {}
    with torch.no_grad():
        for key, m in (("ref", ref), ("sdpa", sdpa), ("cu", cu)):
            out = m(input_ids=ids[:, :100], use_cache=True)
            steps, cache = [out.logits[:, -1]], out.past_key_values
            for t in range(100, 104):
                out = m(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
                steps.append(out.logits[:, -1])
                cache = out.past_key_values
            logits[key] = torch.stack(steps)
    err, pt, allowed = _allowed(logits["cu"], logits["ref"], logits["sdpa"])
    assert err <= allowed, f"decoding logits: err {err:.3e} > allowed {allowed:.3e} (sdpa's {pt:.3e})"
    if which == "llama-gqa":
        assert spy["sdpa"] == 0 and len(spy["cuflash"]) == 5 * 2  # 5 forwards x 2 layers, none fell back


def test_padding_in_the_middle_falls_back_to_sdpa(spy):
    _, sdpa, cu = _models(llama, torch.bfloat16)
    ids = torch.randint(0, 256, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 10:14] = 0  # neither left nor right padding
    with torch.no_grad(), pytest.warns(UserWarning, match="attention mask"):
        got = cu(input_ids=ids, attention_mask=mask).logits
    want = sdpa(input_ids=ids, attention_mask=mask).logits
    assert spy["sdpa"] >= 2 and not spy["cuflash"] and not spy["rows"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same sdpa calls on the same weights


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_sequences_packed_by_position_ids_run_on_cuflash(which, spy):
    """Three sequences packed in one row, told apart by position_ids: transformers builds a block
    mask (it looks for packing only without a cache, hence use_cache=False), which the mask function
    recognises; the rows run on attention_varlen. Logits and a training step's gradients by the 2x
    rule against float32 sdpa."""
    config_fn, dtype = CONFIGS[which]
    ids = torch.randint(0, 256, (1, 192), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    pos = torch.cat([torch.arange(70), torch.arange(50), torch.arange(72)]).to("cuda")[None]
    ref, sdpa, cu, fallbacks = _steps(_models(config_fn, dtype), spy, ids, position_ids=pos, use_cache=False)
    assert not fallbacks and spy["rows"] == config_fn().num_hidden_layers, spy
    _assert_steps_agree(ref, sdpa, cu)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_padded_batches_run_on_cuflash(which, side, spy):
    """Batches padded at the end (training) or the start (generation) of their rows run on cuflash
    (attention_varlen, each row's real tokens its used sequence): the logits at the real positions
    and a training step's gradients (padding labelled -100) agree with sdpa's by the 2x rule against
    float32; padding in the middle falls back (test_padding_in_the_middle_falls_back_to_sdpa)."""
    config_fn, dtype = CONFIGS[which]
    ids = torch.randint(0, 256, (3, 160), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, 100:] = 0
    mask[2, 37:] = 0
    if side == "left":
        mask = mask.flip(-1)
    labels = ids.masked_fill(mask == 0, -100)
    ref, sdpa, cu, fallbacks = _steps(_models(config_fn, dtype), spy, ids, labels, attention_mask=mask,
                                      use_cache=False)
    assert not fallbacks and spy["rows"] == config_fn().num_hidden_layers, spy
    _assert_steps_agree(ref, sdpa, cu, real=mask.bool())


def gemma2_softcap():
    return transformers.Gemma2Config(num_key_value_heads=2, sliding_window=48, attn_logit_softcapping=50.0,
                                     final_logit_softcapping=None, query_pre_attn_scalar=64, **COMMON)


def test_attention_softcap_runs_on_cuflash_and_matches_eager(spy):
    """Gemma 2's attention logit soft-capping on cuflash's softcap: logits and gradients by the 2x
    rule against transformers' eager attention (sdpa ignores softcap), float32 eager the reference."""
    ids = torch.randint(0, 256, (2, 192), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    ref, eager, cu, _ = _steps(_models(gemma2_softcap, torch.bfloat16, impl="eager"), spy, ids)
    assert spy["cuflash"] and all(o["softcap"] == 50.0 for o in spy["cuflash"])
    _assert_steps_agree(ref, eager, cu)  # (eager in sdpa's place: sdpa ignores softcap)


def test_float32_model_falls_back_with_a_correct_mask(spy):
    """A float32 model (cuflash takes fp16/bf16 only) runs on sdpa with cuflash's bottom-right window
    as an explicit mask, so results stay those of the sdpa model."""
    ref, _, _ = _models(mistral, torch.float16)
    name = cuflash_hf.register()
    cu32 = transformers.AutoModelForCausalLM.from_config(mistral(), attn_implementation=name)
    cu32.load_state_dict(ref.state_dict())
    cu32 = cu32.cuda().float()
    ids = torch.randint(0, 256, (2, 160), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    with torch.no_grad(), pytest.warns(UserWarning, match="dtype float32"):
        got = cu32(input_ids=ids).logits
    want = ref(input_ids=ids).logits
    assert not spy["cuflash"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_flash_style_packed_sequences_run_on_varlen(monkeypatch):
    """Sequences packed into batch 1 with cu_seq_lens_q/k (transformers' FlashAttentionKwargs, passed
    to the model's forward) run on cuflash.attention_varlen; the logits equal each sequence run alone
    (positions restarting per sequence), to the half-precision model's own run-to-run tolerance."""
    _, _, cu = _models(llama, torch.bfloat16)
    cu.eval()
    ran = []
    real = cuflash_hf._cuflash_varlen
    monkeypatch.setattr(cuflash_hf, "_cuflash_varlen", lambda *a, **o: ran.append(o) or real(*a, **o))
    lens = [64, 1, 127]
    ids = torch.randint(0, 256, (1, sum(lens)), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    offsets = torch.tensor([0, 64, 65, 192], device="cuda", dtype=torch.int32)
    positions = torch.cat([torch.arange(n, device="cuda") for n in lens])[None]
    with torch.no_grad():
        packed = cu(input_ids=ids, position_ids=positions, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets,
                    max_length_q=max(lens), max_length_k=max(lens)).logits[0]
        alone = torch.cat([cu(input_ids=ids[:, a:b]).logits[0] for a, b in ((0, 64), (64, 65), (65, 192))])
    assert len(ran) == cu.config.num_hidden_layers, "the packed call did not reach attention_varlen"
    err = float((packed.float() - alone.float()).abs().max())
    assert err <= 4 * torch.finfo(torch.bfloat16).eps * float(alone.float().abs().max()), err


def test_cached_decoding_runs_the_decode_kernel(spy, monkeypatch):
    """The decode steps of a cached generation (q_len 1, no autograd) go to the KV-cache decode
    kernel (attention_with_kvcache over the whole cache), the prefill to cuflash.attention; the
    logits match sdpa's as in test_cached_decoding_matches_sdpa."""
    from cuflash import kvcache

    calls = []
    real = kvcache.attention_with_kvcache
    monkeypatch.setattr(kvcache, "attention_with_kvcache", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    config_fn, dtype = CONFIGS["llama-gqa"]
    ref, sdpa, cu = _models(config_fn, dtype)
    ids = torch.randint(0, 256, (2, 70), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    logits = {}
    with torch.no_grad():
        for key, m in (("ref", ref), ("sdpa", sdpa), ("cu", cu)):
            out = m(input_ids=ids[:, :64], use_cache=True)
            steps, cache = [out.logits[:, -1]], out.past_key_values
            for t in range(64, 70):
                out = m(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
                steps.append(out.logits[:, -1])
                cache = out.past_key_values
            logits[key] = torch.stack(steps)
    assert len(calls) == 6 * 2 and all(s[1] == 1 for s in calls)  # 6 decode steps x 2 layers, one query each
    err, pt, allowed = _allowed(logits["cu"], logits["ref"], logits["sdpa"])
    assert err <= allowed, f"decoding logits: err {err:.3e} > allowed {allowed:.3e} (sdpa's {pt:.3e})"


@pytest.mark.parametrize("which", ["llama-gqa", "mistral-window-fp16"])
def test_left_padded_decoding_runs_on_the_kv_cache_path(which, spy, monkeypatch):
    """A left-padded batch (generate()'s) decoding over its cache: the steps go to
    attention_with_kvcache with each row's pad (cache_leftpad; Mistral's window of 48 still holds the
    whole cache), the prefill to the rows path; the real positions' logits within the 2x rule of
    sdpa's against the float32 reference."""
    from cuflash import kvcache

    pads_seen = []
    real = kvcache.attention_with_kvcache
    monkeypatch.setattr(kvcache, "attention_with_kvcache",
                        lambda *a, **kw: pads_seen.append(kw.get("cache_leftpad")) or real(*a, **kw))
    config_fn, dtype = CONFIGS[which]
    ref, sdpa, cu = _models(config_fn, dtype)
    n, pad, new = 36, 13, 6
    ids = torch.randint(0, 256, (2, n + new), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    logits = {}
    with torch.no_grad():
        for key, m in (("ref", ref), ("sdpa", sdpa), ("cu", cu)):
            m.eval()
            out = m(input_ids=ids[:, :n], attention_mask=mask[:, :n], use_cache=True)
            steps, cache = [out.logits[:, -1]], out.past_key_values
            for t in range(n, n + new):
                out = m(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache,
                        use_cache=True)
                steps.append(out.logits[:, -1])
                cache = out.past_key_values
            logits[key] = torch.stack(steps)
    assert spy["sdpa"] == 0 and spy["rows"] == 2, spy  # the prefill: 2 layers on the rows path
    assert len(pads_seen) == new * 2 and all(p is not None and p.tolist() == [0, pad] for p in pads_seen)
    err, pt, allowed = _allowed(logits["cu"], logits["ref"], logits["sdpa"])
    assert err <= allowed, f"decoding logits: err {err:.3e} > allowed {allowed:.3e} (sdpa's {pt:.3e})"
