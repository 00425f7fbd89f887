// cuflash/kernels_cu/attn/block_range.cuh
// Which key blocks a query block visits and which of them need the mask (forward, dQ); the
// reverse for the dK/dV kernel (which query blocks see a key block).
#pragma once
#include "core/types.cuh"

namespace cuflash {

struct BlockRange {
    int n_begin, n_end;                // blocks visited: [n_begin, n_end)
    int unmasked_begin, unmasked_end;  // no mask needed in [unmasked_begin, unmasked_end)
    __device__ __forceinline__ bool needs_mask(int n) const { return n >= unmasked_end; }
};

// Key blocks of BC keys for the query rows [r0, r0 + BR).
template <int BR, int BC>
__device__ __forceinline__ BlockRange key_blocks_of(int r0, int seqlen_q, int seqlen_k, int causal) {
    BlockRange r;
    const int off = seqlen_k - seqlen_q;  // bottom-right alignment offset
    r.n_begin = 0;
    r.unmasked_begin = 0;
    r.n_end = (seqlen_k + BC - 1) / BC;
    r.unmasked_end = seqlen_k / BC;
    if (causal) {
        int last_key = r0 + BR - 1 + off;  // largest key the tile's last row may see
        r.n_end = min(r.n_end, last_key < 0 ? 0 : last_key / BC + 1);
        int first_row_keys = r0 + off + 1;  // keys [0, first_row_keys) visible to every row
        r.unmasked_end = min(r.unmasked_end, first_row_keys < 0 ? 0 : first_row_keys / BC);
    }
    return r;
}

// First query block of BR rows that sees any key of key block j (BC keys): query block i
// (rows r0 = i*BR ..) sees block j iff its last row does, r0 + BR - 1 + off >= j*BC.
template <int BR, int BC>
__device__ __forceinline__ int first_query_block(int j, int off, int causal) {
    const int x = j * BC - off - BR + 1;
    return (!causal || x <= 0) ? 0 : (x + BR - 1) / BR;
}

// Query blocks of BR rows that see key block c0 / BC (the dK/dV kernel): [m_begin, m_blocks).
template <int BR>
__device__ __forceinline__ int query_block_begin(int c0, int off, int m_blocks, int causal) {
    int m_begin = 0;
    if (causal) {
        int first_row = c0 - off;  // first query that sees key c0
        m_begin = first_row <= 0 ? 0 : min(m_blocks, first_row / BR);
    }
    return m_begin;
}

}  // namespace cuflash
