"""Markdown table of registers / spills / shared memory for every selectable config (no GPU)."""
from cuflash import _compile, families
from cuflash.features import Features

print("| kernel | config (d, Br x Bc, warps, stages) | dtype | arch | registers | spill bytes | dynamic smem |")
print("|---|---|---|---|---|---|---|")
for cfg in families.FWD.selectable() + (families.BWD.selectable() + families.BWD_DQ.selectable()):
    for dtype in ("bfloat16", "float16"):
        for arch in ("sm_80", "sm_90a"):
            r = _compile.compile_report(_compile.kernel_source(cfg, Features(dtype, cfg.head_dim)), arch)
            print(f"| {families.of(cfg).name} | d{cfg.head_dim} {cfg.block_q}x{cfg.block_k}, {cfg.warps}, {cfg.stages} | {dtype} | "
                  f"{arch} | {r['registers']} | {r['spill_stores']} | {cfg.smem_bytes // 1024} KB |")
