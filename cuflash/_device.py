"""Facts about the CUDA devices, asked once: is there a GPU, and what are its limits."""
from __future__ import annotations

import functools


def cuda_device_count() -> tuple[int, str]:
    """(number of CUDA devices, why none) -- any CuPy/driver failure counts as no GPU."""
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        return n, "" if n else "getDeviceCount() returned 0"
    except Exception as e:  # ImportError, CUDARuntimeError (no driver, insufficient driver, ...)
        return 0, f"{type(e).__name__}: {e}"


@functools.lru_cache(maxsize=None)
def smem_optin(device_id: int) -> int:
    """Shared memory a block may opt into on this device (bytes)."""
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device_id)["sharedMemPerBlockOptin"]
