"""Shared test setup: the `gpu` marker skips (visibly) where no CUDA GPU is present."""
from __future__ import annotations

import functools
import os

import pytest


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str | None:
    from cuflash.device import cuda_device_count

    n, why = cuda_device_count()
    return None if n > 0 else f"no CUDA GPU present ({why.split(':')[0]})"


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
