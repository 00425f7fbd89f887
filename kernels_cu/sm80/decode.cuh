// cuflash/kernels_cu/sm80/decode.cuh
// Decoding against a KV cache (issue 17): few query rows per sequence, many cached keys. The
// prefill kernel (sm80/fwd.cuh) gives each query head its own block of 64-128 query rows, so a
// one-token step runs 1 useful row in 128 through the tensor cores and reads each K/V head once
// per query head of its GQA group: compute-bound on padding (measured 0.08-0.17x of the copy
// bandwidth on the H200, docs/perf-notes.md). Here one block serves one (K/V head, batch) and
// split of its keys:
//
//   rows : the query heads of the K/V head's group times the queries, packed into one m16 tile
//          (row r = query r / group, head h_kv * group + r % group; group * seqlen_q <= 16), so
//          every K/V element is read once per block and feeds all of them
//   keys : a STAGES-deep cp.async ring of BC = 16 * WARPS / COL_SPLITS keys per tile (all threads
//          copy); warp w multiplies the tile's keys [16 kw, 16 kw + 16), kw = w % (WARPS /
//          COL_SPLITS): S = Q K_kw^T, online softmax, O += P V_kw over its column split
//          w / (WARPS / COL_SPLITS) of D (COL_SPLITS 2 above D = 128: a lane's O is then 16 x D/2,
//          where 16 x D spilled; the two warps of a key slice compute the same S)
//   end  : the warps' (max, sum, O) combined through shared memory into the block's rows: O
//          (16-bit, V::kSplitKV off) or O normalised over this split's keys and its lse (fp32,
//          the split-KV accumulators that cuflash.merge_attention reduces, as sm80/fwd.cuh's)
//   grid : blockIdx.x = split + n_splits * (h_kv + heads_kv * batch); batch b's key blocks are
//          divided among the n_splits blocks from its own length (seqused_k[b]), so a short
//          sequence does not leave its later splits with work and its earlier ones without
//   merge: V::kSplitKV with split_counters (one zeroed int per (K/V head, batch), per stream:
//          cuflash/stream_scratch.py): each split block, once its partial results are written,
//          counts itself in; the last of a tile's splits merges them all into merged_o (16-bit) and
//          merged_lse (cuflash.merge_attention's arithmetic) and sets the count back to 0, so no
//          combine launch follows. Without split_counters the host's combine kernel merges.
// Masks (causal, windows) bottom-right aligned to each batch's length, per packed row's query;
// softcap through attn/score_mod.cuh. No dropout (inference).
// V::kPaged: k and v are pages (num_pages, page_size, heads_kv, D); key row r of batch b is row
// r % page_size of page block_table[b * table_stride + r / page_size], looked up per row a tile
// before the tile is copied (any page size; rows past the batch's length are neither looked up
// nor read).
#pragma once
#include "attn/features.cuh"
#include "attn/mask.cuh"
#include "attn/params.cuh"
#include "attn/score_mod.cuh"
#include "attn/softmax.cuh"
#include "core/frag.cuh"
#include "sm80/tile_copy.cuh"
#include "sm80/warp_gemm.cuh"

