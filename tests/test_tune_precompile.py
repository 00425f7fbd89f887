"""The tuner's parallel pre-compile (cuflash/tune/precompile.py): who calls it, and that it never
raises (a failed compile is the serial check's to report)."""
from __future__ import annotations

import pytest

from cuflash import families
from cuflash.features import Features
from cuflash.tune import __main__ as cli
from cuflash.tune import precompile, tuner
from tests.test_tune_cli import H200, FakeWorker

pytest.importorskip("optuna")


def test_default_jobs_is_between_1_and_16():
    assert 1 <= precompile.default_jobs() <= 16


def test_one_job_or_one_tile_does_nothing():
    tiles = families.FWD.space(64)[:3]
    assert precompile.precompile(tiles, Features("bfloat16", 64), 0, 1) == 0
    assert precompile.precompile(tiles[:1] * 2, Features("bfloat16", 64), 0, 8) == 0  # one distinct tile
    # decode tiles that differ only in the host-only split depth are one instance
    decode = [t for t in families.DECODE.space(128) if (t.warps, t.stages) == (4, 3)]
    assert len(decode) == 5
    assert precompile.precompile(decode, Features("bfloat16", 128, seqused_k=True), 0, 8) == 0


def test_a_failed_compile_does_not_raise():
    """In a pool of two processes; without a GPU every load fails, and precompile says none compiled."""
    from cuflash import device

    if device.cuda_device_count()[0] > 0:
        pytest.skip("a GPU is present: the compiles would succeed")
    assert precompile.precompile(families.FWD.space(64)[:2], Features("bfloat16", 64), 0, 2) == 0


class DeviceFakeWorker(FakeWorker):
    device = 0


@pytest.mark.parametrize("jobs, worker_cls, expect", [(4, DeviceFakeWorker, True), (1, DeviceFakeWorker, False),
                                                       (4, FakeWorker, False)])
def test_the_tuner_precompiles_each_group_for_a_device_worker(monkeypatch, tmp_path, jobs, worker_cls, expect):
    from cuflash import tuning_store

    monkeypatch.setenv(tuning_store.ENV_CACHE_DIR, str(tmp_path))
    calls = []
    monkeypatch.setattr(precompile, "precompile", lambda tiles, f, dev, j: calls.append((len(tiles), f, dev, j)))
    o = tuner.Options(kernels=("fwd",), head_dims=(64,), seqlens=(1024,), causal=(False, True), compile_jobs=jobs)
    tuner.tune(o, worker_cls(), H200)
    if expect:  # one call per (kernel, class, dtype, head_dim) group, both causal studies share it
        assert len(calls) == 1 and calls[0][1:] == (Features("bfloat16", 64), 0, jobs) and calls[0][0] > 1
    else:
        assert calls == []


def test_cli_defaults_to_the_machine_and_takes_compile_jobs():
    a = cli.parse_args(["--kernels", "fwd"])
    assert cli.options_from_args(a).compile_jobs == precompile.default_jobs()
    assert cli.options_from_args(cli.parse_args(["--compile-jobs", "1"])).compile_jobs == 1


def test_a_broken_pool_costs_only_the_speed_up(monkeypatch):
    import concurrent.futures

    class Broken:
        def __init__(self, *a, **k):
            raise concurrent.futures.process.BrokenProcessPool("a worker died")

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Broken)
    assert precompile.precompile(families.FWD.space(64)[:3], Features("bfloat16", 64), 0, 4) == 0
