"""Head dims of real models (issue 12), decided on the CPU: validation, the instantiated head dim a
call runs with, and the config every family picks on the recorded devices (sm_80 to sm_120)
for every multiple of 8 from 8 to 256."""
from __future__ import annotations

import math
import pathlib

import pytest

from cuflash import _tuned, device, families, problem, tiles
from cuflash.device import DeviceProps
from cuflash.mask import NO_MASK

FIX = pathlib.Path(__file__).parent / "fixtures" / "devices"
DEVICES = {p.stem: DeviceProps.from_json(p) for p in sorted(FIX.glob("*.json"))}
ALL_DIMS = tuple(range(8, 257, 8))


def info(shape, dtype="bfloat16"):
    strides, acc = [], 2
    for n in reversed(shape):
        strides.insert(0, acc)
        acc *= n
    return problem.ArrayInfo(tuple(shape), dtype, 2, tuple(strides), 1 << 20, 0)


def lse_info(b, h, n):
    return problem.ArrayInfo((b, h, n), "float32", 4, (h * n * 4, n * 4, 4), 1 << 20, 0)


def test_kernel_head_dim_ladder():
    assert tiles.SUPPORTED_HEAD_DIMS == (32, 64, 96, 128, 192, 256)
    assert [tiles.kernel_head_dim(d) for d in (8, 32, 40, 64, 72, 96, 104, 128, 136, 192, 200, 256)] == \
        [32, 32, 64, 64, 96, 96, 128, 128, 192, 192, 256, 256]


@pytest.mark.parametrize("d", (0, 4, 12, 84, 260, 264, 512))
def test_validation_names_the_supported_set(d):
    q = info((1, 16, 2, d))
    with pytest.raises(ValueError, match=rf"q: head_dim must be a multiple of 8 between 8 and 256, got {d}"):
        problem.resolve_forward(q, q, q, NO_MASK, None)


@pytest.mark.parametrize("d", ALL_DIMS)
def test_problem_keeps_the_call_head_dim_and_its_default_scale(d):
    q = info((2, 16, 4, d))
    p = problem.resolve_forward(q, q, q, NO_MASK, None)
    kd = tiles.kernel_head_dim(d)
    assert p.head_dim == d and p.features.head_dim == kd and p.features.partial_d == (d != kd)
    assert p.softmax_scale == 1.0 / math.sqrt(d)  # the call's head dim, not the instance's
    assert p.features.perf_class() == "dense"
    from cuflash import params

    assert int(params.pack_fwd(p, 1)["head_dim"][0]) == d
    assert int(params.pack_fwd(p, 1)["o_sn"][0]) == 4 * d  # out is (batch, seqlen, heads, d): no padded copy


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_every_head_dim_gets_a_forward_and_backward_that_fit(name, monkeypatch):
    props = DEVICES[name]
    monkeypatch.setattr(device, "query", lambda device_id=0: props)
    monkeypatch.setattr(_tuned, "lookup", lambda *a: None)
    for d in ALL_DIMS:
        kd = tiles.kernel_head_dim(d)
        q, lse = info((1, 128, 2, d)), lse_info(1, 2, 128)
        p = problem.resolve_forward(q, q, q, NO_MASK, None)
        fam = families.choose(families.FORWARDS, p)
        if fam.backend == "sm90":  # on its instances (64, 128, 192, 256) or their column-masking forms
            assert props.cc == (9, 0) and kd in tiles.SM90_HEAD_DIMS
        else:
            assert fam is families.FWD
            if props.cc == (9, 0):  # why the sm80 forward runs it: no sm90 instance (d 8-32, 72-96),
                assert families.FWD_SM90.cannot_run(p, props)  # or no TMA bindings on this host
        tile = families.select(fam, p)
        assert tile.head_dim == kd and tile.smem_bytes <= props.smem_optin
        assert fam.can_implement(tile, props, p.features) is None
        for det in (False, True):
            pb = problem.resolve_backward(q, q, q, q, q, lse, NO_MASK, None, det)
            for bfam in (families.BWD, families.BWD_DQ) if det else (families.BWD,):
                t = families.select(bfam, pb)
                assert t.head_dim == kd and t.smem_bytes <= props.smem_optin
                assert bfam.can_implement(t, props, pb.features) is None


