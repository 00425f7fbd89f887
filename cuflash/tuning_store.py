"""The tuned-config store: file format, keys, atomic and concurrent-safe writes, loading for lookup.

The library reads it (cuflash/_tuned.py, on the first call per device); the tuner writes it
(`python -m cuflash.tune`). One JSON format serves the user's cache, the tables shipped in the
wheel (tuning/*.json, made with `--export`), and `--export` itself:

    {"format": "cuflash-tuning", "version": 2, "entries": [ENTRY, ...]}

ENTRY holds the key fields (gpu, cc, sm_count, driver, nvrtc, kernel, source, dtype, head_dim,
perf_class, causal, seqlen_bucket), the winning "config", and what was measured (time_ms,
default_config, default_ms, method, trials, valid, per-config "timings", ...). `kernel` names a
kernel family (cuflash/families/); `perf_class` the feature class the entry was tuned for
(Features.perf_class(): "dense", "dropout", "softcap", "alibi"). Version-1 tables predate perf_class: they were tuned
without dropout, so their entries are read as "dense".

Matching an entry against the running process:
  * gpu, cc and sm_count must equal the device's, or the entry belongs to another GPU (skipped
    silently);
  * source must equal the current fingerprint of that kernel's sources, else the entry is stale;
  * driver and nvrtc must equal the current versions for the user's cache, else stale; shipped
    tables are exempt (they cannot know the user's driver), and are the fallback anyway.
Stale entries and corrupt files are reported once with a TuningCacheWarning and ignored.

Writers take a file lock (filelock), re-read the file, merge their entries by key, write a
temporary file in the same directory and os.replace it over the old one: readers never lock and
never see a partial file, and a writer killed mid-write leaves the old content intact.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import tempfile
import warnings

from . import _compile, families
from .features import PERF_CLASSES, Features

FORMAT = "cuflash-tuning"
VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1: no perf_class, every entry "dense"
FILE_NAME = "tuned.json"
ENV_CACHE_DIR = "CUFLASH_CACHE_DIR"
# A missing bucket borrows the nearest tuned one within this many powers of two.
MAX_BUCKET_DISTANCE = 2

KEY_FIELDS = ("gpu", "cc", "sm_count", "driver", "nvrtc", "kernel", "source", "dtype", "head_dim", "perf_class",
              "causal", "seqlen_bucket")


class TuningCacheWarning(UserWarning):
    """A tuning cache or table was unreadable, malformed or stale; it was ignored."""


def _warn(msg: str) -> None:
    warnings.warn(msg, TuningCacheWarning, stacklevel=3)


# ----------------------------------------------------------------------------- where files live

def cache_dir() -> pathlib.Path:
    """$CUFLASH_CACHE_DIR, else the user's cache directory (platformdirs) / cuflash."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return pathlib.Path(env)
    try:
        import platformdirs

        return pathlib.Path(platformdirs.user_cache_dir("cuflash", appauthor=False))
    except ImportError:  # platformdirs is a dependency; this only keeps a bare environment working
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return pathlib.Path(base) / "cuflash"


def cache_path() -> pathlib.Path:
    return cache_dir() / FILE_NAME


def shipped_dir() -> pathlib.Path | None:
    """tuning/ as installed (cuflash/tuning in the wheel) or at the top of a checkout.

    Plain paths, not importlib.resources: cuflash/tuning has no __init__.py, and for such a
    namespace package files() returns a MultiplexedPath whose str() is not a path."""
    pkg = pathlib.Path(__file__).resolve().parent
    for d in (pkg / "tuning", pkg.parent / "tuning"):
        if d.is_dir():
            return d
    return None


def shipped_tables() -> list:
    d = shipped_dir()
    return sorted(d.glob("*.json")) if d is not None else []


# ----------------------------------------------------------------------------- key parts

def seqlen_bucket(seqlen_q: int, seqlen_k: int) -> int:
    """The power of two at or above the longer sequence: 1000 -> 1024, 1024 -> 1024, 1025 -> 2048."""
    return 1 << (max(int(seqlen_q), int(seqlen_k), 1) - 1).bit_length()


def shape_key(kernel: str, dtype: str, head_dim: int, perf_class: str, causal: bool) -> tuple:
    """What an Index is keyed by, besides the seqlen bucket."""
    return (kernel, dtype, head_dim, perf_class, bool(causal))


def _features(e: dict) -> Features:
    """The features an entry was tuned for (enough to judge its tile: its perf class's spills)."""
    return Features.of_class(e["dtype"], e["head_dim"], e["perf_class"])


def source_fingerprint(kernel: str) -> str | None:
    """The current source fingerprint of the family named `kernel` (None: unknown or no sources)."""
    fam = families.REGISTRY.get(kernel)
    return _compile.kernel_fingerprint(fam) if fam is not None else None


def nvrtc_str(v) -> str | None:
    return None if v is None else ".".join(str(x) for x in v)


