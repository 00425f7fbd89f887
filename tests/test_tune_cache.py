"""The tuned-config store (cuflash.tuning_store): keys, atomic and concurrent writes, corrupt and
stale files, and the call-time lookup (cuflash._tuned, families.select) with recorded device
properties (no GPU needed)."""
from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import shutil
import signal
import time
import types
import warnings

import pytest

from cuflash import _compile, _tuned, device, families, tiles, tuning_store
from cuflash.features import Features
from cuflash.tune import space
from cuflash.tuning_store import TuningCacheWarning
from cuflash.device import DeviceProps

FIX = pathlib.Path(__file__).parent / "fixtures" / "devices"
H200 = DeviceProps.from_json(FIX / "h200.json")
A100 = DeviceProps.from_json(FIX / "a100-80gb.json")
TUNED = tiles.FwdConfig(128, 128, 64, 8, 2)  # not the H200 default (128x128 w8 s3)


def entry(props=H200, cfg=TUNED, *, kernel="fwd", dtype="bfloat16", causal=False, bucket=8192, source=None,
          perf_class="dense", **kw):
    dev = tuning_store.DeviceKey.of(props)
    return tuning_store.make_entry(dev, kernel, source or tuning_store.source_fingerprint(kernel), dtype,
                                   cfg.head_dim, perf_class, causal, bucket, space.config_to_dict(cfg), time_ms=1.0,
                                   default_ms=1.1, **kw)


def problem(seqlen=8192, d=128, causal=False, dtype="bfloat16", device=0, seqlen_k=None, dropout=False):
    return types.SimpleNamespace(batch=2, seqlen_q=seqlen, seqlen_k=seqlen_k or seqlen, heads=16, head_dim=d,
                                 dtype=dtype, device=device, causal=causal, softmax_scale=0.1,
                                 features=Features(dtype, d, dropout))


