"""The torch ops' registration, fake implementations and autograd wiring, on meta tensors (no GPU).

Skipped where torch is not installed; the GPU side is tests/gpu/test_torch_gpu.py.
"""
import pytest

torch = pytest.importorskip("torch", reason="torch not installed: torch op registration not tested")


@pytest.fixture(scope="module")
def ops():
    import cuflash

    cuflash.api._load_torch()
    return torch.ops.cuflash.attention_fwd.default, torch.ops.cuflash.attention_bwd.default


def _meta(b, n, h, d, dtype=torch.bfloat16, requires_grad=False):
    return torch.empty(b, n, h, d, device="meta", dtype=dtype, requires_grad=requires_grad)


def test_schemas(ops):
    fwd, bwd = ops
    assert str(fwd._schema).startswith("cuflash::attention_fwd(Tensor q, Tensor k, Tensor v, bool causal, "
                                       "float? softmax_scale, str algorithm, bool deterministic, float dropout_p, "
                                       "int seed")
    assert str(bwd._schema).startswith("cuflash::attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, "
                                       "Tensor out, Tensor lse, bool causal, float? softmax_scale, "
                                       "bool deterministic, float dropout_p, int seed")


def test_op_signatures_follow_the_argument_lists(ops):
    import inspect

    from cuflash import _torch, signature

    for op, fake, names in ((_torch.attention_fwd, _torch._attention_fwd_fake, signature.FWD_ARGS),
                            (_torch.attention_bwd, _torch._attention_bwd_fake, signature.BWD_ARGS)):
        real = getattr(op, "_init_fn", fake)  # (the wrapped function's attribute name is torch's private)
        for fn in (real, fake):
            assert tuple(inspect.signature(fn).parameters) == names, fn


def test_fake_shapes_and_autograd_wiring(ops):
    fwd, _ = ops
    q, k, v = _meta(2, 64, 4, 64, requires_grad=True), _meta(2, 80, 4, 64, requires_grad=True), \
        _meta(2, 80, 4, 64, requires_grad=True)
    out, lse = fwd(q, k, v, True, None, "v2", True, 0.0, 0)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (2, 4, 64) and lse.dtype == torch.float32
    assert out.requires_grad and not lse.requires_grad  # lse is marked non-differentiable
    out.sum().backward()  # a zero-stride dout through the bwd op's fake
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("args,exc,words", [
    (dict(dtype=torch.float32), TypeError, "q has dtype float32"),
    (dict(d=100), ValueError, "head_dim must be a multiple of 8"),
    (dict(scale=-1.0), ValueError, "softmax_scale"),
    (dict(algorithm="v3"), ValueError, "algorithm must be 'v1' or 'v2'"),
])
def test_fake_validates(ops, args, exc, words):
    fwd, _ = ops
    d, dt = args.get("d", 64), args.get("dtype", torch.bfloat16)
    q = _meta(1, 16, 2, d, dt)
    with pytest.raises(exc, match=words):
        fwd(q, q, q, False, args.get("scale"), args.get("algorithm", "v2"), False, 0.0, 0)


def test_opcheck_on_meta(ops):
    fwd, bwd = ops
    q, k, v = _meta(2, 64, 4, 64, requires_grad=True), _meta(2, 80, 4, 64, requires_grad=True), \
        _meta(2, 80, 4, 64, requires_grad=True)
    torch.library.opcheck(fwd, (q, k, v, True, None, "v2", False, 0.0, 0))
    d = _meta(2, 64, 4, 64)
    lse = torch.empty(2, 4, 64, device="meta", dtype=torch.float32)
    torch.library.opcheck(bwd, (d, q.detach(), k.detach(), v.detach(), d, lse, True, 0.2, True, 0.0, 0))


@pytest.mark.parametrize("registered", [False, True])
def test_cpu_tensors_refused_by_name(registered, monkeypatch):
    import numpy as np

    import cuflash

    if registered:  # the torch module loaded: its own checks give the same messages
        cuflash.api._load_torch()
    else:
        monkeypatch.setattr(cuflash.api, "_tmod", None)
    x = torch.zeros(1, 8, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="q must be on a CUDA device, got a torch.Tensor on cpu"):
        cuflash.attention(x, x, x)
    with pytest.raises(TypeError, match="v must be a CuPy array, torch.Tensor"):
        cuflash.attention(x, x, [1])
    with pytest.raises(TypeError, match="k must be on a CUDA device, got a numpy.ndarray in host memory"):
        cuflash.attention(x, np.zeros((1, 8, 1, 64)), x)


@pytest.mark.parametrize("hkv", [1, 2])
def test_fake_gqa_shapes(ops, hkv):
    """GQA/MQA through the ops' fakes: out and lse follow q, dk and dv follow k and v (heads_kv heads);
    heads that do not divide are refused with problem.py's message."""
    fwd, _ = ops
    q = _meta(2, 64, 4, 64, requires_grad=True)
    k, v = _meta(2, 80, hkv, 64, requires_grad=True), _meta(2, 80, hkv, 64, requires_grad=True)
    out, lse = fwd(q, k, v, True, None, "v2", False, 0.0, 0)
    assert out.shape == q.shape and lse.shape == (2, 4, 64)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape == v.grad.shape == (2, 80, hkv, 64)
    bad = _meta(2, 80, 3, 64)
    with pytest.raises(ValueError, match="q has 4, k and v have 3"):
        fwd(q.detach(), bad, bad, False, None, "v2", False, 0.0, 0)
