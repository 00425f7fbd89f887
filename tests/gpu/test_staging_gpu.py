"""cuflash.staging.upload: host arrays reach the device asynchronously and intact, also when the
host runs far ahead of the GPU (more uploads than the ring has buffers behind a long kernel)."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash import staging

pytestmark = pytest.mark.gpu


def test_uploads_behind_a_long_kernel_keep_their_values():
    import cupy

    a = cupy.random.standard_normal((4096, 4096), dtype=cupy.float32)
    outs, want = [], []
    for i in range(3 * staging.SLOTS):
        if i % staging.SLOTS == 0:
            a = a @ a / 64  # keeps the stream busy while the host queues the next copies
        v = np.arange(i, i + 7 + i % 5, dtype=np.int32)
        outs.append(staging.upload(v))
        want.append(v)
    cupy.cuda.get_current_stream().synchronize()
    for got, v in zip(outs, want):
        assert got.dtype == v.dtype and got.shape == v.shape and (got.get() == v).all()


def test_upload_of_nothing_and_of_a_large_array():
    import cupy

    assert staging.upload(np.zeros(0, np.int32)).shape == (0,)
    big = np.arange(100_000, dtype=np.int64)
    got = staging.upload(big)
    cupy.cuda.get_current_stream().synchronize()
    assert (got.get() == big).all()
