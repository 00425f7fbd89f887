"""The tuned-config cache: keys, atomic and concurrent writes, corrupt and stale files, and the
call-time lookup (cuflash._tuned) with recorded device properties (no GPU needed)."""
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

from cuflash import _compile, _configs, _forward, _tuned
from cuflash.tune import cache, space
from cuflash.tune.cache import TuningCacheWarning
from cuflash.tune.device import DeviceProps

FIX = pathlib.Path(__file__).parent / "fixtures" / "devices"
H200 = DeviceProps.from_json(FIX / "h200.json")
A100 = DeviceProps.from_json(FIX / "a100-80gb.json")
TUNED = _configs.FwdConfig(128, 128, 64, 8, 2)  # not the H200 default (128x128 w8 s3)


def entry(props=H200, cfg=TUNED, *, kernel="fwd", dtype="bfloat16", causal=False, bucket=8192, source=None, **kw):
    dev = cache.DeviceKey.of(props)
    return cache.make_entry(dev, kernel, source or cache.kernel_fingerprint(kernel), dtype, cfg.head_dim, causal,
                            bucket, space.config_to_dict(cfg), time_ms=1.0, default_ms=1.1, **kw)


def problem(seqlen=8192, d=128, causal=False, dtype="bfloat16", device=0, seqlen_k=None):
    return types.SimpleNamespace(batch=2, seqlen_q=seqlen, seqlen_k=seqlen_k or seqlen, heads=16, head_dim=d,
                                 dtype=dtype, device=device, causal=causal, softmax_scale=0.1)


@pytest.fixture
def env(tmp_path, monkeypatch):
    """An empty user cache in tmp, no shipped tables, the H200's identity, fresh lookup state."""
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv("CUFLASH_TUNED", raising=False)
    shipped: list = []
    monkeypatch.setattr(cache, "shipped_tables", lambda: list(shipped))
    props = {"p": H200}
    monkeypatch.setattr(_tuned, "_device_props", lambda device: props["p"])
    _tuned.reload()
    yield types.SimpleNamespace(user=tmp_path / "cache" / cache.FILE_NAME, shipped=shipped, props=props, tmp=tmp_path)
    _tuned.reload()


# ----------------------------------------------------------------------------- keys

def test_seqlen_bucket():
    assert [cache.seqlen_bucket(n, n) for n in (1, 2, 3, 1000, 1024, 1025, 8192)] == [1, 2, 4, 1024, 1024, 2048, 8192]
    assert cache.seqlen_bucket(1, 5000) == cache.seqlen_bucket(5000, 7) == 8192


def test_key_holds_everything_that_changes_the_answer():
    e = entry()
    k = cache.key_string(e)
    for f in ("NVIDIA H200", "9.0", "132", "13000", "13.0", "fwd", cache.kernel_fingerprint("fwd"), "bfloat16",
              "128", "False", "8192"):
        assert f in k.split("|"), f
    variants = [entry(A100), entry(causal=True), entry(bucket=4096), entry(dtype="float16"), entry(source="0" * 16),
                entry(DeviceProps.from_dict({**H200.to_dict(), "driver_version": 12080})),
                entry(DeviceProps.from_dict({**H200.to_dict(), "nvrtc_version": [12, 9]})),
                entry(DeviceProps.from_dict({**H200.to_dict(), "sm_count": 114})),
                entry(cfg=_configs.FwdConfig(64, 128, 64, 4, 2))]
    assert len({cache.key_string(v) for v in variants} | {k}) == len(variants) + 1


def test_kernel_fingerprint_follows_the_kernels_own_sources(tmp_path, monkeypatch):
    copy = tmp_path / "kernels_cu"
    shutil.copytree(_compile.kernel_dir(), copy)
    monkeypatch.setattr(_compile, "kernel_dir", lambda: copy)
    monkeypatch.setattr(cache, "_fingerprints", {})
    fp = cache.kernel_fingerprint("fwd")
    assert fp and len(fp) == 16
    (copy / "unrelated_kernel.cuh").write_text("// another kernel's header\n")
    cache._fingerprints.clear()
    assert cache.kernel_fingerprint("fwd") == fp  # editing another kernel does not invalidate fwd
    with open(copy / "common.cuh", "a") as f:  # an included header does
        f.write("\n// edited\n")
    cache._fingerprints.clear()
    assert cache.kernel_fingerprint("fwd") != fp
    (copy / "flash_bwd.cuh").unlink(missing_ok=True)
    cache._fingerprints.clear()
    assert cache.kernel_fingerprint("bwd") is None  # no sources: nothing can match


# ----------------------------------------------------------------------------- writing

