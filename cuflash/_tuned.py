"""Call-time lookup of tuned kernel configs (the tuned tables' only hook on the hot path).

    tile = _tuned.lookup(families.FWD, problem, props)   # a tile, or None: use the heuristic default

The first lookup on a device reads the user's tuning cache and the shipped tables once (see
cuflash/tuning_store.py for the key and the matching rules); every later lookup is one dict hit on
(family, device, dtype, head_dim, perf class, causal, seqlen bucket); a perf class with no entry
takes its fallback class's (features.PERF_CLASS_FALLBACK: ALiBi -> dense). Never raises: a broken cache
is reported with a warning and treated as empty. No Optuna, no GPU work, no import of the tuner.

CUFLASH_TUNED=0 in the environment disables tuned configs (the heuristic defaults run).
"""
from __future__ import annotations

import os
import threading
import warnings

from . import tuning_store
from .features import PERF_CLASS_FALLBACK
from .mask import UNBOUNDED

_memo: dict = {}  # (family, device, shape key, bucket) -> tile or None
_tables: dict = {}  # device -> tuning_store.Tables
_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get("CUFLASH_TUNED", "1").strip().lower() not in ("0", "false", "no", "off")


def tables(device: int, props):
    """The loaded tables for a device (loaded on first use)."""
    t = _tables.get(device)
    if t is None:
        with _lock:
            t = _tables.get(device)
            if t is None:
                t = _tables[device] = tuning_store.load_tables(props)
    return t


def lookup(family, problem, props):
    """The tuned tile of `family` for a problem (anything with device, dtype, head_dim, causal,
    seqlen_q, seqlen_k and features) on a device with properties `props`, or None when nothing
    tuned applies."""
    bucket = _bucket(problem)
    # the instantiated head dim: a call of a smaller one runs (and is served by) its tiles
    shape = tuning_store.shape_key(family.name, problem.dtype, problem.features.head_dim, problem.features.perf_class(),
                                   problem.causal and family.causal_matters)
    key = (problem.device, shape, bucket)
    try:
        return _memo[key]
    except KeyError:
        pass
    cfg = None
    if enabled():
        try:
            t = tables(problem.device, props)
            cfg, _ = t.find(shape, bucket)
            fallback = PERF_CLASS_FALLBACK.get(shape[3])
            if cfg is None and fallback is not None:  # a class nothing was tuned for: its fallback's entry
                cfg, _ = t.find(shape[:3] + (fallback,) + shape[4:], bucket)
        except Exception as e:  # noqa: BLE001 - a tuning cache must never break attention()
            warnings.warn(f"cuflash: tuned-config lookup failed ({type(e).__name__}: {e}); using defaults",
                          RuntimeWarning, stacklevel=2)
            _tables[problem.device] = _EMPTY
    _memo[key] = cfg
    return cfg


def _bucket(problem) -> int:
    """The seqlen bucket whose tuned tile serves a call: the longer sequence's, or for a window
    bounded on both sides (a sliding window with causal or a right edge) its width
    window_left + window_right where that is shorter. Each query block's key loop (the backward's
    query loop per key block) then runs about that many keys, as a full call of that length does, and
    the loop's length is what the tuned tiles follow (H200, 2026-12-07: a 4096 window at seqlen 32768
    ran the 8192 bucket's 192-key tile at 0.880 of full attention's rate)."""
    n = max(int(problem.seqlen_q), int(problem.seqlen_k), 1)
    left, right = getattr(problem, "window_left", UNBOUNDED), getattr(problem, "window_right", UNBOUNDED)
    if left != UNBOUNDED and right != UNBOUNDED:
        n = min(n, max(left + right, 1))
    return tuning_store.seqlen_bucket(n, n)


def reload() -> None:
    """Forget loaded tables and memoised answers (after tuning in this process, or in tests)."""
    with _lock:
        _memo.clear()
        _tables.clear()


class _Empty:
    def find(self, *a):
        return None, None


_EMPTY = _Empty()
