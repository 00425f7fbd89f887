"""CPU tests of the benchmark's formulas, case list, table, JSON and CLI (no GPU needed)."""
import json
import sys
from datetime import datetime, timezone

import pytest

from cuflash import bench
from cuflash._timing import bytes_attention, flops_attention, time_cuda


# ----------------------------------------------------------------------------- formulas


def test_flops_fwd_causal_bwd():
    fwd = flops_attention(2, 16, 8192, 8192, 128, False)
    assert fwd == 4 * 2 * 16 * 8192 * 8192 * 128
    assert flops_attention(2, 16, 8192, 8192, 128, True) == fwd / 2
    assert flops_attention(2, 16, 8192, 8192, 128, False, "bwd") == 2.5 * fwd
    assert flops_attention(2, 16, 8192, 8192, 128, True, "bwd") == 2.5 * fwd / 2
    assert flops_attention(2, 16, 8192, 8192, 128, False, "fwd_bwd") == 3.5 * fwd
    # FA2 convention: causal halves even when Nq != Nk.
    assert flops_attention(1, 1, 100, 300, 64, True) == 4 * 100 * 300 * 64 / 2


def test_bytes():
    # q, k, v, o of 1*1*4*8 elements at 2 bytes each.
    assert bytes_attention(1, 1, 4, 4, 8) == 4 * 64
    assert bytes_attention(1, 1, 4, 4, 8, lse=True) == 4 * 64 + 4 * 4
    assert bytes_attention(2, 3, 10, 20, 8, itemsize=2) == 2 * 3 * 8 * 2 * (10 + 10 + 20 + 20)
    # bwd: read q, o, do, k, v, lse; write dq, dk, dv.
    assert bytes_attention(1, 1, 4, 4, 8, pass_="bwd") == 8 * 64 + 16


def test_time_cuda_rotates_and_reports():
    calls = []
    clock = iter(range(1000))

    class Ev:
        def record(self):
            self.t = next(clock)

        def synchronize(self):
            pass

    sets = [("a",), ("b",), ("c",)]
    r = time_cuda(calls.append, warmup=2, reps=7, rotate=sets, events=(Ev, lambda s, e: e.t - s.t))
    assert calls == list("ab") + list("cabcabc")  # cycles on across warm-up and timed runs
    assert r["n"] == 7 and r["median_ms"] == 1.0 and r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]

    r = time_cuda(lambda: None, warmup=0, reps=1, events=(Ev, lambda s, e: 2.0))
    assert r == {"median_ms": 2.0, "p20_ms": 2.0, "p80_ms": 2.0, "n": 1}


def test_time_cuda_warms_up_for_a_device_time():
    """warmup_ms: after the counted warm-up, doubling batches until the device was busy that long (each
    call 1 ms here: batches of 1, 2, 4 reach 7 >= 5 ms), then the timed runs; the rotation runs on."""
    calls = []

    class Ev:
        def record(self):
            self.n = len(calls)

        def synchronize(self):
            pass

    sets = [("a",), ("b",)]
    r = time_cuda(calls.append, warmup=1, reps=3, rotate=sets, events=(Ev, lambda s, e: float(e.n - s.n)),
                  warmup_ms=5)
    assert len(calls) == 1 + 7 + 3 and calls == list("ab" * 5) + ["a"]
    assert r["median_ms"] == 1.0 and r["n"] == 3
    assert time_cuda(lambda: None, warmup=0, reps=1, events=(Ev, lambda s, e: 2.0), warmup_ms=0)["n"] == 1


# ----------------------------------------------------------------------------- cases and CLI


def test_build_cases_derives_batch_and_heads():
    cases = bench.build_cases([64, 128], [512, 16384, 32768], tokens=16384, hidden=2048,
                              causal_modes=[False, True])
    assert len(cases) == 2 * 3 * 2
    by = {(c.head_dim, c.seqlen, c.causal): c for c in cases}
    assert (by[64, 512, False].batch, by[64, 512, False].heads) == (32, 32)
    assert (by[128, 16384, True].batch, by[128, 16384, True].heads) == (1, 16)
    assert by[128, 32768, False].batch == 1  # seqlen > tokens: still one sequence
    assert [c.causal for c in cases[:2]] == [False, True]


