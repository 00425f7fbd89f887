"""Check a tuned table's entries on this GPU before they ship: each entry's tile against the tile
the same shape runs untuned (KernelFamily.untuned: the family's default, a causal shape's drawn
variant), on the tuner's own workload (cuflash.tune.runner.Bench: its inputs and class options),
verified against the default's output, then timed in alternating rounds (_timing.time_rounds).

Why: the tuner's confirmation rounds call a pick a gain at 1.00-1.01x where the benchmark later
measured it 2-3% slower (H100, 2026-12-07, docs/perf-notes.md), so a second, longer measurement
decides what ships.

    python scripts/check_table.py TABLE.json [--kernels fwd_sm90 ...] [--classes dense ...]
        [--rounds 7] [--reps 20] [--warmup-ms 100] [--min-gain 1.01] [--json rows.json] [--write KEPT.json]

--write keeps the checked entries at least --min-gain faster than the untuned tile (every entry
for another GPU unchanged) in the table's format. Entries for other GPUs, or tuned for other
kernel sources, are listed and skipped."""
from __future__ import annotations

import argparse
import json
import pathlib
import sys


def keep(entries: list, gains: dict, min_gain: float) -> list:
    """The entries to write: those not checked here (gains has no index for them: another GPU's)
    as they are, and the checked ones whose gain is at least `min_gain`."""
    return [e for i, e in enumerate(entries) if i not in gains or (gains[i] is not None and gains[i] >= min_gain)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table")
    p.add_argument("--kernels", nargs="+")
    p.add_argument("--classes", nargs="+")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup-ms", type=float, default=100.0)
    p.add_argument("--min-gain", type=float, default=1.01)
    p.add_argument("--json")
    p.add_argument("--write")
    a = p.parse_args(argv)

    from cuflash import device, families, tuning_store
    from cuflash._timing import time_rounds
    from cuflash.tune import runner

    doc = json.loads(pathlib.Path(a.table).read_text())
    entries = doc["entries"]
    props = device.query(0)
    here = tuning_store.DeviceKey.of(props).gpu_id
    gains, rows = {}, []
    for i, e in enumerate(entries):
        if (e["gpu"], e["cc"], e["sm_count"]) != here:
            continue
        if (a.kernels and e["kernel"] not in a.kernels) or (a.classes and e["perf_class"] not in a.classes):
            continue
        fam = families.get(e["kernel"])
        sh = e["shape"]
        shape = runner.Shape(e["kernel"], e["dtype"], e["head_dim"], e["causal"], sh["seqlen"], sh["batch"],
                             sh["heads"], e["perf_class"])
        if e["source"] != tuning_store.source_fingerprint(e["kernel"]):
            print(f"{shape.label:44s} stale (tuned for other kernel sources): skipped", flush=True)
            continue
        tile = fam.tile_from_dict(e["config"])
        base = fam.untuned(e["head_dim"], props.smem_optin, shape.features, e["causal"])
        if tile == base:  # the entry changes nothing: no device time on it
            gains[i] = 1.0
            print(f"{shape.label:44s} the untuned tile itself ({tile}): 1.000x", flush=True)
            rows.append({"index": i, "label": shape.label, "tile": str(tile), "untuned_tile": str(base),
                         "tuned_ms": None, "untuned_ms": None, "gain": 1.0,
                         "tuner_gain": e["default_ms"] / e["time_ms"]})
            continue
        bench = runner.Bench(shape, device=0)
        ok = bench.trial(tile, warmup=1, reps=3, verify=True)
        if ok.status != "ok":
            gains[i] = None
            print(f"{shape.label:44s} {tile}: {ok.status} ({ok.reason})", flush=True)
            continue
        run, d = bench._run, bench.sets[0]
        ms = time_rounds({"untuned": lambda: run(base, d), "tuned": lambda: run(tile, d)},
                         a.rounds, a.reps, a.warmup_ms)
        gains[i] = ms["untuned"] / ms["tuned"]
        print(f"{shape.label:44s} tuned {ms['tuned']:8.4f} ms  untuned {ms['untuned']:8.4f} ms  {gains[i]:6.3f}x  "
              f"tuner said {e['default_ms'] / e['time_ms']:6.3f}x  {tile} vs {base}", flush=True)
        rows.append({"index": i, "label": shape.label, "tile": str(tile), "untuned_tile": str(base),
                     "tuned_ms": ms["tuned"], "untuned_ms": ms["untuned"], "gain": gains[i],
                     "tuner_gain": e["default_ms"] / e["time_ms"]})
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"gpu": props.name, "rows": rows}, indent=1))
    if a.write:
        kept = keep(entries, gains, a.min_gain)
        pathlib.Path(a.write).write_text(json.dumps({**doc, "entries": kept}, indent=1) + "\n")
        print(f"kept {sum(1 for i in gains if gains[i] is not None and gains[i] >= a.min_gain)} of {len(gains)} "
              f"checked entries (at least {a.min_gain}x): {a.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
