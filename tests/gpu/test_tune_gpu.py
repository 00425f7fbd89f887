"""The autotuner on the GPU: short fwd studies, clean trials, tuned >= default, crash isolation,
and a second process that picks the cached config without tuning (issue 4)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    from cuflash import _tuned, tuning_store

    monkeypatch.setenv(tuning_store.ENV_CACHE_DIR, str(tmp_path))  # the worker process inherits it
    _tuned.reload()
    yield tmp_path
    _tuned.reload()


def _interleaved_ms(fns, sets, rounds=5, reps=20):
    from cuflash._timing import time_cuda

    out = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            # each after 100 ms of its own work: the clock the GPU holds under load (cuflash._timing)
            out[i].append(time_cuda(fn, warmup=3, reps=reps, rotate=sets, warmup_ms=100.0)["median_ms"])
    return [float(np.median(v)) for v in out]


@pytest.mark.parametrize("d", [64, 128])
def test_short_fwd_study_then_a_second_process_uses_the_cache(d, tmp_cache):
    from cuflash import _forward
    from cuflash.tune import tuner
    from cuflash.device import query
    from cuflash.tune.runner import Worker
    from cuflash.testing import dtype_of, random_qkv

    n = 4096
    o = tuner.Options(kernels=("fwd",), head_dims=(d,), dtypes=("bfloat16",), seqlens=(n,), causal=(False,),
                      trials=6, reps=10)
    props = query(0)
    with Worker(0, isolated=True) as w:
        (r,) = tuner.tune(o, w, props)
        assert w.restarts == 0, "a trial crashed the worker"
    assert r.error is None and r.winner is not None, r.error
    # every trial ran and matched the default's output; everything else was pruned before timing
    assert r.statuses() == {"ok": r.trials_used}, r.to_dict()["search"]["trials"]
    assert r.trials_used == min(6, r.n_valid) and r.n_valid + len(r.compile_pruned) + len(r.static_pruned) == r.n_space
    assert all(t.info["max_abs_diff"] < 0.1 for t in r.search.trials)
    assert r.winner_ms <= r.default_ms
    print(f"\nd{d}: default {r.default} {r.default_ms:.3f} ms -> {r.winner} {r.winner_ms:.3f} ms "
          f"({r.trials_used} trials / {r.n_valid} valid; pruned after compile: {len(r.compile_pruned)})")

    # tuned >= default, re-measured here, interleaved, on fresh inputs (within 3% noise). Only when
    # this process has the GPU to itself: under pytest-xdist the other workers' kernels share it, and
    # the same config read 8% apart from itself there (H200, 2026-12-02); the tuner's own interleaved
    # confirmation rounds (winner_ms <= default_ms above) stand either way
    rng = np.random.default_rng(d)
    b, h = max(1, 16384 // n), 2048 // d
    if r.winner != r.default and not os.environ.get("PYTEST_XDIST_WORKER"):
        sets = [random_qkv(rng, b, n, n, h, d, dtype_of("bfloat16")) for _ in range(3)]
        t_def, t_win = _interleaved_ms([lambda q, k, v: _forward.forward(q, k, v, config=r.default),
                                        lambda q, k, v: _forward.forward(q, k, v, config=r.winner)], sets)
        assert t_win <= t_def * 1.03, (t_win, t_def)

    # a second process: the tuned config is selected from the cache, with no tuning and no Optuna
    code = f"""
import json, sys, time, cupy, ml_dtypes, cuflash
from cuflash import _compile, _forward, _tuned, device, families, tiles
from cuflash.features import Features
q = cupy.random.standard_normal(({b}, {n}, {h}, {d}), dtype=cupy.float32).astype(ml_dtypes.bfloat16)
cuflash.attention(q, q, q, backend="sm80")  # the family tuned above (on a cc 9.0 GPU, auto picks fwd_sm90)
cupy.cuda.Device().synchronize()
prob = type("P", (), dict(seqlen_q={n}, seqlen_k={n}, head_dim={d}, dtype="bfloat16", device=0, causal=False,
                          features=Features("bfloat16", {d})))()
props = device.query(0)
t0 = time.perf_counter()
for _ in range(1000):
    cfg = _tuned.lookup(families.FWD, prob, props)
