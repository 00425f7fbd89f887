// cuflash/kernels_cu/attn/scheduler.cuh
// Thread block -> (row block, head, batch). The row block index is the fastest, so blocks that
// run together share one head's K/V (or Q/dO) in L2.
#pragma once
#include "core/types.cuh"

namespace cuflash {

struct BlockCoord {
    int block;  // m_block (query tile) for fwd / dq, n_block (key tile) for dK/dV
    int bh;     // batch * n_heads + head
    int batch, head;
};

// blockIdx.x = block + n_blocks * (head + n_heads * batch). With heaviest_first the block order
// is reversed: under a bottom-right causal mask the last query tiles see the most keys, so they
// start first and the short ones fill the tail of the wave.
__device__ __forceinline__ BlockCoord schedule_blocks(int bid, int n_blocks, int n_heads, bool heaviest_first) {
    BlockCoord c;
    c.bh = bid / n_blocks;
    c.block = bid - c.bh * n_blocks;
    if (heaviest_first) c.block = n_blocks - 1 - c.block;
    c.batch = c.bh / n_heads;
    c.head = c.bh - c.batch * n_heads;
    return c;
}

// One block per (batch, head) (the v1 forward, FlashAttention-1's parallelisation).
__device__ __forceinline__ BlockCoord schedule_heads(int bid, int n_heads) {
    BlockCoord c;
    c.block = 0;
    c.bh = bid;
    c.batch = bid / n_heads;
    c.head = bid - c.batch * n_heads;
    return c;
}

}  // namespace cuflash
