"""Replay the tuner's search on recorded sweeps (no GPU): how close does it get to the true best?

    python scripts/replay_search.py [SWEEP.json ...] [--seeds 20] [--fraction 0.333] [--props FILE]

A sweep is either a config sweep (docs/bench/*config-sweep*.json: rows of d, n, causal, cfg, ms)
or a tuner run written with `python -m cuflash.tune --exhaustive[-compare] --json PATH` (studies
with an exhaustive phase). For each landscape and seed, the search (as the tuner runs it) picks a
config, and q = t(best) / t(picked) is taken from the recorded times. Prints median/mean/worst q
and the share of runs with q >= 0.99, for the random baseline, the default TPE, and TPE
warm-started with the winner of the neighbouring landscape (same shape, other causality), as the
tuner does for later shapes of a group.
"""
import argparse
import collections
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from cuflash import families, tiles  # noqa: E402
from cuflash.tune import search, space  # noqa: E402
from cuflash.device import DeviceProps  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load(path, props):
    """{(kernel, d, n, causal): {config: ms}}, keeping configs that pass the static checks."""
    doc = json.loads(pathlib.Path(path).read_text())
    land = collections.defaultdict(dict)
    if isinstance(doc, list):  # config sweep rows (forward)
        for r in doc:
            cfg = tiles.FwdConfig(**r["cfg"])
            if props is None or space.static_problem(cfg, props) is None:
                land[("fwd", r["d"], r["n"], r["causal"])][cfg] = r["ms"]
    else:  # tuner --json
        for s in doc["studies"]:
            if not s.get("exhaustive"):
                continue
            for t in s["exhaustive"]["trials"]:
                if t["status"] == "ok":
                    land[(s["kernel"], s["head_dim"], s["seqlen"], s["causal"])][
                        families.get(s["kernel"]).tile_from_dict(t["config"])] = t["ms"]
    return land


def replay(land, sampler, fraction, seeds, neighbour=False):
    qs = []
    for (kernel, d, n, causal), times in land.items():
        valid, best = sorted(times), min(times.values())
        warm = [families.get(kernel).default(d)]
        other = land.get((kernel, d, n, not causal))
        if neighbour and other:
            warm.append(min(other, key=other.get))
        for seed in range(seeds):
            r = search.optimize(valid, lambda c: search.Outcome("ok", times[c]),
                                n_trials=search.default_budget(len(valid), fraction), warm_start=warm,
                                seed=seed, sampler=sampler)
            qs.append(best / r.best_ms)
    return qs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sweeps", nargs="*", default=[str(ROOT / "docs/bench/h200-fwd-config-sweep-2026-11-29.json")])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--fraction", type=float, default=1 / 3)
    ap.add_argument("--props", default=str(ROOT / "tests/fixtures/devices/h200.json"),
                    help="device properties for static pruning of config sweeps ('' for none)")
    a = ap.parse_args()
    props = DeviceProps.from_json(a.props) if a.props else None
    land = {}
    for p in a.sweeps:
        land.update(load(p, props))
    print(f"{len(land)} landscapes, {sum(map(len, land.values()))} timed configs, {a.seeds} seeds, "
          f"budget {a.fraction:.3f} of each space")
    print(f"{'search':<40} {'median q':>8} {'mean q':>8} {'q>=0.99':>8} {'worst q':>8}")
    for label, sampler, nb in (("random, default first", "random", False), ("TPE (the tuner's default)", "tpe", False),
                               ("TPE + neighbouring winner", "tpe", True)):
        qs = replay(land, sampler, a.fraction, a.seeds, nb)
        print(f"{label:<40} {statistics.median(qs):>8.3f} {statistics.mean(qs):>8.3f} "
              f"{sum(q >= 0.99 for q in qs) / len(qs):>8.0%} {min(qs):>8.3f}")


if __name__ == "__main__":
    main()
