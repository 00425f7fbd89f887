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


def test_interleaved_us_takes_turns_and_reports_failures():
    """The eager paths take turns round by round (each round starting with another), each inside its
    own context; a path whose warm-up raises gets the exception, the others their times."""
    import contextlib

    order, entered = [], []

    @contextlib.contextmanager
    def ctx():
        entered.append(1)
        yield

    def boom():
        raise RuntimeError("no backend")

    entries = [(lambda: order.append("a"), lambda: None, None), (lambda: order.append("b"), lambda: None, ctx),
               (boom, lambda: None, None)]
    got = bench_overhead.interleaved_us(entries, calls=2, rounds=3, warmup=1)
    assert got[0] >= 0 and got[1] >= 0 and isinstance(got[2], RuntimeError)
    timed = order[2:]  # after one warm-up call each
    assert timed == ["a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b"]
    assert len(entered) == 1 + 3
