"""Compile a study group's candidate kernels in parallel before the resource checks.

The checks (runner.check_on_device) compile and load one candidate at a time in the tuner's
worker, which made NVRTC most of a tuning run on the H200 (279 s of 351 s for fwd, bwd, bwd_dq
and fwd_sm90 on one core's worth of compiles). Compiling the same (source, options, arch) in a
pool of processes first fills CuPy's disk cache (cupy.RawModule keys it on exactly those), so the
serial checks then load cached binaries and judge the resources of the very kernels that will be
timed. A compile failure here is ignored: the check that follows reports it for that config.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os


def default_jobs() -> int:
    """Processes for the parallel compile: the CPUs this process may use, at most 16."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(16, n))


def _compile_one(args) -> str | None:  # runs in a pool process
    tile, features, device_id = args
    try:
        from cuflash import _compile

        _compile.get_kernel(tile, features, device_id)
        return None
    except Exception as e:  # noqa: BLE001 - the serial check reports it
        return f"{type(e).__name__}: {e}"[:200]


def precompile(tiles, features, device_id: int, jobs: int) -> int:
    """Compile each (tile, features) instance for device `device_id` in `jobs` processes; returns
    how many compiled. jobs <= 1, or fewer than two tiles, does nothing (the checks compile). Tiles
    that differ only in host-only fields (tiles.py _host_axis) are one instance: compiled once."""
    tiles = list({(type(t), t.template_args()): t for t in tiles}.values())
    if jobs <= 1 or len(tiles) < 2:
        return 0
    ctx = multiprocessing.get_context("spawn")  # no CUDA state inherited from the tuner
    try:
        with concurrent.futures.ProcessPoolExecutor(max_workers=min(jobs, len(tiles)), mp_context=ctx) as ex:
            results = list(ex.map(_compile_one, [(t, features, device_id) for t in tiles]))
    except Exception:  # noqa: BLE001 - a broken pool (a worker killed, no spawn here) only costs the speed-up
        return 0
    return sum(r is None for r in results)