def test_parse_args_defaults_and_options():
    a = bench.parse_args([])
    assert a.head_dims == [64, 128] and a.seqlens == [512, 1024, 2048, 4096, 8192, 16384]
    assert (a.tokens, a.hidden, a.causal, a.dtype, a.json, a.no_sdpa) == (16384, 2048, "both", "bf16", None, False)
    assert bench.causal_modes(a.causal) == [False, True]

    a = bench.parse_args(["--head-dims", "128", "--causal", "1", "--dtype", "fp16", "--quick",
                          "--no-sdpa", "--reps", "5", "--json", "x.json"])
    assert a.head_dims == [128] and a.seqlens == [2048, 8192] and a.reps == 5
    assert (a.causal, a.dtype, a.no_sdpa, a.json) == ("1", "fp16", True, "x.json")
    assert [(c.seqlen, c.causal) for c in bench.cases_from_args(a)] == [(2048, True), (8192, True)]

    with pytest.raises(SystemExit):
        bench.parse_args(["--causal", "2"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--head-dims", "84"])  # multiples of 8 from 8 to 256


def test_default_json_path():
    when = datetime(2026, 3, 4, tzinfo=timezone.utc)
    assert bench.default_json_path("NVIDIA H200", when) == "bench-nvidia-h200-20260304.json"
    assert bench.gpu_slug("NVIDIA GeForce RTX 4090 (x)") == "nvidia-geforce-rtx-4090-x"


# ----------------------------------------------------------------------------- table and JSON


def _fake_records():
    c1 = bench.Case(head_dim=128, seqlen=8192, batch=2, heads=16, causal=True)
    r1 = bench.new_record(c1, "bf16")
    ms = r1["flops"]["fwd"] / 500e9  # 500 TFLOP/s
    bench.add_timing(r1, "fwd", "cuflash", {"median_ms": ms, "p20_ms": ms, "p80_ms": ms, "n": 5})
    bench.add_timing(r1, "fwd", "sdpa_flash", {"median_ms": 2 * ms, "p20_ms": 2 * ms, "p80_ms": 2 * ms, "n": 5})
    bench.add_timing(r1, "fwd", "sdpa_cudnn", None, "RuntimeError: no cuDNN")
    r1["max_abs_diff"], r1["checked_against"] = 0.0078125, "sdpa_flash"

    c2 = bench.Case(head_dim=64, seqlen=512, batch=32, heads=32, causal=False)
    r2 = bench.new_record(c2, "bf16")
    bench.add_timing(r2, "fwd", "cuflash", {"median_ms": 0.1, "p20_ms": 0.09, "p80_ms": 0.11, "n": 5})
    return [r1, r2]


def test_add_timing_rates():
    r1, _ = _fake_records()
    t = r1["timings"]["fwd"]
    assert t["cuflash"]["tflops"] == pytest.approx(500)
    assert t["sdpa_flash"]["tflops"] == pytest.approx(250)
    assert t["cuflash"]["gbps"] == pytest.approx(r1["bytes"]["fwd"] / t["cuflash"]["median_ms"] / 1e6)
    assert t["sdpa_cudnn"] is None and r1["errors"]["fwd"]["sdpa_cudnn"] == "RuntimeError: no cuDNN"


def test_format_table():
    lines = bench.format_table(_fake_records()).splitlines()
    assert "cuflash" in lines[1] and "cf/cudnn" in lines[1]
    row1, row2 = lines[3].split(), lines[4].split()
    assert row1 == ["128", "8192", "2", "16", "yes", "fwd", "500.0", "250.0", "-", "2.00", "-", "-", "-"]
    assert row2[:6] == ["64", "512", "32", "32", "no", "fwd"]
    assert row2[7:] == ["-", "-", "-", "-", "-", "-"]  # SDPA not run at all, no forced-sm80 timing
    widths = {len(l) for l in lines[1:]}
    assert len(widths) == 1  # fixed width: columns line up


def test_write_json(tmp_path):
    path = tmp_path / "out.json"
    env = {"gpu": "Fake GPU", "sm_count": 132, "driver_version": 13000, "runtime_version": 13000}
    bench.write_json(path, env, {"dtype": "bf16"}, _fake_records())
    data = json.loads(path.read_text())
    assert data["env"]["gpu"] == "Fake GPU" and data["settings"] == {"dtype": "bf16"}
    c = data["cases"][0]
    assert (c["head_dim"], c["seqlen"], c["batch"], c["heads"], c["causal"]) == (128, 8192, 2, 16, True)
    assert c["timings"]["fwd"]["cuflash"]["tflops"] == pytest.approx(500)
    assert c["timings"]["fwd"]["sdpa_cudnn"] is None
    assert c["flops"]["fwd"] == 4 * 2 * 16 * 8192 * 8192 * 128 / 2


# ----------------------------------------------------------------------------- main


@pytest.mark.parametrize("where", ["missing/x.json", "."])
def test_json_path_that_cannot_be_written_is_a_message(where, tmp_path, monkeypatch, capsys):
    """Checked before anything is measured (and before the GPU is looked for): no traceback."""
    monkeypatch.setattr(bench, "_cuda_device_count", lambda: (1, ""))
    assert bench.main(["--quick", "--json", str(tmp_path / where)]) == 2
    assert "--json:" in capsys.readouterr().err


def test_main_without_gpu_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(bench, "_cuda_device_count", lambda: (0, "no driver"))
    assert bench.main(["--quick"]) == 2
    assert "no CUDA GPU found" in capsys.readouterr().err


def test_main_with_fake_measurements(monkeypatch, tmp_path, capsys):
    # Everything but the measuring part runs for real.
    monkeypatch.setattr(bench, "_cuda_device_count", lambda: (1, ""))
    monkeypatch.setattr(bench, "env_info", lambda torch=None: {"gpu": "Fake GPU", "sm_count": 1})

    def fake_measure(case, *, dtype, torch=None, passes=("fwd",), reps=50, warmup=10, warmup_ms=0.0, rounds=1):
        assert warmup_ms == 300.0  # the default: every backend timed at the sustained clock
        assert rounds == 3  # the default: backends in alternating rounds
        rec = bench.new_record(case, dtype)
        bench.add_timing(rec, "fwd", "cuflash", {"median_ms": 1.0, "p20_ms": 1.0, "p80_ms": 1.0, "n": reps})
        rec["max_abs_diff"], rec["checked_against"] = 1.0, "sdpa_flash"  # a mismatch: warns
        return rec

    monkeypatch.setattr(bench, "measure_case", fake_measure)
    path = tmp_path / "b.json"
    assert bench.main(["--quick", "--head-dims", "128", "--no-sdpa", "--reps", "3", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("WARNING") == 4
    data = json.loads(path.read_text())
    assert [(c["seqlen"], c["causal"]) for c in data["cases"]] == [(2048, False), (2048, True), (8192, False), (8192, True)]
    assert data["cases"][0]["timings"]["fwd"]["cuflash"]["n"] == 3


def test_measure_case_alternates_backends_over_rounds(monkeypatch):
    """--rounds: an untimed warm-up round, then the backends take turns round after round (round r
    starting from backend r, the failed one skipped); each gets
    its rounds' medians' median, the rounds kept; a backend that raises is tried once (in the warm-up
    round) and recorded with its reason."""
    calls = []
    # the warm-up round (a, b), then three timed rounds, each starting one backend later: a b, b a, b a
    times = iter([99.0, 99.0, 3.0, 1.0, 2.0, 5.0, 9.0, 4.0])

    def fake_time_cuda(fn, *, warmup, reps, rotate, events, warmup_ms):
        calls.append((fn(), warmup))
        ms = next(times)
        return {"median_ms": ms, "p20_ms": ms, "p80_ms": ms, "n": reps}

    def boom():
        raise RuntimeError("no such backend here")

    class FakeBench:
        def __init__(self, fn):
            self.fn, self.rotate, self.events = fn, None, "cupy"

        def context(self):
            import contextlib
            return contextlib.nullcontext()

    benches = {"a": FakeBench(lambda: "a"), "bad": FakeBench(boom), "b": FakeBench(lambda: "b")}
    monkeypatch.setattr(bench, "time_cuda", lambda fn, **kw: fake_time_cuda(fn, **kw))
    monkeypatch.setattr(bench, "make_inputs", lambda case, dtype, torch=None: [])
    monkeypatch.setitem(bench.PASS_BENCHES, "fwd", lambda case, sets, torch: benches)

    class FakePool:
        def free_all_blocks(self):
            pass

    import types
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(get_default_memory_pool=FakePool))
    case = bench.Case(64, 512, 32, 32, True)
    rec = bench.measure_case(case, dtype="bf16", reps=7, warmup=10, rounds=3)
    # the failing backend raised inside fake_time_cuda's fn() call: tried once, in the warm-up round
    assert [c[0] for c in calls] == ["a", "b", "a", "b", "b", "a", "b", "a"]
    assert [c[1] for c in calls] == [10, 10] + [0] * 6  # the counted warm-up only in the untimed round
    a, b = rec["timings"]["fwd"]["a"], rec["timings"]["fwd"]["b"]
    assert (a["median_ms"], a["round_ms"], a["n"]) == (4.0, [3.0, 5.0, 4.0], 21)
    assert (b["median_ms"], b["round_ms"]) == (2.0, [1.0, 2.0, 9.0])
    assert rec["timings"]["fwd"]["bad"] is None and "no such backend here" in rec["errors"]["fwd"]["bad"]


def test_gqa_cases_and_their_row():
    cases = bench.build_cases([128], [8192], tokens=16384, hidden=4096, causal_modes=[False], gqa=4)
    (c,) = cases
    assert (c.heads, c.heads_kv, c.kv_heads, c.batch) == (32, 8, 8, 2)  # Llama-3-8B's attention
    assert bench.build_cases([128], [8192], 16384, 4096, [False])[0].kv_heads == 32  # MHA: heads_kv 0
    with pytest.raises(ValueError, match="--gqa 3 does not divide the 32 heads"):
        bench.build_cases([128], [8192], 16384, 4096, [False], gqa=3)
    rec = bench.new_record(c, "bf16", ("fwd",))
    bench.add_timing(rec, "fwd", "cuflash", {"median_ms": 1.0})
    assert " 32/8 " in bench.format_rows(rec)[0]
    assert bench.parse_args(["--gqa", "4"]).gqa == 4


def test_time_rounds_alternates_and_takes_each_medians_median(monkeypatch):
    """The variant benches' timing (cuflash._timing.time_rounds): callables in turn, round after
    round, each its median over the rounds; their shape rule (variant_bench_shape)."""
    from cuflash import _timing

    order = []
    clock = iter([5.0, 1.0, 7.0, 2.0, 6.0, 9.0])
    monkeypatch.setattr(_timing, "time_cuda", lambda fn, reps, warmup_ms: order.append(fn) or {"median_ms": next(clock)})
    assert _timing.time_rounds({"a": "fa", "b": "fb"}, 3, 20) == {"a": 6.0, "b": 2.0}
    assert order == ["fa", "fb"] * 3
    assert _timing.variant_bench_shape(128, 8192) == (2, 16) and _timing.variant_bench_shape(64, 32768) == (1, 32)
