"""Issue 18: cuflash inside CUDA graphs from CuPy (stream capture) and torch (inference forward), and
the torch entry point's cached options: a call whose options were seen before still gets its
tensors checked and never takes a plan made for other options."""
from __future__ import annotations

import numpy as np
import pytest

import cuflash
from cuflash.testing import dtype_of, random_qkv

pytestmark = pytest.mark.gpu


def _bits(a):
    import cupy

    return cupy.ascontiguousarray(a).view(cupy.uint8).get()


def test_cupy_stream_capture_of_forward_and_backward():
    """After a warm-up (kernels compiled, plans built), CuPy's stream capture records the forward and
    the backward: the replays write what eager calls give, bit for bit."""
    import cupy

    q, k, v = random_qkv(np.random.default_rng(3), 2, 200, 300, 4, 64, dtype_of("bfloat16"))
    dout = cupy.asarray(random_qkv(np.random.default_rng(4), 2, 200, 200, 4, 64, dtype_of("bfloat16"))[0])
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(2):
            out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
            cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
        stream.synchronize()
        stream.begin_capture()
        g_out, g_lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        g_grads = cuflash.attention_backward(dout, q, k, v, g_out, g_lse, causal=True, deterministic=True)
        graph = stream.end_capture()
        for a in (g_out, g_lse, *g_grads):
            a.fill(0)  # captured, not run: the replay writes them
        graph.launch(stream)
        stream.synchronize()
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
        stream.synchronize()
    for got, want in zip((g_out, g_lse, *g_grads), (out, lse, *grads)):
        assert (_bits(got) == _bits(want)).all()


_REPLAY_AFTER_REUSE = """
import sys
import cupy
import numpy as np
import cuflash
from cuflash.testing import dtype_of, random_qkv

det = sys.argv[1] == "1"
q, k, v = random_qkv(np.random.default_rng(3), 2, 200, 300, 4, 64, dtype_of("bfloat16"))
dout = cupy.asarray(random_qkv(np.random.default_rng(4), 2, 200, 200, 4, 64, dtype_of("bfloat16"))[0])
bits = lambda a: cupy.ascontiguousarray(a).view(cupy.uint8).get()
pool = cupy.get_default_memory_pool()
stream = cupy.cuda.Stream(non_blocking=True)
with stream:
    for _ in range(2):  # compiled, planned
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=det)
    stream.synchronize()
    stream.begin_capture()
    g_out, g_lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    g_grads = cuflash.attention_backward(dout, q, k, v, g_out, g_lse, causal=True, deterministic=det)
    graph = stream.end_capture()
    # What a program does next: the pool's free blocks go back to CUDA, and new arrays take memory.
    # A workspace the capture had taken from the pool would now be freed memory or someone's array.
    pool.free_all_blocks()
    others = [cupy.full(n, np.nan, dtype=cupy.float32) for n in (1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20) * 4]
    for _ in range(3):
        graph.launch(stream)
    stream.synchronize()
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=det)
    stream.synchronize()
for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (g_out, g_lse, *g_grads), (out, lse, *grads)):
    if name == "dq" and not det:  # summed by atomics in any order
        g, w = (cupy.asnumpy(x.astype(cupy.float32)) for x in (got, want))
        assert np.allclose(g, w, rtol=1e-2, atol=1e-3), name
    else:
        assert (bits(got) == bits(want)).all(), name
assert all(bool(cupy.isnan(a).all()) for a in others), "a replay wrote into memory the program had since allocated"
print("ok")
"""


@pytest.mark.parametrize("deterministic", [False, True])
def test_captured_workspaces_belong_to_the_graph(deterministic):
    """The backward's workspaces (dQ accumulator, delta, ...) die at the end of the captured call. From
    CuPy's pool, the program's next arrays would get that memory and every replay would overwrite it;
    captured, they are the graph's own (launch._graph_owned). In a child process: the failure this
    guards against can be an illegal address, which would end the test process."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", _REPLAY_AFTER_REUSE, "1" if deterministic else "0"], capture_output=True,
                       text=True, cwd=root, env=env, timeout=300, check=False)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_torch_inference_forward_in_a_graph():
    """A forward that records no gradient (no input requires one) skips autograd's Function; it is
    captured by torch.cuda.graph like the differentiable one."""
    torch = pytest.importorskip("torch")
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 256, 4, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            cuflash.attention(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuflash.attention(q, k, v)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    eager = cuflash.attention(q, k, v)
    assert not eager.requires_grad and eager.grad_fn is None
    assert torch.equal(out.view(torch.uint8), eager.view(torch.uint8))
    with torch.no_grad():  # grad mode off with inputs that require one: no graph either
        assert cuflash.attention(q.requires_grad_(), k, v).grad_fn is None


def test_torch_cached_options_still_check_arguments():
    """The torch entry point keeps the checked options of calls without dropout by their public
    arguments; equal-comparing arguments of another type are not taken for them (softmax_scale=True
    after 1.0), and tensors of another device or framework still get their messages."""
    torch = pytest.importorskip("torch")
    import cupy

    q, k, v = (torch.randn(1, 64, 2, 64, device="cuda").to(torch.bfloat16) for _ in range(3))
    cuflash.attention(q, k, v, softmax_scale=1.0)
    cuflash.attention(q, k, v, softmax_scale=1.0)
    with pytest.raises(TypeError, match="softmax_scale"):
        cuflash.attention(q, k, v, softmax_scale=True)
    with pytest.raises(TypeError, match="CUDA device"):
        cuflash.attention(q, k.cpu(), v, softmax_scale=1.0)
    with pytest.raises((TypeError, ValueError), match="k"):
        cuflash.attention(q, cupy.asarray(k.float().cpu().numpy()), v, softmax_scale=1.0)
    half = cuflash.attention(q, k, v, softmax_scale=0.5)  # other options: another entry, other results
    assert not torch.equal(half, cuflash.attention(q, k, v, softmax_scale=1.0))
