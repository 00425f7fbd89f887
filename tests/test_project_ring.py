"""scripts/project_ring.py's model of ring attention on P GPUs (issue 16's projection), on CPU: the
arithmetic the next GPU session's figures go through."""
import importlib.util
import pathlib
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "project_ring.py"


def _mod():
    spec = importlib.util.spec_from_file_location("project_ring", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


def test_a_compute_bound_ring_keeps_one_gpus_pace():
    """Half blocks at the causal diagonal's rate, transfers well under them: every step does half a
    block's worth of the one-GPU causal work, so the ratio is 1 (2.5x for the backward's FLOPs)."""
    m = _mod()
    n, h, d = 1 << 20, 16, 128
    for p in (2, 4, 8):
        shard = n // p
        causal_ms = 4 * h * shard * shard * d / 2 / 500e9  # 500 TFLOP/s
        t = m.StepTimes(causal_fwd=causal_ms, causal_bwd=2.5 * causal_ms, half_fwd=causal_ms, half_bwd=2.5 * causal_ms,
                        merge=0.0, accumulate=0.0)
        r = m.project(p, n, h, h, d, t, link_gbps=1e9)  # an instant link
        assert r["fwd_ratio"] == pytest.approx(1.0) and r["bwd_ratio"] == pytest.approx(1.0)
        assert r["one_fwd_tflops"] == pytest.approx(500.0)


def test_transfers_count_where_they_do():
    """The forward hides a K/V block under the step (the longer of the two counts); the backward
    waits for its fp32 dK/dV accumulators after every step, the diagonal's included."""
    m = _mod()
    t = m.StepTimes(causal_fwd=10.0, causal_bwd=25.0, half_fwd=10.0, half_bwd=25.0, merge=1.0, accumulate=2.0)
    p, n, h, d = 4, 1 << 20, 16, 128
    shard = n // p
    kv_ms = 2 * shard * h * d * 2 / 100e9 * 1e3  # 100 GB/s
    r = m.project(p, n, h, h, d, t, link_gbps=100)
    assert r["kv_transfer_ms"] == pytest.approx(kv_ms) and r["dkv_transfer_ms"] == pytest.approx(2 * kv_ms)
    assert r["fwd_ms"] == pytest.approx(10.0 + 3 * max(11.0, kv_ms))
    assert r["bwd_ms"] == pytest.approx(25.0 + 2.0 + 2 * kv_ms + 3 * (max(27.0, kv_ms) + 2 * kv_ms))
    slow = m.project(p, n, h, h, d, t, link_gbps=1)  # a link slower than the step: the transfer sets the pace
    assert slow["fwd_ms"] == pytest.approx(10.0 + 3 * slow["kv_transfer_ms"])
    # GQA moves fewer bytes
    assert m.project(p, n, h, 4, d, t, link_gbps=100)["kv_transfer_ms"] == pytest.approx(kv_ms / 4)
