// cuflash/kernels_cu/sm90/fwd.cuh
// FlashAttention forward on Hopper (sm_90a): TMA loads, warp specialisation, wgmma, a persistent
// grid. The attention math is the shared policies' (attn/: scheduler, block_range, mask, softmax,
// dropout); this file is the data movement and the issue order. design/hopper.md §1 explains the
// structure; in short:
//
//   tiles    (query block of 64*CONSUMERS rows, head, batch), params.tiles of them, under a causal
//            mask in attn/tile_order.cuh's heaviest-first order, else block-fastest. The producer
//            picks the CTA's tiles (sm90/tile_feed.cuh: i, i + gridDim.x, ... on any grid, or drawn
//            from a grid-wide counter, tile_counter != nullptr) and hands them to the consumers
//   WG 0     producer: one thread loads K_j, V_j per key block by TMA into a STAGES-deep ring
//            (full/empty mbarrier pairs, K and V separate), and each tile's Q after its first K.
//            The ring runs on across tiles, so the next tile's first K/V arrive while this one
//            finishes.
//   WG 1..C  consumers, 64 query rows each (wgmma M = 64), registers raised by setmaxnreg:
//              S = Q K_j^T   (SS wgmma, N = BC)  -> score mod (softcap) -> mask (boundary blocks) -> online softmax
//              -> dropout -> P to A registers -> O += P V_j (RS wgmma, N = D)
//            OVERLAP: block j's P V_j is issued right after S_{j+1} = Q K_{j+1}^T, so the
//            softmax of block j+1 runs while the tensor cores do P V_j (FA3 §3.2)
//            PINGPONG: the consumers issue their GEMMs in turn (named barriers), so one's
//            softmax runs under the other's GEMMs (FA3 §3.1)
//   end      Q is released after the tile's last S GEMM (the producer loads the next tile's Q
//            under this one's last P V); O = O~ / l and lse go from registers to global memory.
//            Rows that see no key get O = 0 and lse = -inf.
//   V::kPartialD  the call's head dims (q, k: params.head_dim; v, out: params.head_dim_v) may be
//            less than D: q, k, v come through 4-D maps (columns, rows, heads, batch) with 64-column
//            boxes, one load per chunk that holds a column of the call's; the TMA unit zero-fills
//            the columns past it in that chunk, and the chunks past it are zeroed once at the start
//            and never loaded, so Q K^T and P V see zeros there; O's columns past head_dim_v are
//            not stored.
// The accumulator of a m64nN wgmma is, per warp, the m16 C-fragment layout of core/frag.cuh, so
// Mask, OnlineSoftmax and Dropout apply to it unchanged (MT = 1 per warp).
#pragma once
#include "attn/block_mask.cuh"
#include "attn/block_range.cuh"
#include "attn/dropout.cuh"
#include "attn/features.cuh"
#include "attn/mask.cuh"
#include "attn/params.cuh"
#include "attn/scheduler.cuh"
#include "attn/tile_order.cuh"
#include "attn/score_mod.cuh"
#include "attn/sinks.cuh"
#include "attn/softmax.cuh"
#include "core/ptx_sm90.cuh"
#include "sm80/warp_gemm.cuh"
#include "sm90/tile_feed.cuh"
#include "sm90/traits.cuh"