@pytest.fixture
def env(tmp_path, monkeypatch):
    """An empty user cache in tmp, no shipped tables, the H200's identity, fresh lookup state."""
    monkeypatch.setenv(tuning_store.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv("CUFLASH_TUNED", raising=False)
    shipped: list = []
    monkeypatch.setattr(tuning_store, "shipped_tables", lambda: list(shipped))
    props = {"p": H200}
    monkeypatch.setattr(device, "query", lambda device_id=0: props["p"])
    _tuned.reload()
    yield types.SimpleNamespace(user=tmp_path / "cache" / tuning_store.FILE_NAME, shipped=shipped, props=props, tmp=tmp_path)
    _tuned.reload()


def lookup(kernel, p, props=None):
    return _tuned.lookup(families.get(kernel), p, props or device.query(p.device))


# ----------------------------------------------------------------------------- keys

def test_seqlen_bucket():
    assert [tuning_store.seqlen_bucket(n, n) for n in (1, 2, 3, 1000, 1024, 1025, 8192)] == [1, 2, 4, 1024, 1024, 2048, 8192]
    assert tuning_store.seqlen_bucket(1, 5000) == tuning_store.seqlen_bucket(5000, 7) == 8192


def test_key_holds_everything_that_changes_the_answer():
    e = entry()
    k = tuning_store.key_string(e)
    for f in ("NVIDIA H200", "9.0", "132", "13000", "13.0", "fwd", _compile.kernel_fingerprint(families.FWD), "bfloat16",
              "128", "dense", "False", "8192"):
        assert f in k.split("|"), f
    variants = [entry(A100), entry(causal=True), entry(bucket=4096), entry(dtype="float16"), entry(source="0" * 16), entry(perf_class="dropout"),
                entry(DeviceProps.from_dict({**H200.to_dict(), "driver_version": 12080})),
                entry(DeviceProps.from_dict({**H200.to_dict(), "nvrtc_version": [12, 9]})),
                entry(DeviceProps.from_dict({**H200.to_dict(), "sm_count": 114})),
                entry(cfg=tiles.FwdConfig(64, 128, 64, 4, 2))]
    assert len({tuning_store.key_string(v) for v in variants} | {k}) == len(variants) + 1


def test_kernel_fingerprint_follows_the_kernels_own_sources(tmp_path, monkeypatch):
    copy = tmp_path / "kernels_cu"
    shutil.copytree(_compile.kernel_dir(), copy)
    monkeypatch.setattr(_compile, "kernel_dir", lambda: copy)
    monkeypatch.setattr(_compile, "_fingerprints", {})
    fp = _compile.kernel_fingerprint(families.get("fwd"))
    assert fp and len(fp) == 16
    (copy / "unrelated_kernel.cuh").write_text("// another kernel's header\n")
    _compile._fingerprints.clear()
    assert _compile.kernel_fingerprint(families.get("fwd")) == fp  # editing another kernel does not invalidate fwd
    with open(copy / "common.cuh", "a") as f:  # an included header does
        f.write("\n// edited\n")
    _compile._fingerprints.clear()
    assert _compile.kernel_fingerprint(families.get("fwd")) != fp
    (copy / "flash_bwd.cuh").unlink(missing_ok=True)
    _compile._fingerprints.clear()
    assert _compile.kernel_fingerprint(families.get("bwd")) is None  # no sources: nothing can match


def test_kernel_fingerprint_follows_includes_in_subdirectories(tmp_path, monkeypatch):
    """`#include "dir/x.cuh"` resolves beside the including file first, then from kernels_cu/."""
    root = tmp_path / "kernels_cu"
    (root / "attn").mkdir(parents=True)
    (root / "core").mkdir()
    (root / "common.cuh").write_text("// marker for kernel_dir\n")
    (root / "flash_fwd.cuh").write_text('#include "attn/mask.cuh"\n')
    (root / "attn" / "mask.cuh").write_text('#include "softmax.cuh"\n#include "core/types.cuh"\n')
    (root / "attn" / "softmax.cuh").write_text("// beside mask.cuh\n")
    (root / "core" / "types.cuh").write_text("// from the root\n")
    monkeypatch.setattr(_compile, "kernel_dir", lambda: root)
    assert _compile._local_headers(root, "flash_fwd.cuh") == {
        "flash_fwd.cuh", "attn/mask.cuh", "attn/softmax.cuh", "core/types.cuh"}
    monkeypatch.setattr(_compile, "_fingerprints", {})
    fp = _compile.kernel_fingerprint(families.FWD)
    for edited in ("attn/softmax.cuh", "core/types.cuh"):
        with open(root / edited, "a") as f:
            f.write("// edited\n")
        _compile._fingerprints.clear()
        assert _compile.kernel_fingerprint(families.FWD) != fp, edited
        fp = _compile.kernel_fingerprint(families.FWD)


# ----------------------------------------------------------------------------- writing

def test_save_merges_by_key_and_round_trips(tmp_path):
    p = tmp_path / "t.json"
    assert tuning_store.save_entries(p, [entry(), entry(causal=True)]) == 2
    assert tuning_store.save_entries(p, [entry(cfg=tiles.FwdConfig(128, 64, 64, 4, 2))]) == 2  # same key: replaced
    entries, problem = tuning_store.read_file(p)
    assert problem is None and len(entries) == 2
    assert {e["config"]["block_q"] for e in entries} == {64, 128}
    with pytest.raises(ValueError):
        tuning_store.save_entries(p, [{"gpu": "x"}])


def test_failed_write_leaves_the_old_file_intact(tmp_path, monkeypatch):
    p = tmp_path / "t.json"
    tuning_store.save_entries(p, [entry()])
    before = p.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(tuning_store.os, "replace", boom)
    with pytest.raises(OSError):
        tuning_store.save_entries(p, [entry(causal=True)])
    assert p.read_bytes() == before
    assert [x.name for x in tmp_path.iterdir() if x.name.endswith(".tmp")] == []


def _die_before_replace(path):
    tuning_store.os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    tuning_store.save_entries(path, [entry(causal=True)])


def test_killed_writer_leaves_old_content_and_no_stuck_lock(tmp_path):
    p = tmp_path / "t.json"
    tuning_store.save_entries(p, [entry()])
    before = p.read_bytes()
    proc = multiprocessing.get_context("fork").Process(target=_die_before_replace, args=(p,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    assert p.read_bytes() == before
    t0 = time.monotonic()
    assert tuning_store.save_entries(p, [entry(bucket=1024)]) == 2  # the lock died with the writer
    assert time.monotonic() - t0 < 10


def _writer(path, wid, rounds):
    for r in range(rounds):
        tuning_store.save_entries(path, [entry(bucket=2 ** (wid + 1), dtype=f"w{r}"), entry(dtype="shared")])


def _reader(path, stop, bad):
    while not stop.is_set():
        entries, problem = tuning_store.read_file(path)
        if problem:
            bad.value += 1


def test_concurrent_writers_lose_nothing_and_readers_never_see_a_partial_file(tmp_path):
    p = tmp_path / "t.json"
    ctx = multiprocessing.get_context("fork")
    stop, bad = ctx.Event(), ctx.Value("i", 0)
    reader = ctx.Process(target=_reader, args=(p, stop, bad))
    reader.start()
    writers = [ctx.Process(target=_writer, args=(p, w, 6)) for w in range(8)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(120)
        assert w.exitcode == 0
    stop.set()
    reader.join(30)
    entries, problem = tuning_store.read_file(p)
    assert problem is None and bad.value == 0
    assert len(entries) == 8 * 6 + 1  # every writer's every round, plus the key they all share


def test_clear(tmp_path):
    p = tmp_path / "t.json"
    tuning_store.save_entries(p, [entry()])
    assert tuning_store.clear(p) and not p.exists() and not tuning_store.clear(p)


# ----------------------------------------------------------------------------- reading and lookup

def test_lookup_uses_the_user_cache(env):
    tuning_store.save_entries(env.user, [entry()])
    assert lookup("fwd", problem()) == TUNED
    assert lookup("fwd", problem(causal=True)) is None
    assert lookup("fwd", problem(dtype="float16")) is None
    assert lookup("fwd", problem(d=64)) is None
    assert lookup("bwd", problem()) is None
    assert lookup("fwd", problem(seqlen=5000)) == TUNED  # same bucket
    assert lookup("fwd", problem(seqlen=1, seqlen_k=8192)) == TUNED


def test_a_window_bounded_on_both_sides_takes_its_widths_bucket(env):
    """A sliding window's key loop runs about window_left + window_right keys a query block, as a full
    call of that length does: it takes that bucket's entry where the width is the shorter."""
    from cuflash.mask import UNBOUNDED

    short = tiles.FwdConfig(128, 64, 64, 4, 2)
    tuning_store.save_entries(env.user, [entry(), entry(cfg=short, bucket=4096)])

    def windowed(left, right, seqlen=32768):
        p = problem(seqlen)
        p.window_left, p.window_right = left, right
        return p
    assert lookup("fwd", problem(32768)) == TUNED  # no window: the nearest bucket, 8192
    assert lookup("fwd", windowed(4096, 0)) == short  # Mistral's causal sliding window
    assert lookup("fwd", windowed(2048, 2048)) == short
    assert lookup("fwd", windowed(4096, UNBOUNDED)) == TUNED  # one edge unbounded: the whole row may be seen
    assert lookup("fwd", windowed(UNBOUNDED, 0)) == TUNED  # causal
    assert lookup("fwd", windowed(6000, 0, seqlen=4096)) == short  # the window wider than the sequence
    assert lookup("fwd", windowed(0, 0)) is None  # one key a row: bucket 1, nothing tuned near it


def test_select_prefers_tuned_then_heuristic(env, monkeypatch):
    p = problem()
    assert families.select(families.FWD, p) == families.FWD.default(128)
    tuning_store.save_entries(env.user, [entry()])
    _tuned.reload()
    assert families.select(families.FWD, p) == TUNED
    monkeypatch.setenv("CUFLASH_TUNED", "0")
    _tuned.reload()
    assert families.select(families.FWD, p) == families.FWD.default(128)


def test_alibi_calls_take_alibi_entries_else_the_dense_ones(env):
    """ALiBi has its own perf class (its best tile may differ); a GPU whose tables have no ALiBi entry
    for the shape gives ALiBi calls the dense entry they ran on before the class existed
    (features.PERF_CLASS_FALLBACK), never the other way round."""
    other = tiles.FwdConfig(128, 64, 64, 4, 2)
    alibi = types.SimpleNamespace(**{**vars(problem()), "features": Features("bfloat16", 128, alibi=True)})
    assert alibi.features.perf_class() == "alibi"
    tuning_store.save_entries(env.user, [entry()])
    assert lookup("fwd", alibi) == TUNED  # the dense entry: nothing tuned for ALiBi
    tuning_store.save_entries(env.user, [entry(cfg=other, perf_class="alibi")])
    _tuned.reload()
    assert lookup("fwd", alibi) == other and lookup("fwd", problem()) == TUNED
    assert lookup("fwd", problem(dropout=True)) is None  # dropout has no fallback


def test_dropout_is_tuned_separately_and_spilling_tiles_are_avoided(env):
    """The dropout perf class has its own entries; a dense entry never serves a dropout call, and the
    heuristic skips the tiles whose dropout instantiation spills (the family's data)."""
    tuning_store.save_entries(env.user, [entry()])
    assert families.select(families.FWD, problem(dropout=True)) == families.FWD.default(128)
    spilling = next(iter(families.FWD.spilling["dropout"]))
    d = spilling.head_dim
    assert families.FWD.default(d) == spilling  # the plain kernel's default...
    assert families.select(families.FWD, problem(d=d, dropout=True)) != spilling  # ...is not dropout's
    dropout_tile = tiles.FwdConfig(128, 64, 64, 4, 2)
    tuning_store.save_entries(env.user, [entry(cfg=dropout_tile, perf_class="dropout")])
    _tuned.reload()
    assert families.select(families.FWD, problem(dropout=True)) == dropout_tile
    assert families.select(families.FWD, problem()) == TUNED
    # a tuned dropout entry naming a tile that spills as dropout is ignored, with a warning
    tuning_store.save_entries(env.user, [entry(cfg=spilling, perf_class="dropout", bucket=1024)])
    _tuned.reload()
    with pytest.warns(TuningCacheWarning, match="cannot run on this device"):
        assert lookup("fwd", problem(d=d, seqlen=1024, dropout=True)) is None


def test_softcap_is_its_own_class_and_unknown_classes_are_ignored(env):
    """Softcap calls take softcap entries only (not dense's tile); an entry of a class this cuflash
    does not know (a newer one's table) is ignored with a warning, the others still serve."""
    softcap_tile = tiles.FwdConfig(128, 64, 64, 4, 2)
    tuning_store.save_entries(env.user, [entry(), entry(cfg=softcap_tile, perf_class="softcap"),
                                         entry(cfg=softcap_tile, perf_class="future", bucket=1024)])
    sc = problem()
    sc.features = Features("bfloat16", 128, softcap=True)
    with pytest.warns(TuningCacheWarning, match="unknown perf class 'future'"):
        assert lookup("fwd", sc) == softcap_tile
    assert lookup("fwd", problem()) == TUNED


def test_version_1_tables_are_read_as_dense(env):
    e = entry()
    del e["perf_class"]
    env.user.parent.mkdir(parents=True)
    env.user.write_text(json.dumps({"format": tuning_store.FORMAT, "version": 1, "entries": [e]}))
    assert lookup("fwd", problem()) == TUNED
    assert lookup("fwd", problem(dropout=True)) is None


def test_lookup_is_a_dict_hit(env):
    tuning_store.save_entries(env.user, [entry()])
    p = problem()
    lookup("fwd", p)
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        lookup("fwd", p)
    per_call = (time.perf_counter() - t0) / n
    assert per_call < 20e-6, f"{per_call * 1e6:.1f} us per lookup"


def test_nearest_bucket_within_two_octaves(env):
    tuning_store.save_entries(env.user, [entry(bucket=4096)])
    assert lookup("fwd", problem(seqlen=8192)) == TUNED
    assert lookup("fwd", problem(seqlen=16384)) == TUNED
    assert lookup("fwd", problem(seqlen=32768)) is None
    assert lookup("fwd", problem(seqlen=1024)) == TUNED
    assert lookup("fwd", problem(seqlen=512)) is None


def test_user_cache_beats_shipped_table_and_shipped_beats_heuristic(env):
    ship = env.tmp / "nvidia-h200.json"
    shipped_cfg = tiles.FwdConfig(128, 64, 64, 4, 2)
    # a shipped table made under another driver/NVRTC still applies (it cannot know the user's)
    other_tc = DeviceProps.from_dict({**H200.to_dict(), "driver_version": 12080, "nvrtc_version": [12, 8]})
    tuning_store.save_entries(ship, [entry(other_tc, shipped_cfg, bucket=8192), entry(other_tc, shipped_cfg, bucket=1024)])
    env.shipped.append(ship)
    assert lookup("fwd", problem()) == shipped_cfg
    tuning_store.save_entries(env.user, [entry(bucket=8192)])
    _tuned.reload()
    assert lookup("fwd", problem()) == TUNED
    assert lookup("fwd", problem(seqlen=1024)) == shipped_cfg  # exact shipped beats nearest user (8192)
    assert lookup("fwd", problem(seqlen=4096)) == TUNED  # nearest: user first


@pytest.mark.parametrize("content", [
    b"", b"{", b'{"format": "cuflash-tuning", "version": 1, "entries": [', b"\x00\xff\xfe garbage",
    b"\xc3\x28", b"[]", b'{"format": "something-else"}', b'{"format": "cuflash-tuning", "version": 99, "entries": []}',
    b'{"format": "cuflash-tuning", "version": 1, "entries": {}}',
], ids=["empty", "brace", "truncated", "binary", "bad-utf8", "list", "other-format", "future-version", "entries-dict"])
def test_corrupt_file_warns_and_is_ignored(env, content):
    env.user.parent.mkdir(parents=True)
    env.user.write_bytes(content)
    with pytest.warns(TuningCacheWarning, match="ignoring tuning cache"):
        assert lookup("fwd", problem()) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lookup("fwd", problem()) is None  # reported once, then memoised


def test_malformed_entries_are_skipped_and_good_ones_kept(env):
    good = entry()
    bad_cfg = entry(causal=True)
    bad_cfg["config"] = {"head_dim": 128, "block_q": "big"}
    wrong_type = dict(entry(bucket=1024), head_dim="128")
    not_pow2 = dict(entry(bucket=2048), seqlen_bucket=3000)
    unknown = dict(entry(bucket=4096), kernel="fwd_v9")
    doc = {"format": tuning_store.FORMAT, "version": tuning_store.VERSION, "entries": [good, bad_cfg, wrong_type, not_pow2, unknown, 7]}
    env.user.parent.mkdir(parents=True)
    env.user.write_text(json.dumps(doc))
    with pytest.warns(TuningCacheWarning, match="5 malformed entries"):
        assert lookup("fwd", problem()) == TUNED
    assert lookup("fwd", problem(causal=True)) is None


def test_stale_source_hash_warns_and_is_ignored(env):
    tuning_store.save_entries(env.user, [entry(source="0123456789abcdef")])
    with pytest.warns(TuningCacheWarning, match="other kernel sources"):
        assert lookup("fwd", problem()) is None


def test_stale_driver_or_nvrtc_warns_for_the_user_cache(env):
    old = DeviceProps.from_dict({**H200.to_dict(), "nvrtc_version": [12, 4]})
    tuning_store.save_entries(env.user, [entry(old)])
    with pytest.warns(TuningCacheWarning, match="driver or NVRTC"):
        assert lookup("fwd", problem()) is None


def test_other_gpus_entries_are_silently_skipped(env):
    tuning_store.save_entries(env.user, [entry(A100), entry(DeviceProps.from_dict({**H200.to_dict(), "sm_count": 114}))])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lookup("fwd", problem()) is None
    env.props["p"] = A100
    _tuned.reload()
    assert lookup("fwd", problem()) == TUNED


def test_tuned_config_that_does_not_fit_the_device_is_ignored(env):
    big = tiles.FwdConfig(128, 128, 128, 8, 3)  # 224 KiB of shared memory
    tuning_store.save_entries(env.user, [entry(cfg=big)])
    env.props["p"] = DeviceProps.from_dict({**H200.to_dict(), "smem_optin": 163 * 1024})  # same identity, less smem
    with pytest.warns(TuningCacheWarning, match="cannot run on this device"):
        assert lookup("fwd", problem()) is None


def test_lookup_never_raises(env, monkeypatch):
    def broken(props, *a, **k):
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(tuning_store, "load_tables", broken)
    with pytest.warns(RuntimeWarning, match="lookup failed"):
        assert lookup("fwd", problem()) is None


def test_unreadable_cache_directory_is_not_fatal(env):
    env.user.mkdir(parents=True)  # a directory where the file should be
    with pytest.warns(TuningCacheWarning, match="cannot read"):
        assert lookup("fwd", problem()) is None


def test_cache_dir_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv(tuning_store.ENV_CACHE_DIR, raising=False)
    assert "cuflash" in str(tuning_store.cache_dir())
    monkeypatch.setenv(tuning_store.ENV_CACHE_DIR, str(tmp_path))
    assert tuning_store.cache_path() == tmp_path / tuning_store.FILE_NAME


def test_importing_cuflash_does_not_import_optuna(tmp_path):
    import os
    import subprocess
    import sys

    import cuflash

    code = ("import sys, cuflash, cuflash._forward, cuflash._tuned, cuflash.tune, cuflash.tuning_store;"
            "print(sorted(m for m in ('optuna', 'matplotlib', 'tqdm') if m in sys.modules))")
    # the child imports the cuflash this process imported (an installed wheel or a checkout), not
    # whatever its working directory happens to hold
    where = str(pathlib.Path(cuflash.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [where, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
