"""Every command-line entry point answers --version with cuflash's version and where it was imported from."""
import importlib
import os
import pathlib
import subprocess
import sys

import pytest

import cuflash

MODULES = {  # `python -m NAME` -> the module whose main() parses its arguments
    "cuflash": "cuflash.__main__",
    "cuflash.bench": "cuflash.bench",
    "cuflash.tune": "cuflash.tune.__main__",
    "cuflash.roofline": "cuflash.roofline",
}
ROOT = pathlib.Path(__file__).resolve().parent.parent


def _expected() -> str:
    return f"cuflash {cuflash.__version__} from {pathlib.Path(cuflash.__file__).resolve().parent} "


def _env() -> dict:
    """The child imports the cuflash this process imported (installed wheel or checkout)."""
    where = str(pathlib.Path(cuflash.__file__).resolve().parent.parent)
    # a narrow terminal: the version line must not be wrapped (argparse's action="version" would)
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [where, os.environ.get("PYTHONPATH")])),
                COLUMNS="20")


def _declared_scripts() -> dict:
    """[project.scripts] of the checkout's pyproject.toml (name -> "module:function")."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def test_version_is_a_release_number():
    parts = cuflash.__version__.split(".")
    assert len(parts) == 3 and all(p.isdigit() for p in parts), cuflash.__version__


@pytest.mark.parametrize("module", sorted(MODULES))
def test_main_version_in_process(module, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "20")
    main = importlib.import_module(MODULES[module]).main
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(_expected()) and out.count("\n") == 1, out


@pytest.mark.parametrize("module", sorted(MODULES))
def test_python_dash_m_version(module, tmp_path):
    r = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, cwd=tmp_path,
                       env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(_expected()) and r.stdout.count("\n") == 1, r.stdout


def test_every_console_script_has_version(capsys):
    scripts = _declared_scripts()
    assert set(scripts) == {"cuflash-bench", "cuflash-tune"}
    for name, target in scripts.items():
        mod, func = target.split(":")
        assert mod in MODULES.values(), (name, target)  # so the tests above cover it
        with pytest.raises(SystemExit) as e:
            getattr(importlib.import_module(mod), func)(["--version"])
        assert e.value.code == 0
        assert capsys.readouterr().out.startswith(_expected()), name


@pytest.mark.parametrize("name", ["cuflash-bench", "cuflash-tune"])
def test_installed_console_script_version(name, tmp_path):
    """The executables pip wrote beside this Python (present once cuflash is installed)."""
    exe = pathlib.Path(sys.executable).parent / name
    if not exe.is_file():
        pytest.skip(f"{name} is not installed beside {sys.executable}")
    r = subprocess.run([str(exe), "--version"], capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(_expected()) and r.stdout.count("\n") == 1, r.stdout
