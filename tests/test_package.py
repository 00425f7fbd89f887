"""Packaging and the CPU side of the main job.

CI (.ci/run) builds the sdist and wheel with `python -m build`, installs the wheel in a fresh virtual
environment and runs these tests there with CUFLASH_TEST_DIST=<the folder holding both> and
CUFLASH_TEST_INSTALLED=1: the tests below then check the very files CI built and that `cuflash` was
imported from the installed wheel, not from the checkout. Elsewhere they build a wheel themselves."""
import email
import os
import pathlib
import subprocess
import sys
import tarfile
import zipfile

import pytest

import cuflash
from cuflash import _compile

ROOT = pathlib.Path(__file__).resolve().parent.parent  # the checkout these tests belong to


def test_kernel_sources_found():
    assert (_compile.kernel_dir() / "flash_fwd.cuh").is_file()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """The wheel CI built (CUFLASH_TEST_DIST), else one built here from the checkout."""
    dist = os.environ.get("CUFLASH_TEST_DIST")
    if dist:
        (whl,) = pathlib.Path(dist).glob("cuflash-*.whl")
        return whl
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (whl,) = out.glob("cuflash-*.whl")
    return whl


def test_cuflash_is_the_installed_wheel_when_ci_says_so():
    if not os.environ.get("CUFLASH_TEST_INSTALLED"):
        pytest.skip("CUFLASH_TEST_INSTALLED not set: cuflash may come from the checkout")
    from importlib import metadata

    pkg = pathlib.Path(cuflash.__file__).resolve().parent
    assert ROOT not in pkg.parents, f"cuflash imported from the checkout ({pkg}), not from the installed wheel"
    assert pkg.parent.name == "site-packages", pkg
    dist = metadata.distribution("cuflash")
    assert dist.version == cuflash.__version__
    assert pathlib.Path(dist.locate_file("cuflash/__init__.py")).resolve() == pkg / "__init__.py"
    assert _compile.kernel_dir() == pkg / "kernels_cu"  # the wheel's kernel sources, not the checkout's


def test_wheel_metadata(wheel):
    z = zipfile.ZipFile(wheel)
    names = z.namelist()
    (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    meta = email.message_from_bytes(z.read(meta_name))
    assert meta["Name"] == "cuflash" and meta["Version"] == cuflash.__version__
    assert wheel.name == f"cuflash-{cuflash.__version__}-py3-none-any.whl"
    assert meta["License-Expression"] == "BSD-3-Clause"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert f"cuflash-{cuflash.__version__}.dist-info/licenses/LICENSE" in names
    assert "cuflash/py.typed" in names  # declared in package-data: PEP 561, the package is typed
    extras = set(meta.get_all("Provides-Extra"))
    assert {"cuda13", "cuda12", "test", "plot"} <= extras
    entry_points = z.read(meta_name.replace("METADATA", "entry_points.txt")).decode()
    assert "cuflash-bench = cuflash.bench:main" in entry_points
    assert "cuflash-tune = cuflash.tune.__main__:main" in entry_points


def test_sdist_builds_the_same_package():
    """The sdist CI built holds what building the wheel needs (LICENSE, the kernel sources, the tuning
    tables, the recorded GPUs under tests/fixtures/devices) and the same version."""
    dist = os.environ.get("CUFLASH_TEST_DIST")
    if not dist:
        pytest.skip("CUFLASH_TEST_DIST not set (CI sets it to the folder of `python -m build`'s outputs)")
    (sdist,) = pathlib.Path(dist).glob("cuflash-*.tar.gz")
    top = f"cuflash-{cuflash.__version__}"
    assert sdist.name == f"{top}.tar.gz"
    names = set(tarfile.open(sdist).getnames())
    for f in ("LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "cuflash/py.typed", "cuflash/_version.py",
              "kernels_cu/common.cuh", "tuning/README.md"):
        assert f"{top}/{f}" in names, f
    for p in sorted((ROOT / "kernels_cu").rglob("*.cu*")) + sorted((ROOT / "tuning").glob("*.json")) \
            + sorted((ROOT / "tests" / "fixtures" / "devices").glob("*.json")):
        assert f"{top}/{p.relative_to(ROOT).as_posix()}" in names, p


def test_docs_do_not_install_from_a_registry():
    """Until cuflash is published, no instruction installs `cuflash` by name from a package index:
    the docs install from the checkout ('.[cuda13]') or a built wheel."""
    import re

    by_name = re.compile(r"""pip install\s+(-\S+\s+)*['"]?cuflash(\[[^\]]*\])?['"]?(\s|$)""")
    offenders = []
    for doc in [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        commands = re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, flags=re.S)
        commands += [m for m in re.findall(r"`([^`\n]+)`", text) if "pip install" in m and "[" in m]
        offenders += [f"{doc.name}: {line.strip()}" for block in commands for line in block.splitlines()
                      if by_name.search(line)]
    assert not offenders, offenders


def test_wheel_ships_kernel_sources(wheel, tmp_path):
    root = ROOT
    whl = wheel
    names = zipfile.ZipFile(whl).namelist()
    # every kernel source, subdirectories included (core/, attn/, sm80/, rowwise/)
    kroot = root / "kernels_cu"
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
