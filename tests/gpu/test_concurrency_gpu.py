"""Concurrency (issue 14): threads, each on its own CuPy stream, calling forward (v2, v1, dropout), the
deterministic backward and a split-KV decoding step at once give bitwise the results of serial
calls (plan and kernel caches are shared)."""
from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from cuflash.testing import dtype_of, random_qkv

pytestmark = pytest.mark.gpu

THREADS, CALLS = 8, 12
# shapes differ per thread so that plans and kernels are built concurrently too
SHAPES = [(1 + t % 2, 100 + 37 * t, 80 + 53 * t, 2 + t % 3, 64 if t % 2 else 128, t % 3 == 0) for t in range(THREADS)]


def _inputs(t):
    b, nq, nk, h, d, causal = SHAPES[t]
    rng = np.random.default_rng(t)
    q, k, v = random_qkv(rng, b, nq, nk, h, d, dtype_of("bfloat16" if t % 2 else "float16"))
    dout = random_qkv(rng, b, nq, 1, h, d, q.dtype)[0]
    return q, k, v, dout, causal


def _run(q, k, v, dout, causal, t):
    """Thread t's calls: the forward (v1 on every fourth thread, dropout on every fourth other), the
    deterministic backward, and a split-KV decoding step on k, v as a cache (its plan's two launches
    share argument buffers across threads)."""
    import cuflash

    drop = dict(dropout_p=0.1, seed=t) if t % 4 == 2 else {}
    algorithm = "v1" if t % 4 == 1 else "v2"
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, algorithm=algorithm, **drop)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True, **drop)
    step = cuflash.attention_with_kvcache(q[:, :1], k, v, cache_seqlens=k.shape[1] - 3, num_splits=3)
    return (out, lse, *grads, step)


def test_threads_and_streams_match_serial_calls():
    import cupy

    inputs = [_inputs(t) for t in range(THREADS)]
    serial = [tuple(x.copy() for x in _run(*inputs[t], t)) for t in range(THREADS)]
    cupy.cuda.Device().synchronize()

    def worker(t):
        stream = cupy.cuda.Stream(non_blocking=True)
        results = []
        with stream:
            for _ in range(CALLS):
                results.append(_run(*inputs[t], t))
            stream.synchronize()
        return results

    with concurrent.futures.ThreadPoolExecutor(THREADS) as ex:
        all_results = list(ex.map(worker, range(THREADS)))
    for t, results in enumerate(all_results):
        for r in results:
            for got, want in zip(r, serial[t]):
                assert bool((got.view(cupy.uint8) == want.view(cupy.uint8)).all()), f"thread {t}: differs from serial"
