"""Call-time lookup of tuned kernel configs (the tuner's only hook on the hot path).

    cfg = _tuned.lookup("fwd", problem)   # a config, or None: use the heuristic default

The first lookup on a device reads the user's tuning cache and the shipped tables once (see
cuflash/tune/cache.py for the key and the matching rules); every later lookup is one dict hit on
(kernel, device, dtype, head_dim, causal, seqlen bucket). Never raises: a broken cache is reported
with a warning and treated as empty. No Optuna, no GPU work.

CUFLASH_TUNED=0 in the environment disables tuned configs (the heuristic defaults run).
"""
from __future__ import annotations

import os
import threading
import warnings

_memo: dict = {}  # (kernel, device, dtype, head_dim, causal, bucket) -> config or None
_tables: dict = {}  # device -> cache.Tables
_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get("CUFLASH_TUNED", "1").strip().lower() not in ("0", "false", "no", "off")


def _device_props(device: int):
    from .tune import device as _dev

    return _dev.query(device)


def tables(device: int):
    """The loaded tables for a device (loaded on first use)."""
    t = _tables.get(device)
    if t is None:
        with _lock:
            t = _tables.get(device)
            if t is None:
                from .tune import cache

                t = _tables[device] = cache.load_tables(_device_props(device))
    return t


def lookup(kernel: str, problem):
    """The tuned config of `kernel` for a problem (anything with device, dtype, head_dim, causal,
    seqlen_q, seqlen_k), or None when nothing tuned applies."""
    bucket = 1 << (max(problem.seqlen_q, problem.seqlen_k, 1) - 1).bit_length()
    key = (kernel, problem.device, problem.dtype, problem.head_dim, bool(problem.causal), bucket)
    try:
        return _memo[key]
    except KeyError:
        pass
    cfg = None
    if enabled():
        try:
            cfg, _ = tables(problem.device).find(kernel, problem.dtype, problem.head_dim, bool(problem.causal), bucket)
        except Exception as e:  # noqa: BLE001 - a tuning cache must never break attention()
            warnings.warn(f"cuflash: tuned-config lookup failed ({type(e).__name__}: {e}); using defaults",
                          RuntimeWarning, stacklevel=2)
            _tables[problem.device] = _EMPTY
    _memo[key] = cfg
    return cfg


def reload() -> None:
    """Forget loaded tables and memoised answers (after tuning in this process, or in tests)."""
    with _lock:
        _memo.clear()
        _tables.clear()


class _Empty:
    def find(self, *a):
        return None, None


_EMPTY = _Empty()
