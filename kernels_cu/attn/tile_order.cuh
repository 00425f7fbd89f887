// cuflash/kernels_cu/attn/tile_order.cuh
// Work-tile orders for kernels that stride over their tiles (the sm90 forward's persistent loop).
// (Its own header: attn/scheduler.cuh is the sm80 kernels' and keys their tuned entries.)
#pragma once
#include "attn/scheduler.cuh"

namespace cuflash {

// K/V heads per section of the heaviest-first order: with one CTA per SM drawing its tiles in
// order, ~4 CTAs per K/V head run at once on the H100's and H200's 132 SMs. A head's CTAs at adjacent
// ranks start together and stream the same K/V blocks nearly in step, so one's reads are L2 hits for
// the others. Measured (scripts/bench_l2_sections.py, d128 causal, 16k tokens x 16 heads): one section
// of all 128 (batch, head)s at N2048 (~1 CTA per head, every K/V block from DRAM at ~4 TB/s) 417-420
// TFLOP/s, sections of 16-32 heads 514-526; N512 250 -> 290. Sections of 2-8 heads at N8192 read
// 5-15% below one of 32 in a run whose warm-ups were too short to trust that (docs/perf-notes.md).
// A macro only so that scripts/bench_l2_sections.py can compile other counts beside it.
#ifndef CUFLASH_SECTION_KV_HEADS
#define CUFLASH_SECTION_KV_HEADS 32
#endif
constexpr int kSectionKVHeads = CUFLASH_SECTION_KV_HEADS;

// (batch, head)s per section of schedule_tiles_heaviest_first: kSectionKVHeads K/V heads' worth of
// query heads (gqa of them share one K/V head), at most bh_count (then one section: the plain
// rank-by-rank order).
__device__ __forceinline__ int section_heads(int gqa, int bh_count) {
    return (int)min((long long)bh_count, (long long)kSectionKVHeads * max(gqa, 1));
}

// Tile t of n_blocks * bh_count (bh_count = batch * heads) under a mask where later query blocks
// are heavier (bottom-right causal). The (batch, head)s go in sections of section_heads (the last
// may have fewer); within a section, every (batch, head)'s heaviest block first, then every one's
// next heaviest, ... (longest-processing-time first, round robin). CTAs that take the tiles in this
// order as they free up (drawn from a counter, or one CTA per tile) balance, the tail being the last
// section's lightest tiles. A grid striding over it (CTA i takes i, i + G, ...) balances only over
// one section (each section's offset against G moves the CTAs' shares by up to a heavy tile): give
// it section_heads >= bh_count, one section, rank = t / bh_count. (The block-fastest order of
// schedule_blocks would give a CTA a run of one head's heaviest blocks.)
__device__ __forceinline__ BlockCoord schedule_tiles_heaviest_first(int tile, int n_blocks, int bh_count, int n_heads,
                                                                    int section_heads) {
    BlockCoord c;
    const int per_section = n_blocks * section_heads;
    const int section = tile / per_section;
    const int first_bh = section * section_heads;
    const int heads_in = min(section_heads, bh_count - first_bh);
    const int rem = tile - section * per_section;
    const int rank = rem / heads_in;  // 0 = the heaviest block of every (batch, head) of the section
    c.bh = first_bh + (rem - rank * heads_in);
    c.block = n_blocks - 1 - rank;
    c.batch = c.bh / n_heads;
    c.head = c.bh - c.batch * n_heads;
    return c;
}

}  // namespace cuflash