namespace cuflash {

template <int D, int WARPS, int STAGES>
struct Sm80DecodeTraits {
    static constexpr int kNumThreads = WARPS * 32;
    static constexpr int kRows = 16;  // one m16 tile: group * seqlen_q rows of it are live
    static constexpr int kColSplits = D > 128 ? 2 : 1;  // warps per key slice, each a part of O's columns
    static constexpr int kKeyWarps = WARPS / kColSplits;
    static constexpr int kBlockK = 16 * kKeyWarps;  // keys per K/V tile, 16 per key slice
    static constexpr int kRowChunks = D / 8;
    static constexpr int kHeadSteps = D / 16;
    static constexpr int kOutTiles = D / 8 / kColSplits;  // n8 tiles of a warp's O columns
    static constexpr int kRowBytes = SmemRow<kRowChunks>::kBytes;
    static constexpr int kQBytes = kRows * kRowBytes;
    static constexpr int kKVTileBytes = kBlockK * kRowBytes;
    // after the loop the ring holds each warp's O (fp32, kRows x D) for the combine
    static constexpr int kCombineBytes = kKeyWarps * kRows * D * 4;
    static constexpr int kRingBytes = 2 * STAGES * kKVTileBytes;
    static constexpr int kSmemBytes = kQBytes + (kRingBytes > kCombineBytes ? kRingBytes : kCombineBytes);
    static_assert(D % 16 == 0 && D >= 16 && D <= 256, "head_dim must be a multiple of 16 in [16, 256]");
    static_assert(WARPS >= 1 && WARPS <= 8 && WARPS % kColSplits == 0, "1 to 8 warps, a multiple of the column splits");
    static_assert(STAGES >= 2, "the single-barrier pipeline needs at least 2 stages");
};

// The pages of one K/V tile's rows that this thread copies (chunk idx = tid + i * THREADS of the
// tile is row idx / CH), looked up in the batch's block-table row a tile ahead of the copy: the
// lookup is a global load the copy's addresses depend on, so fetched in the same iteration as the
// copy it stalled the tile's issue for a load latency every tile (paged caches read at 0.73-0.90x
// of contiguous ones, H200, 2026-12-01); fetched one iteration earlier, the previous tile's
// compute covers it. Rows at or past seqlen_k are not looked up (their chunks are zero-filled).
// Where CH divides THREADS a thread's rows are row0 + kStep i: one division by the page size per
// tile, then (page, row in page) advanced by kStep (PageWalk); a division per chunk in both the
// lookup and the copy doubled the kernel's instructions and held paged caches at ~0.55-0.6x of
// contiguous ones in cells the contiguous kernel reads at the copy bandwidth (H200, 2026-12-02).
// Page sizes that are a multiple of RowGroupTileCopy's kRowsPer do not walk (GROUPED_PAGES below).
template <int BC, int CH, int THREADS>
struct PagedTileRows {
    static constexpr int kChunks = BC * CH;
    static constexpr int kPer = (kChunks + THREADS - 1) / THREADS;
    static constexpr bool kWalk = THREADS % CH == 0;  // a thread's chunks: one column c, rows kStep apart
    static constexpr int kStep = kWalk ? THREADS / CH : 0;
    int page[kPer];

    // (block-table entry, row within its page) of a row, advanced a fixed number of rows at a time
    struct PageWalk {
        int entry, in;
        __device__ __forceinline__ PageWalk(int row, int page_size) : entry(row / page_size), in(row - entry * page_size) {}
        __device__ __forceinline__ void advance(int page_size) {
            in += kStep;
            const bool next = in >= page_size;  // a page further (at most one when kStep <= page_size)
            in -= next ? page_size : 0;
            entry += next;
            if (in >= page_size) {  // pages of fewer than kStep rows
                entry += in / page_size;
                in %= page_size;
            }
        }
    };

    __device__ __forceinline__ void fetch(const int* __restrict__ table_row, int page_size, int n_block, int seqlen_k,
                                          int tid) {
        if constexpr (kWalk) {
            const int row0 = n_block * BC + tid / CH;
            PageWalk w(row0, page_size);
#pragma unroll
            for (int i = 0; i < kPer; ++i) {
                const bool ok = (kChunks % THREADS == 0 || tid + i * THREADS < kChunks) && row0 + i * kStep < seqlen_k;
                page[i] = ok ? __ldg(table_row + w.entry) : 0;
                w.advance(page_size);
            }
        } else {
#pragma unroll
            for (int i = 0; i < kPer; ++i) {
                const int idx = tid + i * THREADS, row = n_block * BC + idx / CH;
                const bool ok = (kChunks % THREADS == 0 || idx < kChunks) && row < seqlen_k;
                page[i] = ok ? __ldg(table_row + row / page_size) : 0;
            }
        }
    }
};

// K and V rows [n_block * BC, + BC) of one batch's pages into a ring slot (the swizzled layout of
// load_tile, sm80/tile_copy.cuh), the rows' pages fetched beforehand (PagedTileRows::fetch for
// this n_block; the rows within them walked again as it walked them: keeping each row's place
// from the lookup saved ~120 instructions a tile but spilled at d64 and d192). Rows at or past seqlen_k are
// zero-filled (their page is 0, a real page: the address is formed, never read). A row's offset
// within its page is 32-bit (k_sn, v_sn as int: the host refuses pages of 2^31 elements or more,
// cuflash/kvcache.py), the page's 64-bit: ~5 instructions per chunk and tensor, where 64-bit
// products throughout took ~12.
template <int BC, int CH, int THREADS>
__device__ __forceinline__ void load_kv_tile_paged(u32 sK_slot, u32 sV_slot, const elem_t* kg, const elem_t* vg,
                                                   int k_sn, int v_sn, long long k_sp, long long v_sp,
                                                   const PagedTileRows<BC, CH, THREADS>& rows, int page_size,
                                                   int n_block, int seqlen_k, int tid) {
    using Rows = PagedTileRows<BC, CH, THREADS>;
    constexpr int CHUNKS = BC * CH;
    typename Rows::PageWalk w(Rows::kWalk ? n_block * BC + tid / CH : 0, Rows::kWalk ? page_size : 1);
#pragma unroll
    for (int i = 0; i < (CHUNKS + THREADS - 1) / THREADS; ++i) {
        const int idx = tid + i * THREADS;
        if (CHUNKS % THREADS == 0 || idx < CHUNKS) {
            const int tr = idx / CH, c = idx % CH, row = n_block * BC + tr;
            const bool ok = row < seqlen_k;
            const unsigned page = (unsigned)rows.page[i];
            const int in = Rows::kWalk ? w.in : row % page_size;
            const elem_t* ks = kg + (page * (unsigned long long)k_sp + (unsigned)(in * k_sn + c * 8));
            const elem_t* vs = vg + (page * (unsigned long long)v_sp + (unsigned)(in * v_sn + c * 8));
            cp_async_16(sK_slot + swz<CH>(tr, c), ks, ok);
            cp_async_16(sV_slot + swz<CH>(tr, c), vs, ok);
        }
        if constexpr (Rows::kWalk) w.advance(page_size);
    }
}

// Row r of the block from the warps' partial statistics (raw max m_w and sum l_w over each warp's
// keys): m_scaled = m c for the block's max m (0 when no warp saw a key, so exp2 gives 0, not NaN)
// and l = sum_w l_w exp2(m_w c - m_scaled).
template <int W, int ROWS>
__device__ __forceinline__ void combined_row(const float (&s_max)[W][ROWS], const float (&s_sum)[W][ROWS], int r,
                                             float scale_log2, float& m_scaled, float& l) {
    float m = neg_inf();
#pragma unroll
    for (int w = 0; w < W; ++w) m = fmaxf(m, s_max[w][r]);
    m_scaled = m == neg_inf() ? 0.f : m * scale_log2;
    l = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) l += s_sum[w][r] * fast_exp2(s_max[w][r] * scale_log2 - m_scaled);
}

