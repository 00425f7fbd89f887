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
    for slot in (2, 3, 4, 5, 6):  # each wait's sum, and the spun turns
        assert f"TRACE_ADD({slot}," in text, slot
    assert text.count("TRACE_MAX(1,") == 2  # the end: the store warp's last completion, the consumers' epilogue
