"""Which GPUs cuflash runs on, decided on the CPU from recorded device properties.

Older GPUs (compute capability < 8.0) get one clear error naming the GPU, its compute capability
and the minimum, at the first call of every entry point, before any kernel is selected or compiled.
"""
from __future__ import annotations

import dataclasses
import pathlib

import pytest

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
    """The d128 backward has no tile for the ~99 KB of shared memory of cc 8.6 / 8.9 GPUs (known gap)."""
    monkeypatch.setattr(device, "query", lambda device_id=0: L4)
    from cuflash import _tuned

    monkeypatch.setattr(_tuned, "lookup", lambda *a: None)
    q, lse = info((1, 128, 2, 128)), _bwd_arrays()[-1]
    p = problem.resolve_backward(q, q, q, q, q, lse, False, None)
    with pytest.raises(RuntimeError, match=r"no backward config for head_dim 128 fits in 101376 bytes of shared "
                                           r"memory per block on NVIDIA L4 \(cc 8\.9\)"):
        families.select(families.BWD, p)
