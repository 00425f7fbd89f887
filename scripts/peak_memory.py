"""Peak device memory of a forward and a backward at 128k and 1M tokens (issue 14): the memory a call
allocates beyond its inputs must be O(N) (out, lse, the backward's fp32 dQ accumulator and row
statistics), never O(N^2). Tracked with a CuPy memory hook over the call (every allocation of the
default pool), so other processes' memory does not count."""
from __future__ import annotations

import json
import sys
import time

import cupy
import numpy as np

sys.path.insert(0, ".")
import cuflash  # noqa: E402
from cuflash.testing import dtype_of, random_qkv  # noqa: E402


class PeakHook(cupy.cuda.MemoryHook):
    name = "PeakHook"

    def __init__(self):
        self.now = self.peak = 0

    def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
        self.now += mem_size
        self.peak = max(self.peak, self.now)

    def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
        self.now -= mem_size


def measure(n, heads, d=128, causal=True):
    q, k, v = random_qkv(np.random.default_rng(0), 1, n, n, heads, d, dtype_of("bfloat16"))
    dout = random_qkv(np.random.default_rng(1), 1, n, 1, heads, d, dtype_of("bfloat16"))[0]
    inputs = 4 * q.nbytes
    res = {"tokens": n, "heads": heads, "head_dim": d, "causal": causal, "input_bytes": inputs}
    cuflash.attention(q[:, :256], k[:, :256], v[:, :256], causal=causal)  # kernels compiled outside the hook
    cupy.cuda.Device().synchronize()
    with PeakHook() as h:
        t = time.perf_counter()
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        cupy.cuda.Device().synchronize()
        res["fwd_s"] = time.perf_counter() - t
        res["fwd_extra_bytes"] = h.peak
    with PeakHook() as h:
        t = time.perf_counter()
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
        cupy.cuda.Device().synchronize()
        res["bwd_s"] = time.perf_counter() - t
        res["bwd_extra_bytes"] = h.peak
    res["fwd_extra_per_token"] = res["fwd_extra_bytes"] / n
    res["bwd_extra_per_token"] = res["bwd_extra_bytes"] / n
    res["finite"] = bool(cupy.isfinite(out.astype(cupy.float32)).all()) and all(
        bool(cupy.isfinite(g.astype(cupy.float32)).all()) for g in grads)
    del out, lse, grads
    cupy.get_default_memory_pool().free_all_blocks()
    return res


def linear_bound(r) -> int:
    """What O(N) allows a pass: per token and head, the outputs and the backward's fp32 workspaces
    (out; dq, dk, dv; dq's fp32 accumulator; lse, delta, lse2), doubled for slack: 2 (10 d + 16)
    bytes. An N x N score matrix at 128k tokens would be 32 GiB per head."""
    return 2 * (10 * r["head_dim"] + 16) * r["tokens"] * r["heads"]


if __name__ == "__main__":
    rows = [measure(128 * 1024, 8), measure(1024 * 1024, 1)]
    bad = [r for r in rows if max(r["fwd_extra_bytes"], r["bwd_extra_bytes"]) > linear_bound(r) or not r["finite"]]
    for r in rows:
        print(f"{r['tokens']:>8} tokens x {r['heads']} heads, d{r['head_dim']}, causal: inputs {r['input_bytes'] / 2**20:.0f} MiB; "
              f"forward allocates {r['fwd_extra_bytes'] / 2**20:.1f} MiB ({r['fwd_extra_per_token']:.0f} B/token) in "
              f"{r['fwd_s']:.2f} s; backward {r['bwd_extra_bytes'] / 2**20:.1f} MiB ({r['bwd_extra_per_token']:.0f} B/token) "
              f"in {r['bwd_s']:.2f} s; finite {r['finite']}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)
    for r in bad:
        print(f"NOT O(N) or not finite at {r['tokens']} tokens: bound {linear_bound(r) / 2**20:.1f} MiB")
    sys.exit(1 if bad else 0)
