"""Whole tuner processes under faults (issue 14), with a GPU-less fake worker: two tuners writing
into one cache at once lose nothing, and a tuner killed with SIGKILL mid-run leaves a valid cache
holding every study it finished (entries are saved per study; tuning_store's writes are atomic)."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from cuflash import tuning_store

pytest.importorskip("optuna")

ROOT = pathlib.Path(__file__).resolve().parents[1]

DRIVER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from tests.test_tune_cli import FakeWorker, H200
    from cuflash import tuning_store
    from cuflash.tune import __main__ as cli, runner

    class Slow(FakeWorker):
        def trial(self, *a, **k):
            time.sleep({delay})
            return super().trial(*a, **k)

    runner.Worker = Slow
    cli._gpu_props = lambda device: (H200, "")
    tuning_store.shipped_tables = lambda: []
    sys.exit(cli.main(sys.argv[1:]))
""")


def _tuner(cache: pathlib.Path, args: list, delay: float = 0.0) -> subprocess.Popen:
    env = {**os.environ, tuning_store.ENV_CACHE_DIR: str(cache)}
    code = DRIVER.format(root=str(ROOT), delay=delay)
    return subprocess.Popen([sys.executable, "-c", code, "--kernels", "fwd", "--dtypes", "bf16", "--compile-jobs", "1",
                             *args], env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _entries(cache: pathlib.Path) -> list:
    entries, problem = tuning_store.read_file(cache / tuning_store.FILE_NAME)
    assert problem is None, problem
    return entries


def test_two_tuners_into_one_cache_lose_nothing(tmp_path):
    a = _tuner(tmp_path, ["--head-dims", "64", "--seqlens", "1024", "4096"], delay=0.01)
    b = _tuner(tmp_path, ["--head-dims", "128", "--seqlens", "1024", "4096"], delay=0.01)
    outs = [p.communicate(timeout=300)[0].decode() for p in (a, b)]
    assert a.returncode == 0 and b.returncode == 0, outs
    keys = {(e["head_dim"], e["causal"], e["seqlen_bucket"]) for e in _entries(tmp_path)}
    assert keys == {(d, c, n) for d in (64, 128) for c in (False, True) for n in (1024, 4096)}


def test_sigkill_mid_run_keeps_the_finished_studies(tmp_path):
    p = _tuner(tmp_path, ["--head-dims", "64", "128", "--seqlens", "1024", "4096", "16384"], delay=0.2)
    path = tmp_path / tuning_store.FILE_NAME
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:  # wait for the first finished study, then kill mid-run
            if path.exists() and _entries(tmp_path):
                break
            assert p.poll() is None, p.stdout.read().decode()
            time.sleep(0.05)
        else:
            pytest.fail("no study finished in time")
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    done = _entries(tmp_path)
    assert 1 <= len(done) < 12, "the kill came after the run ended: nothing was tested"
    # the cache is usable: the lock is free and a new save merges with what survived
    n = tuning_store.save_entries(path, [])
    assert n == len(done)
