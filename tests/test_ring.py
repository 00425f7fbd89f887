"""Ring attention's schedule, zigzag layout and loops (cuflash/ring.py), simulated on the CPU: one thread
per rank, in-memory queues as the ring's links, the float64 NumPy reference as each step's attention.
The ranks' results must equal attention over the whole sequence (and its gradients), sharded."""
from __future__ import annotations

import queue
import threading

import numpy as np
import pytest

from cuflash import reference, ring

OPS = ring.RingOps(zeros_acc=lambda like: np.zeros(like.shape, np.float64), to_acc=lambda x: np.asarray(x, np.float64),
                   cast=lambda x, like: x.astype(like.dtype), concat=lambda xs, axis: np.concatenate(xs, axis),
                   contiguous=np.ascontiguousarray)


class SimRing:
    """Links of a simulated ring: rank r sends to r + 1 and receives from r - 1, in order."""

    def __init__(self, world):
        self.world, self.boxes = world, [queue.Queue() for _ in range(world)]

    def exchange(self, rank):
        def send(tensors):
            self.boxes[(rank + 1) % self.world].put([np.array(t, copy=True) for t in tensors])
            box = self.boxes[rank]
            return type("Handle", (), {"wait": lambda _self: box.get(timeout=60)})()
        return send


def _attend(q, k, v, causal):
    return reference.attention_naive(q, k, v, causal=causal)


def _attend_backward(dout, q, k, v, out, lse, causal):
    return reference.attention_backward(dout, q, k, v, out, lse, causal=causal)


def _run_ranks(world, fn):
    results, errors = [None] * world, []

    def run(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_schedule_gives_each_rank_one_diagonal_and_balanced_halves(world):
    for r in range(world):
        srcs = [ring.step_source(r, s, world) for s in range(world)]
        assert sorted(srcs) == list(range(world)) and srcs[0] == r
        kinds = [ring.step_kind(r, src, True) for src in srcs]
        assert kinds.count(ring.DIAGONAL) == 1
        assert kinds.count(ring.FRONT_KEYS) == r and kinds.count(ring.BACK_QUERIES) == world - 1 - r
        assert set(ring.step_kind(r, src, False) for src in srcs) == {ring.ALL}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_zigzag_round_trip_and_chunk_order(world):
    x = np.arange(2 * 2 * world * 3).reshape(2, 2 * world * 3, 1, 1)
    shards = [ring.zigzag_shard(x, r, world, OPS) for r in range(world)]
    assert [int(s[0, 0, 0, 0]) for s in shards] == [3 * r for r in range(world)]  # chunk r first
    np.testing.assert_array_equal(ring.zigzag_unshard(shards, OPS), x)
    with pytest.raises(ValueError, match="multiple of"):
        ring.zigzag_shard(x[:, :5], 0, world + 1, OPS)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_forward_and_backward_equal_whole_sequence_attention(world, causal):
    rng = np.random.default_rng(world * 2 + causal)
    b, n, h, d = 2, 2 * world * 5, 2, 8
    q, k, v, dout = (rng.standard_normal((b, n, h, d)) for _ in range(4))
    want_out, want_lse = reference.attention_naive(q, k, v, causal=causal)
    want_grads = reference.attention_backward(dout, q, k, v, want_out, want_lse, causal=causal)
    shard = lambda x, r: ring.zigzag_shard(x, r, world, OPS) if causal else np.split(x, world, axis=1)[r]  # noqa: E731
    fwd_ring, bwd_ring = SimRing(world), SimRing(world)

    def rank(r):
        ql, kl, vl, dl = (shard(x, r) for x in (q, k, v, dout))
        out, lse = ring.ring_forward(ql, kl, vl, rank=r, world=world, causal=causal, attend=_attend,
                                     exchange=fwd_ring.exchange(r), ops=OPS)
        grads = ring.ring_backward(dl, ql, kl, vl, out, lse, rank=r, world=world, causal=causal,
                                   attend_backward=_attend_backward, exchange=bwd_ring.exchange(r), ops=OPS)
        return out, lse, grads

    results = _run_ranks(world, rank)
    lse_shard = (lambda r: ring.zigzag_shard(want_lse, r, world, OPS, axis=2)) if causal else \
        (lambda r: np.split(want_lse, world, axis=2)[r])
    for r, (out, lse, grads) in enumerate(results):
        np.testing.assert_allclose(out, shard(want_out, r), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse, lse_shard(r), rtol=1e-10, atol=1e-12)
        for g, w in zip(grads, want_grads):
            np.testing.assert_allclose(g, shard(w, r), rtol=1e-9, atol=1e-11)


def test_importing_cuflash_distributed_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, cuflash.distributed; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
