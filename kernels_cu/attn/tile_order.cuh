// cuflash/kernels_cu/attn/tile_order.cuh
// Work-tile orders for kernels that stride over their tiles (the sm90 forward's persistent loop).
// (Its own header: attn/scheduler.cuh is the sm80 kernels' and keys their tuned entries.)
#pragma once
#include "attn/scheduler.cuh"

namespace cuflash {

// K and V bytes the (batch, head)s of one section of the heaviest-first order may hold in L2 together
// (the H100's and H200's L2 is 50 MB; the rest is Q and O streaming through, and the sections' overlap).
// A macro only so that scripts/bench_l2_sections.py can compile other budgets beside it (at most
// 2^21 KiB: times the GQA factor's 1024 it stays within 32 bits).
#ifndef CUFLASH_L2_SECTION_KIB
#define CUFLASH_L2_SECTION_KIB (32u * 1024u)
#endif
constexpr unsigned kL2SectionKiB = CUFLASH_L2_SECTION_KIB;

// (batch, head)s per section of schedule_tiles_heaviest_first: as many as have their K and V rows
// (seqlen_k rows of kv_row_bytes each, gqa query heads sharing one K/V head) within kL2SectionKiB
// together; at least 1, at most bh_count (then one section: the plain rank-by-rank order).
// Why sections: ranked over every (batch, head) at once, the CTAs resident together hold one tile of
// ~as many different heads as there are SMs, so when the heads outnumber the SMs (short causal
// sequences: 128 of them at 16k tokens x 16 heads of 2048) no two share a K/V block and every one
// comes from DRAM (d128 N2048 causal read ~4 TB/s of K/V, the H200's copy bandwidth). Within a
// section the same number of CTAs spans ~SMs / section_heads tiles of each of its heads, which read
// the same K/V blocks from L2.
__device__ __forceinline__ int l2_section_heads(int seqlen_k, int kv_row_bytes, int gqa, int bh_count) {
    // KiB of one K/V head, in 32 bits: seqlen_k < 2^31, kv_row_bytes <= 1024 (at least 1)
    const unsigned per_head_kib = max((unsigned)(seqlen_k >> 4) * (unsigned)(kv_row_bytes >> 6), 1u);
    const unsigned g = (kL2SectionKiB * (unsigned)min(max(gqa, 1), 1024)) / per_head_kib;
    return (int)min((unsigned)bh_count, max(g, 1u));
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
