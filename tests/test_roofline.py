"""CPU tests of the roofline arithmetic (cuflash/roofline.py): ceilings, traffic models, CLI.

The design notes' A100 example (312 TFLOP/s over 1.5-2 TB/s, ridge 156-208 FLOP/byte, "about 200")
goes through the same functions the CLI uses on measured ceilings. The traffic models are checked
byte for byte against emulations of the kernels' own loop schedules; the v1 emulation also computes
attention, checked against the float64 oracle, so the schedule it counts is a correct one.
"""
from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest

from cuflash import roofline as rl
from cuflash import reference
from cuflash._timing import flops_attention

BRIEF = rl.Shape(batch=2, heads=16, seqlen_q=8192, seqlen_k=8192, head_dim=128, causal=False)
TILES = {"v1": (128, 128), "v2": (128, 128), "sdpa_flash": (128, 64)}


# ----------------------------------------------------------------------------- ceilings


def test_design_notes_a100_ridge():
    lo_bw, hi_bw = rl.DESIGN_NOTES_A100  # 1.5 and 2 TB/s
    assert lo_bw.peak_tflops == hi_bw.peak_tflops == 312
    assert lo_bw.ridge == pytest.approx(208.0)
    assert hi_bw.ridge == pytest.approx(156.0)
    # "about 200": A100 40 GB's 1555 GB/s (the notes write 155*10^9 and get 201)
    assert rl.ridge_point(312e12, 1555e9) == pytest.approx(200.6, abs=0.1)
    assert rl.ridge_point(312e12, 1.55e12) == pytest.approx(201.3, abs=0.1)


def test_roof_and_sides():
    peak, bw = 312e12, 1.5e12
    assert rl.attainable_flops(100, peak, bw) == 150e12  # memory roof: 100 FLOP/B x 1.5 TB/s
    assert rl.attainable_flops(1000, peak, bw) == peak
    assert rl.attainable_flops(208, peak, bw) == pytest.approx(peak)
    assert rl.bound_side(207.9, peak, bw) == "memory"
    assert rl.bound_side(208.0, peak, bw) == "compute"
    with pytest.raises(ValueError):
        rl.ridge_point(0, 1)


def test_which_side_each_kernel_falls_on_a100():
    """Brief's shape (bf16, d=128, N=8192, B=2, H=16) with the notes' A100 figures, both ends of 1.5-2 TB/s."""
    for ceil in rl.DESIGN_NOTES_A100:
        c = rl.analyse_case(BRIEF, ceil, TILES, {"v1": None, "v2": None, "sdpa_cudnn": None})
        k = c["kernels"]
        # intensities: floor ~ N/2, v2 ~ block_q (K, V re-read per Q tile), v1 ~ 0.4 block_k
        assert k["floor"]["intensity"] == pytest.approx(4080.1, abs=0.1)
        assert k["v2"]["intensity"] == pytest.approx(126.0, abs=0.1)
        assert k["v1"]["intensity"] == pytest.approx(50.7, abs=0.1)
        assert k["floor"]["bound"] == "compute"
        assert k["sdpa_cudnn"]["bound"] == "compute"  # placed at the floor
        assert k["v1"]["bound"] == "memory"
        # v2 with every K/V re-read counted as memory traffic sits left of the ridge; with L2
        # serving the re-reads (the floor's intensity) it is compute-bound
        assert k["v2"]["bound"] == "memory"
        assert k["v2"]["intensity_floor"] > ceil.ridge
        assert k["v1"]["intensity"] < k["v2"]["intensity"] < ceil.ridge < k["floor"]["intensity"]
    # The notes' "v2 reaches 50-73% of peak": 73% of 312 is above v2's roof at 1.5 TB/s if every
    # K/V re-read came from HBM, so those re-reads must be L2 hits; 50% is below it.
    lo = rl.analyse_case(BRIEF, rl.DESIGN_NOTES_A100[0], TILES, {})["kernels"]["v2"]["roof_tflops"]
    assert 0.50 * 312 < lo < 0.73 * 312


