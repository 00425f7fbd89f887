"""Tuning a list of shapes: compile-check the space, search (and/or sweep), confirm, cache.

For each (kernel, dtype, head_dim) group the static space is built from the device's properties and
every candidate is compiled once (pruned on resources); then for each (causal, seqlen) of the group:

  1. the worker sets up inputs and the default config's reference output;
  2. search: Optuna over the valid configs, warm-started with the default and with the winners of
     neighbouring shapes (this run's and the cache's), each trial verified then timed;
     exhaustive: every valid config (--exhaustive; --exhaustive-compare runs both);
  3. confirm: the default and the best few re-timed in interleaved rounds; the fastest wins and
     is written to the cache (one locked, atomic write per shape, so an interrupted run keeps
     what it finished).

The GPU is reached only through the worker (runner.Worker), so this module runs on CPU in the
tests with a fake worker.
"""
from __future__ import annotations

import dataclasses
import datetime
import statistics
import time
from typing import Callable

from .. import _compile, families, tuning_store
from . import precompile, search, space
from .runner import Shape, make_shape

MODES = ("search", "exhaustive", "compare")


@dataclasses.dataclass
class Options:
    kernels: tuple = ("fwd",)
    perf_classes: tuple = ("dense",)  # Features.perf_class() values to tune
    head_dims: tuple = (64, 128)
    dtypes: tuple = ("bfloat16",)
    seqlens: tuple = (1024, 4096, 16384)
    causal: tuple = (False, True)
    mode: str = "search"
    trials: int | None = None  # per study; None: search.default_budget(valid)
    fraction: float = 1 / 3
    min_trials: int = 1
    time_budget_s: float | None = None  # per study, search phase
    seed: int = 0
    sampler: str = "tpe"
    n_startup: int = 3
    warmup: int = 5
    warmup_ms: float = 0.0  # device time each trial runs before it is timed (time_cuda's warmup_ms)
    reps: int = 20
    confirm_top: int = 3
    confirm_rounds: int = 3
    tokens: int = 16384
    hidden: int = 2048
    allow_local_bytes: int = 0
    write_cache: bool = True
    compile_jobs: int = 1  # processes compiling a group's candidates before the checks (precompile.py)


def plan_shapes(o: Options) -> list:
    """Shapes grouped by (kernel, perf class, dtype, head_dim), so each group's compile check runs once."""
    return [make_shape(k, dt, d, c, n, o.tokens, o.hidden, pc)
            for k in o.kernels for pc in o.perf_classes for dt in o.dtypes for d in o.head_dims
            for c in _causal_values(k, o.causal) for n in o.seqlens]


def _causal_values(kernel: str, causal: tuple) -> tuple:
    """The causal settings to tune `kernel` at: the options', or False alone for a family whose cost a
    causal mask does not change (KernelFamily.causal_matters: its causal calls take those entries)."""
    return causal if families.get(kernel).causal_matters else (False,)


@dataclasses.dataclass
class StudyReport:
    shape: Shape
    default: object = None
    n_space: int = 0
    static_pruned: dict = dataclasses.field(default_factory=dict)
    compile_pruned: dict = dataclasses.field(default_factory=dict)
    n_valid: int = 0
    search: search.SearchResult | None = None
    exhaustive: search.SearchResult | None = None
    confirm: dict = dataclasses.field(default_factory=dict)  # config -> [ms per round]
    winner: object = None
    compile_s: float = 0.0
    wall_s: float = 0.0
    error: str | None = None

    def confirmed_ms(self, cfg):
        v = [x for x in self.confirm.get(cfg, []) if x is not None]
        return statistics.median(v) if v else None

    @property
    def default_ms(self):
        return self.confirmed_ms(self.default)

    @property
    def winner_ms(self):
        return self.confirmed_ms(self.winner)

    @property
    def speedup(self):
        d, w = self.default_ms, self.winner_ms
        return d / w if d and w else None

    @property
    def search_best(self):
        return self.search.best if self.search else None

    @property
    def exhaustive_best(self):
        return self.exhaustive.best if self.exhaustive else None

    @property
    def quality(self):
        """t(exhaustive best) / t(search's pick), both from the exhaustive sweep's timings: 1.0 means
        the search found the true best; None without both phases."""
        if not (self.search and self.exhaustive and self.search.best and self.exhaustive.best):
            return None
        t = {tr.config: tr.ms for tr in self.exhaustive.trials if tr.ms is not None}
        found = t.get(self.search.best)
        return self.exhaustive.best_ms / found if found else None

    @property
    def trials_used(self):
        return len(self.search.trials) if self.search else (len(self.exhaustive.trials) if self.exhaustive else 0)

    def statuses(self) -> dict:
        out: dict = {}
        for r in (self.search, self.exhaustive):
            for t in (r.trials if r else []):
                out[t.status] = out.get(t.status, 0) + 1
        return out

    def to_dict(self) -> dict:
        def cfgd(c):
            return None if c is None else space.config_to_dict(c)

        def res(r):
            if r is None:
                return None
            return {"method": r.method, "wall_s": r.wall_s, "asks": r.asks, "n_valid": r.n_valid,
                    "best": cfgd(r.best), "best_ms": r.best_ms,
                    "trials": [{"n": t.number, "config": cfgd(t.config), "status": t.status, "ms": t.ms,
                                "reason": t.reason, "t_s": round(t.t_s, 3), **t.info} for t in r.trials]}

        s = self.shape
        return {
            "kernel": s.kernel, "perf_class": s.perf_class, "dtype": s.dtype, "head_dim": s.head_dim, "causal": s.causal, "seqlen": s.seqlen,
            "batch": s.batch, "heads": s.heads, "seqlen_bucket": s.bucket,
            "error": self.error, "default": cfgd(self.default), "default_ms": self.default_ms,
            "winner": cfgd(self.winner), "winner_ms": self.winner_ms, "speedup": self.speedup,
            "search_best": cfgd(self.search_best), "search_best_ms": self.confirmed_ms(self.search_best),
            "exhaustive_best": cfgd(self.exhaustive_best),
            "exhaustive_best_ms": self.confirmed_ms(self.exhaustive_best),
            "quality": self.quality, "trials_used": self.trials_used, "n_valid": self.n_valid,
            "n_space": self.n_space, "statuses": self.statuses(),
            "static_pruned": {space.config_label(c): r for c, r in self.static_pruned.items()},
            "compile_pruned": {space.config_label(c): r for c, r in self.compile_pruned.items()},
            "confirm": [{"config": cfgd(c), "ms": v} for c, v in self.confirm.items()],
            "compile_s": self.compile_s, "wall_s": self.wall_s,
            "search": res(self.search), "exhaustive": res(self.exhaustive),
        }


