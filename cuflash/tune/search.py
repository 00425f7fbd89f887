"""The search loop: which configs to time, in what order, and which one wins.

Nothing here touches a GPU. A study is driven by two callables supplied by the caller:

    check(cfg)    -> None, or why the config cannot run (compile failed, spills, ...); called for
                     every candidate before any timing, so a pruned config is never evaluated
    evaluate(cfg) -> Outcome(status, ms, reason): "ok" with a time, or "wrong" / "failed" /
                     "crashed" (never wins)

so the same loop runs on the GPU (runner.py) and, in the tests, on a deterministic cost function.

`optimize` is an Optuna study (seeded TPE by default) over the categorical parameters of a kernel
config: the tile class's searched fields (Sm80Tile.axes(): block_q, block_k, warps, stages), warm-started with the heuristic default (and any configs that won on neighbouring
shapes). Parameter combinations outside the valid set are told to Optuna as PRUNED, so the sampler
learns to avoid them, and cost nothing. A config is timed at most once per study. `exhaustive` times
every valid config, for the ground truth the search is judged against.
"""
from __future__ import annotations

import dataclasses
import math
import random
import time
from typing import Any, Callable, Iterable, Sequence

SAMPLERS = ("tpe", "random", "gp")
# Asks in a row that propose nothing new (infeasible or already timed) before the loop stops
# trusting the sampler for one trial and times a random untimed config instead.
MAX_IDLE_ASKS = 16


@dataclasses.dataclass
class Outcome:
    status: str  # "ok" | "wrong" | "failed" | "crashed"
    ms: float | None = None
    reason: str = ""
    info: dict = dataclasses.field(default_factory=dict)  # e.g. max_abs_diff, p20/p80

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.ms is not None and math.isfinite(self.ms)


@dataclasses.dataclass
class Trial:
    number: int  # 0-based index among this study's evaluations
    config: Any
    status: str
    ms: float | None
    reason: str
    phase: str  # "search" | "exhaustive"
    t_s: float  # seconds since the study started, when the evaluation finished
    info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class SearchResult:
    method: str
    trials: list  # [Trial], in evaluation order
    n_valid: int
    wall_s: float
    asks: int = 0  # sampler proposals, including infeasible and repeated ones

    @property
    def best(self):
        t = self.best_trial
        return None if t is None else t.config

    @property
    def best_ms(self):
        t = self.best_trial
        return None if t is None else t.ms

    @property
    def best_trial(self):
        ok = [t for t in self.trials if t.status == "ok" and t.ms is not None]
        # Ties go to the earlier trial: deterministic given the evaluation order.
        return min(ok, key=lambda t: (t.ms, t.number)) if ok else None

    def best_so_far(self) -> list:
        """Best time after each evaluation (None until one succeeds): the study's history curve."""
        out, best = [], None
        for t in self.trials:
            if t.status == "ok" and t.ms is not None and (best is None or t.ms < best):
                best = t.ms
            out.append(best)
        return out


def params_of(cfg) -> tuple:
    """The values of the tile's searched fields, in the tile class's order."""
    return tuple(getattr(cfg, p) for p in type(cfg).axes())


def prune(candidates: Iterable, check: Callable | None, on_check: Callable | None = None):
    """(valid, pruned): `check` is asked about every candidate once; pruned maps config -> reason."""
    valid, pruned = [], {}
    for cfg in dict.fromkeys(candidates):
        why = check(cfg) if check is not None else None
        if why:
            pruned[cfg] = why
        else:
            valid.append(cfg)
        if on_check is not None:
            on_check(cfg, why)
    return valid, pruned


def default_budget(n_valid: int, fraction: float = 1 / 3, minimum: int = 1) -> int:
    """Trials per study when none is given: at most a third of the valid configs (rounded down),
    at least `minimum` (the warm start: the heuristic default is always the first trial).

    Small spaces thus get few trials, and lean on good heuristic defaults (cuflash/families/).
    """
    return min(n_valid, max(minimum, math.floor(fraction * n_valid)))


