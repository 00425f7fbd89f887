"""scripts/trace_det_waits.py patches a copy of sm90/bwd.cuh at anchors of its text: each must still
occur exactly once, or the next GPU session's trace fails before it measures anything. CPU only (the
compile of the traced kernels: `python scripts/trace_det_waits.py --check`)."""
import importlib.util
import pathlib

import pytest

pytest.importorskip("cupy")
SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "trace_det_waits.py"


def test_the_trace_patches_apply_once(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("trace_det_waits", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    kdir = mod.patched_kernel_dir(tmp_path)  # asserts every anchor once
    text = (kdir / "sm90" / "bwd.cuh").read_text()
    for slot in range(1, 7):
        assert f"({slot}" in text
    assert text.count("TRACE_ADD(") >= 5 and "TRACE_MAX(1" in text