def test_save_merges_by_key_and_round_trips(tmp_path):
    p = tmp_path / "t.json"
    assert cache.save_entries(p, [entry(), entry(causal=True)]) == 2
    assert cache.save_entries(p, [entry(cfg=_configs.FwdConfig(128, 64, 64, 4, 2))]) == 2  # same key: replaced
    entries, problem = cache.read_file(p)
    assert problem is None and len(entries) == 2
    assert {e["config"]["block_q"] for e in entries} == {64, 128}
    with pytest.raises(ValueError):
        cache.save_entries(p, [{"gpu": "x"}])


def test_failed_write_leaves_the_old_file_intact(tmp_path, monkeypatch):
    p = tmp_path / "t.json"
    cache.save_entries(p, [entry()])
    before = p.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(cache.os, "replace", boom)
    with pytest.raises(OSError):
        cache.save_entries(p, [entry(causal=True)])
    assert p.read_bytes() == before
    assert [x.name for x in tmp_path.iterdir() if x.name.endswith(".tmp")] == []


def _die_before_replace(path):
    cache.os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    cache.save_entries(path, [entry(causal=True)])


def test_killed_writer_leaves_old_content_and_no_stuck_lock(tmp_path):
    p = tmp_path / "t.json"
    cache.save_entries(p, [entry()])
    before = p.read_bytes()
    proc = multiprocessing.get_context("fork").Process(target=_die_before_replace, args=(p,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    assert p.read_bytes() == before
    t0 = time.monotonic()
    assert cache.save_entries(p, [entry(bucket=1024)]) == 2  # the lock died with the writer
    assert time.monotonic() - t0 < 10


def _writer(path, wid, rounds):
    for r in range(rounds):
        cache.save_entries(path, [entry(bucket=2 ** (wid + 1), dtype=f"w{r}"), entry(dtype="shared")])


def _reader(path, stop, bad):
    while not stop.is_set():
        entries, problem = cache.read_file(path)
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
    entries, problem = cache.read_file(p)
    assert problem is None and bad.value == 0
    assert len(entries) == 8 * 6 + 1  # every writer's every round, plus the key they all share


def test_clear(tmp_path):
    p = tmp_path / "t.json"
    cache.save_entries(p, [entry()])
    assert cache.clear(p) and not p.exists() and not cache.clear(p)


# ----------------------------------------------------------------------------- reading and lookup

def test_lookup_uses_the_user_cache(env):
    cache.save_entries(env.user, [entry()])
    assert _tuned.lookup("fwd", problem()) == TUNED
    assert _tuned.lookup("fwd", problem(causal=True)) is None
    assert _tuned.lookup("fwd", problem(dtype="float16")) is None
    assert _tuned.lookup("fwd", problem(d=64)) is None
    assert _tuned.lookup("bwd", problem()) is None
    assert _tuned.lookup("fwd", problem(seqlen=5000)) == TUNED  # same bucket
    assert _tuned.lookup("fwd", problem(seqlen=1, seqlen_k=8192)) == TUNED


def test_select_fwd_config_prefers_tuned_then_heuristic(env, monkeypatch):
    monkeypatch.setattr(_forward._device, "smem_optin", lambda device: H200.smem_optin)
    p = problem()
    assert _forward.select_fwd_config(p) == _configs.default_fwd_config(128)
    cache.save_entries(env.user, [entry()])
    _tuned.reload()
    assert _forward.select_fwd_config(p) == TUNED
    monkeypatch.setenv("CUFLASH_TUNED", "0")
    _tuned.reload()
    assert _forward.select_fwd_config(p) == _configs.default_fwd_config(128)


def test_lookup_is_a_dict_hit(env):
    cache.save_entries(env.user, [entry()])
    p = problem()
    _tuned.lookup("fwd", p)
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        _tuned.lookup("fwd", p)
    per_call = (time.perf_counter() - t0) / n
    assert per_call < 20e-6, f"{per_call * 1e6:.1f} us per lookup"


def test_nearest_bucket_within_two_octaves(env):
    cache.save_entries(env.user, [entry(bucket=4096)])
    assert _tuned.lookup("fwd", problem(seqlen=8192)) == TUNED
    assert _tuned.lookup("fwd", problem(seqlen=16384)) == TUNED
    assert _tuned.lookup("fwd", problem(seqlen=32768)) is None
    assert _tuned.lookup("fwd", problem(seqlen=1024)) == TUNED
    assert _tuned.lookup("fwd", problem(seqlen=512)) is None


def test_user_cache_beats_shipped_table_and_shipped_beats_heuristic(env):
    ship = env.tmp / "nvidia-h200.json"
    shipped_cfg = _configs.FwdConfig(128, 64, 64, 4, 2)
    # a shipped table made under another driver/NVRTC still applies (it cannot know the user's)
    other_tc = DeviceProps.from_dict({**H200.to_dict(), "driver_version": 12080, "nvrtc_version": [12, 8]})
    cache.save_entries(ship, [entry(other_tc, shipped_cfg, bucket=8192), entry(other_tc, shipped_cfg, bucket=1024)])
    env.shipped.append(ship)
    assert _tuned.lookup("fwd", problem()) == shipped_cfg
    cache.save_entries(env.user, [entry(bucket=8192)])
    _tuned.reload()
    assert _tuned.lookup("fwd", problem()) == TUNED
    assert _tuned.lookup("fwd", problem(seqlen=1024)) == shipped_cfg  # exact shipped beats nearest user (8192)
    assert _tuned.lookup("fwd", problem(seqlen=4096)) == TUNED  # nearest: user first


@pytest.mark.parametrize("content", [
    b"", b"{", b'{"format": "cuflash-tuning", "version": 1, "entries": [', b"\x00\xff\xfe garbage",
    b"\xc3\x28", b"[]", b'{"format": "something-else"}', b'{"format": "cuflash-tuning", "version": 99, "entries": []}',
    b'{"format": "cuflash-tuning", "version": 1, "entries": {}}',
], ids=["empty", "brace", "truncated", "binary", "bad-utf8", "list", "other-format", "future-version", "entries-dict"])
def test_corrupt_file_warns_and_is_ignored(env, content):
    env.user.parent.mkdir(parents=True)
    env.user.write_bytes(content)
    with pytest.warns(TuningCacheWarning, match="ignoring tuning cache"):
        assert _tuned.lookup("fwd", problem()) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _tuned.lookup("fwd", problem()) is None  # reported once, then memoised


def test_malformed_entries_are_skipped_and_good_ones_kept(env):
    good = entry()
    bad_cfg = entry(causal=True)
    bad_cfg["config"] = {"head_dim": 128, "block_q": "big"}
    wrong_type = dict(entry(bucket=1024), head_dim="128")
    not_pow2 = dict(entry(bucket=2048), seqlen_bucket=3000)
    unknown = dict(entry(bucket=4096), kernel="fwd_v9")
    doc = {"format": cache.FORMAT, "version": cache.VERSION, "entries": [good, bad_cfg, wrong_type, not_pow2, unknown, 7]}
    env.user.parent.mkdir(parents=True)
    env.user.write_text(json.dumps(doc))
    with pytest.warns(TuningCacheWarning, match="5 malformed entries"):
        assert _tuned.lookup("fwd", problem()) == TUNED
    assert _tuned.lookup("fwd", problem(causal=True)) is None


def test_stale_source_hash_warns_and_is_ignored(env):
    cache.save_entries(env.user, [entry(source="0123456789abcdef")])
    with pytest.warns(TuningCacheWarning, match="other kernel sources"):
        assert _tuned.lookup("fwd", problem()) is None


def test_stale_driver_or_nvrtc_warns_for_the_user_cache(env):
    old = DeviceProps.from_dict({**H200.to_dict(), "nvrtc_version": [12, 4]})
    cache.save_entries(env.user, [entry(old)])
    with pytest.warns(TuningCacheWarning, match="driver or NVRTC"):
        assert _tuned.lookup("fwd", problem()) is None


def test_other_gpus_entries_are_silently_skipped(env):
    cache.save_entries(env.user, [entry(A100), entry(DeviceProps.from_dict({**H200.to_dict(), "sm_count": 114}))])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _tuned.lookup("fwd", problem()) is None
    env.props["p"] = A100
    _tuned.reload()
    assert _tuned.lookup("fwd", problem()) == TUNED


def test_tuned_config_that_does_not_fit_the_device_is_ignored(env):
    big = _configs.FwdConfig(128, 128, 128, 8, 3)  # 224 KiB of shared memory
    cache.save_entries(env.user, [entry(cfg=big)])
    env.props["p"] = DeviceProps.from_dict({**H200.to_dict(), "smem_optin": 163 * 1024})  # same identity, less smem
    with pytest.warns(TuningCacheWarning, match="cannot run on this device"):
        assert _tuned.lookup("fwd", problem()) is None


def test_lookup_never_raises(env, monkeypatch):
    def broken(device):
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(_tuned, "_device_props", broken)
    with pytest.warns(RuntimeWarning, match="lookup failed"):
        assert _tuned.lookup("fwd", problem()) is None


def test_unreadable_cache_directory_is_not_fatal(env):
    env.user.mkdir(parents=True)  # a directory where the file should be
    with pytest.warns(TuningCacheWarning, match="cannot read"):
        assert _tuned.lookup("fwd", problem()) is None


def test_cache_dir_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv(cache.ENV_CACHE_DIR, raising=False)
    assert "cuflash" in str(cache.cache_dir())
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path))
    assert cache.cache_path() == tmp_path / cache.FILE_NAME


def test_importing_cuflash_does_not_import_optuna():
    import subprocess
    import sys

    code = ("import sys, cuflash, cuflash._forward, cuflash._tuned, cuflash.tune, cuflash.tune.cache;"
            "print(sorted(m for m in ('optuna', 'matplotlib', 'tqdm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=pathlib.Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
