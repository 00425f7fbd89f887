"""Which GPUs cuflash runs on, decided on the CPU from recorded device properties.

Older GPUs (compute capability < 8.0) get one clear error naming the GPU, its compute capability
and the minimum, at the first call of every entry point, before any kernel is selected or compiled.
"""
from __future__ import annotations

import dataclasses
import pathlib

import pytest

from cuflash.mask import NO_MASK

from cuflash import _backward, _compile, _forward, _forward_v1, device, families, problem, tiles
from cuflash.device import MIN_CC, DeviceProps, UnsupportedDeviceError
from cuflash.tune import __main__ as cli

FIX = pathlib.Path(__file__).parent / "fixtures" / "devices"
L4 = DeviceProps.from_json(FIX / "l4.json")
T4 = dataclasses.replace(L4, name="Tesla T4", cc=(7, 5), sm_count=40, smem_optin=65536, smem_per_sm=65536,
                         max_threads_per_sm=1024)
OLD_GPU = r"compute capability 8\.0 or newer.*CUDA device 0 is Tesla T4 with compute capability 7\.5"


def info(shape):
    strides, acc = [], 2
    for n in reversed(shape):
        strides.insert(0, acc)
        acc *= n
    return problem.ArrayInfo(tuple(shape), "bfloat16", 2, tuple(strides), 1 << 20, 0)


@pytest.fixture
def t4(monkeypatch):
    """device 0 is a T4; the entry points take ArrayInfo records for arrays (describe is the identity),
    and any compile fails the test."""
    monkeypatch.setattr(device, "query", lambda device_id=0: T4)
    monkeypatch.setattr(problem, "describe", lambda x, name: x)

    def no_compile(*a, **k):
        raise AssertionError("compiled a kernel for an unsupported GPU")

    monkeypatch.setattr(_compile, "kernel_source", no_compile)
    monkeypatch.setattr(_compile, "aux_source", no_compile)
    for cache in (_forward._plans, _forward_v1._plans, _backward._plans):
        cache.clear()


def test_min_cc_is_the_oldest_family_minimum():
    assert MIN_CC == (8, 0) == min(f.min_cc for f in families.REGISTRY.values())


def test_message_names_gpu_cc_and_minimum():
    assert device.unsupported_reason(L4) is None and device.check_supported(L4) is L4
    why = device.unsupported_reason(T4, 0)
    assert "Tesla T4" in why and "7.5" in why and "8.0" in why
    with pytest.raises(UnsupportedDeviceError, match=OLD_GPU):
        device.check_supported(T4, 0)
    assert issubclass(UnsupportedDeviceError, RuntimeError)
    import cuflash

    assert cuflash.UnsupportedDeviceError is UnsupportedDeviceError


QKV = (info((1, 128, 2, 64)),) * 3


@pytest.mark.parametrize("backend", [None, "sm80", "sm90"])
def test_forward_v2_refuses_old_gpus(t4, backend):
    with pytest.raises(UnsupportedDeviceError, match=OLD_GPU):
        _forward.forward(*QKV, causal=True, backend=backend)


def test_forward_v2_with_explicit_config_refuses_old_gpus(t4):
    with pytest.raises(UnsupportedDeviceError, match=OLD_GPU):
        _forward.forward(*QKV, config=tiles.FwdConfig(64, 64, 64, 4, 2))


def test_forward_v1_refuses_old_gpus(t4):
    with pytest.raises(UnsupportedDeviceError, match=OLD_GPU):
        _forward_v1.forward_v1(*QKV)
    with pytest.raises(UnsupportedDeviceError, match=OLD_GPU):
        _forward_v1.forward_v1(*QKV, config=tiles.V1Config(64, 64, 64, 4, 2))


def _bwd_arrays():
    q = info((1, 128, 2, 64))
    lse = problem.ArrayInfo((1, 2, 128), "float32", 4, (2 * 128 * 4, 128 * 4, 4), 1 << 20, 0)
    return (q, q, q, q, q, lse)


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_refuses_old_gpus(t4, deterministic):
    with pytest.raises(UnsupportedDeviceError, match=OLD_GPU):
        _backward.backward(*_bwd_arrays(), deterministic=deterministic)


def test_backward_with_explicit_configs_refuses_old_gpus_before_compiling(t4):
    with pytest.raises(UnsupportedDeviceError, match=OLD_GPU):
        _backward.backward(*_bwd_arrays(), config=tiles.BwdConfig(64, 128, 128, 8, 2))
    with pytest.raises(UnsupportedDeviceError, match=OLD_GPU):
        _backward.backward(*_bwd_arrays(), deterministic=True, config=tiles.BwdConfig(64, 128, 128, 8, 2),
                           dq_config=tiles.DqConfig(64, 64, 64, 4, 2))


