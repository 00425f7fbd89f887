"""Markdown table of registers / spills / shared memory (no GPU).

    python scripts/compile_table.py                  every selectable config of the sm80 families
    python scripts/compile_table.py --shipped KERNEL  the configs a shipped table selects for KERNEL
                                                      (e.g. fwd_sm90, bwd_sm90), with the family's
                                                      default, compiled for sm_90a in bf16

For the sm90 families ptxas reports the registers of the launch bound (every warp's share of the
file before setmaxnreg moves registers from the producer to the consumers); the split after it is
the traits' (kernels_cu/sm90/traits.cuh, bwd_traits.cuh)."""
import json
import pathlib
import sys

from cuflash import _compile, families
from cuflash.features import Features


def sm80_rows():
    print("| kernel | config (d, Br x Bc, warps, stages) | dtype | arch | registers | spill bytes | dynamic smem |")
    print("|---|---|---|---|---|---|---|")
    for cfg in families.FWD.selectable() + (families.BWD.selectable() + families.BWD_DQ.selectable()):
        for dtype in ("bfloat16", "float16"):
            for arch in ("sm_80", "sm_90a"):
                r = _compile.compile_report(_compile.kernel_source(cfg, Features(dtype, cfg.head_dim)), arch)
                print(f"| {families.of(cfg).name} | d{cfg.head_dim} {cfg.block_q}x{cfg.block_k}, {cfg.warps}, {cfg.stages} | {dtype} | "
                      f"{arch} | {r['registers']} | {r['spill_stores']} | {cfg.smem_bytes // 1024} KB |")


def shipped_rows(kernel: str, table: str = "tuning/nvidia-h200.json"):
    fam = families.REGISTRY[kernel]
    entries = [e for e in json.loads(pathlib.Path(table).read_text())["entries"] if e["kernel"] == kernel]
    uses: dict = {}  # config -> the cells that select it
    for e in sorted(entries, key=lambda e: (e["head_dim"], e["perf_class"], e["causal"], e["seqlen_bucket"])):
        cfg = fam.tile_from_dict(e["config"])
        uses.setdefault(cfg, []).append(f"{e['perf_class']}{' causal' if e['causal'] else ''} {e['seqlen_bucket']}")
    for d in sorted({c.head_dim for c in uses}):
        uses.setdefault(fam.default(d), []).append("default")
    print("| config | selected for (d: class, seqlen bucket) | registers (launch bound) | spill bytes | dynamic smem |")
    print("|---|---|---|---|---|")
    for cfg, cells in sorted(uses.items(), key=lambda kv: (kv[0].head_dim, kv[0].label())):
        r = _compile.compile_report(_compile.kernel_source(cfg, Features("bfloat16", cfg.head_dim)), "sm_90a")
        print(f"| d{cfg.head_dim} {cfg.label()} | {', '.join(cells)} | {r['registers']} | {r['spill_stores']} | "
              f"{cfg.smem_bytes / 1024:.0f} KB |")


if __name__ == "__main__":
    if "--shipped" in sys.argv:
        shipped_rows(sys.argv[sys.argv.index("--shipped") + 1])
    else:
        sm80_rows()