// x, opaque to the compiler: the merge's values computed where they are used, after the mainloop
// (hoisted above it, they took registers the mainloop needed: 8-16 B of spills at d64 / d192)
__device__ __forceinline__ int late(int x) {
    asm volatile("mov.b32 %0, %0;" : "+r"(x));
    return x;
}

// The last split block of a (K/V head h_kv, batch b) tile: its live rows' partial results of every
// split (o_acc: (n_splits, batch, n_q, heads, D) fp32 at params.o_s* strides; lse_acc: (n_splits,
// batch, heads, n_q), natural log, -inf where a split saw no key) merged into merged_o (batch, n_q,
// heads, D) of the input dtype and merged_lse (batch, heads, n_q): out = sum_s exp(lse_s - m) O_s /
// sum_s exp(lse_s - m), lse = m + log of that sum; a row no split saw gives 0 and -inf, a NaN lse a
// NaN row (the combine kernel's rules, cuflash/kvcache.py _COMBINE_SRC). The partial results are
// read with ld.global.cg: other blocks wrote them, past this SM's L1.
// The merge runs in the grid's tail (every tile's last split finishes at about the same time), so
// its time adds to the kernel's. Its loads of other blocks' results are L2 round trips, issued
// kMergeBatch at a time (lse and O together) before the first is used: one at a time, in two passes
// (the first merge) a thread made 4 n_splits dependent round trips at d128, 64 at 16 splits (1 x
// 128k: estimated at several us of a ~120 us step); batched in two passes 16; in one pass 8. The
// sums run in split order.
// Not inlined: the merge's registers are then its own, not the mainloop's allocation stretched
// over it (inlined, batches of 8 spilled 4 B at d64 and of 2 16 B at d192 with 8 warps, both
// paged). Its arguments are scalars: a reference to the kernel's parameters put a 216 B copy of
// them on each thread's stack. Batches of 4: of 8, the d64 4-warp 4-stage tile (72 registers)
// spilled 4 B under NVRTC 13.5.
constexpr int kMergeBatch = 4;

