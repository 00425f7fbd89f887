"""The dependency runs one way: the tuner (cuflash/tune/) imports the library, never the reverse."""
import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parent.parent / "cuflash"


def _imported_modules(path: pathlib.Path) -> set:
    """Absolute names of the modules a file imports (relative imports resolved against its package)."""
    rel = path.relative_to(PKG.parent).with_suffix("")
    package = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # `from . import tune`
    return out


def test_library_never_imports_the_tuner():
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        if "tune" in path.relative_to(PKG).parts[:1]:
            continue
        bad = sorted(m for m in _imported_modules(path) if m == "cuflash.tune" or m.startswith("cuflash.tune."))
        if bad:
            offenders.append(f"{path.relative_to(PKG.parent)}: {', '.join(bad)}")
    assert not offenders, "the library imports the tuner:\n" + "\n".join(offenders)


def test_the_scan_sees_relative_imports():
    """Guard the guard: a relative import of the tuner from the library is recognised."""
    import tempfile

    with tempfile.TemporaryDirectory(dir=PKG) as d:
        f = pathlib.Path(d) / "probe.py"
        f.write_text("from ..tune import space\nfrom .. import tune\n")
        assert {"cuflash.tune", "cuflash.tune.space"} <= _imported_modules(f)