dt = (time.perf_counter() - t0) / 1000
print(json.dumps({{"loaded": [k[0].__dict__ for k in _compile._loaded if type(k[0]) is tiles.FwdConfig],
                  "looked_up": cfg.__dict__ if cfg is not None else None,
                  "optuna": "optuna" in sys.modules, "lookup_us": dt * 1e6}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["looked_up"] == r.winner.__dict__, "the cache did not give the tuned config"
    assert res["loaded"] == [r.winner.__dict__], "the second process did not run (only) the tuned config"
    assert not res["optuna"]
    assert res["lookup_us"] < 50


def test_worker_survives_an_illegal_address_and_sets_up_again(tmp_cache):
    from cuflash import families
    from cuflash.tune.runner import Worker, make_shape

    shape = make_shape("fwd", "bf16", 64, False, 1024)
    with Worker(0, isolated=True) as w:
        assert w.setup(shape)[0] == "ok"
        status, why = w.call("inject", "illegal_address")
        assert status == "crashed" and ("illegal" in why.lower() or "context" in why), why
        out = w.trial(families.FWD.default(64), 2, 5, True)  # a fresh worker, the shape set up again
        assert out.status == "ok", out.reason
        assert w.restarts == 1


@pytest.mark.parametrize("kernel", ["bwd", "bwd_dq"])
def test_short_backward_studies_run_cleanly(kernel, tmp_cache):
    from cuflash import _compile, families
    from cuflash.device import query
    from cuflash.tune import tuner
    from cuflash.tune.runner import Worker

    if _compile.kernel_fingerprint(families.get(kernel)) is None:
        pytest.skip(f"{kernel} kernel sources absent")
    o = tuner.Options(kernels=(kernel,), head_dims=(128,), dtypes=("bfloat16",), seqlens=(2048,), causal=(True,),
                      trials=3, reps=5, confirm_rounds=2)
    with Worker(0, isolated=True) as w:
        (r,) = tuner.tune(o, w, query(0))
        assert w.restarts == 0
    assert r.error is None and r.winner is not None, r.error
    assert r.statuses() == {"ok": r.trials_used}, r.to_dict()["search"]["trials"]
    assert r.winner_ms <= r.default_ms


def test_short_decode_study_runs_cleanly_and_calls_take_its_winner(tmp_cache, monkeypatch):
    """The decode kernel's study (issue 17: num_splits=0's choice, tuned): tiles and their split depth
    timed on one decoding step (8 x 8k cache, 32 query heads over 8 K/V heads), every trial matching
    the default's output; attention_with_kvcache then plans with the winner (causal calls too)."""
    import cupy
    import ml_dtypes

    from cuflash import _tuned, kvcache
    from cuflash.device import query
    from cuflash.tune import tuner
    from cuflash.tune.runner import Worker

    o = tuner.Options(kernels=("decode",), head_dims=(128,), dtypes=("bfloat16",), seqlens=(8192,),
                      causal=(False, True), trials=8, reps=10, confirm_rounds=2, tokens=8 * 8192, hidden=32 * 128)
    with Worker(0, isolated=True) as w:
        reports = tuner.tune(o, w, query(0))
        assert w.restarts == 0
    (r,) = reports  # causal does not change a decoding step: one study
    assert r.error is None and r.winner is not None, r.error
    assert r.statuses() == {"ok": r.trials_used}, r.to_dict()["search"]["trials"]
    assert r.winner_ms <= r.default_ms
    _tuned.reload()
    planned = []
    real = kvcache.plan_decode
    monkeypatch.setattr(kvcache, "plan_decode", lambda p, cfg, *a, **k: planned.append(cfg) or real(p, cfg, *a, **k))
    rng = np.random.default_rng(17)
    mk = lambda *s: cupy.asarray(rng.standard_normal(s, dtype=np.float32)).astype(ml_dtypes.bfloat16)
    q, kc, vc = mk(8, 1, 32, 128), mk(8, 8192, 8, 128), mk(8, 8192, 8, 128)
    kvcache._plans.clear()
    for causal in (False, True):
        kvcache.attention_with_kvcache(q, kc, vc, cache_seqlens=8192, causal=causal)
    assert planned == [r.winner, r.winner]