template <bool BF16, int D, int THREADS>
__device__ __noinline__ void merge_splits(const float* o_acc, const float* lse_acc, elem_t* __restrict__ merged_o,
                                          float* __restrict__ merged_lse, int n_splits, int b, int h_kv, int group,
                                          int live_rows, int heads, int n_q, int batch, long long o_sb, long long o_sn,
                                          long long o_sh) {
    constexpr int U = kMergeBatch;
    const long long o_split = (long long)batch * o_sb, l_split = (long long)batch * heads * n_q;
    for (int idx = threadIdx.x; idx < live_rows * (D / 2); idx += THREADS) {
        // two columns a thread (a float4 accumulator spilled the d192 instances)
        const int r = idx / (D / 2), col = 2 * (idx % (D / 2));
        const int qi = r / group, h = h_kv * group + r % group;
        const long long lrow = ((long long)b * heads + h) * n_q + qi;
        const float* orow = o_acc + (long long)b * o_sb + (long long)qi * o_sn + (long long)h * o_sh + col;
        float m = neg_inf(), sum = 0.f;
        float2 acc = make_float2(0.f, 0.f);
        bool nan = false;
        // One pass, the running max rescaling sum and acc as it grows (as the mainloop's softmax
        // does): each batch's lse and O loads go out together, so a thread waits n_splits / U round
        // trips an item, not 2 n_splits / U (a pass over lse for the max, then one over O). The
        // batch loop is not unrolled, pointers walked: the kernel's register cap is set for the
        // mainloop; past n_splits a batch reads split 0 again, and skips it.
        const float* lp = lse_acc + lrow;
#pragma unroll 1
        for (int s = 0; s < n_splits; s += U, lp += U * l_split, orow += U * o_split) {
            float l[U];
            float2 x[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int du = s + u < n_splits ? u : -s;
                l[u] = __ldcg(lp + du * l_split);
                x[u] = __ldcg(reinterpret_cast<const float2*>(orow + du * o_split));
            }
            float m_new = m;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                nan |= l[u] != l[u];
                m_new = fmaxf(m_new, l[u]);  // a NaN lse leaves the max alone; `nan` makes the row NaN
            }
            if (m_new != neg_inf()) {  // else every split so far saw no key: nothing to add
                const float c = __expf(m - m_new);  // 0 while m = -inf (sum and acc are 0 then)
                sum *= c, acc.x *= c, acc.y *= c;
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    if (s + u < n_splits) {
                        const float w = __expf(l[u] - m_new);  // 0 for a split that saw no key
                        sum += w;
                        acc.x += w * x[u].x, acc.y += w * x[u].y;
                    }
                }
                m = m_new;
            }
        }
        const float inv = nan ? __int_as_float(0x7fffffff) : (sum > 0.f ? 1.f / sum : 0.f);
        *reinterpret_cast<u32*>(merged_o + ((long long)b * n_q + qi) * heads * D + (long long)h * D + col) =
            pack2<BF16>(acc.x * inv, acc.y * inv);
        if (col == 0)
            merged_lse[lrow] = nan ? __int_as_float(0x7fffffff) : (m == neg_inf() ? neg_inf() : m + __logf(sum));
    }
}