@dataclasses.dataclass(frozen=True)
class DeviceKey:
    gpu: str
    cc: str
    sm_count: int
    driver: int | None
    nvrtc: str | None

    @classmethod
    def of(cls, props) -> "DeviceKey":
        return cls(props.name, props.cc_str, props.sm_count, props.driver_version, nvrtc_str(props.nvrtc_version))

    @property
    def gpu_id(self) -> tuple:
        return (self.gpu, self.cc, self.sm_count)


def key_string(e: dict) -> str:
    return "|".join(str(e[f]) for f in KEY_FIELDS)


def make_entry(dev: DeviceKey, kernel: str, source: str, dtype: str, head_dim: int, perf_class: str, causal: bool,
               bucket: int, config: dict, **measured) -> dict:
    e = {"gpu": dev.gpu, "cc": dev.cc, "sm_count": dev.sm_count, "driver": dev.driver, "nvrtc": dev.nvrtc,
         "kernel": kernel, "source": source, "dtype": dtype, "head_dim": int(head_dim), "perf_class": perf_class,
         "causal": bool(causal), "seqlen_bucket": int(bucket), "config": dict(config)}
    e.update(measured)
    return e


_TYPES = {"gpu": str, "cc": str, "sm_count": int, "driver": (int, type(None)), "nvrtc": (str, type(None)),
          "kernel": str, "source": str, "dtype": str, "head_dim": int, "perf_class": str, "causal": bool,
          "seqlen_bucket": int}


def check_entry(e) -> str | None:
    """Why `e` is not a well-formed entry, or None."""
    if not isinstance(e, dict):
        return "entry is not an object"
    for f, t in _TYPES.items():
        if f not in e:
            return f"entry lacks {f!r}"
        if not isinstance(e[f], t) or (t is int and isinstance(e[f], bool)):
            return f"entry field {f!r} has the wrong type ({e[f]!r})"
    b = e["seqlen_bucket"]
    if b < 1 or b & (b - 1):
        return f"seqlen_bucket {b} is not a power of two"
    if not isinstance(e.get("config"), dict):
        return "entry lacks a config"
    return None


# ----------------------------------------------------------------------------- reading

def read_file(path) -> tuple[list, str | None]:
    """(entries, problem): the raw entries of a table, or [] and why the file is unusable.
    A missing file is not a problem."""
    path = pathlib.Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return [], None
    except OSError as e:
        return [], f"cannot read it ({e.strerror or e})"
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        return [], f"not valid JSON ({type(e).__name__}: {str(e)[:120]})"
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return [], f"not a cuflash tuning table (no \"format\": \"{FORMAT}\")"
    if doc.get("version") not in READABLE_VERSIONS:
        return [], f"table version {doc.get('version')!r}, this cuflash reads version {VERSION}"
    entries = doc.get("entries")
    if not isinstance(entries, list):
        return [], "\"entries\" is not a list"
    if doc["version"] == 1:
        entries = [{**e, "perf_class": "dense"} if isinstance(e, dict) else e for e in entries]
    return entries, None