def make_sampler(name: str, seed: int, n_startup: int):
    import optuna

    if name == "tpe":
        # Multivariate TPE models the parameters jointly (block_q and warps interact); few random
        # start-up trials, because the whole budget is only a handful of evaluations.
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup, multivariate=True,
                                          constant_liar=False)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "gp":  # needs torch and scipy
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=n_startup)
    raise ValueError(f"unknown sampler {name!r}; choose from {SAMPLERS}")


def _record(trials, cfg, out: Outcome, phase, t0):
    t = Trial(len(trials), cfg, out.status, out.ms if out.ok else None, out.reason, phase,
              time.monotonic() - t0, dict(out.info))
    trials.append(t)
    return t


def optimize(valid: Sequence, evaluate: Callable, *, n_trials: int, warm_start: Sequence = (),
             timeout_s: float | None = None, seed: int = 0, sampler: str = "tpe", n_startup: int = 3,
             on_trial: Callable | None = None) -> SearchResult:
    """Optuna search over `valid` (configs of one kernel and head_dim): at most `n_trials` evaluations.

    `warm_start` configs (the heuristic default first) are evaluated first, in order, if valid.
    Stops early when every valid config has been timed or `timeout_s` has passed.
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    t0 = time.monotonic()
    valid = list(dict.fromkeys(valid))
    trials: list = []
    if not valid or n_trials <= 0:
        return SearchResult(f"optuna-{sampler}", trials, len(valid), time.monotonic() - t0)
    axes = type(valid[0]).axes()  # one family's tiles: one class
    by_params = {params_of(c): c for c in valid}
    domains = {p: sorted({getattr(c, p) for c in valid}) for p in axes}

    study = optuna.create_study(direction="minimize", sampler=make_sampler(sampler, seed, n_startup))
    for cfg in warm_start:
        if cfg in by_params.values():
            study.enqueue_trial(dict(zip(axes, params_of(cfg))), skip_if_exists=True)
    done: dict = {}  # config -> Outcome
    rng = random.Random(seed)
    asks = idle = 0
    state = optuna.trial.TrialState
    while len(done) < min(n_trials, len(valid)):
        if timeout_s is not None and time.monotonic() - t0 > timeout_s and done:
            break
        trial = study.ask()
        asks += 1
        cfg = by_params.get(tuple(trial.suggest_categorical(p, domains[p]) for p in axes))
        if cfg is None or cfg in done:
            prev = done.get(cfg)
            if prev is not None and prev.ok:
                study.tell(trial, prev.ms)  # a repeat: the stored time, no new evaluation
            else:
                study.tell(trial, state=state.PRUNED)
            idle += 1
            if idle >= MAX_IDLE_ASKS:
                fresh = [c for c in valid if c not in done]
                study.enqueue_trial(dict(zip(axes, params_of(rng.choice(fresh)))))
                idle = 0
            continue
        idle = 0
        out = evaluate(cfg)
        done[cfg] = out
        t = _record(trials, cfg, out, "search", t0)
        if out.ok:
            study.tell(trial, out.ms)
        else:  # wrong / failed / crashed: PRUNED, so TPE counts it among the bad ones
            study.tell(trial, state=state.PRUNED)
        if on_trial is not None:
            on_trial(t)
    return SearchResult(f"optuna-{sampler}", trials, len(valid), time.monotonic() - t0, asks)


def exhaustive(valid: Sequence, evaluate: Callable, *, on_trial: Callable | None = None,
               timeout_s: float | None = None) -> SearchResult:
    """Time every valid config once, in the given order: the true best of the space."""
    t0 = time.monotonic()
    trials: list = []
    valid = list(dict.fromkeys(valid))
    for cfg in valid:
        if timeout_s is not None and time.monotonic() - t0 > timeout_s and trials:
            break
        t = _record(trials, cfg, evaluate(cfg), "exhaustive", t0)
        if on_trial is not None:
            on_trial(t)
    return SearchResult("exhaustive", trials, len(valid), time.monotonic() - t0, len(trials))