def _closeness(shape: Shape, causal: bool, bucket: int) -> tuple:
    return (abs(bucket.bit_length() - shape.bucket.bit_length()), causal != shape.causal, -bucket)


def warm_start(shape: Shape, default, done: dict, cached) -> list:
    """The default first, then configs that won on neighbouring shapes of the same group (this run's
    first, then the cache's), nearest seqlen bucket first, same causality first."""
    out = [default] if default is not None else []
    near = sorted(done.items(), key=lambda kv: _closeness(shape, kv[0][0], kv[0][1]))
    out += [cfg for _, cfg in near]
    if cached is not None:
        rows = []
        for causal in (False, True):
            key = tuning_store.shape_key(shape.kernel, shape.dtype, shape.head_dim, shape.perf_class, causal)
            for b, cfg in cached.by_shape.get(key, {}).items():
                rows.append((_closeness(shape, causal, b), cfg))
        out += [cfg for _, cfg in sorted(rows, key=lambda r: r[0])]
    return list(dict.fromkeys(out))


def confirm(worker, finalists: list, o: Options) -> dict:
    """Re-time the finalists in interleaved rounds (order rotated each round); config -> [ms]."""
    times: dict = {c: [] for c in finalists}
    for r in range(max(1, o.confirm_rounds)):
        k = r % len(finalists)
        for cfg in finalists[k:] + finalists[:k]:
            out = worker.trial(cfg, o.warmup, o.reps, False, o.warmup_ms)
            times[cfg].append(out.ms if out.ok else None)
    return times


def _top(result, k):
    if result is None:
        return []
    ok = sorted((t for t in result.trials if t.status == "ok" and t.ms is not None), key=lambda t: (t.ms, t.number))
    return [t.config for t in ok[:k]]