namespace cuflash {

// The consumers' GEMM issue order when they take turns (PINGPONG): consumer c waits on barrier
// kBarSchedule + c, issues, then lets the next one go. Each barrier counts the 128 threads that
// wait on it plus the 128 of the consumer before it that arrive. Turns run on across tiles (all
// consumers of a CTA take the same number of turns per tile). start() is the first hand-off (to
// consumer 0), finish() takes the last consumer's final one after the CTA's last tile, so every
// barrier ends complete whatever the CTA's tiles (none, or only keyless ones, included) without
// knowing in advance which turn is the last (the tiles come from TileFeed one at a time).
template <int CONSUMERS, bool ON>
struct IssueOrder {
    int me;
    __device__ __forceinline__ void start(int bar0) const {  // the last consumer lets consumer 0 go first
        if constexpr (ON) if (me == CONSUMERS - 1) named_bar_arrive(bar0, 256);
    }
    __device__ __forceinline__ void wait_turn(int bar0) const {
        if constexpr (ON) named_bar_sync(bar0 + me, 256);
    }
    __device__ __forceinline__ void pass_turn(int bar0) const {
        if constexpr (ON) named_bar_arrive(bar0 + (me + 1) % CONSUMERS, 256);
    }
    __device__ __forceinline__ void finish(int bar0) const {
        if constexpr (ON) if (me == 0) named_bar_sync(bar0, 256);
    }
};

// The shared-memory barriers of one CTA: Q full/empty, and per stage K full/empty, V full/empty.
// full: the producer's expect_tx + the TMA bytes; empty: one arrival per consumer warpgroup.
template <int STAGES, int QSTAGES>
struct Sm90FwdBarriers {
    u32 base;
    static constexpr int kQ = 16 * QSTAGES;  // bytes of the Q barriers
    __device__ __forceinline__ u32 q_full(int q) const { return base + 8 * q; }
    __device__ __forceinline__ u32 q_empty(int q) const { return base + 8 * (QSTAGES + q); }
    __device__ __forceinline__ u32 k_full(int s) const { return base + kQ + 8 * s; }
    __device__ __forceinline__ u32 k_empty(int s) const { return base + kQ + 8 * (STAGES + s); }
    __device__ __forceinline__ u32 v_full(int s) const { return base + kQ + 8 * (2 * STAGES + s); }
    __device__ __forceinline__ u32 v_empty(int s) const { return base + kQ + 8 * (3 * STAGES + s); }
    static constexpr int kCount = 2 * QSTAGES + 4 * STAGES;
    __device__ __forceinline__ void init(int consumers) const {
#pragma unroll
        for (int q = 0; q < QSTAGES; ++q) {
            mbar_init(q_full(q), 1);
            mbar_init(q_empty(q), consumers);
        }
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(k_full(s), 1);
            mbar_init(v_full(s), 1);
            mbar_init(k_empty(s), consumers);
            mbar_init(v_empty(s), consumers);
        }
        fence_barrier_init();
    }
};

// Position in a ring of STAGES slots, counted over the whole kernel: slot and phase parity.
template <int STAGES>
struct RingPos {
    int count;
    __device__ __forceinline__ int slot() const { return count % STAGES; }
    __device__ __forceinline__ u32 parity() const { return (count / STAGES) & 1; }
};

// Where the work tile's batch lives: the varlen offsets (V::kVarlen), else nothing; and which of
// its key blocks a block mask lists (V::kBlockMask: attn/block_mask.cuh, the params' list strides).
struct Sm90Seqs {
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;
    int align_end;
    const int* bm_counts = nullptr;
    const int* bm_index = nullptr;
    int bm_sb = 0, bm_sh = 0, bm_nb = 0;
    int gqa = 1;            // query heads per K/V head (the sections of the causal order: attn/tile_order.cuh)
    bool sections = false;  // whether the causal order goes by sections (not for a strided grid: tile_order.cuh)
};

// The work tile `tile` (0 <= tile < params.tiles) and the key blocks its rows visit (`blocks`: the
// range, or its blocks a block mask lists). V::kVarlen: also its batch's rows (SeqSpan) and
// geometry; a tile past its batch's queries visits no key block (every role skips it, and its
// epilogue writes no row).
template <int BR, int BC, class V>
struct Sm90FwdTile {
    BlockCoord blk;
    int r0;  // first query row (of its sequence)
    BlockRange range;
    BlockList<V::kBlockMask> blocks;
    SeqSpan span;
    MaskGeometry geo;
    __device__ __forceinline__ Sm90FwdTile(int tile, const MaskGeometry& geo_call, int m_blocks, int heads, int n_tiles,
                                           const Sm90Seqs& seqs = Sm90Seqs{nullptr, nullptr, 0}) {
        // heavier later rows (causal): heaviest blocks of every head (of a section, where the CTAs
        // take tiles as they free up: seqs.sections) first, so that the grid balances (and concurrent
        // CTAs share their section's K/V: attn/tile_order.cuh); else block-fastest, so concurrent
        // CTAs share a head's K/V. (batch * heads = n_tiles / m_blocks, computed here per tile: kept
        // live over the producer's loop, its 24 registers spilled.) Not in V::kLocal instances: the
        // host runs them for a bounded left window only, whose later rows are not heavier (and the
        // order's arithmetic cost the d64 ALiBi window instance 8 B of spills, NVRTC 13.0).
        if (!V::kLocal && geo_call.later_rows_heavier()) {
            const int bh_count = n_tiles / m_blocks;
            blk = schedule_tiles_heaviest_first(tile, m_blocks, bh_count, heads,
                                                seqs.sections ? section_heads(seqs.gqa, bh_count) : bh_count);
        } else {
            blk = schedule_blocks(tile, m_blocks, heads, false);
        }
        r0 = blk.block * BR;
        span = SeqSpan::of<V>(seqs.cu_seqlens_q, seqs.cu_seqlens_k, blk.batch, geo_call.seqlen_q, geo_call.seqlen_k);
        geo = geo_call.template for_span<V>(span, seqs.align_end);
        range = key_blocks<BR, BC, V::kLocal>(geo, r0);
        if (V::kVarlen && r0 >= span.seqlen_q) range.end = range.begin;  // past its sequence: no work
        const long long row = V::kBlockMask
            ? ((long long)blk.batch * seqs.bm_sb + (long long)blk.head * seqs.bm_sh) * m_blocks + blk.block : 0;
        blocks = BlockList<V::kBlockMask>::of(seqs.bm_counts, seqs.bm_index, row, seqs.bm_nb, range);
    }
};

