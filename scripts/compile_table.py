"""Markdown table of registers / spills / shared memory for every selectable config (no GPU)."""
from cuflash import _compile, _configs

print("| kernel | config (d, Br x Bc, warps, stages) | dtype | arch | registers | spill bytes | dynamic smem |")
print("|---|---|---|---|---|---|---|")
for cfg in _configs.selectable_fwd_configs() + _configs.selectable_bwd_configs():
    for dtype in ("bfloat16", "float16"):
        for arch in ("sm_80", "sm_90a"):
            r = _compile.compile_report(_compile.kernel_source(cfg, dtype), arch)
            print(f"| {cfg.KERNEL} | d{cfg.head_dim} {cfg.block_q}x{cfg.block_k}, {cfg.warps}, {cfg.stages} | {dtype} | "
                  f"{arch} | {r['registers']} | {r['spill_stores']} | {cfg.smem_bytes // 1024} KB |")
