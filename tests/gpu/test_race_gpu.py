"""Races in the backward (reliability matrix R9, FlashAttention-3's race test): the deterministic
backward bitwise equal over many runs at batch 60, also with half of the GPU's free memory taken
first (another allocation pattern, other timing; half, not most: the suite shares the GPU between
xdist workers); the atomic mode's dK and dV bitwise equal over runs
(only dQ's fp32 additions are unordered there), its dQ to rounding. On the H200 the default
backward is the Hopper kernel (its deterministic mode: turn counters zeroed per call, a store warp,
CTAs in head groups); elsewhere the sm80 one. CUFLASH_RACE_RUNS sets the runs (default 200)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from cuflash.testing import dtype_of, random_qkv

pytestmark = pytest.mark.gpu

RUNS = int(os.environ.get("CUFLASH_RACE_RUNS", "200"))


def _case(causal, seed):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 60, 384, 384, 4, 128, dtype_of("bfloat16"))
    dout = random_qkv(rng, 60, 384, 1, 4, 128, q.dtype)[0]
    return q, k, v, dout


def _same(a, b) -> bool:
    import cupy

    return bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())


def _runs(causal, deterministic, runs):
    import cuflash

    q, k, v, dout = _case(causal, 60 + causal)
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    first = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)
    for i in range(runs):
        again = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)
        yield i, first, again


@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_backward_is_bitwise_over_many_runs(causal):
    for i, first, again in _runs(causal, True, RUNS):
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert _same(a, b), f"{name} differs in run {i + 1} of {RUNS}"


def test_deterministic_backward_is_bitwise_with_half_the_memory_taken():
    import cupy

    free, _ = cupy.cuda.runtime.memGetInfo()
    hog = cupy.empty(int(free * 0.5) // 2, dtype=cupy.uint16)  # held through the runs
    try:
        for i, first, again in _runs(True, True, max(RUNS // 4, 10)):
            for name, a, b in zip(("dq", "dk", "dv"), first, again):
                assert _same(a, b), f"{name} differs in run {i + 1} with half the memory taken"
    finally:
        del hog


@pytest.mark.parametrize("causal", [False, True])
def test_atomic_backward_keeps_dk_dv_bitwise_and_dq_to_rounding(causal):
    import cupy

    for i, first, again in _runs(causal, False, max(RUNS // 4, 10)):
        assert _same(first[1], again[1]) and _same(first[2], again[2]), f"dk or dv differs in run {i + 1}"
        a, b = first[0].astype(cupy.float32), again[0].astype(cupy.float32)
        # dQ's additions in another order: within a few bf16 roundings of its magnitude
        assert float(cupy.abs(a - b).max()) <= 4 * 2.0**-8 * max(float(cupy.abs(a).max()), 1e-3), i
