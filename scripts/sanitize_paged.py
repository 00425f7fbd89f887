"""Paged decode calls for compute-sanitizer (gpu_run.sh pagedtests): pools allocated exactly (CuPy's pool
off), so a read past a page or past the pool is an error memcheck sees. Page sizes that walk (1, 100)
and that take the grouped copy (16, 24, 256; sm80/decode.cuh GROUPED_PAGES), lengths ending mid-tile,
split and unsplit, d64 / d128."""
import numpy as np
import cupy

cupy.cuda.set_allocator(None)
import cuflash  # noqa: E402

rng = np.random.default_rng(0)
for d in (64, 128):
    for page in (1, 16, 24, 100, 256):
        cap, b, hk = 1000, 3, 2
        per = -(-cap // page)
        table = rng.permutation(b * per).reshape(b, per).astype(np.int32)
        kp = cupy.asarray(rng.standard_normal((b * per, page, hk, d)), dtype=cupy.float16)
        vp = cupy.asarray(rng.standard_normal((b * per, page, hk, d)), dtype=cupy.float16)
        q = cupy.asarray(rng.standard_normal((b, 1, 4, d)), dtype=cupy.float16)
        for splits in (1, 3):
            cuflash.attention_with_kvcache(q, kp, vp, cache_seqlens=[0, 17, cap], block_table=cupy.asarray(table),
                                           causal=True, num_splits=splits)
            cupy.cuda.Device().synchronize()
        print("done", d, page, flush=True)