def _entry(rep: StudyReport, props, o: Options) -> dict | None:
    if rep.winner is None or rep.winner_ms is None:
        return None
    s = rep.shape
    timings = []
    for r in (rep.search, rep.exhaustive):
        for t in (r.trials if r else []):
            timings.append([*search.params_of(t.config), t.ms, t.status])
    method = "+".join(r.method for r in (rep.search, rep.exhaustive) if r is not None)
    from .. import __version__

    return tuning_store.make_entry(
        tuning_store.DeviceKey.of(props), s.kernel, tuning_store.source_fingerprint(s.kernel), s.dtype, s.head_dim,
        s.perf_class, s.causal, s.bucket, space.config_to_dict(rep.winner),
        time_ms=rep.winner_ms, default_config=space.config_to_dict(rep.default) if rep.default else None,
        default_ms=rep.default_ms, method=method, trials=rep.trials_used, valid=rep.n_valid,
        shape={"batch": s.batch, "seqlen": s.seqlen, "heads": s.heads},
        exhaustive_best_ms=rep.confirmed_ms(rep.exhaustive_best), seed=o.seed, reps=o.reps,
        timings=timings, cuflash_version=__version__,
        tuned_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def tune(o: Options, worker, props, *, on_event: Callable | None = None, cache_path=None) -> list:
    """Tune every planned shape; returns [StudyReport]. Cache entries are written as shapes finish."""
    if o.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    ev = on_event or (lambda kind, **kw: None)
    shapes = plan_shapes(o)
    cached = None
    try:
        cached = tuning_store.load_tables(props, user_path=cache_path, warn=False).user
    except Exception:  # noqa: BLE001 - warm starts are a nicety
        pass
    reports, groups = [], {}
    for sh in shapes:
        groups.setdefault((sh.kernel, sh.perf_class, sh.dtype, sh.head_dim), []).append(sh)
    for (kernel, _, dtype, d), group in groups.items():
        fam, features = families.get(kernel), group[0].features
        sp = space.build_space(fam, d, props, features)
        base = dict(default=sp.default, n_space=sp.size, static_pruned=sp.pruned)
        problem = None
        if _compile.kernel_fingerprint(fam) is None:
            problem = f"kernel {kernel!r} has no sources in this cuflash (not implemented yet?)"
        elif fam.device_problem(props):
            problem = f"{kernel} does not run on this device: {fam.device_problem(props)}"
        elif sp.default is None or not sp.candidates:
            problem = f"no {kernel} config for head_dim {d} fits this device"
        if problem:
            for sh in group:
                reports.append(StudyReport(sh, error=problem, **base))
                ev("study_done", report=reports[-1])
            continue
        t0 = time.monotonic()
        ev("compile_start", kernel=kernel, dtype=dtype, head_dim=d, n=len(sp.candidates))
        if o.compile_jobs > 1 and getattr(worker, "device", None) is not None:
            precompile.precompile(sp.candidates, features, worker.device, o.compile_jobs)
        valid, pruned = search.prune(sp.candidates, lambda c: worker.check(c, features, o.allow_local_bytes),
                                     lambda c, why: ev("checked", config=c, reason=why))
        compile_s = time.monotonic() - t0
        done: dict = {}  # (causal, bucket) -> winner, for warm starts
        for sh in group:
            # the baseline is what this shape runs untuned (a causal shape: the causal variant)
            rep = StudyReport(sh, compile_pruned=pruned, n_valid=len(valid), compile_s=compile_s,
                              **{**base, "default": fam.untuned(d, props.smem_optin, features, sh.causal)})
            reports.append(rep)
            try:
                _study(rep, worker, valid, o, done, cached, ev)
            except Exception as e:  # noqa: BLE001 - one study's failure must not end the run
                rep.error = f"study failed: {type(e).__name__}: {e}"
                rep.winner = None
            if rep.winner is not None:
                done[(sh.causal, sh.bucket)] = rep.winner
                entry = _entry(rep, props, o)
                if entry is not None and o.write_cache:
                    tuning_store.save_entries(cache_path or tuning_store.cache_path(), [entry])
            ev("study_done", report=rep)
    return reports


def _study(rep: StudyReport, worker, valid, o: Options, done, cached, ev):
    t0 = time.monotonic()
    sh = rep.shape
    if not valid:
        rep.error = "every config was pruned"
        return
    ev("study_start", shape=sh, n_valid=len(valid))
    status, payload = worker.setup(sh)
    if status != "ok":
        rep.error = f"setup failed ({status}): {payload}"
        rep.wall_s = time.monotonic() - t0
        return

    def evaluate(cfg):
        return worker.trial(cfg, o.warmup, o.reps, True, o.warmup_ms)

    def on_trial(t):
        ev("trial", shape=sh, trial=t)

    if o.mode in ("search", "compare"):
        n = o.trials if o.trials is not None else search.default_budget(len(valid), o.fraction, o.min_trials)
        rep.search = search.optimize(valid, evaluate, n_trials=n, warm_start=warm_start(sh, rep.default, done, cached),
                                     timeout_s=o.time_budget_s, seed=o.seed, sampler=o.sampler,
                                     n_startup=o.n_startup, on_trial=on_trial)
    if o.mode in ("exhaustive", "compare"):
        rep.exhaustive = search.exhaustive(valid, evaluate, on_trial=on_trial)
    candidates = _top(rep.search, o.confirm_top) + _top(rep.exhaustive, o.confirm_top)
    finalists = list(dict.fromkeys([rep.default] + candidates))
    ev("confirm", shape=sh, n=len(finalists))
    rep.confirm = confirm(worker, finalists, o)
    # The default is always eligible (it is what runs untuned), so a winner is never slower than it.
    eligible = set(valid) | {rep.default}
    ranked = sorted((c for c in finalists if c in eligible and rep.confirmed_ms(c) is not None),
                    key=lambda c: (rep.confirmed_ms(c), finalists.index(c)))
    rep.winner = ranked[0] if ranked else None
    if rep.winner is None:
        rep.error = "no config ran correctly"
    rep.wall_s = time.monotonic() - t0
