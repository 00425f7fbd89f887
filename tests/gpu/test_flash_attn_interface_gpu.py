"""cuflash.flash_attn_interface on torch tensors: flash-attn 2's call conventions give cuflash's
results (forward and autograd), packed layouts without copies. Needs torch and a GPU."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def _qkv(b=2, n=257, h=4, d=64, dtype=None, requires_grad=False):
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda: torch.randn(b, n, h, d, device="cuda", dtype=dtype or torch.bfloat16, generator=g).requires_grad_(requires_grad)
    return mk(), mk(), mk()


def _sdpa(q, k, v, causal):
    # math path in float32 as the reference (bottom-right = top-left for square seqlens)
    o = torch.nn.functional.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v)), is_causal=causal)
    return o.transpose(1, 2)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_matches_cuflash_and_sdpa(causal):
    import cuflash
    from cuflash.flash_attn_interface import flash_attn_func

    q, k, v = _qkv()
    out = flash_attn_func(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.equal(out, cuflash.attention(q, k, v, causal=causal))
    assert (out.float() - _sdpa(q, k, v, causal)).abs().max().item() < 2e-2
    out2, lse, probs = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert torch.equal(out2, out) and lse.shape == (2, 4, 257) and lse.dtype == torch.float32 and probs is None


def test_packed_layouts_are_views():
    from cuflash.flash_attn_interface import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func

    q, k, v = _qkv()
    qkv = torch.stack([q, k, v], dim=2)  # (b, n, 3, h, d)
    ref = flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    assert torch.equal(flash_attn_qkvpacked_func(qkv, causal=True), ref)
    kv = torch.stack([k, v], dim=2)
    assert torch.equal(flash_attn_kvpacked_func(q, kv, causal=True), flash_attn_func(q, k, v, causal=True))


def test_autograd_and_window():
    from cuflash.flash_attn_interface import flash_attn_func

    q, k, v = _qkv(requires_grad=True)
    out = flash_attn_func(q, k, v, causal=True, window_size=(32, 0))
    out.float().square().sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))
    # against a float32 autograd of the same window mask
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    n = q.shape[1]
    i, j = torch.arange(n, device="cuda")[:, None], torch.arange(n, device="cuda")[None, :]
    allowed = (j <= i) & (j >= i - 32)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) / q.shape[-1] ** 0.5
    p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    o = torch.einsum("bhqk,bkhd->bqhd", p, vf)
    o.square().sum().backward()
    assert (out.float() - o).abs().max().item() < 3e-2
    for a, b in ((q.grad, qf.grad), (k.grad, kf.grad), (v.grad, vf.grad)):
        assert (a.float() - b).abs().max().item() < 0.1 * b.abs().max().item() + 1e-2