// GROUPED_PAGES (V::kPaged, pages of a multiple of RowGroupTileCopy's kRowsPer rows: 16-row pages
// and up at d128): each thread copies a run of consecutive rows, which then lie in one page, so a
// thread takes one block-table entry and one address a tile (RowGroupTileCopy), where the walk
// looks up and addresses each of its chunks.
template <bool BF16, int D, int WARPS, int STAGES, class V, bool GROUPED_PAGES = false>
__device__ __forceinline__ void flash_decode_impl(const elem_t* __restrict__ q, const elem_t* __restrict__ k,
                                                  const elem_t* __restrict__ v, elem_t* __restrict__ o,
                                                  float* __restrict__ lse, const int* __restrict__ seqused_k,
                                                  const int* __restrict__ block_table, const float* __restrict__ alibi_slopes,
                                                  const FwdParams& params) {
    static_assert(V::kSeqUsedK && !V::kVarlen && !V::kDropout && !V::kPartialD,
                  "the decode kernel: per-batch key lengths, no packed batches, no dropout, an instantiated head dim");
    using Tr = Sm80DecodeTraits<D, WARPS, STAGES>;
    constexpr int CH = Tr::kRowChunks, BC = Tr::kBlockK, kThreads = Tr::kNumThreads;

    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 sQ = smem_u32(smem);
    const u32 sK = sQ + Tr::kQBytes;
    const u32 sV = sK + STAGES * Tr::kKVTileBytes;
    constexpr int KW = Tr::kKeyWarps;
    __shared__ float s_max[KW][Tr::kRows], s_sum[KW][Tr::kRows];

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4;
    // key slice, column split (without column splits: the warp itself, and the code of one split)
    const int kw = Tr::kColSplits == 1 ? warp : warp % KW, cs = Tr::kColSplits == 1 ? 0 : warp / KW;
    const int n_splits = params.n_splits, heads_kv = params.heads_kv, group = params.group;
    const int split = (int)(blockIdx.x % n_splits);
    const int hb = (int)(blockIdx.x / n_splits);
    const int h_kv = hb % heads_kv, b = hb / heads_kv;
    const int n_q = params.seqlen_q, live_rows = group * n_q;
    const float scale_log2 = params.scale_log2;

    // The batch's key length: seqused_k[b] + params.seqused_add, clipped into [0, seqlen_k]. So the
    // host may pass a caller's device lengths as they are (cache_seqlens before the append, n_new
    // added here; any value, int32's extremes included, stays inside the cache), with no lengths
    // kernel launched per call. A null seqused_k reads as seqlen_k for every batch: the dense route
    // (seqused_add 0) and one host length n for all (seqused_add n - seqlen_k: kvcache's uniform
    // plans, no lengths array for a CUDA graph to fill).
    const MaskGeometry geo_call = MaskGeometry::of<V>(params);
    const long long base = seqused_k == nullptr ? (long long)geo_call.seqlen_k : (long long)seqused_k[b];
    const MaskGeometry geo =
        geo_call.with_length((int)min(max(base + params.seqused_add, 0ll), (long long)geo_call.seqlen_k));
    const int seqlen_k = geo.seqlen_k;
    // the keys any of the rows sees: from the first query's left window edge to the last query's
    // right edge (causal: its own position), then this split's share of those key blocks
    const int k_lo = V::kLocal ? max(0, geo.key_begin(0)) : 0;
    const int k_hi = geo.key_end(n_q - 1);
    const int blk_lo = k_lo / BC, blk_hi = k_hi > k_lo ? (k_hi + BC - 1) / BC : blk_lo;
    const int per_split = (blk_hi - blk_lo + n_splits - 1) / n_splits;
    const int n_begin = blk_lo + split * per_split;
    const int n_iter = max(0, min(blk_hi, n_begin + per_split) - n_begin);

    // V::kPaged: k_sb / v_sb are the page strides, the batch's rows found through its table row
    const elem_t* kg = k + (V::kPaged ? 0ll : (long long)b * params.k_sb) + (long long)h_kv * params.k_sh;
    const elem_t* vg = v + (V::kPaged ? 0ll : (long long)b * params.v_sb) + (long long)h_kv * params.v_sh;
    const int* table_row = V::kPaged ? block_table + (long long)b * params.table_stride : nullptr;
    PagedTileRows<BC, CH, kThreads> pages;  // V::kPaged: the next tile's pages (unused otherwise)
    using Copy = StridedTileCopy<BC, CH, kThreads>;  // contiguous caches (THREADS a multiple of CH)
    using Grouped = RowGroupTileCopy<BC, CH, kThreads>;  // GROUPED_PAGES
    static_assert(!GROUPED_PAGES || (V::kPaged && Grouped::kApplies), "grouped pages: a paged cache, whole row groups");
    // GROUPED_PAGES: the next tile's page of this thread's rows and their first row's place in it
    int group_page = 0, group_in = 0;
    auto fetch_pages = [&](int n_block) {
        if constexpr (GROUPED_PAGES) {
            const int row = n_block * BC + Grouped::first_row(tid), entry = row / params.page_size;
            group_page = row < seqlen_k ? __ldg(table_row + entry) : 0;
            group_in = row - entry * params.page_size;
        } else if constexpr (V::kPaged) {
            pages.fetch(table_row, params.page_size, n_block, seqlen_k, tid);
        }
    };
    auto load_kv = [&](int slot, int n_block) {  // paged: after fetch_pages(n_block)
        const u32 ks = sK + slot * Tr::kKVTileBytes, vs = sV + slot * Tr::kKVTileBytes;
        const bool whole = (n_block + 1) * BC <= seqlen_k;  // every tile but a partial last one
        if constexpr (GROUPED_PAGES) {
            const unsigned long long page = (unsigned)group_page;
            const int c8 = tid % CH * 8, n_ok = seqlen_k - n_block * BC - Grouped::first_row(tid);
            const elem_t* ksrc = kg + (page * params.k_sb + (unsigned)(group_in * (int)params.k_sn + c8));
            const elem_t* vsrc = vg + (page * params.v_sb + (unsigned)(group_in * (int)params.v_sn + c8));
            if (whole) {
                Grouped::template copy<true>(ks, ksrc, params.k_sn, n_ok, tid);
                Grouped::template copy<true>(vs, vsrc, params.v_sn, n_ok, tid);
            } else {
                Grouped::template copy<false>(ks, ksrc, params.k_sn, n_ok, tid);
                Grouped::template copy<false>(vs, vsrc, params.v_sn, n_ok, tid);
            }
        } else if constexpr (V::kPaged) {
            load_kv_tile_paged<BC, CH, kThreads>(ks, vs, kg, vg, (int)params.k_sn, (int)params.v_sn, params.k_sb, params.v_sb,
                                                 pages, params.page_size, n_block, seqlen_k, tid);
        } else if constexpr (Copy::kApplies) {
            if (whole) {
                Copy::template copy<true>(ks, kg, params.k_sn, n_block * BC, seqlen_k, tid);
                Copy::template copy<true>(vs, vg, params.v_sn, n_block * BC, seqlen_k, tid);
            } else {
                Copy::template copy<false>(ks, kg, params.k_sn, n_block * BC, seqlen_k, tid);
                Copy::template copy<false>(vs, vg, params.v_sn, n_block * BC, seqlen_k, tid);
            }
        } else {  // rows of CH chunks that THREADS does not divide (d96, d192)
            load_kv_tile<BC, CH, kThreads>(ks, vs, kg, params.k_sn, vg, params.v_sn, n_block, seqlen_k, tid);
        }
    };

    // Q: packed row r -> query r / group of head h_kv * group + r % group; rows past the group's
    // queries read as zeros (their results are never stored)
    {
        const elem_t* qb = q + (long long)b * params.q_sb + (long long)(h_kv * group) * params.q_sh;
#pragma unroll
        for (int i = 0; i < (Tr::kRows * CH + kThreads - 1) / kThreads; ++i) {
            const int idx = tid + i * kThreads;
            if ((Tr::kRows * CH) % kThreads == 0 || idx < Tr::kRows * CH) {
                const int r = idx / CH, c = idx % CH;
                const bool ok = r < live_rows;
                const elem_t* src = ok ? qb + (long long)(r / group) * params.q_sn + (long long)(r % group) * params.q_sh + c * 8 : q;
                cp_async_16(sQ + swz<CH>(r, c), src, ok);
            }
        }
    }
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < n_iter) {
            fetch_pages(n_begin + s);
            load_kv(s, n_begin + s);
        }
        cp_async_commit();  // Q joins group 0; empty groups keep the wait count uniform
    }
    if (STAGES - 1 < n_iter) fetch_pages(n_begin + STAGES - 1);  // the loop's first copy

    float acc_o[1][Tr::kOutTiles][4];
