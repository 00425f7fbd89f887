// cuflash/kernels_cu/attn/block_range.cuh
// Which blocks a tile visits and which of them need the mask, from the canonical MaskGeometry
// (attn/mask.cuh). tests/test_block_range_twin.py is the NumPy twin of every formula here.
//
// Block pair (query block i of BR rows, key block j of BC keys) is VISITED iff some (q, k) of it,
// counting the virtual rows and keys that pad the last tiles (q >= seqlen_q, k >= seqlen_k),
// lies inside the window:
//     j BC <= (i BR + BR - 1) + offset + window_right   and   j BC + BC - 1 >= i BR + offset - window_left
// within the block grid (i < ceil(seqlen_q / BR), j < ceil(seqlen_k / BC)). key_blocks (forward,
// v1, dQ) and query_blocks (dK/dV, v1) enumerate the same pairs from either side; v1 relies on
// that. A visited block is UNMASKED iff every real-key element of it is visible to every row,
// virtual rows included, and it has no seqlen_k tail. Masked blocks may sit at both ends of a
// range (a sliding window has a masked head and a masked tail).
//
// LOCAL (attn/features.cuh, Variant::kLocal): the geometry may have a bounded left edge. Without
// it (window_left = kUnbounded, MaskGeometry::of) the left-edge bounds are constants here -- key
// ranges start at block 0 with no masked head, query ranges end at m_blocks with no masked tail --
// rather than values ptxas would compute from the sentinel and keep live. Same results either way
// (tests/test_block_range_twin.py checks both forms).
#pragma once
#include "attn/mask.cuh"

namespace cuflash {

struct BlockRange {
    int begin, end;                    // blocks visited: [begin, end), begin <= end
    int unmasked_begin, unmasked_end;  // no mask needed in [unmasked_begin, unmasked_end) (may be empty)
    // Block b needs the mask: in the masked head (left window edge) or the masked tail (right
    // edge, seqlen tail). Both can hold for one block.
    __device__ __forceinline__ bool masked_head(int b) const { return b < unmasked_begin; }
    __device__ __forceinline__ bool masked_tail(int b) const { return b >= unmasked_end; }
    __device__ __forceinline__ bool needs_mask(int b) const { return masked_head(b) || masked_tail(b); }
    __device__ __forceinline__ int size() const { return end - begin; }
};

// Key blocks of BC keys visited by the query rows [r0, r0 + BR) (forward, dQ, v1).
template <int BR, int BC, bool LOCAL>
__device__ __forceinline__ BlockRange key_blocks(const MaskGeometry& geo, int r0) {
    BlockRange r;
    const int ke_first = geo.key_end(r0), ke_last = geo.key_end(r0 + BR - 1);  // key end of the first / last row
    r.end = ke_last <= 0 ? 0 : (ke_last + BC - 1) / BC;
    if constexpr (LOCAL) {
        const int kb_first = geo.key_begin(r0), kb_last = geo.key_begin(r0 + BR - 1);  // first key of the first / last row
        r.begin = min(r.end, kb_first <= 0 ? 0 : kb_first / BC);
        r.unmasked_begin = kb_last <= 0 ? 0 : (kb_last + BC - 1) / BC;
    } else {  // key_begin(q) < 0 for every row
        r.begin = r.unmasked_begin = 0;
    }
    r.unmasked_end = ke_first <= 0 ? 0 : ke_first / BC;  // key_end <= seqlen_k: no tail block
    return r;
}

// Query blocks of BR rows that visit key block n_block of BC keys (dK/dV, v1). m_blocks =
// ceil(seqlen_q / BR). A key block with a seqlen_k tail masks every query block (head = all).
template <int BR, int BC, bool LOCAL>
__device__ __forceinline__ BlockRange query_blocks(const MaskGeometry& geo, int n_block, int m_blocks) {
    BlockRange r;
    const int c0 = n_block * BC;
    const int qf_first = geo.query_first(c0), qf_last = geo.query_first(c0 + BC - 1);  // first query of the first / last key
    if constexpr (LOCAL) {
        const int ql_first = geo.query_last(c0), ql_last = geo.query_last(c0 + BC - 1);  // last query of the first / last key
        r.end = ql_last < 0 ? 0 : min(m_blocks, ql_last / BR + 1);
        r.unmasked_end = ql_first < 0 ? 0 : (ql_first + 1) / BR;
    } else {  // query_last(k) >= every query block
        r.end = r.unmasked_end = m_blocks;
    }
    r.begin = min(r.end, qf_first <= 0 ? 0 : qf_first / BR);
    // In query order the window's right edge and the seqlen_k tail mask the head of the range
    // (Mask::apply_transposed<false, true>), the left edge its tail (<true, false>).
    r.unmasked_begin = c0 + BC > geo.seqlen_k ? m_blocks : qf_last <= 0 ? 0 : (qf_last + BR - 1) / BR;
    return r;
}

// Query blocks whose key range is not empty: [begin, end) (unmasked_* unused). The rest see no
// key at all; a kernel that never visits them (v1) writes their O = 0 and lse = -inf itself.
template <int BR, int BC, bool LOCAL>
__device__ __forceinline__ BlockRange live_query_blocks(const MaskGeometry& geo, int m_blocks) {
    BlockRange r;
    const int qf = geo.query_first(0);  // first query that may see key 0
    if constexpr (LOCAL) {
        const int ql = geo.query_last((geo.seqlen_k + BC - 1) / BC * BC - 1);  // last query that may see the last (virtual) key
        r.end = ql < 0 ? 0 : min(m_blocks, ql / BR + 1);
    } else {
        r.end = m_blocks;
    }
    r.begin = min(r.end, qf <= 0 ? 0 : qf / BR);
    r.unmasked_begin = r.unmasked_end = 0;
    return r;
}

}  // namespace cuflash
