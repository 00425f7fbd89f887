"""Packaging and the CPU side of the main job."""
import subprocess
import sys
import zipfile

import pytest

from cuflash import _compile


def test_kernel_sources_found():
    assert (_compile.kernel_dir() / "flash_fwd.cuh").is_file()


def test_wheel_ships_kernel_sources(tmp_path):
    root = _compile.kernel_dir().parent
    if not (root / "pyproject.toml").is_file():
        pytest.skip("installed package, not a checkout: nothing to build")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(root)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (whl,) = tmp_path.glob("cuflash-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    for f in ("cuflash/kernels_cu/common.cuh", "cuflash/kernels_cu/flash_fwd.cuh", "cuflash/__init__.py"):
        assert f in names


def test_main_job_without_gpu_runs_cpu_reference(capsys):
    from cuflash.__main__ import main

    assert main(["--cpu"]) == 0
    out = capsys.readouterr().out
    assert "CPU reference of both FlashAttention algorithms" in out
    assert out.count("max |diff| vs naive") == 4
    diffs = [float(line.split("naive ")[1].split()[0]) for line in out.splitlines() if "vs naive" in line]
    assert max(diffs) < 1e-12
