"""Issue 13's snippet bar by tile: the snippet that re-expresses softcap (cap 30 on tanh_approx) on
named Hopper-forward tiles, against the built-in softcap on its class tile, same run.

    python scripts/bench_snippet_tiles.py [--head-dims 128 64] [--seqlens 2048 8192] [--json out.json]

Why: a snippet runs the first tile of (the dense class's tuned one, the family's defaults) whose
instance does not spill (families._tile_for_snippet), the ping-pong dense default today, while the
built-in softcap runs its class's tile (two consumers without ping-pong, two Q stages, a greedy
persistent grid). That tile spills 56 B with such a snippet at d128 (O's staging), so this times the
clean neighbours (one Q stage; ping-pong on / off; persistent grid drawn / static; at d64 two
consumers with two Q stages), and the spilling class tile itself, to see which, if any, brings the
snippet within 5% of the built-in.
Each forced tile is its own snippet text (a trailing comment: its own kernel and plan), forced by
wrapping families._tile_for_snippet in this process only. bf16, the variant benches' shapes,
alternating rounds (cuflash._timing.time_rounds).
"""
from __future__ import annotations

import json

# the last of each: softcap's own class tile, which spills with this snippet (d128 56 B, O's staging;
# d64 52-56 B, three consumers): what the spill costs, against the clean neighbours before it
TILES = {128: [dict(consumers=2, pingpong=0, q_stages=1, persistent=2),
               dict(consumers=2, pingpong=1, q_stages=1, persistent=2),
               dict(consumers=2, pingpong=0, q_stages=1, persistent=1),
               dict(consumers=2, pingpong=0, q_stages=2, persistent=2)],
         64: [dict(consumers=2, pingpong=0, q_stages=2, persistent=2),
              dict(consumers=2, pingpong=0, q_stages=1, persistent=2),
              dict(consumers=2, pingpong=1, q_stages=1, persistent=2),
              dict(consumers=3, pingpong=0, q_stages=2, persistent=2)]}
SNIPPET = "30.f * tanh_approx(score / 30.f)"


def main():
    import cupy

    import cuflash
    from cuflash import families
    from cuflash._timing import flops_attention, time_rounds, variant_bench_parser, variant_bench_shape
    from cuflash.testing import dtype_of

    p = variant_bench_parser(__doc__, [128, 64])
    a = p.parse_args()
    forced, automatic = {}, families._tile_for_snippet

    def tile_for_snippet(family, problem, props, tuned):
        src = problem.features.mod.score or ""
        return next((t for tag, t in forced.items() if tag in src), None) or automatic(family, problem, props, tuned)

    families._tile_for_snippet = tile_for_snippet
    bf16, rows = dtype_of("bfloat16"), []
    for d in a.head_dims:
        for n in a.seqlens:
            b, h = variant_bench_shape(d, n)
            rng = cupy.random.default_rng(0)
            q, k, v = (rng.standard_normal((b, n, h, d), dtype=cupy.float32).astype(bf16) for _ in range(3))
            calls = {"plain": dict(), "softcap (built-in)": dict(softcap=30.0),
                     "snippet, automatic tile": dict(score_mod=cuflash.ScoreMod(SNIPPET))}
            for i, cfg in enumerate(TILES.get(d, [])):
                tag = f"/* tile {d} {i} */"
                base = {"head_dim": d, "block_k": 128, "stages": 2, "overlap": 1}
                forced[tag] = families.FWD_SM90.tile_from_dict({**base, **cfg})
                name = f"snippet, c{cfg['consumers']} pp{cfg['pingpong']} q{cfg['q_stages']} p{cfg['persistent']}"
                calls[name] = dict(score_mod=cuflash.ScoreMod(f"{SNIPPET} {tag}"))
            fns = {name: (lambda kw=kw: cuflash.attention(q, k, v, **kw)) for name, kw in calls.items()}
            for fn in fns.values():
                fn()
            ms = time_rounds(fns, a.rounds, a.reps, a.warmup_ms)
            flops = flops_attention(b, h, n, n, d, False, "fwd")
            for name, t in ms.items():
                ref = "softcap (built-in)" if name.startswith("snippet") else "plain"
                print(f"d{d} N{n:6d}  {name:28s} {flops / (t * 1e-3) / 1e12:7.1f} TFLOP/s  {ms[ref] / t:6.3f} of {ref}",
                      flush=True)
                rows.append(dict(head_dim=d, seqlen=n, batch=b, heads=h, call=name, ms=t, of=ref, ratio=ms[ref] / t))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