def test_hopper_families_refuse_other_head_dims_with_a_reason():
    h200 = DEVICES["h200"]
    for d in (32, 96, 24, 80):  # the instances 32 and 96 have no Hopper form
        q = info((1, 128, 2, d))
        p = problem.resolve_forward(q, q, q, NO_MASK, None)
        why = families.FWD_SM90.cannot_run(p, h200)
        assert why and "sm90 forward kernels do not support" in why, why
    for d in (48, 104, 160, 200):  # column-masking instances of 64, 128, 192, 256
        q = info((1, 128, 2, d))
        p = problem.resolve_forward(q, q, q, NO_MASK, None)
        assert p.features.partial_d and p.features.head_dim in tiles.SM90_HEAD_DIMS
        why = families.FWD_SM90.cannot_run(p, h200)
        assert why is None or why == families.FWD_SM90.call_problem(p)
        want = families.FWD_SM90 if why is None else families.FWD
        assert families.choose(families.FORWARDS, p, props=h200) is want
    q = info((1, 128, 2, 256))  # d256 is instantiated on Hopper (FlashAttention-3's 128 x 80, two consumers)
    p = problem.resolve_forward(q, q, q, NO_MASK, None)
    why = families.FWD_SM90.cannot_run(p, h200)
    assert why is None or why == families.FWD_SM90.call_problem(p)  # only the host's TMA bindings may be missing
    assert families.FWD_SM90.default(256, h200.smem_optin).label() == "128x80 c2 s2 pp1 ov1 q1 p1"
    assert families.FWD_SM90.default(192, h200.smem_optin).label() == "128x112 c2 s2 pp1 ov1 q1 p1"


def test_d256_backward_runs_as_two_column_splits():
    t = families.BWD.default(256)
    assert t.column_splits == 2 and families.BWD.default(128).column_splits == 1
    # the register bound counts one split's dK, dV
    assert families.BWD.accumulator_registers(t) == (2 * t.block_k * 128 + t.block_k * t.block_q) // t.threads


def test_prep_threads_per_row_mirror():
    from cuflash._backward import prep_threads_per_row

    assert [prep_threads_per_row(d) for d in (32, 64, 96, 128, 192, 256)] == [4, 8, 16, 16, 32, 32]


def test_backward_column_splits_and_dq_warp_grid_partition_the_tile():
    """NumPy-free twin of Sm80BwdTraits' split arithmetic: the column splits of a key tile cover the
    head dim once, and the dQ product's wm x wn warp grid covers block_q x (d / splits) once, in
    16 x 16 multiples (what the kernel's static_asserts and index math assume)."""
    for t in families.BWD.selectable():
        d, s = t.head_dim, t.column_splits
        cols = d // s
        assert s * cols == d and cols % 16 == 0
        covered = sorted(c for split in range(s) for c in range(split * cols, (split + 1) * cols))
        assert covered == list(range(d))
        wm = min(t.warps, t.block_q // 16)
        wn = t.warps // wm
        rows_w, cols_w = t.block_q // wm, cols // wn
        assert wm * wn == t.warps and rows_w % 16 == 0 and cols_w % 16 == 0
        cells = {(r, c) for w in range(t.warps) for r in range((w % wm) * rows_w, (w % wm + 1) * rows_w, 16)
                 for c in range((w // wm) * cols_w, (w // wm + 1) * cols_w, 16)}
        assert len(cells) == (t.block_q // 16) * (cols // 16)


def test_refusals_name_the_call_head_dim():
    h200 = DEVICES["h200"]
    q = info((1, 64, 2, 200))
    p = problem.resolve_forward(q, q, q, NO_MASK, None)
    assert families.FWD_V1.cannot_run(p, h200) == \
        "v1 forward kernels do not support bfloat16 with head_dim 200 (on the kernels of head dim 256)"
