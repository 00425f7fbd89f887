"""Tables and plots of tuning results: the end-of-run summary, `--show`, `--plot`."""
from __future__ import annotations

import pathlib

from .. import families, tuning_store
from . import space
from .runner import DTYPE_SHORT


def _f(x, fmt="{:.3f}", none="-"):
    return none if x is None else fmt.format(x)


SUMMARY_COLUMNS = ("shape", "valid", "trials", "default ms", "tuned ms", "speedup", "search ms", "exh. best ms",
                   "q", "wall s", "winner")


def summary_rows(reports) -> list:
    rows = []
    for r in reports:
        if r.error and r.winner is None:
            rows.append((r.shape.label, str(r.n_valid), "-", "-", "-", "-", "-", "-", "-", _f(r.wall_s, "{:.1f}"),
                         f"({r.error})"))
            continue
        rows.append((
            r.shape.label, str(r.n_valid), str(r.trials_used), _f(r.default_ms), _f(r.winner_ms),
            _f(r.speedup, "{:.3f}x"), _f(r.confirmed_ms(r.search_best)), _f(r.confirmed_ms(r.exhaustive_best)),
            _f(r.quality, "{:.3f}"), _f(r.wall_s + 0.0, "{:.1f}"), space.config_label(r.winner) if r.winner else "-",
        ))
    return rows


def format_table(columns, rows) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    line = lambda cells: "  ".join(f"{c:<{w}}" if i in (0, len(widths) - 1) else f"{c:>{w}}"
                                   for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in rows])


def format_summary(reports) -> str:
    notes = [
        "default/tuned/search/exh. ms: medians of the confirmation rounds (same inputs, interleaved);",
        "q = t(exhaustive best)/t(search's pick) in the exhaustive sweep (1.000 = the search found the best);",
        "trials = configs timed by the search (or the sweep); valid = configs that passed pruning.",
    ]
    compile_s = {}
    for r in reports:
        compile_s[(r.shape.kernel, r.shape.perf_class, r.shape.dtype, r.shape.head_dim)] = r.compile_s
    out = [format_table(SUMMARY_COLUMNS, summary_rows(reports)), *notes]
    total_compile = sum(compile_s.values())
    total = sum(r.wall_s for r in reports) + total_compile
    out.append(f"compile checks {total_compile:.1f} s, studies {total - total_compile:.1f} s")
    bad = {}
    for r in reports:
        for k, v in r.statuses().items():
            if k != "ok":
                bad[k] = bad.get(k, 0) + v
    if bad:
        out.append("trials that did not run cleanly: " + ", ".join(f"{v} {k}" for k, v in sorted(bad.items())))
    return "\n".join(out)


SHOW_COLUMNS = ("table", "gpu", "kernel", "class", "dtype", "d", "causal", "bucket", "config", "tuned ms", "default ms",
                "gain", "method", "trials/valid", "status")


def show_rows(tables: list, dev=None) -> list:
    """tables: [(label, path, shipped)]; dev: DeviceKey of this GPU, or None (no GPU)."""
    rows = []
    for label, path, shipped in tables:
        entries, problem = tuning_store.read_file(path)
        if problem:
            rows.append((label, f"unusable: {problem}", *[""] * (len(SHOW_COLUMNS) - 2)))
            continue
        for e in entries:
            if tuning_store.check_entry(e):
                continue
            if dev is not None:
                status = tuning_store.classify(e, dev, shipped)
            else:
                status = "stale-source" if e["source"] != tuning_store.source_fingerprint(e["kernel"]) else "?"
            cfg = _label(e)
            t, d0 = e.get("time_ms"), e.get("default_ms")
            gain = f"{(d0 / t - 1) * 100:+.1f}%" if t and d0 else "-"
            rows.append((label, e["gpu"], e["kernel"], e["perf_class"], DTYPE_SHORT.get(e["dtype"], e["dtype"]), str(e["head_dim"]),
                         "yes" if e["causal"] else "no", str(e["seqlen_bucket"]), cfg, _f(t), _f(d0), gain,
                         str(e.get("method", "-")), f"{e.get('trials', '-')}/{e.get('valid', '-')}", status))
    return rows


def _label(e: dict) -> str:
    """The entry's tile as its family labels it; the raw fields for a tile this cuflash cannot read."""
    fam = families.REGISTRY.get(e["kernel"])
    try:
        return space.config_label(fam.tile_from_dict(e["config"]))
    except (AttributeError, ValueError, TypeError):
        return " ".join(f"{k}={v}" for k, v in sorted(e["config"].items()) if k != "head_dim")


def plot_studies(reports, out_dir) -> list:
    """One PNG per study: best time so far against trial number (search and/or sweep), with the
    default's and the exhaustive best's times as lines. Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in reports:
        if r.search is None and r.exhaustive is None:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for res, style in ((r.search, "o-"), (r.exhaustive, ".-")):
            if res is None:
                continue
            curve = res.best_so_far()
            xs = [i + 1 for i, v in enumerate(curve) if v is not None]
            ax.plot(xs, [v for v in curve if v is not None], style, label=f"{res.method} (best so far)")
            ax.plot([i + 1 for i, t in enumerate(res.trials) if t.ms is not None],
                    [t.ms for t in res.trials if t.ms is not None], "x", alpha=0.35, color="gray")
        first = next((t.ms for res in (r.search, r.exhaustive) if res for t in res.trials
                      if t.config == r.default and t.ms is not None), None)
        if first is not None:
            ax.axhline(first, ls="--", color="tab:red", label="default")
        if r.exhaustive is not None and r.exhaustive.best_ms is not None:
            ax.axhline(r.exhaustive.best_ms, ls=":", color="tab:green", label="exhaustive best")
        ax.set_xlabel("trial")
        ax.set_ylabel("time (ms)")
        ax.set_title(f"{r.shape.label}  (valid configs: {r.n_valid})")
        ax.legend(fontsize=8)
        fig.tight_layout()
        s = r.shape
        p = out_dir / (f"{s.kernel}-{DTYPE_SHORT.get(s.dtype, s.dtype)}-d{s.head_dim}-"
                       f"{'causal' if s.causal else 'full'}-n{s.seqlen}.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths
