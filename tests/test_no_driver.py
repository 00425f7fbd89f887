"""No CUDA driver, or one too old for CuPy's CUDA: cuflash says which, not CuPy's "driver version is
insufficient" (which CuPy reports for both). CPU-only: CuPy's runtime calls are monkeypatched."""
from __future__ import annotations

import pytest

from cuflash import __main__ as main_cli
from cuflash import device

cupy = pytest.importorskip("cupy")
rt = cupy.cuda.runtime


def _insufficient():
    raise rt.CUDARuntimeError(35)  # cudaErrorInsufficientDriver, what CuPy raises with no driver at all


@pytest.fixture
def no_driver(monkeypatch):
    monkeypatch.setattr(rt, "getDeviceCount", _insufficient)
    monkeypatch.setattr(rt, "getDeviceProperties", lambda i: _insufficient())
    monkeypatch.setattr(rt, "driverGetVersion", lambda: 0)  # cudaDriverGetVersion's answer without a driver
    monkeypatch.setattr(rt, "runtimeGetVersion", lambda: 13000)


def test_no_driver_is_named(no_driver, capsys):
    n, why = device.cuda_device_count()
    assert n == 0 and why.startswith("no NVIDIA driver found") and "insufficient" not in why
    with pytest.raises(device.CudaUnavailableError, match="cannot use CUDA device 0: no NVIDIA driver found"):
        device.query.__wrapped__(0)  # uncached: a GPU machine may have cached the real device
    assert main_cli.main([]) == 0  # falls back to the CPU reference, saying why
    out = capsys.readouterr().out
    assert "No CUDA GPU available (no NVIDIA driver found" in out and "CPU reference" in out


def test_old_driver_is_named(no_driver, monkeypatch):
    monkeypatch.setattr(rt, "driverGetVersion", lambda: 12040)
    n, why = device.cuda_device_count()
    assert n == 0
    assert "the NVIDIA driver supports CUDA up to 12.4, but this CuPy is built for CUDA 13.0" in why
    assert "cuflash[cuda12]" in why


def test_other_cuda_errors_keep_cupys_words(monkeypatch):
    def no_device():
        raise rt.CUDARuntimeError(100)  # cudaErrorNoDevice

    monkeypatch.setattr(rt, "getDeviceCount", no_device)
    monkeypatch.setattr(rt, "driverGetVersion", lambda: 13000)
    monkeypatch.setattr(rt, "runtimeGetVersion", lambda: 13000)
    n, why = device.cuda_device_count()
    assert n == 0 and "cudaErrorNoDevice" in why


def test_exported():
    import cuflash

    assert cuflash.CudaUnavailableError is device.CudaUnavailableError