#pragma unroll
    for (int i = 0; i < Tr::kOutTiles; ++i) acc_o[0][i][0] = acc_o[0][i][1] = acc_o[0][i][2] = acc_o[0][i][3] = 0.f;
    OnlineSoftmax<1> softmax;
    softmax.init();
    const ScoreMod<V> score_mod = ScoreMod<V>::of(params);

    using Ld = LdmatrixOffsets<CH>;
    const u32 warp_keys = (u32)(16 * kw * Tr::kRowBytes);  // this warp's 16 rows of a K/V tile (row % 8 kept)
    const u32 k_frag_off = Ld::b_operand(lane), v_frag_off = Ld::b_trans(lane);
    const u32 q_frag_off = Ld::a_operand(0, lane);
    const u32 q_unused[1][4] = {};
    // the query of this thread's two fragment rows (g, g + 8): the mask's row coordinate
    const int q_row[2] = {g / group, (g + 8) / group};
    // V::kAlibi: each packed row has its own head, so its own slope (attn/score_mod.cuh AlibiBias's
    // convention: -slope |q + offset - k| in score units, alibi_scale folding the softmax's scale);
    // the distance of the row's first fragment column converted once per tile (FADD + FFMA per score)
    float alibi_slope[2] = {0.f, 0.f};
    if constexpr (V::kAlibi) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = g + 8 * half;
            if (r < live_rows)
                alibi_slope[half] = -alibi_slopes[(long long)b * params.alibi_sb + h_kv * group + r % group] * params.alibi_scale;
        }
    }

    for (int it = 0; it < n_iter; ++it) {
        const int j = n_begin + it;
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        {
            const int in = it + STAGES - 1;
            if (in < n_iter) {
                load_kv(in % STAGES, n_begin + in);
                if (in + 1 < n_iter) fetch_pages(n_begin + in + 1);  // lands while this tile computes
            }
            cp_async_commit();
        }
        const int slot = it % STAGES;

        // ---- S = Q K_w^T over this warp's 16 keys (Q's fragments re-read from shared memory each
        // tile: the loop is bound by the cache's bytes, and in registers they cost 32 at d128) ----
        float acc_s[1][2][4];
        warp_mma_abt<BF16, CH, Tr::kHeadSteps, 1, 2, false>(acc_s, q_unused, sQ, q_frag_off,
                                                           sK + slot * Tr::kKVTileBytes + warp_keys, k_frag_off);
        score_mod.apply(acc_s);
        const int k0 = j * BC + 16 * kw;
        if constexpr (V::kAlibi) {
            using F = FragSm80<1, 2>;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float d0 = (float)(q_row[half] + geo.offset - k0 - F::col(lane, 0, 0));
#pragma unroll
                for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        acc_s[0][nt][2 * half + e] = fmaf(alibi_slope[half], fabsf(d0 - (float)(F::col(lane, nt, e) - F::col(lane, 0, 0))),
                                                          acc_s[0][nt][2 * half + e]);
            }
        }
        // ---- mask: the length tail, the causal / right window edge and the left edge per row ----
        if (k0 + 16 > seqlen_k || k0 + 16 > geo.key_end(0) || (V::kLocal && k0 < geo.key_begin(n_q - 1))) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int kb = geo.key_begin(q_row[half]), ke = geo.key_end(q_row[half]);
