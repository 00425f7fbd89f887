"""attn/softmax.cuh: OnlineSoftmax<MT> on fragment tiles, against a float32/float64 NumPy twin.

The harness (softmax.cu) runs 3 steps of a 32-row warp (MT = 2) over 32-key S tiles (NT = 4) with
an O~ tile of 16 columns (ON = 2), and reports per step both the pieces (max_get_scale ->
m_scaled, corr; exp_and_sum -> P, thread-partial sum; on a copy of the state) and the composed
step() (P in place, O~ rescaled, row_max, thread-partial row_sum, final_sum, lse).

The twin (online_softmax below), with c = scale_log2:
    m_new = max(m_old, rowmax S);  m_scaled = fp32(m_new * c), 0 where m_new = -inf
    corr = 2^(m_old c - m_scaled);  P = 2^(S c - m_scaled);  l = l corr + rowsum P;  O~ *= corr
    lse = (m c + log2 l) ln 2, -inf where l = 0
row_max and m_scaled are exact (fmaxf, one fp32 product) and compared bit for bit.

Tolerances (S is drawn so that |S c|, |m c| < 16, i.e. ulp <= 2^-20 in the exponent):
  * P, corr: rtol 2^-19. ex2.approx.ftz.f32 is documented to ~2 ulp (relative ~2^-22); the
    exponent is rounded once (fmaf) for P and at most twice for corr (the product may or may
    not be contracted into an FMA), |error| <= 2^-20, giving ln2 * 2^-20 ~ 2^-20.5 relative. Sum
    ~2^-20, so 2^-19 leaves a 2x margin and still catches a wrong row, column or max.
  * sums (rowsum P, l, O~): rtol 2^-16. Positive terms, each within 2^-19, plus at most 32 fp32
    additions (31 * 2^-24) and the corr products over 3 steps: below 2^-17.
  * lse: atol 2^-14. log2 turns l's relative error 2^-17 into 2^-17 / ln2 absolute; lg2.approx
    adds ~2^-22; times ln2 stays below 2^-16.
  * pieces vs step(): rtol 2^-20 (the same operations; allowing the compiler a different FMA
    contraction in the two inlined copies).
Masked rows: a row whose keys are all -inf gets P = 0, corr = 0 (not NaN), and keeps l; a row
never seeing a key has l = 0 and lse = -inf; nothing is NaN anywhere.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.cu.harness import kernel

MT, NT, ON = 2, 4, 2
ROWS, COLS, OCOLS = 16 * MT, 8 * NT, 8 * ON
STEPS = 3
SCALE_LOG2 = np.float32(np.log2(np.e) / np.sqrt(64))

RTOL_EXP = 2.0 ** -19
RTOL_SUM = 2.0 ** -16
ATOL_LSE = 2.0 ** -14
RTOL_SAME = 2.0 ** -20

# rows with special masking (all other rows: random finite scores)
ROW_LATE = 3        # all -inf in step 0, finite after
ROW_NEVER = 10      # all -inf in every step
ROW_HALF = 17       # keys 16..31 of every tile -inf
ROW_GAP = 25        # finite, all -inf in step 1, finite again
ROW_JUMP = 30       # its max jumps up in step 1 (small corr)


def make_inputs(seed=0):
    rng = np.random.default_rng(seed)
    s = rng.uniform(-40, 40, size=(STEPS, ROWS, COLS)).astype(np.float32)
    s[0, ROW_LATE] = -np.inf
    s[:, ROW_NEVER] = -np.inf
    s[:, ROW_HALF, 16:] = -np.inf
    s[1, ROW_GAP] = -np.inf
    s[1, ROW_JUMP] += np.float32(30)  # |S c| <= 70 * 0.18 < 16 still
    o = rng.standard_normal((ROWS, OCOLS)).astype(np.float32)
    return s, o


def online_softmax(s, o, c=SCALE_LOG2):
    """The twin: per-step dicts of m (row max), m_scaled, corr, p, part (rowsum P), l, o, lse."""
    m = np.full(ROWS, -np.inf, np.float32)
    l = np.zeros(ROWS)
    o = o.astype(np.float64)
    out = []
    with np.errstate(invalid="raise", over="raise"):
        for si in s:
            m_new = np.maximum(m, si.max(axis=1))
            m_scaled = np.where(m_new == -np.inf, np.float32(0), m_new * c).astype(np.float32)
            corr = np.exp2(m.astype(np.float64) * np.float64(c) - m_scaled)
            p = np.exp2(si.astype(np.float64) * np.float64(c) - m_scaled[:, None])
            part = p.sum(axis=1)
            l = l * corr + part
            o = o * corr[:, None]
            with np.errstate(divide="ignore"):
                lse = np.where(l > 0, (m_new.astype(np.float64) * c + np.log2(np.where(l > 0, l, 1))) * np.log(2), -np.inf)
            m = m_new
            out.append(dict(m=m_new, m_scaled=m_scaled, corr=corr, p=p, part=part, l=l.copy(), o=o.copy(), lse=lse))
    return out


def lane_rows():
    """rows[lane, mt, half] = 16 mt + lane / 4 + 8 half (the per-row outputs' layout)."""
    lane, mt, half = np.meshgrid(np.arange(32), np.arange(MT), np.arange(2), indexing="ij")
    return 16 * mt + lane // 4 + 8 * half


def _run(s, o):
    import cupy

    f32 = cupy.float32
    outs = {
        "p": cupy.full((STEPS, ROWS, COLS), np.nan, f32),
        "p_pieces": cupy.full((STEPS, ROWS, COLS), np.nan, f32),
        "o": cupy.full((STEPS, ROWS, OCOLS), np.nan, f32),
    }
    per_row = ["m_scaled", "corr", "part", "row_max", "row_sum", "l", "lse"]
    outs.update({k: cupy.full((STEPS, 32, MT, 2), np.nan, f32) for k in per_row})
    kernel("softmax", "softmax_steps")((1,), (32,), (
        cupy.asarray(s), cupy.asarray(o), np.int32(STEPS), SCALE_LOG2,
        outs["p"], outs["p_pieces"], outs["o"], *(outs[k] for k in per_row)))
    return {k: cupy.asnumpy(v) for k, v in outs.items()}


@pytest.fixture(scope="module")
def gpu_and_twin():
    s, o = make_inputs()
    return s, _run(s, o), online_softmax(s, o)


@pytest.mark.gpu
def test_nothing_is_nan(gpu_and_twin):
    _, got, _ = gpu_and_twin
    for k, v in got.items():
        assert not np.isnan(v).any(), k
        if k not in ("row_max", "lse"):
            assert np.isfinite(v).all(), k


@pytest.mark.gpu
def test_row_max_and_m_scaled_exact(gpu_and_twin):
    _, got, twin = gpu_and_twin
    rows = lane_rows()
    for i, ref in enumerate(twin):
        np.testing.assert_array_equal(got["row_max"][i], ref["m"][rows], err_msg=f"row_max step {i}")
        np.testing.assert_array_equal(got["m_scaled"][i], ref["m_scaled"][rows], err_msg=f"m_scaled step {i}")


@pytest.mark.gpu
def test_p_and_corr(gpu_and_twin):
    s, got, twin = gpu_and_twin
    rows = lane_rows()
    for i, ref in enumerate(twin):
        np.testing.assert_allclose(got["p"][i], ref["p"], rtol=RTOL_EXP, atol=0, err_msg=f"P step {i}")
        assert (got["p"][i][s[i] == -np.inf] == 0).all()
        np.testing.assert_allclose(got["corr"][i], ref["corr"][rows], rtol=RTOL_EXP, atol=0, err_msg=f"corr step {i}")
    # rows that had no visible key yet: corr is exactly 0 (2^-inf), not NaN
    assert (got["corr"][0] == 0).all()
    assert (got["corr"][1][rows == ROW_LATE] == 0).all() and (got["corr"][:, rows == ROW_NEVER] == 0).all()
    assert (got["p"][:, ROW_NEVER] == 0).all() and (got["p"][1, ROW_GAP] == 0).all()
    # a row without keys this step keeps its max: corr = 2^(m c - fp32(m c)) ~ 1
    np.testing.assert_allclose(got["corr"][1][rows == ROW_GAP], 1.0, rtol=RTOL_EXP)


@pytest.mark.gpu
def test_sums_and_lse(gpu_and_twin):
    _, got, twin = gpu_and_twin
    rows = lane_rows()
    quad_rows = rows[::4]  # (8 g, MT, 2)
    for i, ref in enumerate(twin):
        part = got["part"][i].astype(np.float64).reshape(8, 4, MT, 2).sum(axis=1)
        np.testing.assert_allclose(part, ref["part"][quad_rows], rtol=RTOL_SUM, err_msg=f"exp_and_sum step {i}")
        row_sum = got["row_sum"][i].astype(np.float64).reshape(8, 4, MT, 2).sum(axis=1)
        np.testing.assert_allclose(row_sum, ref["l"][quad_rows], rtol=RTOL_SUM, err_msg=f"row_sum step {i}")
        l = got["l"][i]
        np.testing.assert_allclose(l, ref["l"][rows], rtol=RTOL_SUM, err_msg=f"final_sum step {i}")
        for j in range(1, 4):  # the quad's butterfly gives every lane the same value
            np.testing.assert_array_equal(l.reshape(8, 4, MT, 2)[:, j], l.reshape(8, 4, MT, 2)[:, 0])
        np.testing.assert_allclose(got["lse"][i], ref["lse"][rows], rtol=0, atol=ATOL_LSE, err_msg=f"lse step {i}")
        np.testing.assert_allclose(got["o"][i], ref["o"], rtol=RTOL_SUM, atol=0, err_msg=f"O~ step {i}")
    assert (got["l"][:, rows == ROW_NEVER] == 0).all() and (got["lse"][:, rows == ROW_NEVER] == -np.inf).all()
    assert (got["o"][:, ROW_NEVER] == 0).all() and (got["o"][0, ROW_LATE] == 0).all()


@pytest.mark.gpu
def test_pieces_agree_with_step(gpu_and_twin):
    _, got, _ = gpu_and_twin
    np.testing.assert_allclose(got["p_pieces"], got["p"], rtol=RTOL_SAME, atol=0)
    # step() rescales O~ by the corr max_get_scale returns, and l = l corr + sum
    s, o = make_inputs()
    prev_o = np.concatenate([o[None], got["o"][:-1]])
    rows = lane_rows()
    corr_rows = np.empty((STEPS, ROWS), np.float32)
    corr_rows[:, rows.ravel()] = got["corr"].reshape(STEPS, -1)
    np.testing.assert_allclose(got["o"], prev_o * corr_rows[:, :, None], rtol=RTOL_SAME, atol=0)
    prev_sum = np.concatenate([np.zeros((1, 32, MT, 2), np.float32), got["row_sum"][:-1]])
    np.testing.assert_allclose(got["row_sum"], prev_sum * got["corr"] + got["part"], rtol=RTOL_SAME, atol=0)


# --------------------------------------------------------------------------------------- CPU

def test_twin_is_softmax_over_all_keys():
    s, o = make_inputs()
    twin = online_softmax(s, o)
    full = np.concatenate(list(s), axis=1).astype(np.float64) * np.float64(SCALE_LOG2) * np.log(2)  # natural units
    live = np.isfinite(full).any(axis=1)
    assert live.tolist() == [r != ROW_NEVER for r in range(ROWS)]
    mx = full[live].max(axis=1, keepdims=True)
    lse = np.log(np.exp(full[live] - mx).sum(axis=1)) + mx[:, 0]
    np.testing.assert_allclose(twin[-1]["lse"][live], lse, rtol=1e-6, atol=1e-6)
    assert (twin[-1]["lse"][~live] == -np.inf).all()
    # P of each step rescaled by the later corrs, over l, is the softmax; up to the fp32 rounding
    # of m_scaled (<= 2^-24 * 16 per step, 3 steps: ln2 * 3 * 2^-20 < 2^-19 relative)
    probs = []
    for i, ref in enumerate(twin):
        later = np.prod([twin[j]["corr"] for j in range(i + 1, STEPS)], axis=0) if i + 1 < STEPS else 1.0
        probs.append(ref["p"] * np.asarray(later)[..., None] if i + 1 < STEPS else ref["p"])
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.concatenate(probs, axis=1)[live] / twin[-1]["l"][live, None]
    np.testing.assert_allclose(p, np.exp(full[live] - lse[:, None]), rtol=2.0 ** -17, atol=0)


def test_inputs_stay_in_the_tolerance_range():
    s, _ = make_inputs()
    assert np.abs(s[np.isfinite(s)] * SCALE_LOG2).max() < 16
