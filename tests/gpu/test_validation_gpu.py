"""Bad arguments on real CuPy arrays raise before any launch (R1)."""
from __future__ import annotations

import numpy as np
import pytest

from cuflash.testing import dtype_of, random_qkv

pytestmark = pytest.mark.gpu


def test_bad_inputs_rejected_before_launch(monkeypatch):
    import cupy
    import cuflash
    from cuflash import _compile

    launches = []
    real = _compile.get_kernel
    monkeypatch.setattr(_compile, "get_kernel", lambda *a: launches.append(a) or real(*a))
    rng = np.random.default_rng(0)
    bf = dtype_of("bfloat16")
    q, k, v = random_qkv(rng, 2, 64, 64, 2, 64, bf)
    bad = [
        ((q.astype(cupy.float32), k, v), {}, TypeError, "dtype"),
        ((q, k.astype(cupy.float16), v), {}, TypeError, "one dtype"),
        ((q[0], k, v), {}, ValueError, "4 dimensions"),
        ((q, k[:1], v[:1]), {}, ValueError, "batch"),
        ((q[:, :, :1], k, v), {}, ValueError, "heads"),  # k's heads must divide q's (GQA)
        ((q, k, v[:, :, :1]), {}, ValueError, r"same \(batch, seqlen, heads\)"),  # k and v: the same heads
        ((q[..., :36], k[..., :36], v[..., :36]), {}, ValueError, "head_dim must be a multiple of 8"),
        ((q[..., ::2], k, v), {}, ValueError, "last dimension"),
        ((q[:, :0].astype(cupy.float32), k, v), {}, TypeError, "dtype"),  # empty arrays are still checked
        ((q[:, :0, :1], k, v), {}, ValueError, "heads"),
        ((q.get(), k, v), {}, TypeError, "CuPy array"),
        ((q, k, v), {"softmax_scale": float("nan")}, ValueError, "softmax_scale"),
        ((q, k, v), {"softmax_scale": -1.0}, ValueError, "softmax_scale"),
    ]
    for args, kw, exc, words in bad:
        with pytest.raises(exc, match=words):
            cuflash.attention(*args, **kw)
    assert launches == []
    # context still healthy: a real call works afterwards
    out = cuflash.attention(q, k, v)
    assert bool(cupy.isfinite(out.astype(cupy.float32)).all())




def test_arrays_on_two_devices():
    import cupy
    import cuflash

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs (the device-mismatch rule is also covered by CPU tests on ArrayInfo)")
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, 1, 16, 16, 1, 64, dtype_of("bfloat16"))
    with cupy.cuda.Device(1):
        k1 = cupy.asarray(k)
    with pytest.raises(ValueError, match="one device"):
        cuflash.attention(q, k1, v)
