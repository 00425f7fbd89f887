"""The overhead benchmark's table and target ratios (cuflash/bench_overhead.py), without a GPU."""
from __future__ import annotations

from cuflash import bench, bench_overhead

ROWS = [
    {"path": "cuflash (CuPy)", "lib": "cupy", "pass": "fwd", "graph": False, "us": 30.0},
    {"path": "cuflash (CuPy)", "lib": "cupy", "pass": "fwd", "graph": True, "error": "RuntimeError: capture"},
    {"path": "cuflash (torch)", "lib": "torch", "pass": "fwd", "graph": False, "us": 40.0},
    {"path": "cuflash (torch)", "lib": "torch", "pass": "fwd+bwd", "graph": False, "us": 120.0},
    {"path": "SDPA flash", "lib": "SDPA flash", "pass": "fwd", "graph": False, "us": 24.0},
    {"path": "SDPA flash", "lib": "SDPA flash", "pass": "fwd+bwd", "graph": False, "us": 100.0},
    {"path": "SDPA flash", "lib": "SDPA flash", "pass": "fwd", "graph": True, "us": 8.0},
]


def test_ratios_are_against_eager_sdpa_flash():
    r = bench_overhead.ratios(ROWS)
    assert r[("cupy", "fwd")] == (30.0 / 24.0, 1.2)
    assert r[("torch", "fwd")] == (40.0 / 24.0, 1.5)
    assert r[("torch", "fwd+bwd")] == (1.2, 1.5)


def test_table_shows_eager_graph_errors_and_verdicts():
    t = bench_overhead.format_table(ROWS)
    assert "cuflash (CuPy)     fwd           30.0     error" in t
    assert "SDPA flash         fwd           24.0       8.0" in t
    assert "RuntimeError: capture" in t
    assert "cuflash (cupy) fwd / SDPA flash: 1.25x (misses the 1.2x target)" in t
    assert "cuflash (torch) fwd+bwd / SDPA flash: 1.20x (meets the 1.5x target)" in t


def test_per_call_us_times_the_loop():
    calls = []
    us = bench_overhead.per_call_us(lambda: calls.append(1), lambda: None, calls=10, rounds=3, warmup=2)
    assert len(calls) == 2 + 30 and us >= 0


def test_bench_cli_takes_overhead():
    assert bench.parse_args(["--overhead"]).overhead and not bench.parse_args([]).overhead
