"""Memory (issue 14): many calls with random shapes leave device memory flat after warm-up; running out
of memory raises CuPy's OutOfMemoryError and the next call works."""
from __future__ import annotations

import os

import numpy as np
import pytest

from cuflash.testing import dtype_of, random_qkv

pytestmark = pytest.mark.gpu

SOAK_CALLS = int(os.environ.get("CUFLASH_SOAK_CALLS", "400"))


def _used_bytes():
    """(bytes CuPy's pool holds, bytes in live arrays) of this process: the device's free memory
    would count other processes (pytest-xdist workers share the GPU)."""
    import cupy

    cupy.cuda.Device().synchronize()
    pool = cupy.get_default_memory_pool()
    return pool.total_bytes(), pool.used_bytes()


def test_soak_memory_is_flat():
    import cuflash

    rng = np.random.default_rng(1)
    shapes = [(int(rng.integers(1, 3)), int(rng.integers(1, 600)), int(rng.integers(1, 600)), int(rng.integers(1, 4)),
               int(rng.choice([64, 128])), bool(rng.random() < 0.5)) for _ in range(24)]

    def call(i):
        b, nq, nk, h, d, causal = shapes[i % len(shapes)]
        q, k, v = random_qkv(np.random.default_rng(i), b, nq, nk, h, d, dtype_of("bfloat16"))
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        cuflash.attention_backward(out, q, k, v, out, lse, causal=causal)

    for i in range(2 * len(shapes)):  # warm-up: every shape's kernels, plans and pool blocks
        call(i)
    before = _used_bytes()
    for i in range(SOAK_CALLS):
        call(i)
    after = _used_bytes()
    print(f"soak: {SOAK_CALLS} calls, pool holds {before[0]} -> {after[0]} B, in use {before[1]} -> {after[1]} B")
    assert after[1] <= before[1], "CuPy's pool holds more live memory after the soak"
    assert after[0] - before[0] <= 64 << 20, "CuPy's pool grew by more than 64 MiB over the soak"


def test_out_of_memory_is_clean_and_the_next_call_works():
    """A pool with a limit below the call's output: the output allocation fails inside cuflash with
    CuPy's OutOfMemoryError (no other exception, no launch half done); back on the default pool the
    same call works and is finite. A private pool, so that the check does not depend on what earlier
    tests in the process left in the default one (free blocks inside partly used chunks stay in its
    total after free_all_blocks and can serve the output, so a limit there proves nothing)."""
    import cupy

    import cuflash

    q, k, v = random_qkv(np.random.default_rng(0), 1, 4096, 4096, 8, 128, dtype_of("float16"))  # 8 MiB each
    cuflash.attention(q, k, v)  # kernels and plan built
    cupy.cuda.Device().synchronize()
    pool = cupy.cuda.MemoryPool()
    pool.set_limit(size=1 << 20)  # 1 MiB: out needs 8 MiB
    with cupy.cuda.using_allocator(pool.malloc), pytest.raises(cupy.cuda.memory.OutOfMemoryError):
        cuflash.attention(q, k, v)
    out = cuflash.attention(q, k, v)
    assert bool(cupy.isfinite(out.astype(cupy.float32)).all())


def test_out_of_memory_in_the_backward_is_clean():
    """As the forward's: the backward's workspaces (dq's fp32 accumulator) do not fit a 1 MiB pool:
    CuPy's OutOfMemoryError, then the same backward on the default pool works and is finite."""
    import cupy

    import cuflash

    q, k, v = random_qkv(np.random.default_rng(1), 1, 4096, 4096, 8, 128, dtype_of("bfloat16"))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    cuflash.attention_backward(out, q, k, v, out, lse)  # kernels and plan built
    cupy.cuda.Device().synchronize()
    pool = cupy.cuda.MemoryPool()
    pool.set_limit(size=1 << 20)
    with cupy.cuda.using_allocator(pool.malloc), pytest.raises(cupy.cuda.memory.OutOfMemoryError):
        cuflash.attention_backward(out, q, k, v, out, lse)
    grads = cuflash.attention_backward(out, q, k, v, out, lse)
    assert all(bool(cupy.isfinite(g.astype(cupy.float32)).all()) for g in grads)


_TORCH_OOM = r"""
import torch
import cuflash

g = torch.Generator(device="cuda").manual_seed(2)
q, k, v = (torch.randn(1, 8192, 8, 128, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
           for _ in range(3))
cuflash.attention(q, k, v).sum().backward()  # plans built, torch's cache warm
torch.cuda.synchronize()
torch.cuda.empty_cache()
total = torch.cuda.get_device_properties(0).total_memory
try:
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated() + (1 << 20)) / total)
    try:
        cuflash.attention(q, k, v)
        raise SystemExit("no OutOfMemoryError")
    except torch.OutOfMemoryError:
        pass
finally:
    torch.cuda.set_per_process_memory_fraction(1.0)
out = cuflash.attention(q, k, v)
out.float().sum().backward()
assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
print("ok")
"""


def test_torch_out_of_memory_is_torchs_error_and_the_next_call_works():
    """From torch (outputs from torch's allocator): a per-process memory fraction that leaves no room
    for the output gives torch's OutOfMemoryError; with the fraction back, the same calls work. In a
    child process: the fraction bounds what torch reserves, and a worker's earlier tests can leave a
    reserved segment with room for the output inside it (the call then needs no new memory: an
    H100 run, 2026-12-06)."""
    pytest.importorskip("torch")
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", _TORCH_OOM], capture_output=True, text=True, cwd=root, env=env,
                       timeout=300, check=False)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.stdout[-2000:], r.stderr[-3000:])


def test_grids_beyond_65535_blocks():
    """batch x heads x query blocks over 65,535 (the y/z grid limit): the kernels take 1-D grids,
    forward and backward stay right (2x rule)."""
    import math

    import cuflash
    from cuflash.testing import fa_rule, fa_rule_grads

    q, k, v = random_qkv(np.random.default_rng(3), 35000, 17, 23, 2, 64, dtype_of("bfloat16"))
    dout = random_qkv(np.random.default_rng(4), 35000, 17, 1, 2, 64, dtype_of("bfloat16"))[0]
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    err, pt, allowed = fa_rule(out, q, k, v, True, 1 / math.sqrt(64))
    assert err <= allowed
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    for name, (err, pt, allowed) in fa_rule_grads(grads, q, k, v, dout, True, 1 / math.sqrt(64)).items():
        assert err <= allowed, name