// x, opaque to the compiler (no CSE across it): a value the prologue computes from it is not kept
// live into the 24-register producer, which computes its own from the parameter
__device__ __forceinline__ u32 opaque_u32(u32 x) {
    asm volatile("mov.b32 %0, %0;" : "+r"(x));
    return x;
}

// Zero chunks [chunks, bytes / chunk_bytes) of each of `buffers` images of `bytes` at base (the
// images' chunks no load writes: V::kPartialD), 16 bytes per thread and step.
__device__ __forceinline__ void zero_chunks(u32 base, int buffers, int bytes, int chunk_bytes, int chunks, int tid,
                                            int threads) {
    const int skip = chunks * chunk_bytes, span = bytes - skip;
    for (int i = tid * 16; i < buffers * span; i += threads * 16) {
        const u32 addr = base + (i / span) * bytes + skip + i % span;
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" :: "r"(addr), "r"(0) : "memory");
    }
}

template <bool BF16, int D, int BC, int CONSUMERS, int STAGES, int PINGPONG, int OVERLAP, int QSTAGES, class V>
__device__ __forceinline__ void flash_fwd_sm90(const TmaMap& tq, const TmaMap& tk, const TmaMap& tv,
                                               elem_t* __restrict__ o, float* __restrict__ lse, int* tile_counter,
                                               const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
                                               const float* __restrict__ alibi_slopes,
                                               const void* const* __restrict__ mod_aux, const int* __restrict__ bm_counts,
                                               const int* __restrict__ bm_index, const float* __restrict__ sinks,
                                               const FwdParams& params) {
    using Tr = Sm90FwdTraits<D, BC, CONSUMERS, STAGES, QSTAGES>;
    using Tile = Sm90FwdTile<Tr::kBlockQ, BC, V>;
    // O leaves through shared memory: each consumer stages its rows in its own rows of the tile's Q
    // image (no other consumer reads those bytes), then copies them out 16 bytes a thread, whole rows
    // per warp; Q is released after that, not after the tile's last S GEMM, so the next tile's Q
    // goes to the other buffer (QSTAGES 2). Not V::kPartialD: there the Q chunks past head_dim are
    // zeroed once and never loaded again, and O's staging would overwrite them. Not with three
    // consumers: at 160 registers the d64 tile then spilled 24-80 B (NVRTC 13.5). Not with dropout:
    // its 128 x 128 tiles then spilled 16-36 B (NVRTC 13.0), and its epilogue is a smaller share of
    // a tile (on the H200 the staging made the plain q2 tiles 3-12% faster at N512-2048). Nor with
    // softcap and ALiBi together: the d128 128-key tile then spilled 60-96 B (NVRTC 13.0).
    constexpr bool kStagedO = !V::kPartialD && !V::kDropout && !(V::kSoftcap && V::kAlibi) && QSTAGES == 2 &&
                              CONSUMERS <= 2;
    // ALiBi's form (attn/score_mod.cuh): split (one FFMA per score off the diagonal, the row part
    // through the row max) or the whole bias per score (an FADD and an FFMA). The split form holds
    // two row shifts through the softmax; on three consumers that spills 4-16 B on the 128-key
    // ping-pong tiles (d64, NVRTC 13.0 and 13.5), yet ran 1.5-7% faster there than the whole bias
    // (H100, docs/bench/h100-alibi-split3c-ab-2026-12-06b.log). With softcap, dropout or varlen + a window,
    // three consumers' split spilled 8-124 B: those keep the whole bias.
    constexpr bool kAlibiSplit = CONSUMERS < 3 || !(V::kSoftcap || V::kDropout || (V::kVarlen && V::kLocal));
    // V::kVarlen: q, k, v are packed (total, heads, D) and mapped as one batch of total rows; a
    // tile's rows are its sequence's, from the offsets (the maps read past a sequence's end into the
    // next one's rows: masked keys, queries never stored)
    const Sm90Seqs seqs{cu_seqlens_q, cu_seqlens_k, params.align_end, bm_counts, bm_index,
                        V::kBlockMask ? params.bm_sb : 0, V::kBlockMask ? params.bm_sh : 0, V::kBlockMask ? params.bm_nb : 0,
                        params.group, tile_counter != nullptr || (int)gridDim.x >= params.tiles};
    static_assert(!PINGPONG || (CONSUMERS >= 2 && OVERLAP), "ping-pong needs two consumers and the overlapped loop");

    extern __shared__ unsigned char smem[];
    __shared__ __align__(8) u64 bar_storage[Sm90FwdBarriers<STAGES, QSTAGES>::kCount];
    const Sm90FwdBarriers<STAGES, QSTAGES> bars{smem_u32(bar_storage)};
    __shared__ __align__(8) u64 feed_bars[4];
    __shared__ int feed_ids[3];
    const TileFeed feed{smem_u32(feed_ids), smem_u32(feed_bars)};
    __shared__ int q_load_count;  // V::kPartialD: the producer's Q loads so far (SmemCount; below)
    const SmemCount q_loads{smem_u32(&q_load_count)};
    const u32 sQ = (smem_u32(smem) + 1023u) & ~1023u;  // TMA 128B-swizzle images need 1024-B alignment
    const u32 sK = sQ + QSTAGES * Tr::kQBytes;
    const u32 sV = sK + STAGES * Tr::kKVBytes;

    const int n_heads = params.heads, m_blocks = params.m_blocks, n_tiles = params.tiles;
    const MaskGeometry geo = MaskGeometry::of<V>(params);

    const int tid = threadIdx.x;
    if (tid == 0) {
        if constexpr (V::kPartialD) q_loads.set(0);
        feed.init(4 * CONSUMERS);  // freed by each consumer warp
        bars.init(CONSUMERS);
    }
    // V::kPartialD: 64-column chunks of q / k rows and of v rows holding a column of the call's
    auto chunks_of = [](u32 dim) { return V::kPartialD ? (int)(dim + 63) / 64 : Tr::kChunks; };
    if constexpr (V::kPartialD) {
        // the chunks no load writes, zero in every buffer (Q K^T and P V read them). From opaque
        // copies of the head dims: the producer computes its own counts where it loads (shared with
        // this prologue, the counts' byte products stayed live into its 24 registers and spilled)
        const int zq = chunks_of(opaque_u32(params.head_dim)), zv = chunks_of(opaque_u32(params.head_dim_v));
        zero_chunks(sQ, QSTAGES, Tr::kQBytes, Tr::kQChunkBytes, zq, tid, Tr::kThreads);
        zero_chunks(sK, STAGES, Tr::kKVBytes, Tr::kKVChunkBytes, zq, tid, Tr::kThreads);
        zero_chunks(sV, STAGES, Tr::kKVBytes, Tr::kKVChunkBytes, zv, tid, Tr::kThreads);
        fence_proxy_async();  // visible to wgmma (the async proxy) after the barrier below
    }
    __syncthreads();  // the last CTA-wide barrier: after the role split warps leave at different times

    if (tid / 128 == 0) {
        // ---------------- producer ----------------
        // (the two roles are the two branches of one if/else: ptxas applies setmaxnreg per branch)
        setmaxnreg_dec<Tr::kProducerRegs>();
        if (tid == 0) {
            prefetch_tma_map(tq);
            prefetch_tma_map(tk);
            prefetch_tma_map(tv);
            // one tile's rows [row, row + chunk_bytes / 128) of every chunk into its image at dst,
            // completing on bar: one 5-D box of all chunks, or (V::kPartialD) a 4-D box per chunk of
            // the call's (`chunks`; the bytes expected are those chunks')
            auto load_rows = [&](u32 dst, const TmaMap& map, u32 bar, int chunk_bytes, int chunks, int row, int head,
                                 int batch) {
                if constexpr (V::kPartialD) {
                    mbar_arrive_expect_tx(bar, chunks * chunk_bytes);
                    for (int c = 0; c < chunks; ++c) tma_load_4d(dst + c * chunk_bytes, map, bar, 64 * c, row, head, batch);
                } else {
                    mbar_arrive_expect_tx(bar, Tr::kChunks * chunk_bytes);
                    tma_load_5d(dst, map, bar, 0, row, 0, head, batch);
                }
            };
            const int qk_chunks = chunks_of(params.head_dim), v_chunks = chunks_of(params.head_dim_v);
            RingPos<STAGES> kv{0};
            // tiles with keys this CTA ran: the Q barriers' phase (V::kPartialD: q_loads, in shared
            // memory: with the runtime chunk counts the 24-register producer spilled, NVRTC 13.0)
            int local = 0;
            const int group = params.group;  // GQA/MQA: query head h loads k/v head h / group (MHA: 1)
            const TileSource source{tile_counter, n_tiles};
            int tile = source.first();
            while (true) {
                if (tile >= n_tiles) {
                    feed.publish(TileFeed::kEnd);
                    break;
                }
                const Tile w(tile, geo, m_blocks, n_heads, n_tiles, seqs);
                // a variable-length batch's tile past its sequence: no keys, no rows to store
                if (V::kVarlen && w.r0 >= w.span.seqlen_q) {
                    tile = source.next(tile);
                    continue;
                }
                feed.publish(tile);
                const int n_iter = w.blocks.size();
                const int h_kv = w.blk.head / group;
                const int map_batch = V::kVarlen ? 0 : w.blk.batch;  // varlen: one mapped batch of packed rows
                for (int it = 0; it < n_iter; ++it, ++kv.count) {
                    const int j = w.blocks.at(it);
                    const int s = kv.slot();
                    const u32 free_parity = kv.parity() ^ 1;  // a fresh barrier counts as released
                    mbar_wait(bars.k_empty(s), free_parity);
                    load_rows(sK + s * Tr::kKVBytes, tk, bars.k_full(s), Tr::kKVChunkBytes, qk_chunks,
                              w.span.k_start + j * BC, h_kv, map_batch);
                    if (it == 0) {
                        // Q after the tile's first K: that K load waits only for a free slot, so it
                        // is in flight while the consumers still read the previous tile's Q
                        if constexpr (V::kPartialD) {
                            local = q_loads.get();
                            q_loads.set(local + 1);
                        }
                        const int qs = local % QSTAGES;
                        mbar_wait(bars.q_empty(qs), ((local / QSTAGES) & 1) ^ 1);
                        load_rows(sQ + qs * Tr::kQBytes, tq, bars.q_full(qs), Tr::kQChunkBytes, qk_chunks,
                                  w.span.q_start + w.r0, w.blk.head, map_batch);
                        if constexpr (!V::kPartialD) ++local;
                    }
                    mbar_wait(bars.v_empty(s), free_parity);
                    load_rows(sV + s * Tr::kKVBytes, tv, bars.v_full(s), Tr::kKVChunkBytes, v_chunks,
                              w.span.k_start + j * BC, h_kv, map_batch);
                }
                // V::kPartialD: the id read back from its slot, not kept in a register over the loads
                // (with the runtime chunk counts the 24-register producer spilled it, NVRTC 13.0)
                tile = source.next(V::kPartialD ? feed.last() : tile);
            }
        }
    } else {
        // ---------------- consumers ----------------
        setmaxnreg_inc<Tr::kConsumerRegs>();
        const int cw = tid / 128 - 1, ctid = tid % 128, warp = ctid / 32, lane = tid % 32;
        const int g = lane / 4, t = lane % 4;
        const int warp_row0 = 64 * cw + 16 * warp;  // this warp's first row in the Q tile
        const float scale_log2 = params.scale_log2;
        const ScoreMod<V> score_mod = ScoreMod<V>::of(params);
        const IssueOrder<CONSUMERS, PINGPONG != 0> order{cw};
        constexpr int kBar = Tr::kBarSchedule;

        // Descriptors: this consumer's 64 Q rows in every chunk; K and V of slot 0.
        const u64 desc_q0 = make_desc(sQ + cw * 64 * 128, kDescKMajorSw128);
        u64 desc_q = desc_q0;  // of the tile's Q buffer
        const u64 desc_k0 = make_desc(sK, kDescKMajorSw128);
        const u64 desc_v0 = make_desc(sV, desc_mn_major_sw128(BC));
        // k-step kk of a K-major operand: chunk kk / 4, then 32 B per 16 columns (in 16-B units)
        auto kmajor_step = [](int kk, int chunk_bytes) { return (u64)(((kk / 4) * chunk_bytes + (kk % 4) * 32) >> 4); };

        float acc_s[1][BC / 8][4];
        float acc_o[1][D / 8][4];
        u32 p_frag[Tr::kKeySteps][4];

        auto issue_qk = [&](int slot) {
            const u64 dk = desc_k0 + (u64)((slot * Tr::kKVBytes) >> 4);
#pragma unroll
            for (int kk = 0; kk < Tr::kHeadSteps; ++kk)
                Wgmma<BC, BF16>::ss(acc_s[0], desc_q + kmajor_step(kk, Tr::kQChunkBytes),
                                    dk + kmajor_step(kk, Tr::kKVChunkBytes), kk > 0);
        };
        auto issue_pv = [&](int slot, bool accumulate) {
            const u64 dv = desc_v0 + (u64)((slot * Tr::kKVBytes) >> 4);
#pragma unroll
            for (int kk = 0; kk < Tr::kKeySteps; ++kk)
                Wgmma<D, BF16>::rs(acc_o[0], p_frag[kk], dv + (u64)((2048 * kk) >> 4), accumulate || kk > 0);
        };
        auto release = [&](u32 bar) {
            if (ctid == 0) mbar_arrive(bar);
        };

        RingPos<STAGES> kv{0};
        int local = 0;
        order.start(kBar);
        for (int n = 0;; ++n) {
            const int tile = feed.receive(n, lane);  // the producer's n-th tile (every consumer sees the same)
            if (tile >= n_tiles) break;
            const Tile w(tile, geo, m_blocks, n_heads, n_tiles, seqs);
            const BlockRange range = w.range;
            const Mask<V::kLocal> mask{w.geo};  // the tile's (V::kVarlen: its sequence's) geometry
            const BlockList<V::kBlockMask> blocks = w.blocks;
            const int r0 = w.r0, n_iter = blocks.size();
            const Dropout drop{params.drop_seed, params.drop_threshold, w.blk.bh};
            // ALiBi: -slope |q + offset - k| after the modifier (attn/score_mod.cuh; nothing without it)
            const AlibiBias<V> alibi = AlibiBias<V>::of(params, alibi_slopes, w.blk.batch, w.blk.head, w.geo.offset);
            const UserMod<V> user_mod = UserMod<V>::of(params, mod_aux, w.blk.batch, w.blk.head, w.geo.seqlen_q, w.geo.seqlen_k);
            OnlineSoftmax<1> softmax;
            softmax.init();

            // After S of key block j landed: score modifier (softcap), mask, softmax statistics,
            // P = exp2(S c - m c) in place; corr[half] is O's rescale factor for this block.
            // (`full`: a block mask's full block, where the mask snippet keeps every pair: skipped)
            auto softmax_block = [&](int j, bool full, float (&corr)[2]) {
                score_mod.apply(acc_s);
                if constexpr (V::kUserMod) {
                    if (full) user_mod.template apply<false>(acc_s, r0 + warp_row0, j * BC, lane);
                    else user_mod.apply(acc_s, r0 + warp_row0, j * BC, lane);
                }
                // ALiBi: the split form or the whole bias per score (kAlibiSplit)
                float shift[2] = {0.f, 0.f};
                if constexpr (V::kAlibi) {
                    if constexpr (kAlibiSplit) alibi.apply_split(acc_s[0], r0 + warp_row0, j * BC, lane, shift);
                    else alibi.apply(acc_s, r0 + warp_row0, j * BC, lane);
                }
                if (range.masked_tail(j)) mask.apply<false, true>(acc_s, r0 + warp_row0, j * BC, lane, neg_inf());
                if (range.masked_head(j)) mask.apply<true, false>(acc_s, r0 + warp_row0, j * BC, lane, neg_inf());
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    float m_scaled;
                    if constexpr (V::kAlibi && kAlibiSplit) {
                        m_scaled = softmax.max_get_scale_shifted(acc_s[0], 0, half, scale_log2, corr[half], shift[half]);
                        m_scaled = fmaf(-shift[half], scale_log2, m_scaled);  // the exp's m, in this block's frame
                    } else {
                        m_scaled = softmax.max_get_scale(acc_s[0], 0, half, scale_log2, corr[half]);
                    }
                    const float sum = OnlineSoftmax<1>::exp_and_sum(acc_s[0], half, scale_log2, m_scaled);
                    softmax.row_sum[0][half] = softmax.row_sum[0][half] * corr[half] + sum;
                }
            };
            // P (after softmax_block) -> dropout -> the A registers of P V.
            auto pack_p = [&](int j) {
                if constexpr (V::kDropout) {
#pragma unroll
                    for (int kb = 0; kb < Tr::kKeySteps; ++kb)
                        Dropout::zero_dropped(acc_s[0], kb, drop.bits8((r0 + warp_row0) / 16, (j * BC) / 16 + kb, g, t));
                }
                c_to_a_frags<BF16, Tr::kKeySteps>(p_frag, acc_s[0]);
            };

            if (n_iter > 0) {
                const int qs = local % QSTAGES;
                mbar_wait(bars.q_full(qs), (local / QSTAGES) & 1);
                ++local;
                desc_q = desc_q0 + (u64)((qs * Tr::kQBytes) >> 4);
                if constexpr (OVERLAP) {
                    // prologue: S of the first block and its softmax; P waits in registers
                    mbar_wait(bars.k_full(kv.slot()), kv.parity());
                    order.wait_turn(kBar);
                    fence_regs(acc_s[0]);
                    wgmma_fence();
                    issue_qk(kv.slot());
                    wgmma_commit();
                    order.pass_turn(kBar);
                    wgmma_wait<0>();
                    fence_regs(acc_s[0]);
                    release(bars.k_empty(kv.slot()));
                    if (!kStagedO && n_iter == 1) release(bars.q_empty(qs));
                    {
                        float corr[2];
                        softmax_block(blocks.at(0), blocks.full(0), corr);
                    }
                    pack_p(blocks.at(0));
                    for (int it = 1; it < n_iter; ++it) {
                        const RingPos<STAGES> prev = kv;
                        ++kv.count;
                        const int j = blocks.at(it);
                        mbar_wait(bars.k_full(kv.slot()), kv.parity());
                        mbar_wait(bars.v_full(prev.slot()), prev.parity());
                        order.wait_turn(kBar);
                        fence_regs(acc_s[0]);
                        fence_regs(acc_o[0]);
                        fence_regs(p_frag);
                        wgmma_fence();
                        issue_qk(kv.slot());  // S_j
                        wgmma_commit();
                        issue_pv(prev.slot(), it > 1);  // O += P_{j-1} V_{j-1}
                        wgmma_commit();
                        order.pass_turn(kBar);
                        wgmma_wait<1>();  // S_j is in; P V may still run
                        fence_regs(acc_s[0]);
                        release(bars.k_empty(kv.slot()));
                        if (!kStagedO && it == n_iter - 1) release(bars.q_empty(qs));  // the tile's last read of Q
                        float corr[2];
                        softmax_block(j, blocks.full(it), corr);
                        wgmma_wait<0>();  // P_{j-1} V_{j-1} done: O and the P registers are free
                        fence_regs(acc_o[0]);
                        fence_regs(p_frag);
                        release(bars.v_empty(prev.slot()));
#pragma unroll
                        for (int half = 0; half < 2; ++half) OnlineSoftmax<1>::rescale_o(acc_o[0], half, corr[half]);
                        pack_p(j);
                    }
                    // tail: the last block's P V
                    mbar_wait(bars.v_full(kv.slot()), kv.parity());
                    order.wait_turn(kBar);
                    fence_regs(acc_o[0]);
                    fence_regs(p_frag);
                    wgmma_fence();
                    issue_pv(kv.slot(), n_iter > 1);
                    wgmma_commit();
                    order.pass_turn(kBar);
                    wgmma_wait<0>();
                    fence_regs(acc_o[0]);
                    release(bars.v_empty(kv.slot()));
                    ++kv.count;
                } else {
                    for (int it = 0; it < n_iter; ++it, ++kv.count) {
                        const int s = kv.slot();
                        const int j = blocks.at(it);
                        mbar_wait(bars.k_full(s), kv.parity());
                        fence_regs(acc_s[0]);
                        wgmma_fence();
                        issue_qk(s);
                        wgmma_commit();
                        wgmma_wait<0>();
                        fence_regs(acc_s[0]);
                        release(bars.k_empty(s));
                        if (!kStagedO && it == n_iter - 1) release(bars.q_empty(qs));
                        float corr[2];
                        softmax_block(j, blocks.full(it), corr);
                        if (it > 0) {
#pragma unroll
                            for (int half = 0; half < 2; ++half) OnlineSoftmax<1>::rescale_o(acc_o[0], half, corr[half]);
                        }
                        pack_p(j);
                        mbar_wait(bars.v_full(s), kv.parity());
                        fence_regs(acc_o[0]);
                        fence_regs(p_frag);
                        wgmma_fence();
                        issue_pv(s, it > 0);
                        wgmma_commit();
                        wgmma_wait<0>();
                        fence_regs(acc_o[0]);
                        release(bars.v_empty(s));
                    }
                }
            }

            // ---------------- epilogue: O = O~ / l (x 1/(1-p) with dropout), lse ----------------
            // Straight from registers: each quad writes 16 contiguous bytes of a row per n8 tile.
            // V::kVarlen: the sequence's first row and query count, reloaded (SeqSpan::reload_queries);
            // lse (heads, total_q), total_q = params.seqlen_q
            int q_start = 0, seqlen_q = params.seqlen_q;
            if constexpr (V::kVarlen) SeqSpan::reload_queries<V>(cu_seqlens_q, w.blk.batch, q_start, seqlen_q);
            float* lse_row = V::kVarlen ? lse + (long long)w.blk.head * params.seqlen_q + q_start
                                        : lse + (long long)w.blk.bh * seqlen_q;
            elem_t* og = o + (long long)w.blk.batch * params.o_sb + (long long)q_start * params.o_sn +
                         (long long)w.blk.head * params.o_sh;
            const SinkLogit<V> sink = SinkLogit<V>::of(sinks, w.blk.head);  // V::kSinks: attn/sinks.cuh
            if (kStagedO && n_iter > 0) {
                // row rr of the image, column chunk c (64 columns), 16-byte unit u of it: at
                // c * kQChunkBytes + rr * 128 + (u ^ rr % 8) * 16 (the fragment stores hit 32 banks)
                const int qs = (local - 1) % QSTAGES;  // the tile's Q buffer (local counted it)
                const u32 img = sQ + qs * Tr::kQBytes;
                fence_proxy_async();  // after the async proxy's (wgmma's) reads of these bytes
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const float l = softmax.final_sum(0, half);
                    float inv = l != 0.f ? (V::kDropout ? params.drop_scale : 1.f) / l : 0.f;
                    float sink_lse = 0.f;
                    if constexpr (V::kSinks) {
                        sink.finish(softmax.row_max[0][half], l, scale_log2, inv, sink_lse);
                        if constexpr (V::kDropout) inv *= params.drop_scale;
                    }
                    const int rr = warp_row0 + g + 8 * half;
                    if (t == 0 && r0 + rr < seqlen_q)
                        lse_row[r0 + rr] = V::kSinks ? sink_lse : OnlineSoftmax<1>::lse(softmax.row_max[0][half], l, scale_log2);
                    const u32 line = opaque_u32(img) + rr * 128 + 4 * t;
#pragma unroll
                    for (int nt = 0; nt < D / 8; ++nt) {
                        const float x0 = l != 0.f ? acc_o[0][nt][2 * half] * inv : 0.f;
                        const float x1 = l != 0.f ? acc_o[0][nt][2 * half + 1] * inv : 0.f;
                        st_shared_u32(line + (nt / 8) * Tr::kQChunkBytes + (((nt % 8) ^ (rr % 8)) << 4), pack2<BF16>(x0, x1));
                    }
                }
                named_bar_sync(Tr::kBarEpilogue + cw, 128);  // this consumer's rows are staged
                constexpr int CH = D / 8;  // 16-byte units of a row
#pragma unroll
                for (int i = ctid; i < 64 * CH; i += 128) {
                    const int rr = 64 * cw + i / CH, u = i % CH;
                    uint4 x;
                    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                                 : "r"(img + (u / 8) * Tr::kQChunkBytes + rr * 128 + (((u % 8) ^ (rr % 8)) << 4)));
                    if (r0 + rr < seqlen_q) *reinterpret_cast<uint4*>(og + (long long)(r0 + rr) * params.o_sn + 8 * u) = x;
                }
                named_bar_sync(Tr::kBarEpilogue + cw, 128);  // every thread's reads are done
                release(bars.q_empty(qs));  // the producer may load the tile after next's Q here
            } else {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float l = n_iter > 0 ? softmax.final_sum(0, half) : 0.f;
                float inv = l != 0.f ? (V::kDropout ? params.drop_scale : 1.f) / l : 0.f;
                float sink_lse = 0.f;
                if constexpr (V::kSinks) {
                    sink.finish(softmax.row_max[0][half], l, scale_log2, inv, sink_lse);
                    if constexpr (V::kDropout) inv *= params.drop_scale;
                }
                const int row = r0 + warp_row0 + g + 8 * half;
                if (row < seqlen_q) {
                    if (t == 0) lse_row[row] = V::kSinks ? sink_lse : OnlineSoftmax<1>::lse(softmax.row_max[0][half], l, scale_log2);
                    elem_t* orow = og + (long long)row * params.o_sn + 2 * t;
#pragma unroll
                    for (int nt = 0; nt < D / 8; ++nt) {
                        if (V::kPartialD && 8 * nt >= params.head_dim_v) break;  // out has head_dim_v columns
                        const float x0 = l != 0.f ? acc_o[0][nt][2 * half] * inv : 0.f;
                        const float x1 = l != 0.f ? acc_o[0][nt][2 * half + 1] * inv : 0.f;
                        *reinterpret_cast<u32*>(orow + 8 * nt) = pack2<BF16>(x0, x1);
                    }
                }
            }
            }
        }
        order.finish(kBar);
    }
}

}  // namespace cuflash
