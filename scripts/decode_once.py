"""One decoding step of issue 17's cells for ncu (scripts/ncu_decode.sh): bf16 torch tensors, 32/8 heads, d128, one
query token, a contiguous cache (or, --page-size P, the same rows as shuffled pages of P rows for
ours); ours (cuflash.attention_with_kvcache, --splits, 0 = the heuristic) or SDPA cuDNN's (--cudnn)
on the same cache. Warms up, then runs --calls steps between
cudaProfilerStart and Stop, so `ncu --profile-from-start off` sees only those launches."""
import argparse
import sys

sys.path.insert(0, ".")


def main():
    import cupy
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash

    ap = argparse.ArgumentParser()
    ap.add_argument("--cell", default="1x131072")
    ap.add_argument("--splits", type=int, default=0)
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--cudnn", action="store_true")
    ap.add_argument("--page-size", type=int, default=0, help="ours on shuffled pages of this many rows (0: contiguous)")
    a = ap.parse_args()
    b, n = map(int, a.cell.split("x"))
    kc, vc = (torch.randn(b, n, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    table = None
    if a.page_size:  # paged_probe.py's shuffled pages (the same table for K and V), bf16 carried as int16
        from paged_probe import _pool

        def paged(c):
            pool, tab = _pool(cupy.from_dlpack(c.view(torch.int16)), a.page_size, "shuffled")
            return torch.from_dlpack(pool).view(torch.bfloat16), torch.from_dlpack(tab)

        (kc, table), (vc, _) = paged(kc), paged(vc)
    q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    if a.cudnn:
        tq, tk, tv = (x.transpose(1, 2) for x in (q, kc, vc))

        def step():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
    else:

        def step():
            cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=n, num_splits=a.splits, block_table=table)
    for _ in range(5):
        step()
    cupy.cuda.Device().synchronize()
    cupy.cuda.runtime.profilerStart()
    for _ in range(a.calls):
        step()
    cupy.cuda.Device().synchronize()
    cupy.cuda.runtime.profilerStop()


if __name__ == "__main__":
    main()