#pragma unroll
                for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int kk = k0 + FragSm80<1, 2>::col(lane, nt, e);
                        if ((V::kLocal && kk < kb) || kk >= ke) acc_s[0][nt][2 * half + e] = neg_inf();
                    }
            }
        }
        softmax.step_lazy(acc_s, acc_o, scale_log2);
        u32 p_frag[1][1][4];
        c_to_a_frags<BF16, 1>(p_frag[0], acc_s[0]);
        // ---- O_w += P V_w ----
        if constexpr (Tr::kColSplits == 1) {
            warp_mma_ab<BF16, CH, 1, 1, Tr::kOutTiles>(acc_o, p_frag, sV + slot * Tr::kKVTileBytes + warp_keys, v_frag_off);
        } else {  // columns from chunk CH / 2 for the second split (tile_mma_ab's one-step swizzle)
            tile_mma_ab<BF16, CH, 1, Tr::kOutTiles, false, CH / 2>(acc_o[0], p_frag[0],
                                                                 sV + slot * Tr::kKVTileBytes + warp_keys, v_frag_off, cs == 1);
        }
    }
    cp_async_wait<0>();

    // ---- combine the warps: row max and sum per warp, then each warp's O scaled by
    // exp2((m_w - m) c) / l into the staging, summed over the warps by the store ----
    float l_w[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        l_w[half] = softmax.final_sum(0, half);
        if (lane % 4 == 0 && cs == 0) {  // the column splits of a key slice hold the same statistics
            s_max[kw][g + 8 * half] = softmax.row_max[0][half];
            s_sum[kw][g + 8 * half] = l_w[half];
        }
    }
    __syncthreads();  // every warp's statistics are in, and every warp is done with the ring
    float factor[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float m_scaled, l;
        combined_row(s_max, s_sum, g + 8 * half, scale_log2, m_scaled, l);
        factor[half] = l != 0.f ? fast_exp2(softmax.row_max[0][half] * scale_log2 - m_scaled) / l : 0.f;
    }
    // staging: key slice kw's rows at sK + kw * kRows * D * 4, row-major fp32 (the ring is free
    // now); a column split writes its columns
    const u32 stage = sK + (u32)(kw * Tr::kRows * D * 4);
    const int col0 = cs * (D / Tr::kColSplits);