def test_tuner_refuses_old_gpus(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "_gpu_props", lambda device_id: (T4, ""))
    monkeypatch.setattr(device, "query", lambda device_id=0: T4)
    assert cli.main(["--kernels", "fwd"]) == 2
    err = capsys.readouterr().err
    assert "Tesla T4" in err and "compute capability 7.5" in err and "8.0 or newer" in err
    assert cli.main(["--dry-run"]) == 2
    assert "Tesla T4" in capsys.readouterr().err
    path = tmp_path / "t4.json"
    import json

    path.write_text(json.dumps(T4.to_dict()))
    assert cli.main(["--dry-run", "--props", str(path)]) == 2
    assert "compute capability 7.5" in capsys.readouterr().err


def test_no_fitting_tile_names_the_gpu(monkeypatch):
    """A GPU with less shared memory per block than any tile needs (none recorded: 64 KB here) gets
    an error naming the GPU, its compute capability and the head dim."""
    small = dataclasses.replace(L4, name="Small GPU", smem_optin=64 * 1024)
    monkeypatch.setattr(device, "query", lambda device_id=0: small)
    from cuflash import _tuned

    monkeypatch.setattr(_tuned, "lookup", lambda *a: None)
    q, lse = info((1, 128, 2, 256)), _bwd_arrays()[-1]
    p = problem.resolve_backward(q, q, q, q, q, lse, NO_MASK, None)
    with pytest.raises(RuntimeError, match=r"no backward config for head_dim 256 fits in 65536 bytes of shared "
                                           r"memory per block on Small GPU \(cc 8\.9\)"):
        families.select(families.BWD, p)


@pytest.mark.parametrize("d", [192, 256])
def test_large_head_dim_backward_fits_99_kb(monkeypatch, d):
    """The d192 / d256 backward on a ~99 KB GPU (an L4): the 2-warp 32 x 32 tile, one dS^T buffer
    (d256's is 101,376 B, the limit to the byte), for every feature class the family takes, even
    where its instance spills (a slower kernel beats none)."""
    monkeypatch.setattr(device, "query", lambda device_id=0: L4)
    from cuflash import _tuned

    monkeypatch.setattr(_tuned, "lookup", lambda *a: None)
    q, lse = info((1, 128, 2, d)), _bwd_arrays()[-1]
    p = problem.resolve_backward(q, q, q, q, q, lse, NO_MASK, None)
    tile = families.select(families.BWD, p)
    assert tile == tiles.BwdConfig(d, 32, 32, 2, 2) and tile.ds_buffers == 1
    assert tile.smem_bytes <= L4.smem_optin == 101376
    assert (tile.smem_bytes == 101376) == (d == 256)
    for kw in FEATURE_CLASSES:
        features = Features("bfloat16", d, **kw)
        if families.BWD.supports(features):
            assert families.BWD.default(d, L4.smem_optin, features) == tile, kw
    # a last resort: only where nothing else fits (an A100 or H200 never considers it, not even for
    # a user snippet whose every other tile spills)
    assert tile in families.BWD.last_resort
    assert families.BWD.fitting_defaults(d, L4.smem_optin) == [tile]
    for name in ("a100-80gb", "h200"):
        assert tile not in families.BWD.fitting_defaults(d, DEVICES[name].smem_optin)


# ----------------------------------------------------------------------------- NVRTC's targets

OLD_NVRTC = tuple(range(75, 91))  # an NVRTC before CUDA 12.8: Blackwell's targets unknown to it


def test_compiler_reason_names_the_gpu_the_target_and_what_to_install(monkeypatch):
    b200 = DeviceProps.from_json(FIX / "b200.json")
    monkeypatch.setattr(device, "nvrtc_targets", lambda: OLD_NVRTC)
    monkeypatch.setattr(device, "nvrtc_version", lambda: (12, 6))
    why = device.compiler_reason(b200, 1)
    assert why is not None
    for part in ("NVRTC 12.6", "CUDA device 1, NVIDIA B200", "compute capability 10.0, target sm_100",
                 "its targets end at sm_90", "nvidia-cuda-nvrtc"):
        assert part in why, (part, why)
    assert device.compiler_reason(L4) is None  # sm_89 is among them
    monkeypatch.setattr(device, "nvrtc_targets", lambda: None)  # unknown: not checked
    assert device.compiler_reason(b200) is None


