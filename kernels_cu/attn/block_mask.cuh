// cuflash/kernels_cu/attn/block_mask.cuh
// Block masks for mask snippets (cuflash.BlockMask, cuflash/block_mask.py): the key blocks a mask
// snippet leaves empty are not visited at all (FlexAttention's BlockMask, built explicitly).
//
//   cells  (once per mask and shape): one bit per 16 x 16 cell of (query, key) positions of each
//          (batch, head) of the mask (1 where the snippet reads neither: broadcast), set iff the
//          snippet keeps some pair of the cell; bits[bh][query cell][key cell / 32], bit cell % 32.
//          A second bit array marks the full cells (every pair kept).
//   lists  (once per tile shape BR x BC, multiples of 16): for each query block i, the key blocks
//          j with a set cell in rows [i BR, i BR + BR) x keys [j BC, j BC + BC), ascending:
//          counts[bh][i] and index[bh][i][0 .. counts), each entry j | kFullBlock where all its
//          cells are full (the forwards skip the mask snippet there: same scores, no per-score work).
//          Transposed, for the dK/dV kernels: per key block, its query blocks.
//   BlockList (the kernels): a tile's steps are the listed blocks inside the built-in mask's
//          BlockRange instead of the whole range. Visiting an empty block changes nothing
//          (its P is 0: no rescale, no sum, no P V term), so skipping it gives the same bits.
#pragma once
#include "attn/block_range.cuh"

