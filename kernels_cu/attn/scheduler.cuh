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

// The Hopper backward's deterministic mode (kernels_cu/sm90/bwd.cuh, DQ_BULK 3): each dQ block takes
// its key blocks' reductions in key-block order, so key block n of a head waits at every query block
// for key block n - 1. Started together, a head's resident key blocks form a staircase: the k-th
// idles k steps (one query block each) before its first turn. With the key blocks of one head
// fastest (schedule_blocks) a wave holds ~all of a head's key blocks (64 at seqlen 8192) over 128
// steps of work: a third of the time idle. So the heads go in groups: within a group the head is the
// fastest index, then the key block, so a wave holds ~(SMs / group) key blocks of each of `group`
// heads, the staircase that short, and a later wave's key blocks find their predecessors done.
// group: heads enough that a head's key blocks per wave are at most 1/16 of its query blocks (L2
// keeps each group head's dQ blocks in flight; Q, dO and dQ are fetched again per wave, which the
// H200's bandwidth absorbs). A CTA still waits only for CTAs of lower index (the same head's lower
// key blocks), which are dispatched no later: no deadlock.
__device__ __forceinline__ int ordered_group_heads(int bh_total, int m_blocks) {
    int n_sm;
    asm("mov.u32 %0, %%nsmid;" : "=r"(n_sm));  // SM ids (>= the SMs): one resident CTA per SM
    const int per_head = max(1, m_blocks / 16);  // key blocks of a head per wave
    return max(1, min(bh_total, (n_sm + per_head - 1) / per_head));
}

__device__ __forceinline__ BlockCoord schedule_blocks_grouped(int bid, int n_blocks, int n_heads, int bh_total,
                                                              int group) {
    BlockCoord c;
    const int g = bid / (n_blocks * group);  // the group; the last may have fewer heads
    const int rem = bid - g * n_blocks * group;
    const int heads_in = min(group, bh_total - g * group);
    c.block = rem / heads_in;
    c.bh = g * group + (rem - c.block * heads_in);
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