def test_this_nvrtc_knows_every_recorded_gpu():
    """CI's NVRTC (13.x) builds for every recorded GPU, Blackwell's sm_100 and sm_120 included."""
    if device.nvrtc_targets() is None:
        pytest.skip("no NVRTC with nvrtcGetSupportedArchs here")
    for name, p in DEVICES.items():
        assert device.compiler_reason(p) is None, name


@pytest.fixture
def b200_old_nvrtc(monkeypatch):
    """device 0 is a B200 and NVRTC does not know sm_100; any compile fails the test."""
    b200 = DeviceProps.from_json(FIX / "b200.json")
    monkeypatch.setattr(device, "query", lambda device_id=0: b200)
    monkeypatch.setattr(device, "nvrtc_targets", lambda: OLD_NVRTC)
    monkeypatch.setattr(problem, "describe", lambda x, name: x)

    def no_compile(*a, **k):
        raise AssertionError("compiled a kernel NVRTC cannot build for this GPU")

    monkeypatch.setattr(_compile, "kernel_source", no_compile)
    monkeypatch.setattr(_compile, "aux_source", no_compile)
    for cache in (_forward._plans, _forward_v1._plans, _backward._plans):
        cache.clear()
    return b200


def test_entry_points_refuse_a_gpu_nvrtc_cannot_target_before_compiling(b200_old_nvrtc):
    old = r"NVRTC.*cannot build for CUDA device 0, NVIDIA B200.*target sm_100"
    with pytest.raises(UnsupportedDeviceError, match=old):
        _forward.forward(*QKV, causal=True)
    with pytest.raises(UnsupportedDeviceError, match=old):
        _forward_v1.forward_v1(*QKV)
    with pytest.raises(UnsupportedDeviceError, match=old):
        _backward.backward(*_bwd_arrays())


def test_tuner_refuses_a_gpu_nvrtc_cannot_target(b200_old_nvrtc, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "_gpu_props", lambda device_id: (b200_old_nvrtc, ""))
    assert cli.main(["--kernels", "fwd"]) == 2
    assert "target sm_100" in capsys.readouterr().err
    path = tmp_path / "b200.json"
    import json

    path.write_text(json.dumps(b200_old_nvrtc.to_dict()))
    assert cli.main(["--dry-run", "--props", str(path), "--kernels", "fwd", "--head-dims", "64"]) == 0  # no compile
    capsys.readouterr()
    assert cli.main(["--dry-run", "--compile-check", "--props", str(path), "--kernels", "fwd", "--head-dims", "64"]) == 2
    assert "--compile-check:" in capsys.readouterr().err


# ----------------------------------------------------------------------------- every supported GPU

from cuflash.features import SUPPORTED_DTYPES, Features  # noqa: E402
from cuflash.tiles import SUPPORTED_HEAD_DIMS  # noqa: E402

DEVICES = {p.stem: DeviceProps.from_json(p) for p in sorted(FIX.glob("*.json"))}


def test_fixtures_cover_every_supported_architecture_with_published_limits():
    assert {p.arch for p in DEVICES.values()} >= {"sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"}
    kb = 1024
    published = {  # name: (cc, SMs, opt-in shared memory per block, shared memory per SM, threads per SM)
        "a100-80gb": ((8, 0), 108, 163 * kb, 164 * kb, 2048),
        "rtx-a6000": ((8, 6), 84, 99 * kb, 100 * kb, 1536),
        "rtx3090": ((8, 6), 82, 99 * kb, 100 * kb, 1536),
        "l4": ((8, 9), 58, 99 * kb, 100 * kb, 1536),
        "rtx4090": ((8, 9), 128, 99 * kb, 100 * kb, 1536),
        "h100-sxm": ((9, 0), 132, 227 * kb, 228 * kb, 2048),
        "h200": ((9, 0), 132, 227 * kb, 228 * kb, 2048),
        "b200": ((10, 0), 148, 227 * kb, 228 * kb, 2048),
        "rtx5090": ((12, 0), 170, 99 * kb, 100 * kb, 1536),
    }
    for name, (cc, sms, optin, per_sm, threads) in published.items():
        p = DEVICES[name]
        assert (p.cc, p.sm_count, p.smem_optin, p.smem_per_sm, p.max_threads_per_sm) == (cc, sms, optin, per_sm, threads)
        assert (p.regs_per_block, p.regs_per_sm, p.max_threads_per_block) == (65536, 65536, 1024)
        assert device.unsupported_reason(p) is None


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_every_family_and_feature_picks_a_default_that_fits(name):
    """On each recorded GPU, every family that runs there picks, for every head dim, dtype and
    feature class, a default tile within the device's shared memory, threads and register caps."""
    props = DEVICES[name]
    runs = [f for f in families.REGISTRY.values() if f.device_problem(props) is None]
    assert {f.name for f in runs} >= {"fwd", "fwd_v1", "bwd", "bwd_dq"}
    assert (families.FWD_SM90 in runs) == (props.cc == (9, 0))
    for fam in runs:
        for d in SUPPORTED_HEAD_DIMS:
            for dtype in SUPPORTED_DTYPES:
                for dropout in (False, True):
                    features = Features(dtype, d, dropout)
                    if d not in fam.defaults:  # the Hopper families' subset (calls fall back to sm80); no v1
                        # d256; decode d32-128 (larger head dims decode on the prefill kernel)
                        assert not fam.supports(features) and (fam.name.endswith("_sm90") or fam.name in ("fwd_v1", "decode")), (fam.name, d)
                        continue
                    tile = fam.default(d, props.smem_optin, features)
                    assert fam.can_implement(tile, props, features) is None, (fam.name, tile)
                    assert tile.smem_bytes <= props.smem_optin
                    assert fam.accumulator_registers(tile) <= fam.register_cap(tile, props)