def test_place_with_a_timing():
    ceil = rl.Ceilings(800, 4000)
    flops = BRIEF.flops
    assert flops == flops_attention(2, 16, 8192, 8192, 128, False) == 4 * 2 * 16 * 8192**2 * 128
    nbytes = rl.traffic_v2(BRIEF, 128, 128)["total"]
    ms = flops / 400e12 * 1e3  # 400 TFLOP/s
    p = rl.place(flops, nbytes, ms, ceil)
    assert p["tflops"] == pytest.approx(400)
    assert p["roof_tflops"] == pytest.approx(min(800, flops / nbytes * 4))
    assert p["of_roof"] == pytest.approx(400 / p["roof_tflops"])
    assert p["of_peak"] == pytest.approx(0.5)
    assert p["floor_ms"] == pytest.approx(max(flops / 800e12, nbytes / 4000e9) * 1e3)
    assert rl.place(flops, nbytes, None, ceil)["tflops"] is None


def test_analyse_case_speedup_and_causal_flops():
    c = rl.analyse_case(BRIEF, rl.Ceilings(800, 4000), TILES, {"v1": 10.0, "v2": 2.5})
    assert c["v2_over_v1"] == pytest.approx(4.0)
    assert c["kernels"]["v1"]["tflops"] == pytest.approx(BRIEF.flops / 10e-3 / 1e12)
    causal = rl.Shape(2, 16, 8192, 8192, 128, True)
    assert causal.flops == BRIEF.flops / 2
    assert "sdpa_flash" in c["kernels"] and c["kernels"]["sdpa_flash"]["tiles"] == (128, 64)


def test_the_forced_mma_sync_call_is_placed_beside_the_automatic_one():
    """On Hopper, v2 is the sm90 kernel with its own tile and v2_sm80 the same call forced to the
    mma.sync family (measure_case adds it): both placed with the v2 traffic model, both listed."""
    tiles = {"v1": (128, 64), "v2": (192, 128), rl.V2_SM80: (128, 64)}
    c = rl.analyse_case(BRIEF, rl.Ceilings(800, 4000), tiles, {"v1": 10.0, "v2": 2.0, rl.V2_SM80: 4.0})
    for name in ("v2", rl.V2_SM80):
        assert c["kernels"][name]["model"] == "v2" and c["kernels"][name]["tiles"] == tiles[name]
    # taller Q tiles re-read K and V less: the Hopper tile sits at a higher intensity
    assert c["kernels"]["v2"]["intensity"] > c["kernels"][rl.V2_SM80]["intensity"]
    line = rl.format_case(c)
    assert line.index("v2 ") < line.index("v2_sm80")


def test_nominal_lookup():
    assert rl.nominal_ceilings("NVIDIA H200").peak_tflops == 989
    assert rl.nominal_ceilings("NVIDIA A100-SXM4-40GB").bandwidth_gbps == 1555
    assert rl.nominal_ceilings("Some GPU") is None


# ----------------------------------------------------------------------------- traffic vs schedules


