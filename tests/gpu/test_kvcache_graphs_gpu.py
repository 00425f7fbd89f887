"""attention_with_kvcache inside CUDA graphs (issues 17 and 18), as a serving loop uses it: a decoding
step captured once and replayed each step, the cache's lengths (and pages) on the GPU, updated in
place between replays. Each replay must write what an eager call on the same state writes, bit for
bit, into the output and the cache; memory the program allocates after the capture must stay its
own. Each case runs in a child process: a replay that writes freed memory can end the process."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[2]

_STEP_LOOP = r"""
import sys
import cupy
import numpy as np
import cuflash

lengths_kind, paged, splits, n_new = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
rng = np.random.default_rng(7)
B, H, HK, D, CAP, PAGE = 3, 8, 2, 128, 512, 64
mk = lambda *s: cupy.asarray(rng.standard_normal(s).astype(np.float32)).astype(cupy.float16)
q = mk(B, 1, H, D)
kc, vc = mk(B, CAP, HK, D), mk(B, CAP, HK, D)
kn = mk(B, n_new, HK, D) if n_new else None
vn = mk(B, n_new, HK, D) if n_new else None
start = np.array([5, 200, 300], np.int32)
if paged:  # the same keys, in shuffled pages
    n_pages = B * CAP // PAGE
    perm = rng.permutation(n_pages).astype(np.int32)
    table = cupy.asarray(perm.reshape(B, CAP // PAGE))
    def paged_of(c):
        pool = cupy.empty((n_pages, PAGE, HK, D), dtype=c.dtype)
        pool[cupy.asarray(perm)] = c.reshape(n_pages, PAGE, HK, D)
        return pool
    kc, vc = paged_of(kc), paged_of(vc)
else:
    table = None
lens_dev = cupy.asarray(start)
lens_arg = {"device": lens_dev, "int": 200}[lengths_kind]
bits = lambda a: cupy.ascontiguousarray(a).view(cupy.uint8).get()

def step(k_cache, v_cache, lens):
    return cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, k_new=kn, v_new=vn,
                                          causal=True, num_splits=splits, block_table=table, return_lse=True)

# two copies of the cache: the graph's and the eager calls'
gk, gv, ek, ev = kc.copy(), vc.copy(), kc.copy(), vc.copy()
stream = cupy.cuda.Stream(non_blocking=True)
with stream:
    for _ in range(2):  # compiled, planned, staged (the warm-up writes the scratch copies)
        wk, wv = kc.copy(), vc.copy()
        step(wk, wv, lens_arg if lengths_kind == "int" else lens_dev.copy())
    stream.synchronize()
    stream.begin_capture()
    g_out, g_lse = step(gk, gv, lens_arg)
    graph = stream.end_capture()
    # an int length without new rows: the graph holds the decode kernel alone (kvcache._uniform_plan)
    assert len(cuflash.kvcache._uniform_plans) == (lengths_kind == "int" and not n_new)
    cupy.get_default_memory_pool().free_all_blocks()
    others = [cupy.full(n, np.nan, dtype=cupy.float32) for n in (1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20) * 4]
    e_lens = lens_dev.copy()
    for it in range(3):
        graph.launch(stream)
        e_out, e_lse = step(ek, ev, lens_arg if lengths_kind == "int" else e_lens)
        stream.synchronize()
        for name, got, want in (("out", g_out, e_out), ("lse", g_lse, e_lse), ("k_cache", gk, ek), ("v_cache", gv, ev)):
            assert (bits(got) == bits(want)).all(), (name, it)
        if lengths_kind == "device" and n_new:  # the next step's lengths, in place, as a serving loop does
            lens_dev += n_new
            e_lens += n_new
assert all(bool(cupy.isnan(a).all()) for a in others), "a replay wrote into memory the program had since allocated"
print("ok")
"""

_HOST_LIST = r"""
import cupy
import numpy as np
import cuflash

mk = lambda *s: cupy.asarray(np.random.default_rng(0).standard_normal(s).astype(np.float32)).astype(cupy.float16)
q, kc, vc = mk(2, 1, 8, 64), mk(2, 256, 2, 64), mk(2, 256, 2, 64)
cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=[10, 20])
stream = cupy.cuda.Stream(non_blocking=True)
with stream:
    stream.synchronize()
    stream.begin_capture()
    try:
        cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=[10, 20])
    except RuntimeError as e:
        print("refused:", e)
    finally:
        stream.end_capture()
"""


def _child(code: str, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, cwd=ROOT, check=False,
                          env=env, timeout=300)


@pytest.mark.parametrize("lengths", ["device", "int"])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("splits", [1, 4, 0])
@pytest.mark.parametrize("n_new", [0, 1])
def test_a_captured_decoding_step_replays_as_eager_calls(lengths, paged, splits, n_new):
    r = _child(_STEP_LOOP, lengths, int(paged), splits, n_new)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_host_lengths_are_refused_inside_a_capture_and_named():
    r = _child(_HOST_LIST)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "refused: cache_seqlens given on the host cannot be captured into a CUDA graph" in r.stdout, r.stdout


_TORCH_STEP = r"""
import torch
import cuflash

torch.manual_seed(0)
dev = "cuda"
B, H, HK, D, CAP = 3, 8, 2, 128, 512
mk = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16)
q, kc, vc, kn, vn = mk(B, 1, H, D), mk(B, CAP, HK, D), mk(B, CAP, HK, D), mk(B, 1, HK, D), mk(B, 1, HK, D)
lens = torch.tensor([5, 200, 300], device=dev, dtype=torch.int32)
gk, gv, ek, ev = kc.clone(), vc.clone(), kc.clone(), vc.clone()
step = lambda k, v, n: cuflash.attention_with_kvcache(q, k, v, cache_seqlens=n, k_new=kn, v_new=vn, causal=True,
                                                      return_lse=True)
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(2):
        step(kc.clone(), vc.clone(), lens.clone())
torch.cuda.current_stream().wait_stream(side)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    g_out, g_lse = step(gk, gv, lens)
e_lens = lens.clone()
for it in range(3):
    g.replay()
    e_out, e_lse = step(ek, ev, e_lens)
    torch.cuda.synchronize()
    for name, got, want in (("out", g_out, e_out), ("lse", g_lse, e_lse), ("k_cache", gk, ek), ("v_cache", gv, ev)):
        assert torch.equal(got, want), (name, it)
    lens += 1
    e_lens += 1
print("ok")
"""


def test_a_torch_graph_of_a_decoding_step_replays_as_eager_calls():
    pytest.importorskip("torch")
    r = _child(_TORCH_STEP)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
