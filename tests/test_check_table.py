"""scripts/check_table.py (a tuned table's entries against the untuned tile, before they ship), on
CPU: which entries its --write keeps, and that it loads without a GPU."""
import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "check_table.py"


def _mod():
    spec = importlib.util.spec_from_file_location("check_table", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_keep_drops_checked_entries_below_the_gain_and_failures_and_keeps_unchecked_ones():
    m = _mod()
    entries = [{"n": i} for i in range(6)]
    gains = {0: 1.05, 1: 1.0, 2: 0.97, 3: None, 5: 1.01}  # 4: another GPU's entry, not checked here
    assert [e["n"] for e in m.keep(entries, gains, 1.01)] == [0, 4, 5]
    assert [e["n"] for e in m.keep(entries, gains, 0.0)] == [0, 1, 2, 4, 5]


def test_help_needs_no_gpu(capsys):
    m = _mod()
    try:
        m.main(["--help"])
    except SystemExit as e:
        assert e.code == 0
    assert "--min-gain" in capsys.readouterr().out


def test_a_run_over_the_shipped_h100_table_with_a_fake_gpu(tmp_path, monkeypatch, capsys):
    """main() end to end with the H100's recorded properties, a fake Bench and fake timings: every
    current H100 entry is checked against its untuned tile, and --write keeps the faster ones."""
    import json

    from cuflash import _timing, device
    from cuflash.device import DeviceProps
    from cuflash.tune import runner, search

    root = pathlib.Path(__file__).resolve().parent.parent
    h100 = DeviceProps.from_json(root / "tests" / "fixtures" / "devices" / "h100-sxm.json")
    monkeypatch.setattr(device, "query", lambda i=0: h100)
    seen = []

    class FakeBench:
        def __init__(self, shape, device=0):
            self.shape, self.sets = shape, [{}]

        def trial(self, cfg, warmup=5, reps=20, verify=True, warmup_ms=0.0):
            return search.Outcome("ok", 1.0)

        def _run(self, cfg, d):
            seen.append((self.shape, cfg))

    def fake_rounds(fns, rounds, reps, warmup_ms=0.0):
        for fn in fns.values():
            fn()
        causal = seen[-1][0].causal
        return {"untuned": 1.10 if causal else 1.0, "tuned": 1.0}  # causal entries gain 10%, the rest nothing

    monkeypatch.setattr(runner, "Bench", FakeBench)
    monkeypatch.setattr(_timing, "time_rounds", fake_rounds)
    table = root / "tuning" / "nvidia-h100-80gb-hbm3.json"
    entries = json.loads(table.read_text())["entries"]
    out = tmp_path / "kept.json"
    assert _mod().main([str(table), "--write", str(out), "--rounds", "1"]) == 0
    kept = json.loads(out.read_text())["entries"]
    assert len(kept) == sum(e["causal"] for e in entries) > 0 and all(e["causal"] for e in kept)
    assert len(seen) == 2 * len(entries)  # the tuned and the untuned tile of each
    assert "kept" in capsys.readouterr().out
