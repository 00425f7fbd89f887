"""The tuner's search loop on deterministic cost functions: it finds the optimum of a known
landscape, never evaluates a pruned config, never lets a wrong config win, and is reproducible.
Also replays the recorded H200 forward sweep (docs/bench) to measure the search's quality."""
from __future__ import annotations

import collections
import json
import math
import pathlib
import statistics

import pytest

from cuflash import families, tiles
from cuflash.tune import search, space
from cuflash.device import DeviceProps

ROOT = pathlib.Path(__file__).parent.parent
H200 = DeviceProps.from_json(pathlib.Path(__file__).parent / "fixtures" / "devices" / "h200.json")
SWEEP = ROOT / "docs" / "bench" / "h200-fwd-config-sweep-2026-11-29.json"


def bowl(c):
    """A known landscape: unique optimum at 128x48, 4 warps, 2 stages, far from the default."""
    return (1 + 0.10 * abs(math.log2(c.block_q / 128)) + 0.05 * abs(math.log2(c.block_k / 48))
            + 0.08 * (c.warps != 4) + 0.03 * (c.stages != 2))


def fake_check(c):
    return "fake compile failure: spills" if c.block_k == 96 else None


class Recorder:
    def __init__(self, cost, wrong=()):
        self.cost, self.wrong, self.calls = cost, set(wrong), []

    def __call__(self, cfg):
        self.calls.append(cfg)
        if cfg in self.wrong:  # fastest of all, but wrong: must never win
            return search.Outcome("wrong", None, "max |diff| 1.0 > 0.016")
        return search.Outcome("ok", self.cost(cfg))


def _space():
    return space.build_space(families.get("fwd"), 128, H200)


def test_optimize_finds_the_optimum_and_never_evaluates_a_pruned_config():
    sp = _space()
    valid, pruned = search.prune(sp.candidates, fake_check)
    assert pruned and set(pruned) | set(valid) == set(sp.candidates)
    best = min(valid, key=bowl)
    hits = 0
    for seed in range(10):
        ev = Recorder(bowl)
        r = search.optimize(valid, ev, n_trials=search.default_budget(len(valid), 0.5), warm_start=[sp.default], seed=seed)
        assert not set(ev.calls) & (set(pruned) | set(sp.pruned)), "a pruned config was evaluated"
        assert len(ev.calls) == len(set(ev.calls)) == len(r.trials), "a config was timed twice"
        assert ev.calls[0] == sp.default, "the heuristic default is the first trial"
        hits += r.best == best
    assert hits >= 9, f"optimum found in {hits}/10 seeds at half the space"


def test_search_is_reproducible_for_a_seed():
    valid = _space().candidates
    runs = [[t.config for t in search.optimize(valid, Recorder(bowl), n_trials=8, seed=3).trials] for _ in range(2)]
    assert runs[0] == runs[1]
    other = [t.config for t in search.optimize(valid, Recorder(bowl), n_trials=8, seed=4).trials]
    assert other != runs[0]


def test_budget_and_stop_when_space_exhausted():
    valid = _space().candidates[:5]
    r = search.optimize(valid, Recorder(bowl), n_trials=50, seed=0)
    assert len(r.trials) == 5 and r.best == min(valid, key=bowl)
    assert search.default_budget(30) == 10 and search.default_budget(32) == 10 and search.default_budget(9) == 3
    assert search.default_budget(4) == 1 and search.default_budget(2) == 1 and search.default_budget(0) == 0
    assert search.optimize([], Recorder(bowl), n_trials=5).trials == []


def test_wrong_failed_and_crashed_configs_never_win():
    sp = _space()
    valid = sp.candidates
    best = min(valid, key=bowl)
    others = sorted((c for c in valid if c != best), key=bowl)[:2]

    def ev(cfg):
        if cfg == best:
            return search.Outcome("wrong", None, "planted wrong config")
        if cfg == others[0]:
            return search.Outcome("crashed", None, "worker died")
        if cfg == others[1]:
            return search.Outcome("failed", None, "too many resources requested for launch")
        return search.Outcome("ok", bowl(cfg))

    for r in (search.exhaustive(valid, ev), search.optimize(valid, ev, n_trials=len(valid), seed=0)):
        assert r.best not in (best, *others)
        assert r.best == sorted(valid, key=bowl)[3]
        statuses = collections.Counter(t.status for t in r.trials)
        assert statuses["wrong"] == statuses["crashed"] == statuses["failed"] == 1


def test_exhaustive_times_every_valid_config_once_and_finds_the_true_best():
    valid, _ = search.prune(_space().candidates, fake_check)
    ev = Recorder(bowl)
    r = search.exhaustive(valid, ev)
    assert ev.calls == valid and r.best == min(valid, key=bowl) and r.n_valid == len(valid)
    curve = r.best_so_far()
    assert all(a >= b for a, b in zip(curve, curve[1:])) and curve[-1] == r.best_ms


def test_time_budget_stops_the_search():
    import time

    def slow(cfg):
        time.sleep(0.05)
        return search.Outcome("ok", bowl(cfg))

    r = search.optimize(_space().candidates, slow, n_trials=100, timeout_s=0.2, seed=0)
    assert 1 <= len(r.trials) <= 6


def _sweep_landscapes():
    land = collections.defaultdict(dict)
    for row in json.loads(SWEEP.read_text()):
        cfg = tiles.FwdConfig(**row["cfg"])
        if space.static_problem(cfg, H200) is None:
            land[(row["d"], row["n"], row["causal"])][cfg] = row["ms"]
    return land


@pytest.mark.skipif(not SWEEP.is_file(), reason="recorded sweep not in this checkout")
def test_replay_of_the_recorded_h200_sweep():
    """Quality q = t(best)/t(found) of the default search (TPE, a third of the space, warm-started with
    the default) on the measured H200 forward landscapes (8 shapes x 5 seeds)."""
    qs = []
    for (d, n, causal), times in _sweep_landscapes().items():
        valid, best = sorted(times), min(times.values())
        default = families.FWD.default(d)
        for seed in range(5):
            r = search.optimize(valid, lambda c: search.Outcome("ok", times[c]),
                                n_trials=search.default_budget(len(valid)), warm_start=[default], seed=seed)
            assert r.best_ms <= times[default]  # never worse than the default
            qs.append(best / r.best_ms)
    assert statistics.median(qs) >= 0.99, sorted(qs)
    assert statistics.mean(qs) >= 0.985, sorted(qs)
    assert min(qs) >= 0.94, sorted(qs)  # the default itself is within 6% of the best everywhere
