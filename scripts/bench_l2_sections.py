"""The Hopper forward's causal tile order by sections of K/V heads (kernels_cu/attn/tile_order.cuh)
against the order without them, in one run: the same kernel compiled with other section sizes
(CUFLASH_SECTION_KV_HEADS; "off" is a size past every (batch, head) of these shapes, one section,
the order before sections), on dense causal batches of 16k tokens x 2048 / head_dim heads, each on
the family's default tile (drawn: persistent 2) and on the shipped table's tuned tile of the cell
(its nearest seqlen bucket), with SDPA's cuDNN and flash backends as the anchors. TFLOP/s, bf16,
CUDA events; every callable of a cell takes its turn in each of --rounds alternating rounds, each
after --warmup-ms of its own work (cuflash._timing.time_rounds), so the clock's drift is shared.

    python scripts/bench_l2_sections.py [--head-dims 128 64] [--seqlens 512 ... 16384] [--json out.json]
"""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

from cuflash._timing import time_rounds, variant_bench_parser

SIZES = {"off": 1 << 20, "16": 16, "32": 32, "64": 64}


def shipped_tile(head_dim: int, causal: bool, seqlen: int):
    """The shipped H200 table's fwd_sm90 dense tile for this head dim and the seqlen bucket nearest
    `seqlen` (stale or not), or None."""
    from cuflash.tiles import Sm90FwdConfig

    table = json.loads((pathlib.Path(__file__).resolve().parents[1] / "tuning" / "nvidia-h200.json").read_text())
    found = [e for e in table["entries"]
             if (e["kernel"], e["head_dim"], e["causal"], e["perf_class"]) == ("fwd_sm90", head_dim, causal, "dense")]
    if not found:
        return None
    e = min(found, key=lambda e: (abs(e["seqlen_bucket"].bit_length() - seqlen.bit_length()), -e["seqlen_bucket"]))
    return Sm90FwdConfig(**e["config"])


def main():
    import cupy
    import ml_dtypes
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    from cuflash import _compile, _forward, device, families

    ap = variant_bench_parser(__doc__, head_dims=[128, 64])
    ap.set_defaults(seqlens=[512, 1024, 2048, 4096, 8192, 16384], reps=15, rounds=3)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), help="section sizes (K/V heads) to compare")
    a = ap.parse_args()

    original = _compile.kernel_source

    def source_with(heads):
        @functools.lru_cache(maxsize=None)
        def src(tile, features):
            s = original(tile, features)
            return s if families.of(tile) is not families.FWD_SM90 else f"#define CUFLASH_SECTION_KV_HEADS {heads}\n{s}"
        return src

    sources = {name: source_with(SIZES[name]) for name in a.sizes}
    real_select = families.select
    state = {"size": None, "tile": None}

    def use(size, tile):
        if (state["size"], state["tile"]) != (size, tile):
            state.update(size=size, tile=tile)
            _compile.kernel_source = sources[size]
            _compile._loaded.clear()
            _forward._plans.clear()

    def select(fam, prob):
        t = real_select(fam, prob)
        return state["tile"] if fam is families.FWD_SM90 and state["tile"] is not None else t

    families.select = select
    rows = []
    for d in a.head_dims:
        h = 2048 // d
        for n in a.seqlens:
            b = 16384 // n
            for causal in (True,):
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                tq, tk, tv = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                q, k, v = (cupy.from_dlpack(x.view(torch.int16)).view(ml_dtypes.bfloat16) for x in (tq, tk, tv))
                torch.cuda.synchronize()
                prob = _problem(q, k, v, causal)
                props = device.supported(prob.device)
                # the default tile drawn (persistent 2): a strided grid takes no sections (tile_order.cuh)
                tiles = {"tuned": shipped_tile(d, causal, n),
                         "default": dataclasses.replace(families.FWD_SM90.default(d, props.smem_optin, prob.features),
                                                        persistent=2)}
                fns = {}
                ref = None
                for tname, tile in tiles.items():
                    if tile is None:
                        continue
                    for size in a.sizes:
                        def fn(size=size, tile=tile):
                            use(size, tile)
                            return cuflash.attention(q, k, v, causal=causal)
                        out = fn()
                        if ref is None:
                            ref = out.astype(cupy.float32)
                        elif tname == "tuned":  # the order changes which CTA runs a tile, never its result
                            assert bool((out.astype(cupy.float32) == ref).all()), (d, n, tname, size)
                        fns[f"{tname}_{size}"] = fn
                bq, bk, bv = (x.transpose(1, 2) for x in (tq, tk, tv))
                for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                    def sd(backend=backend):
                        with sdpa_kernel([backend]):
                            return torch.nn.functional.scaled_dot_product_attention(bq, bk, bv, is_causal=causal)
                    fns[name] = sd
                ms = time_rounds(fns, a.rounds, a.reps, a.warmup_ms)
                row = dict(d=d, n=n, b=b, h=h, causal=causal, tuned=str(tiles["tuned"]), default=str(tiles["default"]))
                row.update({key: round(flops / (t * 1e-3) / 1e12, 1) for key, t in ms.items()})
                for tname in ("tuned", "default"):
                    best = max((key for key in row if key.startswith(tname + "_")), key=row.get, default=None)
                    if best:
                        row[f"{tname}_best"] = best
                        row[f"{tname}_vs_cudnn"] = {bud: round(row[f"{tname}_{bud}"] / row["cudnn"], 3) for bud in a.sizes}
                rows.append(row)
                print(json.dumps(row), flush=True)
                fns = None
                cupy.get_default_memory_pool().free_all_blocks()
    families.select = real_select
    _compile.kernel_source = original
    print(f"{'d':>4} {'N':>6} " + " ".join(f"{t[:3]}_{bud:>4}" for t in ("tuned", "default") for bud in a.sizes)
          + "  cudnn  flash")
    for r in rows:
        print(f"{r['d']:>4} {r['n']:>6} " + " ".join(f"{r.get(f'{t}_{bud}', float('nan')):>8.1f}" for t in ("tuned", "default")
                                                  for bud in a.sizes) + f" {r['cudnn']:>6.1f} {r['flash']:>6.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


def _problem(q, k, v, causal):
    from cuflash import problem
    from cuflash.mask import MaskOptions

    infos = [problem.describe(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v"))]
    return problem.resolve_forward(*infos, MaskOptions.of(causal=causal), None)


if __name__ == "__main__":
    main()
