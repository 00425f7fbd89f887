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
    # every kernel source, subdirectories included (core/, attn/, sm80/, rowwise/)
    kroot = _compile.kernel_dir()
    for p in sorted(kroot.rglob("*.cu*")):
        assert f"cuflash/kernels_cu/{p.relative_to(kroot).as_posix()}" in names, p
    for f in ("cuflash/kernels_cu/common.cuh", "cuflash/kernels_cu/flash_fwd.cuh", "cuflash/__init__.py",
              "cuflash/_tuned.py", "cuflash/tune/__main__.py", "cuflash/tuning_store.py", "cuflash/tuning/README.md"):
        assert f in names
    # every shipped tuning table is in the wheel, where the lookup finds it
    for table in sorted((root / "tuning").glob("*.json")):
        assert f"cuflash/tuning/{table.name}" in names, table.name
    # the recorded GPUs (`python -m cuflash.tune --dry-run --props NAME`) ship as cuflash/devices/
    fixtures = sorted((root / "tests" / "fixtures" / "devices").glob("*.json"))
    assert fixtures
    for f in fixtures:
        assert f"cuflash/devices/{f.name}" in names, f.name
    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)
    code = ("from cuflash import _compile, device, tuning_store; print(tuning_store.shipped_dir()); "
            "print(len(tuning_store.shipped_tables())); print(_compile.kernel_dir()); "
            "print(device.shipped_props_dir()); print(len(device.shipped_props()))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    where, count, kdir, ddir, dcount = r.stdout.split()
    assert kdir == str(site / "cuflash" / "kernels_cu")  # the installed wheel finds its kernel sources
    assert ddir == str(site / "cuflash" / "devices") and int(dcount) == len(fixtures)
    assert where == str(site / "cuflash" / "tuning") and int(count) == len(list((root / "tuning").glob("*.json")))


def test_shipped_tables_are_current_and_readable():
    """Each table in tuning/ parses, has only well-formed entries, and was made from the kernel
    sources in this checkout (a stale table would be ignored on every user's machine)."""
    from cuflash import families, tuning_store

    for table in tuning_store.shipped_tables():
        entries, problem = tuning_store.read_file(table)
        assert problem is None, (table.name, problem)
        for e in entries:
            assert tuning_store.check_entry(e) is None, (table.name, e)
            cfg = families.get(e["kernel"]).tile_from_dict(e["config"])
            assert cfg.structural_problem() is None
            assert e["source"] == tuning_store.source_fingerprint(e["kernel"]), (
                f"{table.name}: {e['kernel']} entries were tuned for other kernel sources; re-tune and re-export")


def test_main_job_without_gpu_runs_cpu_reference(capsys):
    from cuflash.__main__ import main

    assert main(["--cpu"]) == 0
    out = capsys.readouterr().out
    assert "CPU reference of both FlashAttention algorithms" in out
    assert out.count("max |diff| vs naive") == 4
    diffs = [float(line.split("naive ")[1].split()[0]) for line in out.splitlines() if "vs naive" in line]
    assert max(diffs) < 1e-12