def _write_atomic(path: pathlib.Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _lock(path: pathlib.Path, timeout: float = 120):
    import filelock

    path.parent.mkdir(parents=True, exist_ok=True)
    return filelock.FileLock(str(path) + ".lock", timeout=timeout)


def save_entries(path, new_entries: list) -> int:
    """Merge `new_entries` into the table at `path` (same key: the new one wins). Returns the number
    of entries in the file afterwards. Safe against concurrent writers and crashes."""
    path = pathlib.Path(path)
    for e in new_entries:
        why = check_entry(e)
        if why:
            raise ValueError(f"refusing to write a malformed entry ({why}): {e!r}")
    with _lock(path):
        old, problem = read_file(path)
        if problem:
            _warn(f"cuflash: tuning cache {path} was unusable ({problem}); starting it afresh")
        merged = {}
        for e in old:
            if check_entry(e) is None:
                merged[key_string(e)] = e
        for e in new_entries:
            merged[key_string(e)] = e
        doc = {"format": FORMAT, "version": VERSION, "entries": [merged[k] for k in sorted(merged)]}
        _write_atomic(path, doc)
        return len(merged)


def clear(path=None) -> bool:
    """Delete the user's cache file; True if there was one. Creates nothing: a missing directory
    means there is no cache, and the lock file goes with the cache (deleted while held, so a writer
    waiting on it then writes to a cache file that clear no longer sees, never a half-cleared one).
    OSError (e.g. the cache path is a directory, or not writable) is the caller's to report."""
    path = pathlib.Path(path) if path is not None else cache_path()
    if not path.parent.is_dir():
        if path.parent.exists():  # a file where the cache directory should be
            raise NotADirectoryError(f"{path.parent} is not a directory")
        return False
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory, not a cache file")
    lock = pathlib.Path(str(path) + ".lock")
    with _lock(path):
        try:
            path.unlink()
            found = True
        except FileNotFoundError:
            found = False
        finally:
            try:
                lock.unlink()
            except FileNotFoundError:
                pass
    return found


# ----------------------------------------------------------------------------- matching

def classify(e: dict, dev: DeviceKey, shipped: bool) -> str:
    """'match', 'other-device', 'stale-source' or 'stale-toolchain' (for a well-formed entry)."""
    if (e["gpu"], e["cc"], e["sm_count"]) != dev.gpu_id:
        return "other-device"
    if e["source"] != source_fingerprint(e["kernel"]):
        return "stale-source"
    if not shipped and (e["driver"], e["nvrtc"]) != (dev.driver, dev.nvrtc):
        return "stale-toolchain"
    return "match"


@dataclasses.dataclass
class Index:
    """Tuned configs of one table for one device: (kernel, dtype, head_dim, perf_class, causal) -> {bucket: config}."""

    by_shape: dict = dataclasses.field(default_factory=dict)
    entries: dict = dataclasses.field(default_factory=dict)  # key tuple + bucket -> entry (for --show)

    def exact(self, shape: tuple, bucket):
        return self.by_shape.get(shape, {}).get(bucket)

    def nearest(self, shape: tuple, bucket, max_distance=MAX_BUCKET_DISTANCE):
        table = self.by_shape.get(shape)
        if not table:
            return None
        e = bucket.bit_length()
        best = min(table, key=lambda b: (abs(b.bit_length() - e), -b))  # ties: the longer bucket
        return table[best] if abs(best.bit_length() - e) <= max_distance else None


def load_index(path, dev: DeviceKey, props, shipped: bool, warn: bool = True) -> Index:
    """Read one table and keep the entries that apply to this device and these kernel sources, and
    whose config fits the device. Problems are warned about (once per call) and never raised."""

    idx = Index()
    entries, problem = read_file(path)
    label = "shipped tuning table" if shipped else "tuning cache"
    if problem:
        if warn:
            _warn(f"cuflash: ignoring {label} {path}: {problem}")
        return idx
    bad, stale, unfit = [], {"stale-source": 0, "stale-toolchain": 0}, []
    for e in entries:
        why = check_entry(e)
        if why is None and e["kernel"] not in families.REGISTRY:
            why = f"unknown kernel {e['kernel']!r}"
        if why is None and e["perf_class"] not in PERF_CLASSES:  # a newer cuflash's table
            why = f"unknown perf class {e['perf_class']!r}"
        if why:
            bad.append(why)
            continue
        c = classify(e, dev, shipped)
        if c in stale:
            stale[c] += 1
            continue
        if c != "match":
            continue
        fam = families.get(e["kernel"])
        try:
            cfg = fam.tile_from_dict(e["config"])
        except ValueError as err:
            bad.append(str(err))
            continue
        why = fam.can_implement(cfg, props, _features(e)) if props is not None else cfg.structural_problem()
        if why is None and cfg.head_dim != e["head_dim"]:
            why = f"config head_dim {cfg.head_dim} != entry head_dim {e['head_dim']}"
        if why:
            unfit.append(f"{e['kernel']} {cfg}: {why}")
            continue
        shape = shape_key(e["kernel"], e["dtype"], e["head_dim"], e["perf_class"], e["causal"])
        idx.by_shape.setdefault(shape, {})[e["seqlen_bucket"]] = cfg
        idx.entries[shape + (e["seqlen_bucket"],)] = e
    if warn:
        if bad:
            _warn(f"cuflash: ignoring {len(bad)} malformed entries in {label} {path} (first: {bad[0]})")
        if unfit:
            _warn(f"cuflash: ignoring {len(unfit)} tuned configs in {label} {path} that cannot run on this "
                  f"device (first: {unfit[0]})")
        if stale["stale-source"]:
            _warn(f"cuflash: ignoring {stale['stale-source']} entries in {label} {path} tuned for other kernel "
                  f"sources on this GPU; re-run `python -m cuflash.tune`")
        if stale["stale-toolchain"]:
            _warn(f"cuflash: ignoring {stale['stale-toolchain']} entries in {label} {path} tuned under another "
                  f"driver or NVRTC version on this GPU; re-run `python -m cuflash.tune`")
    return idx


@dataclasses.dataclass
class Tables:
    """What lookup consults for one device: the user's cache first, then the shipped tables."""

    user: Index
    shipped: Index

    def find(self, shape: tuple, bucket):
        """(config, source) or (None, None) for a shape_key(): exact bucket (user, shipped), then
        nearest bucket (user, shipped)."""
        for name, idx in (("user", self.user), ("shipped", self.shipped)):
            c = idx.exact(shape, bucket)
            if c is not None:
                return c, name
        for name, idx in (("user", self.user), ("shipped", self.shipped)):
            c = idx.nearest(shape, bucket)
            if c is not None:
                return c, name
        return None, None


def load_tables(props, user_path=None, shipped_paths=None, warn: bool = True) -> Tables:
    dev = DeviceKey.of(props)
    user = load_index(user_path if user_path is not None else cache_path(), dev, props, False, warn)
    shipped = Index()
    for p in (shipped_paths if shipped_paths is not None else shipped_tables()):
        one = load_index(p, dev, props, True, warn)
        for shape, table in one.by_shape.items():
            for b, cfg in table.items():
                shipped.by_shape.setdefault(shape, {}).setdefault(b, cfg)  # first table wins on a tie
        for k, e in one.entries.items():
            shipped.entries.setdefault(k, e)
    return Tables(user, shipped)
