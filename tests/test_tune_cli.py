"""`python -m cuflash.tune` and the tuning driver on CPU: a fake worker stands in for the GPU."""
from __future__ import annotations

import dataclasses

import json
import math
import pathlib
import sys
import types

import pytest

from cuflash import _compile, _tuned, families, tiles, tuning_store
from cuflash.tune import __main__ as cli
from cuflash.tune import report, runner, search, space, tuner
from cuflash.device import DeviceProps

FIX = pathlib.Path(__file__).parent / "fixtures" / "devices"
H200 = DeviceProps.from_json(FIX / "h200.json")


def cost(shape, c):
    """A landscape per shape: causal prefers 64-row K tiles, full attention 48-row ones."""
    bk = 64 if shape.causal else 48
    return shape.seqlen / 1e3 * (1 + 0.1 * abs(math.log2(c.block_q / 128)) + 0.05 * abs(math.log2(c.block_k / bk))
                                 + 0.08 * (c.warps != 4) + 0.03 * (c.stages != 2))


def _spills(c):
    return c.block_k == 96 and c.warps == 8


class FakeWorker:
    """The Worker protocol without a GPU; 8-warp configs with block_k 96 'spill', one config is 'wrong'."""

    restarts = 0

    def __init__(self, *a, **k):
        self.shape, self.checked, self.timed = None, [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def check(self, cfg, features, allow_local_bytes=0):
        self.checked.append(cfg)
        return "24 B of local memory per thread (register spills / stack frame)" if _spills(cfg) else None

    def setup(self, shape):
        self.shape = shape
        return "ok", {}

    def trial(self, cfg, warmup=5, reps=20, verify=True, warmup_ms=0.0):
        assert not _spills(cfg), "a pruned config was timed"
        self.timed.append((self.shape, cfg, verify))
        if verify and cfg == tiles.FwdConfig(cfg.head_dim, 64, 32, 4, 2):
            return search.Outcome("wrong", None, "planted")
        return search.Outcome("ok", cost(self.shape, cfg), "", {"p20_ms": 0, "p80_ms": 0})


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning_store.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setattr(tuning_store, "shipped_tables", lambda: [])
    _tuned.reload()
    yield tmp_path
    _tuned.reload()


def test_options_from_args():
    o = cli.options_from_args(cli.parse_args(["--kernels", "fwd", "--dtypes", "bf16", "--causal", "1",
                                              "--exhaustive-compare", "--trials", "7", "--allow-spills", "32"]))
    assert o.kernels == ("fwd",) and o.dtypes == ("bfloat16",) and o.causal == (True,)
    assert o.mode == "compare" and o.trials == 7 and o.allow_local_bytes == 32
    d = cli.options_from_args(cli.parse_args([]))
    assert d.mode == "search" and d.dtypes == ("bfloat16", "float16") and d.causal == (False, True)
    assert d.seqlens == cli.DEFAULT_SEQLENS and d.head_dims == (32, 64, 96, 128, 192, 256)
    assert "fwd" in d.kernels
    assert d.warmup_ms == 100.0  # trials ranked at the sustained clock (cuflash._timing.time_cuda)
    assert cli.options_from_args(cli.parse_args(["--warmup-ms", "0"])).warmup_ms == 0.0
    with pytest.raises(SystemExit):
        cli.parse_args(["--exhaustive", "--exhaustive-compare"])


def test_plan_groups_shapes_by_compile_keys():
    o = tuner.Options(kernels=("fwd",), head_dims=(64, 128), dtypes=("bfloat16",), seqlens=(1024, 16384))
    shapes = tuner.plan_shapes(o)
    assert len(shapes) == 8
    assert shapes[0] == runner.Shape("fwd", "bfloat16", 64, False, 1024, 16, 32)
    assert shapes[1].batch == 1 and shapes[1].bucket == 16384


def test_tune_search_and_compare_end_to_end(env):
    o = tuner.Options(kernels=("fwd",), head_dims=(128,), dtypes=("bfloat16",), seqlens=(2048, 8192), mode="compare")
    w = FakeWorker()
    reports = tuner.tune(o, w, H200)
    assert len(reports) == 4
    sp = space.build_space(families.get("fwd"), 128, H200)
    assert sorted(w.checked) == sorted(sp.candidates)  # each candidate compiled once per group
    for r in reports:
        assert r.error is None and r.winner is not None
        assert not _spills(r.winner) and r.winner != tiles.FwdConfig(128, 64, 32, 4, 2)
        best = min((c for c in sp.candidates if not _spills(c) and c != tiles.FwdConfig(128, 64, 32, 4, 2)),
                   key=lambda c: cost(r.shape, c))
        assert r.winner == best == r.exhaustive_best  # compare mode caches the true best
        assert r.quality is not None and 0.9 < r.quality <= 1.0
        assert r.search.trials[0].config == sp.default
        assert r.winner_ms <= r.default_ms and r.speedup >= 1
        assert r.trials_used <= search.default_budget(r.n_valid)
        json.dumps(r.to_dict())
    # the confirmation re-timing does not re-verify
    assert any(not v for _, _, v in w.timed)
    # later shapes are warm-started with earlier winners of the same group
    assert reports[1].search.trials[1].config == reports[0].winner or reports[0].winner == sp.default
    # every winner is in the user cache and is what lookup returns
    for r in reports:
        p = types.SimpleNamespace(seqlen_q=r.shape.seqlen, seqlen_k=r.shape.seqlen, head_dim=128, dtype="bfloat16",
                                  device=0, causal=r.shape.causal, features=r.shape.features)
        assert _tuned.lookup(families.FWD, p, H200) == r.winner
    text = report.format_summary(reports)
    assert "fwd bf16 d128 causal n8192" in text and "1 wrong" not in text.splitlines()[0]


class Sm90Worker(FakeWorker):
    """fwd_sm90 tiles: nothing spills; a landscape over the Hopper forward's own fields."""

    def check(self, cfg, features, allow_local_bytes=0):
        self.checked.append(cfg)
        return None

    def trial(self, cfg, warmup=5, reps=20, verify=True, warmup_ms=0.0):
        self.timed.append((self.shape, cfg, verify))
        ms = 1 + 0.01 * abs(cfg.block_k - 128) + 0.1 * cfg.pingpong + 0.05 * (cfg.persistent != 2)
        return search.Outcome("ok", ms, "", {"p20_ms": 0, "p80_ms": 0})


def test_a_causal_shape_is_measured_against_the_tile_it_runs_untuned(env):
    """The sm90 forward runs causal calls on its default tile's drawn variant (causal_tile): that,
    not the static default, is the causal studies' baseline, their first trial and a finalist, so a
    tuned causal entry is never slower than the untuned call and its speedup is over that call."""
    fam = families.FWD_SM90
    o = tuner.Options(kernels=("fwd_sm90",), head_dims=(128,), dtypes=("bfloat16",), seqlens=(2048,))
    reports = tuner.tune(o, Sm90Worker(), H200)
    by_causal = {r.shape.causal: r for r in reports}
    static = fam.default(128, H200.smem_optin, by_causal[False].shape.features)
    assert fam.causal_tile is not None and fam.causal_tile(static) != static
    for causal, r in by_causal.items():
        untuned = fam.untuned(128, H200.smem_optin, r.shape.features, causal)
        assert untuned == (fam.causal_tile(static) if causal else static)
        assert r.error is None and r.default == untuned
        assert r.search.trials[0].config == untuned and untuned in r.confirm
        assert r.winner_ms <= r.default_ms


def test_tune_reports_missing_kernels_and_empty_spaces(env, monkeypatch):
    monkeypatch.setattr(_compile, "kernel_fingerprint", lambda f: None if f.name == "bwd" else "f" * 16)
    # a GPU of 64 KB per block: no d256 backward tile fits (the smallest, the ~99 KB last resort, needs 99 KB)
    small = dataclasses.replace(DeviceProps.from_json(FIX / "l4.json"), smem_optin=64 * 1024)
    o = tuner.Options(kernels=("bwd",), head_dims=(256,), seqlens=(1024,), causal=(False,))
    (r,) = tuner.tune(o, FakeWorker(), small)
    assert "no sources" in r.error and r.winner is None
    monkeypatch.setattr(_compile, "kernel_fingerprint", lambda f: "f" * 16)
    (r,) = tuner.tune(o, FakeWorker(), small)
    assert "fits this device" in r.error
    assert "fits this device" in report.format_summary([r])


def test_crashed_setup_is_reported_not_raised(env):
    class Crashy(FakeWorker):
        def setup(self, shape):
            return "crashed", "worker process died (exit code -11)"

    o = tuner.Options(kernels=("fwd",), head_dims=(64,), seqlens=(1024,), causal=(False,))
    (r,) = tuner.tune(o, Crashy(), H200)
    assert "setup failed" in r.error and r.winner is None


def test_main_refuses_kernels_it_cannot_time(env, monkeypatch, capsys):
    """A family without a tuner run (KernelFamily.run None): a clear refusal, not a traceback."""
    monkeypatch.setattr(cli, "_gpu_props", lambda device: (H200, ""))
    monkeypatch.setattr(runner, "Worker", FakeWorker)
    monkeypatch.setitem(families.REGISTRY, "decode", dataclasses.replace(families.DECODE, run=None))
    assert cli.main(["--kernels", "fwd", "decode", "--head-dims", "128", "--seqlens", "8192"]) == 2
    assert "decode cannot be tuned yet" in capsys.readouterr().err


def _decode_cost(shape, c):
    """A decode landscape: 4 warps, 3 stages and 8 key blocks per split at least are best."""
    return shape.seqlen / 1e4 * (1 + 0.1 * (c.warps != 4) + 0.05 * (c.stages != 3)
                                 + 0.02 * abs(math.log2(c.min_split_blocks / 8)))


class DecodeWorker(FakeWorker):
    def check(self, cfg, features, allow_local_bytes=0):
        assert features.seqused_k, "the decode kernel has per-batch length instances only"
        self.checked.append(cfg)

    def trial(self, cfg, warmup=5, reps=20, verify=True, warmup_ms=0.0):
        self.timed.append((self.shape, cfg, verify))
        return search.Outcome("ok", _decode_cost(self.shape, cfg), "", {"p20_ms": 0, "p80_ms": 0})


def test_the_decode_kernel_is_tuned_over_its_tiles_and_split_depth(env, monkeypatch):
    """`--kernels decode` searches the decode tiles with their host-only min_split_blocks (how far
    num_splits=0 splits the keys); once per cache length (a causal mask does not change a decoding
    step's cost, KernelFamily.causal_matters), and causal calls take the entry too. The split depth
    reaches the split count a call gets (kvcache._build_decode)."""
    from cuflash import kvcache
    from tests.test_kvcache import _dense

    o = tuner.Options(kernels=("decode",), head_dims=(128,), dtypes=("bfloat16",), seqlens=(8192,), causal=(False, True),
                      mode="exhaustive")
    w = DecodeWorker()
    (r,) = tuner.tune(o, w, H200)
    assert r.error is None and r.shape.causal is False and r.shape.features.seqused_k
    assert r.shape.heads_kv == r.shape.heads // runner.DECODE_TUNE_GROUP
    assert r.winner == tiles.DecodeConfig(128, 4, 3, 8)
    assert {c.min_split_blocks for c in w.checked} == {1, 2, 4, 8, 16}
    # one compiled instance per (warps, stages): the split depth is not in the kernel's name
    names = {_compile.kernel_name(c, r.shape.features) for c in w.checked}
    assert len(names) == len({(c.warps, c.stages) for c in w.checked})

    for causal in (False, True):  # one token of 32 query heads, 8 K/V heads, 8k cache rows
        p = dataclasses.replace(_dense(1, 8192, 32, 8, 128, causal=causal), seqused_k=True)
        assert _tuned.lookup(families.DECODE, p, H200) == r.winner
    # the tile's split depth is the heuristic's: 16 (K/V head, batch) tiles of 8192 / 64 key blocks
    planned = []
    monkeypatch.setattr(kvcache, "plan_decode", lambda ps, cfg, dtype, dense, seqused_add=0: planned.append(
        (ps.n_splits, cfg)) or "plan")
    monkeypatch.setattr(families, "select", lambda fam, p: r.winner)
    import cuflash.device

    monkeypatch.setattr(cuflash.device, "query", lambda device_id=0: H200)
    kvcache._build_decode(p, 0, "bfloat16")
    resident = kvcache.decode_resident(r.winner, H200)
    per_sm = kvcache.decode_blocks_per_sm(r.winner, resident)
    assert planned[-1] == (kvcache.decode_splits(16, resident, H200.sm_count, 8192 // 64, min_split_blocks=8,
                                                 per_sm=per_sm), r.winner) == (8, r.winner)  # 128 blocks
    deep = dataclasses.replace(r.winner, min_split_blocks=32)  # at most 4 splits of the 128 key blocks
    monkeypatch.setattr(families, "select", lambda fam, p: deep)
    kvcache._build_decode(p, 0, "bfloat16")
    assert planned[-1] == (4, deep)


def test_main_tunes_exports_and_writes_json(env, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_gpu_props", lambda device: (H200, ""))
    monkeypatch.setattr(runner, "Worker", FakeWorker)
    out_json, export = env / "run.json", env / "tuning" / "nvidia-h200.json"
    rc = cli.main(["--kernels", "fwd", "--head-dims", "64", "128", "--seqlens", "8192", "--dtypes", "bf16",
                   "--exhaustive-compare", "--json", str(out_json), "--export", str(export)])
    assert rc == 0
    out = capsys.readouterr()
    assert "default ms" in out.out and "exported 4 entries" in out.out
    doc = json.loads(out_json.read_text())
    assert len(doc["studies"]) == 4 and doc["env"]["name"] == "NVIDIA H200"
    for s in doc["studies"]:
        assert s["quality"] is not None and s["trials_used"] <= s["n_valid"]
        assert s["compile_pruned"] and all("local memory" in v for v in s["compile_pruned"].values())
    # the exported table is exactly what lookup reads as a shipped table (even on another driver)
    other = DeviceProps.from_dict({**H200.to_dict(), "driver_version": 12000})
    tables = tuning_store.load_tables(other, user_path=env / "none.json", shipped_paths=[export])
    for s in doc["studies"]:
        cfg, where = tables.find(tuning_store.shape_key("fwd", "bfloat16", s["head_dim"], "dense", s["causal"]), 8192)
        assert where == "shipped" and space.config_to_dict(cfg) == s["winner"]


def test_show_and_clear_without_gpu(env, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_gpu_props", lambda device: (None, "no GPU"))
    tuning_store.save_entries(tuning_store.cache_path(), [tuning_store.make_entry(
        tuning_store.DeviceKey.of(H200), "fwd", _compile.kernel_fingerprint(families.FWD), "bfloat16", 128, "dense", True, 8192,
        space.config_to_dict(tiles.FwdConfig(128, 128, 64, 8, 2)), time_ms=1.0, default_ms=1.25,
        method="optuna-tpe", trials=10, valid=30)])
    assert cli.main(["--show"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200" in out and "128x64 w8 s2" in out and "+25.0%" in out and "10/30" in out
    assert cli.main(["--clear"]) == 0
    assert not tuning_store.cache_path().exists()
    assert cli.main(["--show"]) == 0 and "nothing cached" in capsys.readouterr().out
    assert cli.main([]) == 2 and "no CUDA GPU" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_get_it(env, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli.main(["--plot", str(env / "plots")]) == 2
    assert "pip install 'cuflash[plot]'" in capsys.readouterr().err


def test_dry_run_from_recorded_properties(capsys):
    assert cli.main(["--dry-run", "--props", str(FIX / "l4.json"), "--kernels", "fwd", "bwd",
                     "--head-dims", "128", "256"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA L4" in out and "shared memory" in out and "fwd d128" in out
    assert "bwd d128: 12 configs, 2 pass the static checks, default 32x64 w4 s2" in out
    # d256: no searched tile fits; the 2-warp last resort is the space
    assert "bwd d256: 13 configs, 1 pass the static checks, default 32x32 w2 s2" in out


def test_compile_check_compiles_for_the_recorded_gpu(capsys):
    """--dry-run --compile-check builds each candidate for the recorded GPU's target (here sm_100,
    a B200; the decode kernel with its per-batch lengths), and lists the valid ones. (It once failed
    on every CuPy 14: its NVRTC probe imported cupy.cuda.nvrtc, which is no module there.)"""
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception:  # noqa: BLE001
        pytest.skip("NVRTC not loadable")
    assert cli.main(["--dry-run", "--props", "b200", "--kernels", "decode", "--head-dims", "64", "--dtypes", "bf16",
                     "--compile-check"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA B200: cc 10.0 (sm_100)" in out
    # (the decode space: its tiles x min_split_blocks, which is not compiled: 45 configs, 9 instances)
    assert "decode d64: 45 configs, 45 pass the static checks" in out
    assert "bfloat16: 45 valid after an offline sm_100 compile" in out and "compile-pruned" not in out


def test_compile_check_without_nvrtc_is_a_message(monkeypatch, capsys):
    """--compile-check where CuPy's NVRTC cannot load says so (exit 2), instead of listing every
    config as compile-pruned and exiting 0."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

    def missing():
        raise RuntimeError("libnvrtc.so.13: cannot open shared object file")

    monkeypatch.setattr(nvrtc, "getVersion", missing)  # as where the library cannot load
    assert cli.main(["--dry-run", "--props", str(FIX / "l4.json"), "--kernels", "fwd", "--head-dims", "64",
                     "--compile-check"]) == 2
    assert "--compile-check needs CuPy with NVRTC" in capsys.readouterr().err


def test_worker_process_survives_a_dying_and_a_hanging_child():
    """The isolation itself (no GPU needed): a child that exits or hangs is replaced."""
    with runner.Worker(0, isolated=True, timeout_s=60) as w:
        assert w.call("ping") == ("ok", "pong")
        status, why = w.call("inject", "exit")
        assert status == "crashed" and "exit code 9" in why
        assert w.call("ping") == ("ok", "pong") and w.restarts == 1
        status, why = w.call("inject", "hang", timeout_s=2)
        assert status == "crashed" and "hung" in why
        assert w.call("ping") == ("ok", "pong") and w.restarts == 2


def test_compare_outputs():
    import numpy as np
    import ml_dtypes

    bf = ml_dtypes.bfloat16
    ref = np.linspace(-4, 4, 64, dtype=np.float32).astype(bf).reshape(8, 8)
    lse = np.array([1.0, -np.inf, 3.0], np.float32)
    assert runner.compare((ref, lse), (ref.copy(), lse.copy()))[0]
    near = (ref.astype(np.float32) + 0.03).astype(bf)  # ~1 ulp at 4
    assert runner.compare((ref,), (near,))[0]
    far = ref.copy()
    far[3, 3] = bf(2.0)
    ok, diff, why = runner.compare((ref,), (far,))
    assert not ok and "max |diff|" in why
    nan = ref.copy()
    nan[0, 0] = np.nan
    assert "NaN" in runner.compare((ref,), (nan,))[2]
    assert not runner.compare((lse,), (np.array([1.0, 0.0, 3.0], np.float32),))[0]  # -inf row must stay -inf
    ok, _, why = runner.compare((ref,), (ref,), [(0, (ref, near))])
    assert not ok and "bitwise" in why


def test_plot_studies_if_matplotlib_is_installed(env):
    pytest.importorskip("matplotlib")
    o = tuner.Options(kernels=("fwd",), head_dims=(64,), seqlens=(1024,), causal=(False,), mode="compare")
    reports = tuner.tune(o, FakeWorker(), H200)
    paths = report.plot_studies(reports, env / "plots")
    assert len(paths) == 1 and paths[0].stat().st_size > 1000


# ----------------------------------------------------------------------------- user mistakes: no tracebacks


def test_unsupported_head_dim_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--dry-run", "--props", str(FIX / "l4.json"), "--head-dims", "80"])
    assert e.value.code == 2
    assert "--head-dims: invalid choice: 80 (choose from 32, 64, 96, 128, 192, 256)" in capsys.readouterr().err


@pytest.mark.parametrize("arg", [["--seqlens", "0"], ["--tokens", "-1"], ["--hidden", "x"]])
def test_non_positive_sizes_are_errors(arg, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--dry-run", "--props", str(FIX / "l4.json"), *arg])
    assert e.value.code == 2 and arg[0] in capsys.readouterr().err


@pytest.mark.parametrize("content,words", [
    (None, "no such file"),
    ("{\"name\": ", "is not JSON"),
    ("[1, 2]", "is not a device-properties file"),
    ("{\"name\": \"x\"}", "is not a device-properties file (missing field 'cc')"),
    ("{\"name\": \"x\", \"cc\": [8, 0]}", "is not a device-properties file"),
    ("\xff\xfe", "is not JSON"),
])
def test_bad_props_file_is_a_message(tmp_path, capsys, content, words):
    path = tmp_path / "props.json"
    if content is not None:
        path.write_bytes(content.encode("latin-1"))
    assert cli.main(["--dry-run", "--props", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cuflash.tune: --props: ") and words in err and "Traceback" not in err
    bad = {**H200.to_dict(), "smem_optin": "lots"}
    path.write_text(json.dumps(bad))
    assert cli.main(["--dry-run", "--props", str(path)]) == 2


def test_props_directory_is_a_message(tmp_path, capsys):
    assert cli.main(["--dry-run", "--props", str(tmp_path)]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_clear_creates_nothing_and_leaves_no_lock(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "not" / "there"
    monkeypatch.setenv(tuning_store.ENV_CACHE_DIR, str(cache))
    assert cli.main(["--clear"]) == 0
    assert "no cache at" in capsys.readouterr().out
    assert not (tmp_path / "not").exists()
    # a real cache: removed, with its lock file, the directory kept
    monkeypatch.setenv(tuning_store.ENV_CACHE_DIR, str(tmp_path / "c"))
    tuning_store.save_entries(tuning_store.cache_path(), [tuning_store.make_entry(
        tuning_store.DeviceKey.of(H200), "fwd", "f" * 16, "bfloat16", 128, "dense", True, 8192,
        space.config_to_dict(tiles.FwdConfig(128, 128, 64, 8, 2)), time_ms=1.0, default_ms=1.25,
        method="optuna-tpe", trials=10, valid=30)])
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [tuning_store.FILE_NAME,
                                                                  tuning_store.FILE_NAME + ".lock"]
    assert cli.main(["--clear"]) == 0
    assert "removed" in capsys.readouterr().out
    assert list((tmp_path / "c").iterdir()) == []
    assert cli.main(["--clear"]) == 0 and list((tmp_path / "c").iterdir()) == []


@pytest.mark.parametrize("odd", ["file_as_dir", "dir_as_file"])
def test_clear_on_an_odd_cache_path_is_a_message(tmp_path, monkeypatch, capsys, odd):
    if odd == "file_as_dir":  # CUFLASH_CACHE_DIR names a file
        (tmp_path / "f").write_text("x")
        monkeypatch.setenv(tuning_store.ENV_CACHE_DIR, str(tmp_path / "f"))
    else:  # the cache file's name is a directory
        monkeypatch.setenv(tuning_store.ENV_CACHE_DIR, str(tmp_path))
        (tmp_path / tuning_store.FILE_NAME).mkdir()
    assert cli.main(["--clear"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cuflash.tune: cannot clear the cache") and "Traceback" not in err
    assert not list(tmp_path.glob("**/*.lock"))


def test_export_to_an_odd_path_is_a_message(env, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_gpu_props", lambda device: (H200, ""))
    tuning_store.save_entries(tuning_store.cache_path(), [tuning_store.make_entry(
        tuning_store.DeviceKey.of(H200), "fwd", _compile.kernel_fingerprint(families.FWD), "bfloat16", 128, "dense",
        True, 8192, space.config_to_dict(tiles.FwdConfig(128, 128, 64, 8, 2)), time_ms=1.0, default_ms=1.25,
        method="optuna-tpe", trials=10, valid=30)])
    (env / "f").write_text("x")
    assert cli.main(["--no-tune", "--export", str(env / "f" / "table.json")]) == 1
    assert "cannot export to" in capsys.readouterr().err
