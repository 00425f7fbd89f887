"""The Hopper forward's column-masking instances against the sm80 forward that the automatic choice
gives those calls today (families/sm90.py, `auto_partial_d`), same run, same shapes: a value head
dim of its own (MLA's q/k 192 with v 128; 128 / 64) and head dims between the instances (160 on
the d192 instance, 104 on d128, 40 on d64), with SDPA's cuDNN and flash backends where torch has
them and they take the shape. The useful FLOPs count the call's head dims: 2 B H Nq Nk (d + d_v),
halved when causal.

    python scripts/bench_partial_d.py [--seqlens 2048 8192] [--causal] [--json out.json]

bf16, 16384 tokens (16 heads at head dims >= 128, else 32). Alternating rounds, the median round of
each (cuflash._timing's CUDA events inside). Flip `auto_partial_d` where sm90 wins (and its GPU
tests pass)."""
from __future__ import annotations

import json

PAIRS = [(192, 128), (128, 64), (160, 160), (104, 104), (40, 40)]


def _sdpa(q, k, v, causal):
    """SDPA's cuDNN and flash backends on the same arrays (zero-copy), those that take the shape."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention
    except ImportError:
        return {}
    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
    fns = {}
    for name, backend in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa flash", SDPBackend.FLASH_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel(backend):
                return scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        try:
            run()
            torch.cuda.synchronize()
        except RuntimeError:
            continue  # this backend does not take the shape (e.g. v's own head dim)
        fns[name] = run
    return fns


def main():
    import cupy

    from cuflash import _forward
    from cuflash._timing import time_rounds, variant_bench_parser, variant_bench_shape
    from cuflash.testing import dtype_of

    p = variant_bench_parser(__doc__)
    p.add_argument("--causal", action="store_true")
    a = p.parse_args()
    bf16 = dtype_of("bfloat16")
    rows = []
    for d, dv in PAIRS:
        for n in a.seqlens:
            b, h = variant_bench_shape(max(d, dv), n)
            rng = cupy.random.default_rng(0)
            q, k = (rng.standard_normal((b, n, h, d), dtype=cupy.float32).astype(bf16) for _ in range(2))
            v = rng.standard_normal((b, n, h, dv), dtype=cupy.float32).astype(bf16)
            fns = {be: (lambda be=be: _forward.forward(q, k, v, causal=a.causal, backend=be)) for be in ("sm80", "sm90")}
            fns.update(_sdpa(q, k, v, a.causal))
            for fn in fns.values():
                fn()
            ms = time_rounds(fns, a.rounds, a.reps, a.warmup_ms)
            flops = 2.0 * b * h * n * n * (d + dv) / (2 if a.causal else 1)
            tf = {name: flops / (t * 1e-3) / 1e12 for name, t in ms.items()}
            for name, x in tf.items():
                print(f"d{d}/{dv} N{n:6d} causal={int(a.causal)}  {name:12s} {x:7.1f} TFLOP/s  {x / tf['sm80']:6.3f} of sm80",
                      flush=True)
                rows.append(dict(head_dim=d, head_dim_v=dv, seqlen=n, batch=b, heads=h, causal=a.causal, call=name,
                                 tflops=x))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
