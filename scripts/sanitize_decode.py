import numpy as np, cupy
cupy.cuda.set_allocator(None)
import cuflash
rng = np.random.default_rng(0)
for d in (64, 128):
    kc = cupy.asarray(rng.standard_normal((3, 1000, 2, d)), dtype=cupy.float16)
    vc = cupy.asarray(rng.standard_normal((3, 1000, 2, d)), dtype=cupy.float16)
    q = cupy.asarray(rng.standard_normal((3, 1, 4, d)), dtype=cupy.float16)
    for splits in (1, 3):
        cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=[0, 17, 999], causal=True, num_splits=splits)
        cupy.cuda.Device().synchronize()
        print("done", d, splits, flush=True)