#pragma unroll
    for (int i = 0; i < Tr::kOutTiles; ++i)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = g + 8 * half, col = col0 + 8 * i + 2 * (lane % 4);
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};" :: "r"(stage + (u32)((r * D + col) * 4)),
                         "f"(acc_o[0][i][2 * half] * factor[half]), "f"(acc_o[0][i][2 * half + 1] * factor[half]) : "memory");
        }
    __syncthreads();

    // ---- store: thread-per-(row, 4 columns), rows of live queries only ----
    const int heads = params.heads;
    for (int idx = tid; idx < live_rows * (D / 4); idx += kThreads) {
        const int r = idx / (D / 4), col = 4 * (idx % (D / 4));
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int w = 0; w < KW; ++w) {
            float4 x;
            asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                         : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "r"(sK + (u32)(((w * Tr::kRows + r) * D + col) * 4)));
            sum.x += x.x, sum.y += x.y, sum.z += x.z, sum.w += x.w;
        }
        const int qi = r / group, h = h_kv * group + r % group;
        if constexpr (V::kSplitKV) {  // fp32 accumulators (n_splits, batch, seqlen_q, heads, D) at o_s* strides
            float* orow = reinterpret_cast<float*>(o) + ((long long)split * (params.tiles / heads_kv) + b) * params.o_sb
                          + (long long)qi * params.o_sn + (long long)h * params.o_sh + col;
            *reinterpret_cast<float4*>(orow) = sum;
        } else {
            elem_t* orow = o + (long long)b * params.o_sb + (long long)qi * params.o_sn + (long long)h * params.o_sh + col;
            uint2 packed;
            packed.x = pack2<BF16>(sum.x, sum.y);
            packed.y = pack2<BF16>(sum.z, sum.w);
            *reinterpret_cast<uint2*>(orow) = packed;
        }
    }
    // lse per live row (natural log; -inf where no key was seen): (n_splits, batch, heads, seqlen_q)
    // with V::kSplitKV, else (batch, heads, seqlen_q)
    for (int r = tid; r < live_rows; r += kThreads) {
        float m_scaled, l;
        combined_row(s_max, s_sum, r, scale_log2, m_scaled, l);
        const int qi = r / group, h = h_kv * group + r % group;
        const long long batches = V::kSplitKV ? (long long)split * (params.tiles / heads_kv) + b : b;
        lse[(batches * heads + h) * n_q + qi] = l != 0.f ? (m_scaled + __log2f(l)) * kLn2 : neg_inf();
    }
}

// The shells' entry point: every optional pointer (the block table of V::kPaged caches, ALiBi's
// slopes, V::kSplitKV's merge targets and counters), nullptr where the instance does not take it
// (the family's nullable_pointers).
template <bool BF16, int D, int WARPS, int STAGES, class V>
__device__ __forceinline__ void flash_decode(const elem_t* __restrict__ q, const elem_t* __restrict__ k,
                                             const elem_t* __restrict__ v, elem_t* __restrict__ o,
                                             float* __restrict__ lse, const int* __restrict__ seqused_k,
                                             const int* __restrict__ block_table, const float* __restrict__ alibi_slopes,
                                             elem_t* __restrict__ merged_o, float* __restrict__ merged_lse,
                                             int* split_counters, const FwdParams& params) {
    using Tr = Sm80DecodeTraits<D, WARPS, STAGES>;
    using Grouped = RowGroupTileCopy<Tr::kBlockK, Tr::kRowChunks, Tr::kNumThreads>;
    if constexpr (V::kPaged && Grouped::kApplies) {
        // pages of whole row groups (any multiple of 8 rows at d128) take the grouped copy; the
        // choice is the launch's, so each mainloop is compiled and allocated on its own
        if (params.page_size % Grouped::kRowsPer == 0)
            flash_decode_impl<BF16, D, WARPS, STAGES, V, true>(q, k, v, o, lse, seqused_k, block_table, alibi_slopes, params);
        else
            flash_decode_impl<BF16, D, WARPS, STAGES, V>(q, k, v, o, lse, seqused_k, block_table, alibi_slopes, params);
    } else {
        flash_decode_impl<BF16, D, WARPS, STAGES, V>(q, k, v, o, lse, seqused_k, block_table, alibi_slopes, params);
    }
    if constexpr (V::kSplitKV) {
        // the in-kernel merge: the last of the tile's split blocks to finish merges them all (here,
        // after the mainloop's function: its values are dead, the merge's registers its own)
        if (split_counters != nullptr) {
            const int n_splits = params.n_splits, hb = (int)(blockIdx.x / n_splits);
            __shared__ int s_last;
            __threadfence();  // this thread's partial results, visible device-wide before the count
            __syncthreads();
            if (threadIdx.x == 0) s_last = atomicAdd(split_counters + hb, 1) == n_splits - 1;
            __syncthreads();
            if (s_last) {
                __threadfence();  // the other splits' counts seen: their results are visible
                // back to 0 for the stream's next split launch (every split of this one has counted);
                // before the merge, so nothing of the kernel's is live across the call (after it, the
                // counter's address took a 4 B spill on sm_100)
                if (threadIdx.x == 0) split_counters[hb] = 0;
                const int group = params.group;
                const int n_q = late(params.seqlen_q);
                merge_splits<BF16, D, WARPS * 32>(reinterpret_cast<const float*>(o), lse, merged_o, merged_lse, n_splits,
                                                  hb / params.heads_kv, hb % params.heads_kv, group, group * n_q,
                                                  late(params.heads), n_q, late(params.tiles) / params.heads_kv,
                                                  params.o_sb, params.o_sn, params.o_sh);
            }
        }
    }
}

}  // namespace cuflash
