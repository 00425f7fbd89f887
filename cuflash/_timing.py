"""GPU timing with CUDA events, and FLOP / byte counts for attention.

CuPy and torch are imported lazily so that the formulas can be used (and tested) without a GPU.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

__all__ = ["time_cuda", "flops_attention", "bytes_attention"]


def _cupy_events():
    import cupy

    return cupy.cuda.Event, cupy.cuda.get_elapsed_time


def _torch_events():
    import torch

    return (lambda: torch.cuda.Event(enable_timing=True)), (lambda a, b: a.elapsed_time(b))


_EVENT_APIS = {"cupy": _cupy_events, "torch": _torch_events}


def time_cuda(
    fn: Callable,
    *,
    warmup: int = 10,
    reps: int = 50,
    rotate: Sequence[tuple] | None = None,
    events="cupy",
    warmup_ms: float = 0.0,
) -> dict:
    """Time ``fn`` on the GPU; returns ``dict(median_ms, p20_ms, p80_ms, n)``.

    Each run is bracketed by its own pair of CUDA events recorded on the *current* stream of the
    library that launches the work: ``events="cupy"`` for CuPy code, ``"torch"`` for torch code
    (whose current stream may differ from CuPy's). A ``(new_event, elapsed_ms)`` pair may be given
    instead, e.g. for tests. Events measure device time only, and the host never waits between
    runs, so launch overhead counts only when the host cannot keep ahead of the GPU.

    ``rotate`` is a list of argument tuples that successive calls cycle through: with a few input
    sets each larger than L2 (60 MB on H200), a run never finds its inputs already cached by the
    previous one. Without it, ``fn`` is called with no arguments.

    ``warmup_ms``: after the ``warmup`` calls, keep calling ``fn`` until it has kept the GPU busy
    this long (device time, in doubling batches), so the timed runs see the clock it settles at
    under sustained load. An H200 coming from lighter work (another backend, the host's setup of
    a case) runs attention kernels 9-15% faster for their first ~50 ms (scripts/clock_drift.py,
    2026-12-02): with count-only warm-ups, whichever callable ran first after a pause measured
    faster than the same kernel later in the same round.
    """
    new_event, elapsed_ms = _EVENT_APIS[events]() if isinstance(events, str) else events
    args = list(rotate) if rotate else [()]
    reps = max(1, int(reps))

    calls = 0
    for _ in range(max(0, int(warmup))):
        fn(*args[calls % len(args)])
        calls += 1
    # Wait for the warm-up so that its errors (asynchronous in CUDA) surface here, not in the timing.
    sync = new_event()
    sync.record()
    sync.synchronize()
    busy_ms, batch = 0.0, 1
    while busy_ms < warmup_ms:
        start, end = new_event(), new_event()
        start.record()
        for _ in range(batch):
            fn(*args[calls % len(args)])
            calls += 1
        end.record()
        end.synchronize()
        busy_ms += elapsed_ms(start, end)
        batch *= 2
    warmup = calls

    pairs = [(new_event(), new_event()) for _ in range(reps)]
    for i, (start, end) in enumerate(pairs):
        start.record()
        fn(*args[(warmup + i) % len(args)])
        end.record()
    pairs[-1][1].synchronize()

    times = np.array([elapsed_ms(s, e) for s, e in pairs], dtype=np.float64)
    p20, p50, p80 = np.percentile(times, [20, 50, 80])
    return {"median_ms": float(p50), "p20_ms": float(p20), "p80_ms": float(p80), "n": reps}


def time_rounds(fns: dict, rounds: int, reps: int, warmup_ms: float = 0.0) -> dict:
    """The median milliseconds of each of `fns` (name -> callable) over `rounds` alternating rounds,
    each round one time_cuda median of `reps` runs per callable: the clock drifts as the GPU warms,
    which timing one callable after the other would charge to the later ones (the variant benches,
    scripts/bench_*.py). warmup_ms: time_cuda's, per callable and round."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(time_cuda(fn, reps=reps, warmup_ms=warmup_ms)["median_ms"])
    return {name: float(np.median(t)) for name, t in times.items()}


def variant_bench_parser(doc: str, head_dims: list | None = None):
    """The variant benches' command line (scripts/bench_*.py): --seqlens, --reps, --rounds, --warmup-ms,
    --json, and --head-dims when `head_dims` gives its default. The script adds its own and parses."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if head_dims is not None:
        p.add_argument("--head-dims", nargs="+", type=int, default=list(head_dims))
    p.add_argument("--seqlens", nargs="+", type=int, default=[2048, 8192])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup-ms", type=float, default=200.0,
                   help="each callable kept busy this long before each round's timing (time_cuda's warmup_ms)")
    p.add_argument("--json")
    return p


def variant_bench_shape(head_dim: int, seqlen: int) -> tuple:
    """(batch, heads) of the variant benches: 16384 tokens in all, 16 heads at head_dim >= 128, else 32."""
    return max(1, 16384 // seqlen), 16 if head_dim >= 128 else 32


def flops_attention(batch, heads, seqlen_q, seqlen_k, head_dim, causal, pass_="fwd") -> float:
    """Nominal FLOPs of one attention pass, with FlashAttention-2's benchmark convention.

    fwd = 4*B*H*Nq*Nk*D (two matmuls, QK^T and PV, at 2 FLOPs per multiply-add), halved when
    ``causal`` -- FA2 halves regardless of Nq != Nk instead of counting the unmasked (i, j) pairs,
    and we keep that so numbers compare with published FA2/FA3 results.
    bwd = 2.5 * fwd (five matmuls instead of two); ``"fwd_bwd"`` = 3.5 * fwd.
    """
    f = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    if causal:
        f /= 2
    factor = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[pass_]
    return f * factor


def bytes_attention(
    batch, heads, seqlen_q, seqlen_k, head_dim, *, itemsize=2, lse=False, pass_="fwd"
) -> int:
    """Minimal HBM traffic of one pass: every tensor read or written exactly once.

    fwd: read q, k, v; write o (+ the fp32 logsumexp when ``lse``).
    bwd: read q, k, v, o, do and the fp32 lse; write dq, dk, dv.
    """
    bh = batch * heads
    q_side = bh * seqlen_q * head_dim * itemsize  # one tensor shaped like q
    k_side = bh * seqlen_k * head_dim * itemsize  # one tensor shaped like k
    lse_bytes = bh * seqlen_q * 4
    if pass_ == "fwd":
        return 2 * q_side + 2 * k_side + (lse_bytes if lse else 0)
    if pass_ == "bwd":
        return 4 * q_side + 4 * k_side + lse_bytes
    raise ValueError(f"unknown pass {pass_!r}")
