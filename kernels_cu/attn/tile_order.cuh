// cuflash/kernels_cu/attn/tile_order.cuh
// Work-tile orders for kernels that stride over their tiles (the sm90 forward's persistent loop).
// (Its own header: attn/scheduler.cuh is the sm80 kernels' and keys their tuned entries.)
#pragma once
#include "attn/scheduler.cuh"

namespace cuflash {

// Tile t of n_blocks * bh_count (bh_count = batch * heads) under a mask where later query blocks
// are heavier (bottom-right causal): every (batch, head)'s heaviest block first, then every
// one's next heaviest, ... A grid that strides over this order (CTA i takes i, i + G, ...) gets an
// even share of heavy and light tiles (longest-processing-time first, round robin); the
// block-fastest order of schedule_blocks would give a CTA a run of one head's heaviest blocks.
__device__ __forceinline__ BlockCoord schedule_tiles_heaviest_first(int tile, int n_blocks, int bh_count, int n_heads) {
    BlockCoord c;
    const int rank = tile / bh_count;  // 0 = the heaviest block of every (batch, head)
    c.bh = tile - rank * bh_count;
    c.block = n_blocks - 1 - rank;
    c.batch = c.bh / n_heads;
    c.head = c.bh - c.batch * n_heads;
    return c;
}

}  // namespace cuflash
