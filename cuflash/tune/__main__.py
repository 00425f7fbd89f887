"""python -m cuflash.tune: tune cuflash's kernels for this GPU and remember the best configs.

    python -m cuflash.tune                               # default shapes for this GPU
    python -m cuflash.tune --kernels fwd --head-dims 128 --seqlens 8192 --dtypes bf16
    python -m cuflash.tune --exhaustive-compare --json run.json --plot plots/   # judge the search
    python -m cuflash.tune --show | --clear | --no-tune --export tuning/<gpu>.json
    python -m cuflash.tune --dry-run --props l4 --compile-check   # no GPU: a recorded GPU (or a JSON file)
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import datetime, timezone

from .. import _compile, families, tuning_store
from .. import device as _device
from .._version import add_version_argument
from ..features import PERF_CLASSES, Features
from ..tiles import SUPPORTED_HEAD_DIMS
from . import precompile, report, search, space
from .runner import DTYPES
from .tuner import Options

DEFAULT_SEQLENS = (1024, 4096, 16384)


def _recorded_names() -> list:
    from ..device import shipped_props

    return list(shipped_props())


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m cuflash.tune", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    add_version_argument(p)
    g = p.add_argument_group("what to tune")
    g.add_argument("--kernels", nargs="+", choices=list(families.REGISTRY), default=None,
                   help="default: " + " ".join(space.default_kernels()) + " (those present)")
    g.add_argument("--perf-classes", nargs="+", choices=list(PERF_CLASSES), default=["dense"],
                   help="feature classes to tune, each keyed separately (default: %(default)s)")
    g.add_argument("--head-dims", type=int, nargs="+", default=list(SUPPORTED_HEAD_DIMS), choices=SUPPORTED_HEAD_DIMS,
                   metavar="D", help="head dims to tune, of " + ", ".join(map(str, SUPPORTED_HEAD_DIMS))
                   + " (the instantiated ones: a call of another head dim runs, and is tuned as, the next one)"
                   + " (default: all)")
    g.add_argument("--dtypes", nargs="+", choices=["bf16", "fp16"], default=["bf16", "fp16"])
    g.add_argument("--seqlens", type=_positive, nargs="+", default=list(DEFAULT_SEQLENS),
                   help="one study per seqlen; cached under its power-of-two bucket (default: %(default)s)")
    g.add_argument("--causal", choices=["0", "1", "both"], default="both")
    g.add_argument("--tokens", type=_positive, default=16384, help="batch = tokens // seqlen (default %(default)s)")
    g.add_argument("--hidden", type=_positive, default=2048, help="heads = hidden // head_dim (default %(default)s)")
    g = p.add_argument_group("how")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--exhaustive", action="store_true", help="time every valid config instead of searching")
    m.add_argument("--exhaustive-compare", action="store_true",
                   help="search, then time every valid config too, and report how close the search came")
    g.add_argument("--trials", type=int, default=None,
                   help="configs timed per study (default: a third of the valid configs, at least 6)")
    g.add_argument("--time-budget", type=float, default=None, metavar="S", help="seconds of search per study")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--sampler", choices=list(search.SAMPLERS), default="tpe", help="Optuna sampler (gp needs torch)")
    g.add_argument("--reps", type=int, default=20, help="timed runs per trial (median; default %(default)s)")
    g.add_argument("--warmup", type=int, default=5)
    g.add_argument("--warmup-ms", type=float, default=100.0,
                   help="device time each trial runs before it is timed, so every config is ranked at the clock the "
                        "GPU holds under sustained load (default %(default)s; 0: --warmup calls only)")
    g.add_argument("--confirm-rounds", type=int, default=3, help="re-timing rounds of the finalists")
    g.add_argument("--allow-spills", type=int, default=0, metavar="BYTES",
                   help="keep configs with up to BYTES of local memory per thread (default 0: prune any spill)")
    g.add_argument("--device", type=int, default=0)
    g.add_argument("--compile-jobs", type=int, default=None, metavar="N",
                   help="processes that compile each kernel's candidates before they are checked "
                        "(default: this machine's CPUs, at most 16; 1: compile one at a time)")
    g.add_argument("--in-process", action="store_true",
                   help="run trials in this process (no crash isolation; for debugging)")
    g.add_argument("--no-cache", action="store_true", help="do not write the results to the user's cache")
    g = p.add_argument_group("output and cache")
    g.add_argument("--show", action="store_true", help="list cached and shipped configs and their gain, then exit")
    g.add_argument("--clear", action="store_true", help="delete the user's tuning cache, then exit")
    g.add_argument("--export", metavar="PATH", help="after tuning, write this GPU's cached configs to PATH "
                   "(a table for tuning/; merged into PATH if it exists)")
    g.add_argument("--no-tune", action="store_true", help="skip tuning (with --export: export the cache as is)")
    g.add_argument("--json", metavar="PATH", help="write every study's trials and results to PATH")
    g.add_argument("--plot", metavar="DIR", help="save best-time-against-trial plots (PNG; needs matplotlib)")
    g.add_argument("--dry-run", action="store_true",
                   help="no timing: print each space and why configs are pruned (works without a GPU)")
    g.add_argument("--props", metavar="FILE|NAME", help="with --dry-run: device properties from a JSON file, or "
                   "the name of a recorded GPU shipped with cuflash: " + ", ".join(_recorded_names()))
    g.add_argument("--compile-check", action="store_true", help="with --dry-run: also compile offline (NVRTC)")
    return p.parse_args(argv)


def _causal(arg):
    return {"0": (False,), "1": (True,), "both": (False, True)}[arg]


def available_kernels(props=None) -> list:
    """The default kernels whose sources are present in this cuflash (and, given a device's
    properties, that run on it: the sm90 forward only on compute capability 9.0)."""
    return [k for k in space.default_kernels() if _compile.kernel_fingerprint(families.get(k)) is not None
            and (props is None or families.get(k).device_problem(props) is None)]


def options_from_args(a) -> Options:
    kernels = a.kernels or available_kernels()
    mode = "exhaustive" if a.exhaustive else ("compare" if a.exhaustive_compare else "search")
    return Options(kernels=tuple(kernels), perf_classes=tuple(a.perf_classes), head_dims=tuple(a.head_dims), dtypes=tuple(DTYPES[d] for d in a.dtypes),
                   seqlens=tuple(a.seqlens), causal=_causal(a.causal), mode=mode, trials=a.trials,
                   time_budget_s=a.time_budget, seed=a.seed, sampler=a.sampler, warmup=a.warmup,
                   warmup_ms=a.warmup_ms, reps=a.reps,
                   confirm_rounds=a.confirm_rounds, tokens=a.tokens, hidden=a.hidden,
                   allow_local_bytes=a.allow_spills, write_cache=not a.no_cache,
                   compile_jobs=precompile.default_jobs() if a.compile_jobs is None else a.compile_jobs)


def _gpu_props(device):
    n, why = _device.cuda_device_count()
    if n == 0:
        return None, why
    return _device.query(device), ""


def do_show(props) -> int:
    dev = tuning_store.DeviceKey.of(props) if props is not None else None
    tables = [("user", tuning_store.cache_path(), False)] + [(f"shipped:{p.name}", p, True) for p in tuning_store.shipped_tables()]
    rows = report.show_rows(tables, dev)
    print(f"user cache: {tuning_store.cache_path()}" + ("" if tuning_store.cache_path().exists() else " (none yet)"))
    if dev is not None:
        print(f"this GPU: {dev.gpu}, cc {dev.cc}, {dev.sm_count} SMs, driver {dev.driver}, NVRTC {dev.nvrtc}")
    else:
        print("no GPU here: status shows only whether an entry's kernel sources are current")
    print(report.format_table(report.SHOW_COLUMNS, rows) if rows else "nothing cached")
    print("status: match = used on this GPU; stale-* = ignored (re-tune); other-device = for another GPU")
    return 0


def do_export(path, props) -> int:
    entries, problem = tuning_store.read_file(tuning_store.cache_path())
    if problem:
        print(f"cannot export: the cache {tuning_store.cache_path()} is unusable ({problem})", file=sys.stderr)
        return 1
    dev = tuning_store.DeviceKey.of(props) if props is not None else None
    keep = [e for e in entries if tuning_store.check_entry(e) is None
            and (tuning_store.classify(e, dev, False) == "match" if dev is not None
                 else e["source"] == tuning_store.source_fingerprint(e["kernel"]))]
    if not keep:
        print("nothing to export: no current entries for this GPU in the cache", file=sys.stderr)
        return 1
    try:
        n = tuning_store.save_entries(path, keep)
    except OSError as e:
        print(f"cannot export to {path}: {e}", file=sys.stderr)
        return 1
    print(f"exported {len(keep)} entries to {path} ({n} in the file)")
    return 0


def read_props(path) -> tuple:
    """(DeviceProps from a JSON file or the name of a shipped one, "") or (None, why not): missing,
    unreadable, not JSON, or not device properties (the shipped files, cuflash/devices/, show the fields)."""
    import os

    from ..device import DeviceProps, shipped_props

    shipped = shipped_props()
    if not os.path.exists(path) and str(path).removesuffix(".json") in shipped:
        path = shipped[str(path).removesuffix(".json")]
    elif not os.path.exists(path):
        return None, (f"no such file {path}, nor a recorded GPU of that name (recorded: "
                      f"{', '.join(shipped) or 'none'})")
    from .._jsonfile import load

    doc, why = load(path)
    if doc is None:
        return None, why
    try:
        props = DeviceProps.from_dict(doc)
        int(props.smem_optin), int(props.register_budget), props.cc_str  # noqa: B018 - the fields used
        if len(props.cc) != 2:
            raise ValueError(f"cc must be [major, minor], got {props.cc!r}")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        detail = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        return None, (f"{path} is not a device-properties file ({detail}); see the recorded GPUs in "
                      f"cuflash/devices/*.json, or DeviceProps.to_dict()")
    return props, ""


def do_dry_run(a, o: Options) -> int:
    from ..device import compiler_reason, unsupported_reason

    if a.props:
        props, why = read_props(a.props)
        if props is None:
            print(f"cuflash.tune: --props: {why}", file=sys.stderr)
            return 2
    else:
        props, why = _gpu_props(a.device)
        if props is None:
            print(f"--dry-run needs --props FILE here (no GPU: {why})", file=sys.stderr)
            return 2
    why = unsupported_reason(props)
    if why:
        print(f"cuflash.tune: {why}", file=sys.stderr)
        return 2
    if a.compile_check:  # else every config would be "pruned" by the missing compiler and the run look fine
        # the module the offline compile uses (_compile.compile_report); CuPy 14's cupy.cuda.nvrtc is an
        # attribute, not an importable module
        try:
            from cupy_backends.cuda.libs import nvrtc

            nvrtc.getVersion()
        except Exception as e:  # noqa: BLE001 - ImportError, a missing libnvrtc: said, not traced
            print(f"cuflash.tune: --compile-check needs CuPy with NVRTC: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        why = compiler_reason(props)  # (the recorded GPU's target, not this machine's GPU)
        if why:
            print(f"cuflash.tune: --compile-check: {why}", file=sys.stderr)
            return 2
    print(f"{props.name}: cc {props.cc_str} ({props.arch}), {props.sm_count} SMs, smem opt-in {props.smem_optin} B, "
          f"{props.register_budget} registers per block")
    for k in o.kernels:
        for d in o.head_dims:
            sp = space.build_space(families.get(k), d, props)
            print(f"\n{k} d{d}: {sp.size} configs, {len(sp.candidates)} pass the static checks, default "
                  f"{space.config_label(sp.default) if sp.default else 'none fits'}")
            for c, why in sp.pruned.items():
                print(f"  pruned  {space.config_label(c):<18} {why}")
            for dt in (o.dtypes if a.compile_check else ()):
                if _compile.kernel_fingerprint(families.get(k)) is None:
                    print(f"  ({k} has no sources: compile check skipped)")
                    break
                fam = families.get(k)  # (the decode kernel exists only with per-batch key lengths)
                features = Features(DTYPES.get(dt, dt), d, seqused_k=fam.needs_seqused_k)
                check = space.offline_check(features, props, o.allow_local_bytes)
                valid, pruned = search.prune(sp.candidates, check)
                for c, why in pruned.items():
                    print(f"  {DTYPES[dt] if dt in DTYPES else dt} compile-pruned {space.config_label(c):<18} {why}")
                print(f"  {dt}: {len(valid)} valid after an offline {families.get(k).nvrtc_arch(props)} compile: "
                      + ", ".join(space.config_label(c) for c in valid))
            if not a.compile_check:
                print("  candidates: " + ", ".join(space.config_label(c) for c in sp.candidates))
    return 0


class _Progress:
    """tqdm over studies, with the current trial in the postfix; per-study lines via tqdm.write."""

    def __init__(self, total):
        from tqdm import tqdm

        self.tqdm = tqdm
        # disable=None: a bar on a terminal, none in a log file (the per-study lines still print)
        self.bar = tqdm(total=total, unit="study", dynamic_ncols=True, file=sys.stderr, disable=None,
                        mininterval=0.5)

    def __call__(self, kind, **kw):
        if kind == "compile_start":
            self.n_checked, self.n_total = 0, kw["n"]
            self.bar.set_description(f"compile {kw['kernel']} {kw['dtype']} d{kw['head_dim']}")
        elif kind == "checked":
            self.n_checked += 1
            self.bar.set_postfix_str(f"{self.n_checked}/{self.n_total} configs checked")
        elif kind == "study_start":
            self.bar.set_description(kw["shape"].label)
            self.bar.set_postfix_str(f"{kw['n_valid']} valid")
        elif kind == "trial":
            t = kw["trial"]
            ms = f"{t.ms:.3f} ms" if t.ms is not None else t.status
            self.bar.set_postfix_str(f"trial {t.number + 1}: {space.config_label(t.config)} {ms}")
        elif kind == "confirm":
            self.bar.set_postfix_str(f"confirming {kw['n']} finalists")
        elif kind == "study_done":
            r = kw["report"]
            if r.winner is not None:
                sp = f"{r.speedup:.3f}x" if r.speedup else "-"
                self.tqdm.write(f"{r.shape.label}: {space.config_label(r.winner)} {r.winner_ms:.3f} ms "
                                f"(default {r.default_ms:.3f} ms, {sp}), {r.trials_used} trials of {r.n_valid} valid",
                                file=sys.stderr)
            else:
                self.tqdm.write(f"{r.shape.label}: {r.error}", file=sys.stderr)
            self.bar.update(1)

    def close(self):
        self.bar.close()


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.clear:
        try:
            had = tuning_store.clear()
        except OSError as e:
            print(f"cuflash.tune: cannot clear the cache {tuning_store.cache_path()}: {e}", file=sys.stderr)
            return 1
        print(f"{'removed' if had else 'no cache at'} {tuning_store.cache_path()}")
        return 0
    o = options_from_args(a)
    if a.dry_run:
        return do_dry_run(a, o)
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("--plot needs matplotlib: pip install 'cuflash[plot]' (or pip install matplotlib)", file=sys.stderr)
            return 2
    props, why = _gpu_props(a.device)
    if a.show:
        return do_show(props)
    if a.no_tune:
        return do_export(a.export, props) if a.export else 0
    if props is None:
        print(f"cuflash.tune: no CUDA GPU found ({why}); nothing to tune. (--show, --clear and --dry-run work "
              f"without one.)", file=sys.stderr)
        return 2
    why = _device.unsupported_reason(props, a.device) or _device.compiler_reason(props, a.device)
    if why:
        print(f"cuflash.tune: {why}", file=sys.stderr)
        return 2
    if a.kernels is None:  # by default, only the kernels this GPU runs (--kernels names any)
        o.kernels = tuple(available_kernels(props))
    untimed = [k for k in o.kernels if families.get(k).run is None]
    if untimed:  # e.g. the decode kernel: its defaults run until the tuner learns to time it
        print(f"cuflash.tune: {', '.join(untimed)} cannot be tuned yet (the tuner has no way to time "
              f"{'it' if len(untimed) == 1 else 'them'}); --dry-run lists {'its' if len(untimed) == 1 else 'their'} "
              f"space", file=sys.stderr)
        return 2

    from . import tuner
    from .runner import Worker

    shapes = tuner.plan_shapes(o)
    print(f"{props.name} (cc {props.cc_str}, {props.sm_count} SMs, driver {props.driver_version}, "
          f"NVRTC {tuning_store.nvrtc_str(props.nvrtc_version)}): {len(shapes)} studies, mode {o.mode}, "
          f"kernels {' '.join(o.kernels)}; cache {tuning_store.cache_path() if o.write_cache else '(not written)'}",
          flush=True)
    progress = _Progress(len(shapes))
    t0 = datetime.now(timezone.utc)
    try:
        with Worker(a.device, isolated=not a.in_process) as w:
            reports = tuner.tune(o, w, props, on_event=progress)
            restarts = w.restarts
    finally:
        progress.close()
    print()
    print(report.format_summary(reports))
    if restarts:
        print(f"the worker process was restarted {restarts} time(s) after crashed trials")
    rc = 0
    if a.json:
        doc = {"env": {**props.to_dict(), "python": platform.python_version(), "started": t0.isoformat(timespec="seconds"),
                       "sources": {k: tuning_store.source_fingerprint(k) for k in o.kernels}},
               "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(o).items()},
               "studies": [r.to_dict() for r in reports]}
        try:
            with open(a.json, "w") as f:
                json.dump(doc, f, indent=1)
                f.write("\n")
            print(f"results written to {a.json}")
        except OSError as e:  # the tuning itself is done and cached: say so, do not lose it to a traceback
            print(f"cuflash.tune: cannot write --json {a.json}: {e}", file=sys.stderr)
            rc = 1
    if a.plot:
        paths = report.plot_studies(reports, a.plot)
        print(f"{len(paths)} plots written to {a.plot}")
    if a.export:
        rc = do_export(a.export, props) or rc
    return rc


if __name__ == "__main__":
    sys.exit(main())
