"""cuflash.jax on the GPU: under jax.jit, differentiable, on XLA's stream, against plain JAX attention.

Tolerance: FlashAttention's rule, as tests/gpu (cuflash.testing.fa_rule): cuflash's error against a
float32 reference (plain JAX attention on the inputs upcast to float32, HIGHEST matmul precision) is
at most twice the error of plain JAX attention computed in the input dtype, plus the rounding of
the output dtype at the output's magnitude. (float32 rather than float64: JAX runs without x64 by
default, and float32's error is orders of magnitude below bf16/fp16's.)
"""
from __future__ import annotations

import functools
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # CuPy's pool needs room next to XLA's

import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax = pytest.importorskip("jax", reason="jax not installed: cuflash.jax not tested")
pytest.importorskip("jax.experimental.buffer_callback", reason="this jax has no buffer_callback")
import jax.numpy as jnp  # noqa: E402

pytestmark = pytest.mark.gpu

HIGHEST = jax.lax.Precision.HIGHEST


@pytest.fixture(scope="module", autouse=True)
def _jax_gpu():
    try:
        jax.devices("cuda")
    except RuntimeError as e:
        pytest.skip(f"jax has no CUDA backend here ({e})")


def plain_attention(q, k, v, causal=False, window=(-1, -1), scale=None, dtype=None):
    """Attention in plain JAX, bottom-right aligned masks (cuflash's default), GQA by repeating k/v
    heads; computed in `dtype` (default q's; the softmax in float32 either way), result in `dtype`
    (so that a float32 reference is not rounded back to q's dtype)."""
    dtype = dtype or q.dtype
    b, nq, h, d = q.shape
    nk, hk = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    k, v = (jnp.repeat(x, h // hk, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(dtype), k.astype(dtype), precision=HIGHEST) * scale
    i = jnp.arange(nq)[:, None] + (nk - nq)  # row i's diagonal key
    j = jnp.arange(nk)[None, :]
    left, right = window
    right = 0 if causal and (right < 0 or right > 0) else right
    ok = jnp.ones((nq, nk), bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    s = jnp.where(ok, s.astype(jnp.float32) if dtype != jnp.float32 else s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0)
    p = jnp.exp(s - m)
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(dtype), v.astype(dtype), precision=HIGHEST)


def _err(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def _allowed(got, ref32, same_dtype, factor=2.0):
    """(error, same-dtype error, allowed): cuflash.testing._allowed's rule with a float32 reference."""
    err, pt = _err(got, ref32), _err(same_dtype, ref32)
    r = ref32.astype(jnp.float32)
    atol = 2 * float(jnp.max(jnp.abs((r + 0.3).astype(got.dtype).astype(jnp.float32) - 0.3 - r)))
    return err, pt, factor * pt + atol


def _qkv(seed, b, nq, nk, h, hk, d, dtype=jnp.bfloat16):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (b, nq, h, d), jnp.float32).astype(dtype),
            jax.random.normal(kk, (b, nk, hk, d), jnp.float32).astype(dtype),
            jax.random.normal(kv, (b, nk, hk, d), jnp.float32).astype(dtype))


CASES = [  # (b, nq, nk, h, hk, d, causal, window, dtype)
    (2, 128, 128, 4, 4, 64, False, (-1, -1), jnp.bfloat16),
    (2, 200, 200, 4, 4, 128, True, (-1, -1), jnp.float16),
    (1, 96, 300, 8, 2, 64, True, (-1, -1), jnp.bfloat16),  # GQA, bottom-right causal
    (2, 256, 256, 8, 1, 128, True, (31, 0), jnp.bfloat16),  # MQA, Mistral-style window
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}x{c[2]}-h{c[3]}/{c[4]}-d{c[5]}-c{int(c[6])}-w{c[7][0]}")
def test_jitted_forward_matches_plain_jax(case):
    import cuflash.jax

    b, nq, nk, h, hk, d, causal, window, dtype = case
    q, k, v = _qkv(0, b, nq, nk, h, hk, d, dtype)
    f = jax.jit(lambda q, k, v: cuflash.jax.attention(q, k, v, causal=causal, window_size=window))
    assert "buffer_callback" in str(jax.make_jaxpr(f)(q, k, v))
    out = f(q, k, v)
    assert isinstance(out, jax.Array) and out.shape == q.shape and out.dtype == dtype
    ref = plain_attention(q, k, v, causal, window, dtype=jnp.float32)
    err, pt, allowed = _allowed(out, ref, plain_attention(q, k, v, causal, window))
    assert err <= allowed, f"max err {err:.3e} > allowed {allowed:.3e} (same-dtype err {pt:.3e})"


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3]], ids=["causal", "gqa-causal", "mqa-window"])
def test_jitted_gradients_match_plain_jax(case):
    import cuflash.jax

    b, nq, nk, h, hk, d, causal, window, dtype = case
    q, k, v = _qkv(1, b, nq, nk, h, hk, d, dtype)
    w = jax.random.normal(jax.random.key(2), q.shape, jnp.float32)

    def loss(attn):
        return lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) * w)

    got = jax.jit(jax.grad(loss(lambda *a: cuflash.jax.attention(*a, causal=causal, window_size=window)),
                           argnums=(0, 1, 2)))(q, k, v)
    # the float32 reference differentiates with respect to float32 copies (its gradients unrounded)
    ref = jax.grad(loss(lambda *a: plain_attention(*a, causal, window)),
                   argnums=(0, 1, 2))(*(x.astype(jnp.float32) for x in (q, k, v)))
    same = jax.grad(loss(lambda *a: plain_attention(*a, causal, window)), argnums=(0, 1, 2))(q, k, v)
    for name, g, r, s, x in zip(("dq", "dk", "dv"), got, ref, same, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        err, pt, allowed = _allowed(g, r, s)
        assert err <= allowed, f"{name}: max err {err:.3e} > allowed {allowed:.3e} (same-dtype err {pt:.3e})"


def _init(key, dm, h, hk, d):
    ks = jax.random.split(key, 4)
    sd = 1 / np.sqrt(dm)
    return {"wq": jax.random.normal(ks[0], (dm, h * d)) * sd, "wk": jax.random.normal(ks[1], (dm, hk * d)) * sd,
            "wv": jax.random.normal(ks[2], (dm, hk * d)) * sd,
            "wo": jax.random.normal(ks[3], (h * d, dm)) / np.sqrt(h * d)}


def _model_loss(attn, h, hk, d):
    """A one-layer GQA causal attention block in bf16 (params float32, cast), mean-squared error loss."""
    def loss(params, x, y):
        b, n, _ = x.shape
        p = {name: w.astype(jnp.bfloat16) for name, w in params.items()}
        xb = x.astype(jnp.bfloat16)
        q = (xb @ p["wq"]).reshape(b, n, h, d)
        k = (xb @ p["wk"]).reshape(b, n, hk, d)
        v = (xb @ p["wv"]).reshape(b, n, hk, d)
        o = attn(q, k, v).reshape(b, n, h * d) @ p["wo"]
        return jnp.mean((o.astype(jnp.float32) + x - y) ** 2)
    return loss


def test_jitted_training_step_matches_plain_jax():
    import cuflash.jax

    b, n, dm, h, hk, d = 2, 256, 256, 4, 2, 64
    params = _init(jax.random.key(3), dm, h, hk, d)
    kx, ky = jax.random.split(jax.random.key(4))
    x, y = jax.random.normal(kx, (b, n, dm)), jax.random.normal(ky, (b, n, dm))

    def step_fn(attn):
        loss = _model_loss(attn, h, hk, d)

        @jax.jit
        def step(params, x, y):
            value, grads = jax.value_and_grad(loss)(params, x, y)
            return value, grads, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return step

    got_loss, got_grads, got_params = step_fn(lambda q, k, v: cuflash.jax.attention(q, k, v, causal=True))(params, x, y)
    ref_loss, ref_grads, _ = step_fn(lambda q, k, v: plain_attention(q, k, v, True, dtype=jnp.float32))(params, x, y)
    same_loss, same_grads, _ = step_fn(lambda q, k, v: plain_attention(q, k, v, True))(params, x, y)
    loss_err, same_err = abs(float(got_loss) - float(ref_loss)), abs(float(same_loss) - float(ref_loss))
    assert loss_err <= 2 * same_err + 1e-3 * float(ref_loss), f"loss: err {loss_err:.3e}, plain bf16's {same_err:.3e}"
    for name in params:
        g, r, s = got_grads[name], ref_grads[name], same_grads[name]
        err, pt = _err(g, r), _err(s, r)
        scale = float(jnp.max(jnp.abs(r)))
        assert err <= 2 * pt + 1e-3 * scale, f"grad {name}: err {err:.3e} > 2 * {pt:.3e} + {1e-3 * scale:.3e}"
    # a second step runs from the updated params (the jitted step is reused, not retraced)
    loss2, _, _ = step_fn(lambda q, k, v: cuflash.jax.attention(q, k, v, causal=True))(got_params, x, y)
    assert np.isfinite(float(loss2))


def test_runs_on_xlas_stream(monkeypatch):
    import cupy

    import cuflash.jax
    from cuflash import _forward, _jax_ops

    streams, launches = [], []
    real_on_stream, real_forward = _jax_ops._on_stream, _forward.forward
    monkeypatch.setattr(_jax_ops, "_on_stream", lambda ctx, dev: streams.append(int(ctx.stream)) or
                        real_on_stream(ctx, dev))
    monkeypatch.setattr(_forward, "forward", lambda *a, **kw: launches.append(cupy.cuda.get_current_stream().ptr)
                        or real_forward(*a, **kw))
    q, k, v = _qkv(5, 1, 64, 64, 2, 2, 64)
    out = jax.jit(lambda q, k, v: cuflash.jax.attention(q, k, v, causal=True) * 2)(q, k, v)
    out.block_until_ready()
    assert streams and launches == streams and streams[0] != 0  # XLA's compute stream, not the legacy one


def test_eager_and_return_lse_and_deterministic():
    import cuflash.jax

    q, k, v = _qkv(6, 1, 128, 128, 4, 2, 64)
    out, lse = cuflash.jax.attention(q, k, v, causal=True, return_lse=True)
    assert lse.shape == (1, 4, 128) and lse.dtype == jnp.float32
    jitted = jax.jit(lambda *a: cuflash.jax.attention(*a, causal=True))(q, k, v)
    assert bool(jnp.all(out == jitted))
    w = jax.random.normal(jax.random.key(7), q.shape)
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
        cuflash.jax.attention(q, k, v, causal=True, deterministic=True).astype(jnp.float32) * w)))
    a, b = grad(q, k, v), grad(q, k, v)
    bits = jax.lax.bitcast_convert_type
    assert bool(jnp.all(bits(a, jnp.uint16) == bits(b, jnp.uint16)))


def test_bad_input_raises_when_traced():
    import cuflash.jax

    q, k, v = _qkv(8, 1, 16, 16, 2, 2, 64)
    with pytest.raises(ValueError, match="number of heads"):
        jax.jit(lambda q, k, v: cuflash.jax.attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2)))(q, k, v)
    with pytest.raises(TypeError, match="dtype float32"):
        jax.jit(lambda q, k, v: cuflash.jax.attention(q.astype(jnp.float32), k, v))(q, k, v)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        cuflash.jax.attention(q, k, v, dropout_p=0.1)


def test_vmap_folds_into_one_call():
    """vmap: the mapped axis is merged into batch inside the callbacks (vmap_method="broadcast_all");
    gradients of k, v shared across the mapped axis are summed over it (custom_vjp's batching)."""
    import cuflash.jax

    q, k, v = _qkv(9, 2, 64, 80, 4, 2, 64)
    qs = jnp.stack([q, q * 0.5, -q])
    ks, vs = jnp.stack([k, -k, k]), jnp.stack([v, v, -v])
    attn = functools.partial(cuflash.jax.attention, causal=True)
    got = jax.jit(jax.vmap(attn))(qs, ks, vs)
    want = jnp.stack([attn(qs[i], ks[i], vs[i]) for i in range(3)])
    assert got.shape == (3, *q.shape) and bool(jnp.all(got == want))  # the same blocks, the same bits

    w = jax.random.normal(jax.random.key(10), qs.shape)

    def vmapped(qs, k, v):
        return jnp.sum(jax.vmap(lambda q: attn(q, k, v))(qs).astype(jnp.float32) * w)

    def looped(qs, k, v):
        return sum(jnp.sum(attn(qs[i], k, v).astype(jnp.float32) * w[i]) for i in range(3))

    got = jax.jit(jax.grad(vmapped, argnums=(0, 1, 2)))(qs, k, v)
    want = jax.grad(looped, argnums=(0, 1, 2))(qs, k, v)
    for name, g, r in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == r.shape
        err, scale = _err(g, r), float(jnp.max(jnp.abs(r.astype(jnp.float32))))
        assert err <= 2e-2 * scale, f"{name}: err {err:.3e} vs max {scale:.3e}"