namespace cuflash {

constexpr int kMaskCell = 16;  // positions per cell side
// A list entry: the block index, and this bit where the mask keeps every pair of the block (a
// "full" block: the forwards skip the mask snippet there)
constexpr int kFullBlock = 1 << 30;

// First index of the ascending list a[0 .. n) whose block index is >= x (n when none).
__device__ __forceinline__ int lower_bound(const int* __restrict__ a, int n, int x) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if ((__ldg(a + mid) & (kFullBlock - 1)) < x) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// The cells pass: a warp per (query cell, 32 key cells, bh); grid (qcells, kwords, min(bh count,
// 65535)): the query cells in x, whose limit is 2^31 - 1 (a million-token query side is 65,536
// cells, one past y's limit); z strides over the bh_count (batch, head) pairs, which may pass z's
// limit of 65,535.
// Defs: the snippets' UserModDefs<true> (attn/score_mod.cuh); `heads`: the mask's heads (1 when
// broadcast), so bh = b * heads + h. bits: some pair of the cell kept; full: every pair of it (its
// pairs inside the sequences) kept.
template <class Defs>
__device__ __forceinline__ void block_mask_cells(unsigned* __restrict__ bits, unsigned* __restrict__ full,
                                                 const void* const* __restrict__ aux, int heads, int seqlen_q,
                                                 int seqlen_k, int qcells, int kcells, int kwords, int bh_count) {
    const int lane = threadIdx.x, qc = blockIdx.x, kw = blockIdx.y, kc = kw * 32 + lane;
    for (int bh = blockIdx.z; bh < bh_count; bh += gridDim.z) {  // uniform over the warp: the ballots below
        const int b = bh / heads, h = bh % heads;
        bool any = false, all = true;
        if (kc < kcells) {
            const int q_end = min(qc * kMaskCell + kMaskCell, seqlen_q), k_end = min(kc * kMaskCell + kMaskCell, seqlen_k);
            for (int q = qc * kMaskCell; q < q_end && (all || !any); ++q)
                for (int k = kc * kMaskCell; k < k_end; ++k) {
                    const bool keep = Defs::mask(b, h, q, k, aux);
                    any |= keep;
                    all &= keep;
                    if (any && !all) break;
                }
        }
        const unsigned word = __ballot_sync(0xffffffffu, any), full_word = __ballot_sync(0xffffffffu, any && all);
        if (lane == 0) {
            bits[((long long)bh * qcells + qc) * kwords + kw] = word;
            full[((long long)bh * qcells + qc) * kwords + kw] = full_word;
        }
    }
}

// One list row of the lists pass: block blockIdx.x of pair bh.
template <bool TRANSPOSED>
__device__ __forceinline__ void block_mask_list(const unsigned* __restrict__ bits, const unsigned* __restrict__ full,
                                                int* __restrict__ counts, int* __restrict__ index, int qcells,
                                                int kcells, int kwords, int rb, int cb, int m_blocks, int n_blocks,
                                                int bh) {
    const int lane = threadIdx.x, o = blockIdx.x;
    const int outer = TRANSPOSED ? n_blocks : m_blocks, inner = TRANSPOSED ? m_blocks : n_blocks;
    const unsigned* rows = bits + (long long)bh * qcells * kwords;
    const unsigned* full_rows = full + (long long)bh * qcells * kwords;
    int* out = index + ((long long)bh * outer + o) * inner;
    int count = 0;
    for (int x0 = 0; x0 < inner; x0 += 32) {
        const int x = x0 + lane;
        bool live = false, all = true;  // some cell of the block kept; every cell of it full
        if (x < inner) {
            const int i = TRANSPOSED ? x : o, j = TRANSPOSED ? o : x;
            const int r_end = min(i * rb + rb, qcells), c_end = min(j * cb + cb, kcells);
            for (int r = i * rb; r < r_end; ++r)
                for (int c = j * cb; c < c_end; ++c) {
                    const long long w = (long long)r * kwords + c / 32;
                    live |= ((rows[w] >> (c % 32)) & 1u) != 0;
                    all &= ((full_rows[w] >> (c % 32)) & 1u) != 0;
                }
        }
        const unsigned ballot = __ballot_sync(0xffffffffu, live);
        if (live) out[count + __popc(ballot & ((1u << lane) - 1u))] = x | (all ? kFullBlock : 0);
        count += __popc(ballot);
    }
    if (lane == 0) counts[(long long)bh * outer + o] = count;
}

// The lists pass: a warp per (block, bh); grid (blocks, min(bh count, 65535)), y striding over the
// bh_count pairs. rb, cb: cells per query block and per key block (BR / 16, BC / 16). TRANSPOSED
// false: per query block i (blockIdx.x, of m_blocks), its key blocks (n_blocks entries per row; the
// forwards, dQ); true: per key block j (of n_blocks), its query blocks (m_blocks entries per row;
// the dK/dV kernels).
template <bool TRANSPOSED>
__device__ __forceinline__ void block_mask_lists(const unsigned* __restrict__ bits, const unsigned* __restrict__ full,
                                                 int* __restrict__ counts, int* __restrict__ index, int qcells,
                                                 int kcells, int kwords, int rb, int cb, int m_blocks, int n_blocks,
                                                 int bh_count) {
    for (int bh = blockIdx.y; bh < bh_count; bh += gridDim.y)
        block_mask_list<TRANSPOSED>(bits, full, counts, index, qcells, kcells, kwords, rb, cb, m_blocks, n_blocks, bh);
}

// One tile's block steps: with a block mask (ON) the listed blocks inside `range` (the built-in
// mask's), else the range itself: a query block's key blocks (the forwards, dQ) or a key block's
// query blocks (dK/dV, from the transposed lists). at(it) is step it's block; masked_head /
// _tail stay the range's (a listed block at a window edge or the seqlen_k tail still needs the
// mask). `row`: the tile's list row, block_list_row (params.bm_sb, bm_sh: 0 where the mask
// broadcasts); `entries`: the entries per list row (the other side's block count).
template <bool ON>
struct BlockList {
    const int* list;  // ON: the first listed block inside the range
    int n, begin;

    __device__ __forceinline__ int at(int it) const {
        if constexpr (ON) return __ldg(list + it) & (kFullBlock - 1);
        return begin + it;
    }
    // Whether the mask keeps every pair of step it's block (never without a block mask).
    __device__ __forceinline__ bool full(int it) const {
        if constexpr (ON) return (__ldg(list + it) & kFullBlock) != 0;
        return false;
    }
    __device__ __forceinline__ int size() const { return n; }

    __device__ __forceinline__ static BlockList of(const int* __restrict__ counts, const int* __restrict__ index,
                                                   long long row, int entries, const BlockRange& range) {
        BlockList l{nullptr, range.size(), range.begin};
        if constexpr (ON) {
            const int* list = index + row * entries;
            const int cnt = counts[row];
            const int first = lower_bound(list, cnt, range.begin);
            l.list = list + first;
            l.n = range.size() > 0 ? lower_bound(list, cnt, range.end) - first : 0;
        }
        return l;
    }
};

// The list row of (batch b, head h)'s block `block` among `blocks` per (b, h) (the mask's strides).
template <class Params>
__device__ __forceinline__ long long block_list_row(const Params& p, int b, int h, int blocks, int block) {
    return ((long long)b * p.bm_sb + (long long)h * p.bm_sh) * blocks + block;
}

}  // namespace cuflash