FEATURE_CLASSES = ({"dropout": True}, {"local": True}, {"softcap": True}, {"alibi": True},
                   {"local": True, "softcap": True, "dropout": True}, {"alibi": True, "local": True},
                   {"partial_d": True}, {"seqused_k": True}, {"varlen": True}, {"varlen": True, "local": True},
                   {"seqused_k": True, "split_kv": True}, {"seqused_k": True, "paged": True},
                   {"seqused_k": True, "split_kv": True, "paged": True, "alibi": True})


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_every_feature_class_a_family_takes_fits_the_device(name):
    """Each family's default tile for the feature classes it takes (windows, softcap, ALiBi, partial
    head dims, per-batch lengths, varlen, split-KV, paged caches and combinations), on each recorded
    GPU: within its shared memory, and the accumulators within the register cap (the variants add
    registers and some add shared memory)."""
    props = DEVICES[name]
    checked = 0
    for fam in (f for f in families.REGISTRY.values() if f.device_problem(props) is None):
        for d in SUPPORTED_HEAD_DIMS:
            if d not in fam.defaults:
                continue
            for dtype in SUPPORTED_DTYPES:
                for kw in FEATURE_CLASSES:
                    features = Features(dtype, d, **kw)
                    if not fam.supports(features):
                        continue
                    tile = fam.default(d, props.smem_optin, features)
                    assert fam.can_implement(tile, props, features) is None, (fam.name, d, kw, tile)
                    assert tile.smem_bytes <= props.smem_optin, (fam.name, d, kw, tile)
                    assert fam.accumulator_registers(tile) <= fam.register_cap(tile, props), (fam.name, d, kw)
                    checked += 1
    assert checked >= 100


@pytest.mark.parametrize("name", sorted(DEVICES))
def test_tuner_dry_run_lists_a_space_for_each_recorded_gpu(name, capsys):
    """`python -m cuflash.tune --dry-run --props NAME` (the shipped file, found by name): a non-empty
    space and a default for every kernel that runs there."""
    import re

    props = DEVICES[name]
    kernels = [k for k in cli.available_kernels(props)]
    assert cli.main(["--dry-run", "--props", name, "--kernels", *kernels]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{props.name}: cc {props.cc_str}")
    for k in kernels:
        for d in SUPPORTED_HEAD_DIMS:
            if d not in families.get(k).defaults:
                continue
            m = re.search(rf"^{k} d{d}: (\d+) configs, (\d+) pass the static checks, default (.*)$", out, re.M)
            assert m, (k, d)
            assert int(m.group(2)) > 0 and m.group(3) != "none fits", (k, d, m.group(0))
            # the searched backward tiles have 4 or 8 warps: on ~99 KB GPUs none of d192's and
            # d256's fits, and the space is the 2-warp last resort (the default) alone
            last_resort = k == "bwd" and d in (192, 256) and props.smem_optin < 120 * 1024
            assert (m.group(2) == "1" and m.group(3) == "32x32 w2 s2") == last_resort, (k, d, m.group(0))


def test_props_by_name_and_unknown_names(capsys):
    assert set(device.shipped_props()) == set(DEVICES)
    assert cli.read_props("l4")[0] == DEVICES["l4"] == cli.read_props("l4.json")[0]
    props, why = cli.read_props("t4")
    assert props is None and "nor a recorded GPU of that name" in why and "a100-80gb" in why
