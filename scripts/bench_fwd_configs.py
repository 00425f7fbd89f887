"""The Hopper forward's tiles side by side on the benchmark's shapes, with SDPA's cuDNN backend in the
same alternating rounds: the automatic (tuned) tile, and every tile of the family's space at the
given q_stages / consumers / block_k (default: the two-consumer 128 x 128 tiles with two Q buffers,
which the staged epilogue needs). Each tile's output is checked against the automatic one's first
(max |diff|, bf16): an epilogue change shows up there before it shows up in the times.

    python scripts/bench_fwd_configs.py [--head-dims 128 64] [--seqlens 512 1024 2048] [--causal both]
        [--block-k 128] [--consumers 2] [--q-stages 2] [--json out.json]

bf16, 16k tokens x 2048 / head_dim heads (the benchmark's shapes), CUDA events, median round.
Run under scripts/ab_sources.sh to compare two versions of the kernel sources in one GPU call."""
from __future__ import annotations

import json


def main():
    from cuflash import device, families
    from cuflash._timing import variant_bench_parser, variant_bench_shape

    p = variant_bench_parser(__doc__, [128, 64])
    p.set_defaults(seqlens=[512, 1024, 2048])
    p.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    p.add_argument("--block-k", nargs="+", type=int, default=[128])
    p.add_argument("--consumers", nargs="+", type=int, default=[2])
    p.add_argument("--q-stages", nargs="+", type=int, default=[2])
    a = p.parse_args()
    fam = families.REGISTRY["fwd_sm90"]
    optin = device.query(0).smem_optin
    causals = {"no": [False], "yes": [True], "both": [False, True]}[a.causal]
    rows = []
    for d in a.head_dims:
        tiles = [t for t in fam.space(d, optin)
                 if t.block_k in a.block_k and t.consumers in a.consumers and t.q_stages in a.q_stages]
        for n in a.seqlens:
            b, h = variant_bench_shape(d, n)
            for causal in causals:
                rows += _cell(d, n, b, h, causal, tiles, a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


def _cell(d, n, b, h, causal, tiles, a) -> list:
    """One shape: cuDNN, the automatic tile and `tiles` in alternating rounds; printed and returned."""
    import cupy
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    from cuflash import _forward
    from cuflash._timing import flops_attention, time_rounds

    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qc, kc, vc = (cupy.from_dlpack(x.transpose(1, 2)) for x in (q, k, v))
    torch.cuda.synchronize()
    auto = cuflash.attention(qc, kc, vc, causal=causal)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    fns = {"cudnn": lambda: sdpa(q, k, v, is_causal=causal), "auto": lambda: cuflash.attention(qc, kc, vc, causal=causal)}
    diffs = {}
    for t in tiles:
        out, _ = _forward.forward(qc, kc, vc, causal=causal, config=t)
        diffs[str(t)] = float(cupy.abs(out.astype(cupy.float32) - auto.astype(cupy.float32)).max())
        fns[str(t)] = (lambda t=t: _forward.forward(qc, kc, vc, causal=causal, config=t))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # once, not per timed call (cuflash's calls ignore it)
        ms = time_rounds(fns, a.rounds, a.reps, a.warmup_ms)
    flops = flops_attention(b, h, n, n, d, causal, "fwd")
    rows = []
    for name, t in ms.items():
        tf = flops / (t * 1e-3) / 1e12
        ratio = ms["cudnn"] / t
        print(f"d{d} N{n:5d} causal={int(causal)} {name:70s} {t * 1e3:8.1f} us {tf:6.1f} TFLOP/s "
              f"{ratio:5.3f}x cuDNN  diff {diffs.get(name, 0.0):.2e}", flush=True)
        rows.append({"head_dim": d, "seqlen": n, "batch": b, "heads": h, "causal": causal, "call": name, "ms": t,
                     "tflops": tf, "of_cudnn": ratio, "max_diff_vs_auto": diffs.get(name)})
    return rows


if __name__ == "__main__":
    main()