def _emulate_v1(q, k, v, causal, scale, br, bc):
    """kernels_cu/flash_fwd_v1.cuh's schedule for one (batch, head), float64, counting the bytes it moves.

    Same loop bounds, predicates and workspace protocol as the kernel: the workspace starts as NaN,
    so a read of anything not written before shows up in the result.
    """
    nq, d = q.shape
    nk = k.shape[0]
    off, n_kv, m_blocks = nk - nq, -(-nk // bc), -(-nq // br)

    def first(j):
        x = j * bc - off - br + 1
        return 0 if (not causal or x <= 0) else (x + br - 1) // br

    out = np.full((nq, d), np.nan)
    lse = np.full(nq, np.nan)
    ws_o = np.full((nq, d), np.nan)
    ws_ml = np.full((nq, 2), np.nan)
    nbytes = {"q": 0, "kv": 0, "o_lse": 0, "workspace": 0}
    dead = min(nq, first(0) * br)
    out[:dead], lse[:dead] = 0.0, -np.inf
    nbytes["o_lse"] += dead * (2 * d + 4)
    qp = np.zeros((m_blocks * br, d))
    qp[:nq] = q
    kp, vp = np.zeros((n_kv * bc, d)), np.zeros((n_kv * bc, d))
    kp[:nk], vp[:nk] = k, v
    for j in range(n_kv):
        i0 = first(j)
        assert m_blocks - i0 >= 1
        nbytes["kv"] += 2 * min(bc, nk - j * bc) * d * 2
        kj, vj = kp[j * bc:(j + 1) * bc], vp[j * bc:(j + 1) * bc]
        for i in range(i0, m_blocks):
            r0 = i * br
            rows = np.arange(r0, r0 + br)
            ok = rows < nq
            nbytes["q"] += int(ok.sum()) * d * 2
            assert not causal or r0 + br - 1 + off >= j * bc
            j_last = min(n_kv - 1, (r0 + br - 1 + off) // bc) if causal else n_kv - 1
            last = j == j_last
            full = (j + 1) * bc <= nk and (not causal or (j + 1) * bc - 1 <= r0 + off)
            o = np.zeros((br, d))
            m = np.full(br, -np.inf)
            l = np.zeros(br)
            if j > 0:
                o[ok], m[ok], l[ok] = ws_o[rows[ok]], ws_ml[rows[ok], 0], ws_ml[rows[ok], 1]
                nbytes["workspace"] += int(ok.sum()) * (d + 2) * 4
            s = qp[r0:r0 + br] @ kj.T
            keys = j * bc + np.arange(bc)
            limit = np.minimum(nk, rows + off + 1) if causal else np.full(br, nk)
            visible = keys[None, :] < limit[:, None]
            assert not full or visible.all(), "a tile the kernel does not mask needs a mask"
            if not full:
                s = np.where(visible, s, -np.inf)
            mx = np.maximum(m, s.max(axis=1))
            ms = np.where(np.isneginf(mx), 0.0, mx * scale)
            alpha = np.exp(m * scale - ms)
            p = np.exp(s * scale - ms[:, None])
            l_new = alpha * l + p.sum(axis=1)
            o = o * (alpha * l)[:, None] + p @ vj
            inv = np.where(l_new > 0, 1 / np.where(l_new > 0, l_new, 1), 0.0)
            if not last:
                ws_o[rows[ok]] = (o * inv[:, None])[ok]
                ws_ml[rows[ok], 0], ws_ml[rows[ok], 1] = mx[ok], l_new[ok]
                nbytes["workspace"] += int(ok.sum()) * (d + 2) * 4
            else:
                assert np.isnan(out[rows[ok]]).all(), "output row written twice"
                out[rows[ok]] = (o * inv[:, None])[ok]
                lse[rows[ok]] = np.where(l_new > 0, mx * scale + np.log(np.where(l_new > 0, l_new, 1)), -np.inf)[ok]
                nbytes["o_lse"] += int(ok.sum()) * (2 * d + 4)
    return out, lse, nbytes


def _v2_schedule_bytes(nq, nk, d, causal, br, bc):
    """Bytes kernels_cu/flash_fwd.cuh moves for one (batch, head): its n_end per Q tile."""
    off, n_kv = nk - nq, -(-nk // bc)
    nbytes = {"q": 0, "kv": 0, "o_lse": nq * (2 * d + 4), "workspace": 0}
    for r0 in range(0, nq, br):
        n_end = n_kv
        if causal:
            last_key = r0 + br - 1 + off
            n_end = min(n_end, 0 if last_key < 0 else last_key // bc + 1)
        if n_end > 0:
            nbytes["q"] += min(br, nq - r0) * d * 2
            nbytes["kv"] += sum(2 * min(bc, nk - j * bc) * d * 2 for j in range(n_end))
    return nbytes


SHAPES = [(1, 1), (17, 17), (113, 113), (128, 128), (255, 255), (1000, 1000), (1, 239), (239, 1), (3, 799),
          (799, 3), (113, 203), (128, 217), (1023, 1024), (1024, 1023), (300, 64), (64, 300)]


@pytest.mark.parametrize("br,bc", [(64, 64), (128, 64), (128, 128), (64, 32)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", SHAPES)
def test_v1_schedule_is_attention_and_its_traffic_is_the_model(nq, nk, causal, br, bc):
    rng = np.random.default_rng(hash((nq, nk, causal, br, bc)) % 2**32)
    d = 64
    q, k, v = rng.standard_normal((nq, d)), rng.standard_normal((nk, d)), rng.standard_normal((nk, d))
    scale = 1 / math.sqrt(d)
    out, lse, nbytes = _emulate_v1(q, k, v, causal, scale, br, bc)
    o_ref, lse_ref = reference.attention_naive(q[None, :, None], k[None, :, None], v[None, :, None], causal=causal)
    np.testing.assert_allclose(out, o_ref[0, :, 0], atol=1e-12, rtol=0)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(lse_ref[0, 0]))
    fin = np.isfinite(lse)
    np.testing.assert_allclose(lse[fin], lse_ref[0, 0][fin], atol=1e-12, rtol=0)
    model = rl.traffic_v1(rl.Shape(1, 1, nq, nk, d, causal), br, bc)
    assert {key: model[key] for key in nbytes} == nbytes
    assert model["total"] == sum(nbytes.values())


@pytest.mark.parametrize("br,bc", [(64, 64), (128, 64), (128, 128), (64, 32)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", SHAPES)
def test_v2_traffic_is_its_schedule(nq, nk, causal, br, bc):
    nbytes = _v2_schedule_bytes(nq, nk, 128, causal, br, bc)
    model = rl.traffic_v2(rl.Shape(1, 1, nq, nk, 128, causal), br, bc)
    assert {key: model[key] for key in nbytes} == nbytes


def test_traffic_scales_with_batch_heads_and_floor_is_bytes_attention():
    one, many = rl.Shape(1, 1, 1000, 700, 64, True), rl.Shape(3, 5, 1000, 700, 64, True)
    for fn in (rl.traffic_v1, rl.traffic_v2):
        assert fn(many, 64, 64)["total"] == 15 * fn(one, 64, 64)["total"]
    fl = rl.traffic_floor(BRIEF)
    assert fl["total"] == 4 * 2 * 16 * 8192 * 128 * 2 + 2 * 16 * 8192 * 4
    # v1 moves more than v2, v2 more than the floor (the brief's shape, both tile choices)
    for causal in (False, True):
        s = rl.Shape(2, 16, 8192, 8192, 128, causal)
        assert rl.traffic_v1(s, 128, 128)["total"] > rl.traffic_v2(s, 128, 128)["total"] > rl.traffic_floor(s)["total"]


# ----------------------------------------------------------------------------- report, plot, CLI


def _fake_report():
    meas = rl.Ceilings(750, 4200, "measured")
    cases = []
    for n in (2048, 8192):
        s = rl.Shape(16384 // n, 16, n, n, 128, False)
        ms2 = s.flops / 320e12 * 1e3
        cases.append(rl.analyse_case(s, meas, TILES, {"v1": 4 * ms2, "v2": ms2, "sdpa_flash": ms2 * 0.9,
                                                      "sdpa_cudnn": ms2 / 2}))
    return {"env": {"gpu": "Fake GPU"}, "settings": {"dtype": "bf16", "head_dim": 128, "heads": 16, "tokens": 16384,
                                                      "highlight_seqlen": 8192},
            "ceilings": {"measured": {"roof": {"peak_tflops": 750, "bandwidth_gbps": 4200, "label": "measured"}},
                         "nominal": {"peak_tflops": 989, "bandwidth_gbps": 4800, "label": "H200 nominal"}},
            "cases": cases}


def test_format_case_and_json_round_trip(tmp_path):
    rep = _fake_report()
    line = rl.format_case(rep["cases"][1])
    assert line.startswith("seqlen   8192 batch   2 heads  16 d 128 causal 0")
    assert "v1 80.0 TFLOP/s" in line and "v2 320.0 TFLOP/s" in line and "v2/v1 4.00x" in line
    path = tmp_path / "r.json"
    rl.write_json(path, rep)
    back = json.loads(path.read_text())
    assert back["cases"][1]["kernels"]["v2"]["tflops"] == pytest.approx(320)


def test_replot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    path = tmp_path / "r.json"
    rl.write_json(path, _fake_report())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert rl.main(["--replot", str(path), "--out", str(tmp_path / "r.png")]) == 3
    err = capsys.readouterr().err
    assert "matplotlib is not installed" in err and "cuflash[plot]" in err


def test_replot_draws(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "r.json"
    rl.write_json(path, _fake_report())
    png = tmp_path / "r.png"
    assert rl.main(["--replot", str(path), "--out", str(png)]) == 0
    assert png.stat().st_size > 1000


def test_main_without_gpu_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(rl, "_gpu_count", lambda: (0, "no driver"))
    assert rl.main([]) == 2
    assert "no CUDA GPU found" in capsys.readouterr().err


def test_main_with_fake_measurements(monkeypatch, tmp_path, capsys):
    """Everything but the measuring runs for real: shapes, analysis, JSON (plot optional)."""
    from cuflash import bench, families

    monkeypatch.setattr(rl, "_gpu_count", lambda: (1, ""))
    monkeypatch.setattr(bench, "env_info", lambda torch=None: {"gpu": "NVIDIA H200", "sm_count": 132})
    monkeypatch.setattr(rl, "measure_compute_ceiling", lambda n: {"tflops": 750.0, "dtype": "bfloat16", "n": n})
    monkeypatch.setattr(rl, "measure_bandwidth_ceiling", lambda nbytes: {"gbps": 4200.0, "bytes_copied": nbytes})
    seen = []

    def fake_case(s, dtype, torch=None, reps=10, warmup=3):
        seen.append((s, dtype, reps))
        ms2 = s.flops / 320e12 * 1e3
        return ({"v1": 5 * ms2, "v2": ms2}, {"v1": {"median_ms": 5 * ms2}, "v2": {"median_ms": ms2}},
                {"max_abs_diff_out_v1_v2": 0.0},
                {"v1": families.FWD_V1.default(s.head_dim), "v2": families.FWD.default(s.head_dim)})

    monkeypatch.setattr(rl, "measure_case", fake_case)
    js = tmp_path / "roof.json"
    assert rl.main(["--out", str(tmp_path / "roof.png"), "--json", str(js), "--no-sdpa", "--seqlens", "2048", "8192",
                    "--reps", "4"]) == 0
    assert [(s.seqlen_q, s.batch, s.heads, s.head_dim, s.causal) for s, _, _ in seen] == \
        [(2048, 8, 16, 128, False), (8192, 2, 16, 128, False)]
    rep = json.loads(js.read_text())
    assert rep["ceilings"]["measured"]["ridge"] == pytest.approx(750 / 4.2)
    assert rep["ceilings"]["nominal"]["label"] == "H200 nominal"
    c = rep["cases"][1]
    assert c["kernels"]["v1"]["config"].startswith("V1Config(head_dim=128")
    assert c["kernels"]["v1"]["tiles"] == [128, 128] and c["kernels"]["v2"]["tiles"] == [128, 128]
    assert c["v2_over_v1"] == pytest.approx(5.0)
    assert c["kernels"]["v2"]["tflops"] == pytest.approx(320)
    assert c["kernels"]["v1"]["bound"] == "memory" and c["kernels"]["floor"]["bound"] == "compute"
    assert c["kernels"]["v2"]["timing"] == {"median_ms": pytest.approx(c["flops"] / 320e12 * 1e3)}
    out = capsys.readouterr().out
    assert "ridge 179 FLOP/byte" in out and "v2/v1 5.00x" in out


@pytest.mark.parametrize("content,words", [
    (None, "cannot read"),
    ("{", "is not JSON"),
    ("[]", "is not a roofline report"),
    ('{"ceilings": {}}', "is not a roofline report"),
    ('{"ceilings": {"measured": {"roof": {"peak_tflops": 1, "bandwidth_gbps": 1}}}, "cases": [{}]}',
     "is not a roofline report"),
])
def test_replot_of_a_bad_file_is_a_message(tmp_path, capsys, content, words):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    assert rl.main(["--replot", str(path), "--out", str(tmp_path / "r.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cuflash.roofline: --replot: ") and words in err and "Traceback" not in err


def test_replot_to_an_unwritable_path_is_a_message(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "r.json"
    rl.write_json(path, _fake_report())
    assert rl.main(["--replot", str(path), "--out", str(tmp_path / "no" / "dir" / "r.png")]) == 3
    assert "cannot write the picture" in capsys.readouterr().err
