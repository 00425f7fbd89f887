"""Shared test setup: the `gpu` marker skips (visibly) where no CUDA GPU is present."""
from __future__ import annotations

import functools
import os

import pytest


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str | None:
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - any import failure means no GPU path
        return f"CuPy not importable ({e.__class__.__name__})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001
        return f"no CUDA GPU present ({e.__class__.__name__})"
    return None if n > 0 else "no CUDA GPU present (0 devices)"


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason()
    if reason is None:
        if os.environ.get("CUFLASH_TEST_NO_POOL"):  # compute-sanitizer runs: no pool hides OOB
            import cupy

            cupy.cuda.set_allocator(None)
        return
    skip = pytest.mark.skip(reason=f"GPU test skipped: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
