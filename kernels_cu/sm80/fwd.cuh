// cuflash/kernels_cu/sm80/fwd.cuh
// FlashAttention-2 forward ("v2"), sm80 mainloop on mma.sync m16n8k16. Composition only: the
// attention math is in attn/ (scheduler, block_range, mask, softmax, dropout, epilogue), the
// data movement and products in sm80/ (tile_copy, warp_gemm).
//
//   grid : one thread block per (Q tile of BR rows, head, batch) (attn/scheduler.cuh)
//   block: WARPS warps; warp w owns Q rows [w*BR/WARPS, (w+1)*BR/WARPS) of the tile, so the
//          softmax statistics of a row live in one warp and need no shared-memory reduction
//   loop : over the K/V tiles of BlockRange, STAGES-deep cp.async ring (sm80/tile_copy.cuh)
//   step : S = Q K^T (raw) -> score modifier (softcap: tanh, attn/score_mod.cuh) -> ALiBi -> mask (boundary tiles only) -> online softmax (P = exp2(S c - m c),
//          O~ and l rescaled) -> dropout (P o mask, P V only) -> P to A fragments -> O~ += P V
//   end  : O = O~ / l (x 1/(1-p) with dropout), lse = (m c + log2 l) ln 2 (attn/epilogue.cuh)
// Rows that see no key get O = 0 and lse = -inf.
// V::kSeqUsedK (the KV cache): batch b's key length is seqused_k[b] (a device array), not
// params.seqlen_k (the capacity); the geometry, block range and tile loads (rows past the length
// zero-filled, never read) all follow MaskGeometry::for_batch.
// V::kVarlen (variable-length batches): batch b's queries and keys are row ranges of packed arrays
// given by cu_seqlens_q / cu_seqlens_k (attn/mask.cuh, SeqSpan); the grid covers the longest
// batch's query blocks and a block past its batch's queries returns at once; lse is (heads, total_q).
// V::kAlibi: each score gains -slope_h |q + offset - k| before the mask (attn/score_mod.cuh).
// The generated shell passes every optional pointer (seqused_k, cu_seqlens_q / _k, alibi_slopes),
// nullptr where the instance's features do not take it (KernelFamily.nullable_pointers).
// V::kSplitKV (split-KV decoding): blockIdx.x = split + n_splits x work tile; the split visits its
// slice of the tile's key blocks and writes O normalised over them (fp32, `o` is the accumulator
// (n_splits, batch, seqlen_q, heads, head_dim) at o_s* strides) and their lse to
// (n_splits, batch, heads, seqlen_q); the host merges the splits (cuflash.merge_attention).
#pragma once
#include "attn/block_mask.cuh"
#include "attn/block_range.cuh"
#include "attn/dropout.cuh"
#include "attn/epilogue.cuh"
#include "attn/features.cuh"
#include "attn/mask.cuh"
#include "attn/params.cuh"
#include "attn/scheduler.cuh"
#include "attn/score_mod.cuh"
#include "attn/sinks.cuh"
#include "attn/softmax.cuh"
#include "sm80/tile_copy.cuh"
#include "sm80/traits.cuh"
#include "sm80/warp_gemm.cuh"

namespace cuflash {

template <bool BF16, int D, int BR, int BC, int WARPS, int STAGES, class V>
__device__ __forceinline__ void flash_fwd(const elem_t* __restrict__ q, const elem_t* __restrict__ k,
                                          const elem_t* __restrict__ v, elem_t* __restrict__ o, float* __restrict__ lse,
                                          const int* __restrict__ seqused_k, const int* __restrict__ cu_seqlens_q,
                                          const int* __restrict__ cu_seqlens_k, const float* __restrict__ alibi_slopes,
                                          const void* const* __restrict__ mod_aux, const int* __restrict__ bm_counts,
                                          const int* __restrict__ bm_index, const float* __restrict__ sinks,
                                          const FwdParams& params) {
    // split-KV's partial results are merged on the host, which rescales them by the sinks after
    static_assert(!(V::kSinks && V::kSplitKV), "sinks join the merged softmax, not a split's");
    // The parameters this kernel reads, copied to registers once: a field read where it is used
    // would be re-read from the parameter space after every asm volatile (memory clobber).
    const long long q_sb = params.q_sb, q_sn = params.q_sn, q_sh = params.q_sh, k_sb = params.k_sb, k_sn = params.k_sn, k_sh = params.k_sh,
                    v_sb = params.v_sb, v_sn = params.v_sn, v_sh = params.v_sh, o_sb = params.o_sb, o_sn = params.o_sn, o_sh = params.o_sh;
    const int n_heads = params.heads, m_blocks = params.m_blocks, group = params.group;
    const float scale_log2 = params.scale_log2, drop_scale = params.drop_scale;
    const unsigned long long drop_seed = params.drop_seed;
    const unsigned int drop_threshold = params.drop_threshold;
    // the call's 16-byte chunks per row (V::kPartialD: fewer than the instance's; else all of them)
    const int d_chunks = V::kPartialD ? params.head_dim / 8 : D / 8;
    // v's and out's chunks (its own head dim, params.head_dim_v: d_chunks unless they differ)
    const int v_chunks = V::kPartialD ? params.head_dim_v / 8 : D / 8;
    using Tr = Sm80FwdTraits<D, BR, BC, WARPS, STAGES>;
    constexpr int kRowTiles = Tr::kRowTiles, kScoreTiles = Tr::kScoreTiles, kOutTiles = Tr::kOutTiles;
    constexpr int kHeadSteps = Tr::kHeadSteps, kKeySteps = Tr::kKeySteps, kRowChunks = Tr::kRowChunks;
    constexpr int kNumThreads = Tr::kNumThreads;

    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 sQ = smem_u32(smem);
    const u32 sK = sQ + Tr::kQBytes;
    const u32 sV = sK + STAGES * Tr::kKVTileBytes;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;  // MMA fragment row group / column pair

    static_assert(!(V::kSplitKV && V::kVarlen), "split-KV is for the KV cache's batches, not packed ones");
    const MaskGeometry geo_call = MaskGeometry::of<V>(params);
    const int split = V::kSplitKV ? (int)(blockIdx.x % params.n_splits) : 0;
    const int work_tile = V::kSplitKV ? (int)(blockIdx.x / params.n_splits) : (int)blockIdx.x;
    const BlockCoord blk = schedule_blocks(work_tile, m_blocks, n_heads, geo_call.later_rows_heavier());
    const int bh = blk.bh, b = blk.batch, h = blk.head;
    const int r0 = blk.block * BR;
    // V::kVarlen: this batch's rows of the packed arrays and its lengths; else row 0 of its slice
    // and the call's lengths. The grid covers the longest batch: blocks past this one's queries
    // leave at once (uniformly: before any barrier).
    const SeqSpan span = SeqSpan::of<V>(cu_seqlens_q, cu_seqlens_k, b, params.seqlen_q, params.seqlen_k);
    if (V::kVarlen && r0 >= span.seqlen_q) return;
    const int seqlen_q = span.seqlen_q;
    // V::kVarlen: the batch's own lengths and offset; V::kSeqUsedK: its key length and offset (the
    // KV cache); else geo_call itself
    const MaskGeometry geo = geo_call.for_span<V>(span, params.align_end).template for_batch<V>(seqused_k, b);
    const int seqlen_k = geo.seqlen_k;

    const elem_t* qg = q + (long long)b * q_sb + (long long)span.q_start * q_sn + (long long)h * q_sh;
    const int h_kv = h / group;  // GQA/MQA: the query heads of a group share one k/v head (MHA: group 1)
    const elem_t* kg = k + (long long)b * k_sb + (long long)span.k_start * k_sn + (long long)h_kv * k_sh;
    const elem_t* vg = v + (long long)b * v_sb + (long long)span.k_start * v_sn + (long long)h_kv * v_sh;

    BlockRange range = key_blocks<BR, BC, V::kLocal>(geo, r0);  // may start past key block 0 (window)
    if constexpr (V::kSplitKV) {  // this split's slice of the blocks (the masked ones stay masked)
        range.begin = max(range.begin, split * params.split_blocks);
        range.end = max(range.begin, min(range.end, (split + 1) * params.split_blocks));
    }
    const Mask<V::kLocal> mask{geo};
    const ScoreMod<V> score_mod = ScoreMod<V>::of(params);
    const AlibiBias<V> alibi = AlibiBias<V>::of(params, alibi_slopes, b, h, geo.offset);
    const UserMod<V> user_mod = UserMod<V>::of(params, mod_aux, b, h, geo.seqlen_q, geo.seqlen_k);
    const Dropout drop{drop_seed, drop_threshold, bh};
    // the range's key blocks, or those of them a block mask lists (attn/block_mask.cuh)
    const BlockList<V::kBlockMask> blocks = BlockList<V::kBlockMask>::of(
        bm_counts, bm_index, V::kBlockMask ? block_list_row(params, b, h, m_blocks, blk.block) : 0, params.bm_nb, range);
    const int n_iter = blocks.size();

    float acc_o[kRowTiles][kOutTiles][4];
#pragma unroll
    for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
        for (int i = 0; i < kOutTiles; ++i) acc_o[mt][i][0] = acc_o[mt][i][1] = acc_o[mt][i][2] = acc_o[mt][i][3] = 0.f;
    OnlineSoftmax<kRowTiles> softmax;
    softmax.init();

    if (n_iter > 0) {
        // Prologue: Q joins the first K/V group; steps 0..STAGES-2 (their key blocks) in flight.
        load_tile<BR, kRowChunks, kNumThreads, V::kPartialD>(sQ, qg, q_sn, r0, seqlen_q, tid, d_chunks);
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < n_iter)
                load_kv_tile<BC, kRowChunks, kNumThreads, V::kPartialD>(sK + s * Tr::kKVTileBytes, sV + s * Tr::kKVTileBytes, kg, k_sn,
                                                          vg, v_sn, blocks.at(s), seqlen_k, tid, d_chunks, v_chunks);
            cp_async_commit();  // empty groups keep the wait count uniform
        }
    }

    const int warp_row0 = warp * Tr::kRowsPerWarp;
    u32 q_frag[Tr::kQInRegs ? kHeadSteps : 1][4];
    using Ld = LdmatrixOffsets<kRowChunks>;
    const u32 q_frag_off = Ld::a_operand(warp_row0, lane);
    const u32 k_frag_off = Ld::b_operand(lane);
    const u32 v_frag_off = Ld::b_trans(lane);
    for (int it = 0; it < n_iter; ++it) {
        const int j = blocks.at(it);  // key block of this step
        // Step it has landed once at most STAGES-2 younger groups are pending. The barrier also
        // tells every warp that all others finished step it-1, whose slot is refilled next.
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        {
            int in = it + STAGES - 1;
            if (in < n_iter) {
                int slot = in % STAGES;
                load_kv_tile<BC, kRowChunks, kNumThreads, V::kPartialD>(sK + slot * Tr::kKVTileBytes, sV + slot * Tr::kKVTileBytes, kg,
                                                          k_sn, vg, v_sn, blocks.at(in), seqlen_k, tid, d_chunks, v_chunks);
            }
            cp_async_commit();
        }
        const int slot = it % STAGES;
        const u32 sKj = sK + slot * Tr::kKVTileBytes;
        const u32 sVj = sV + slot * Tr::kKVTileBytes;

        if constexpr (Tr::kQInRegs) {
            if (it == 0) {  // Q landed with the first step's group
#pragma unroll
                for (int kd = 0; kd < kHeadSteps; ++kd)
                    ldmatrix_x4(q_frag[kd][0], q_frag[kd][1], q_frag[kd][2], q_frag[kd][3], sQ + chunk_step<kRowChunks>(q_frag_off, 2 * kd));
            }
        }

        // ---- S = Q K_j^T (raw, unscaled) ----
        float acc_s[kRowTiles][kScoreTiles][4];
        warp_mma_abt<BF16, kRowChunks, kHeadSteps, kRowTiles, kScoreTiles, Tr::kQInRegs>(acc_s, q_frag, sQ, q_frag_off,
                                                                                       sKj, k_frag_off);

        // ---- score modifier (softcap: t = tanh(S softcap_scale); nothing without one) ----
        score_mod.apply(acc_s);

        // ---- a user modification (cuflash.ScoreMod): its score and mask snippets on every tile ----
        // (a block mask's full block: the mask keeps every pair, so only a score snippet runs there)
        if constexpr (V::kUserMod) {
            if (blocks.full(it)) user_mod.template apply<false>(acc_s, r0 + warp_row0, j * BC, lane);
            else user_mod.apply(acc_s, r0 + warp_row0, j * BC, lane);
        }

        // ---- ALiBi: -slope |q + offset - k| on every tile (under the flag: even a dead argument
        // expression moved the dropout instances' code, whose SASS is kept as tuned) ----
        if constexpr (V::kAlibi) alibi.apply(acc_s, r0 + warp_row0, j * BC, lane);

        // ---- mask (only tiles that cross the seqlen_k tail or a window edge, at either end) ----
        if (range.masked_tail(j)) mask.apply<false, true>(acc_s, r0 + warp_row0, j * BC, lane, neg_inf());
        if (range.masked_head(j)) mask.apply<true, false>(acc_s, r0 + warp_row0, j * BC, lane, neg_inf());

        // ---- online softmax: new max, rescale O~ and l by exp2((m_old - m_new) c), P in place ----
        softmax.step(acc_s, acc_o, scale_log2);

        // ---- dropout: zero the dropped P entries for P V only (l keeps the undropped sum, the
        // 1/(1-p) scale joins the final 1/l) ----
        if constexpr (V::kDropout) {
#pragma unroll
            for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
                for (int kb = 0; kb < kKeySteps; ++kb)
                    Dropout::zero_dropped(acc_s[mt], kb, drop.bits8((r0 + warp_row0) / 16 + mt, (j * BC) / 16 + kb, g, t));
        }

        // ---- P to 16-bit A fragments now, so the fp32 S accumulators die before P V ----
        u32 p_frag[kRowTiles][kKeySteps][4];
#pragma unroll
        for (int mt = 0; mt < kRowTiles; ++mt) c_to_a_frags<BF16, kKeySteps>(p_frag[mt], acc_s[mt]);

        // ---- O~ += P V_j ----
        warp_mma_ab<BF16, kRowChunks, kKeySteps, kRowTiles, kOutTiles>(acc_o, p_frag, sVj, v_frag_off);
    }
    cp_async_wait<0>();

    // ---- epilogue: O = O~ / l, lse; stage O through this warp's own Q rows in smem so the
    // global stores are 16-byte and row-contiguous ----
    __syncwarp();
    if constexpr (V::kSplitKV) {
        // fp32 straight from the registers: O normalised over this split's keys, and their lse
        const int bh_count = params.tiles / m_blocks;  // batch * heads
        float* lse_row = lse + ((long long)split * bh_count + bh) * seqlen_q;
        float* og = reinterpret_cast<float*>(o) + ((long long)split * (bh_count / n_heads) + b) * o_sb + (long long)h * o_sh;
#pragma unroll
        for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float l = warp_sum4(softmax.row_sum[mt][half]);
                const float inv = l != 0.f ? (V::kDropout ? drop_scale : 1.f) / l : 0.f;
                const int row = r0 + warp_row0 + mt * 16 + g + 8 * half;
                if (row < seqlen_q) {
                    if (t == 0) lse_row[row] = OnlineSoftmax<kRowTiles>::lse(softmax.row_max[mt][half], l, scale_log2);
                    float* orow = og + (long long)row * o_sn;
#pragma unroll
                    for (int i = 0; i < kOutTiles; ++i) {
                        const int col = 8 * i + 2 * t;
                        if (!V::kPartialD || col < 8 * v_chunks)
                            *reinterpret_cast<float2*>(orow + col) = make_float2(acc_o[mt][i][2 * half] * inv,
                                                                                 acc_o[mt][i][2 * half + 1] * inv);
                    }
                }
            }
        return;
    }
    // V::kVarlen: this batch's first row and query count, reloaded (SeqSpan::reload_queries)
    int q_start = 0, n_q = seqlen_q;
    if constexpr (V::kVarlen) SeqSpan::reload_queries<V>(cu_seqlens_q, b, q_start, n_q);
    // (batch, heads, seqlen_q); V::kVarlen: (heads, total_q), total_q = params.seqlen_q
    float* lse_row = V::kVarlen ? lse + (long long)h * params.seqlen_q + q_start : lse + (long long)bh * seqlen_q;
    const SinkLogit<V> sink = SinkLogit<V>::of(sinks, h);  // V::kSinks: attn/sinks.cuh
#pragma unroll
    for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float l = warp_sum4(softmax.row_sum[mt][half]);
            float inv = l != 0.f ? (V::kDropout ? drop_scale : 1.f) / l : 0.f;
            float sink_lse = 0.f;
            if constexpr (V::kSinks) {
                sink.finish(softmax.row_max[mt][half], l, scale_log2, inv, sink_lse);
                if constexpr (V::kDropout) inv *= drop_scale;
            }
            int tile_row = warp_row0 + mt * 16 + g + 8 * half;
            int row = r0 + tile_row;
            if (t == 0 && row < n_q)
                lse_row[row] = V::kSinks ? sink_lse : OnlineSoftmax<kRowTiles>::lse(softmax.row_max[mt][half], l, scale_log2);
#pragma unroll
            for (int i = 0; i < kOutTiles; ++i) {
                u32 packed = pack2<BF16>(acc_o[mt][i][2 * half] * inv, acc_o[mt][i][2 * half + 1] * inv);
                u32 addr = sQ + swz<kRowChunks>(tile_row, i) + 4 * t;
                asm volatile("st.shared.u32 [%0], %1;" :: "r"(addr), "r"(packed) : "memory");
            }
        }
    __syncwarp();
    elem_t* og = o + (long long)b * o_sb + (long long)q_start * o_sn + (long long)h * o_sh;
    constexpr int WARP_CHUNKS = Tr::kRowsPerWarp * kRowChunks;
#pragma unroll
    for (int it = 0; it < (WARP_CHUNKS + 31) / 32; ++it) {
        int idx = it * 32 + lane;
        if (idx < WARP_CHUNKS) {
            int tr = warp_row0 + idx / kRowChunks, c = idx % kRowChunks;
            int row = r0 + tr;
            if (row < n_q && (!V::kPartialD || c < v_chunks)) {
                uint4 val;
                asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                             : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w) : "r"(sQ + swz<kRowChunks>(tr, c)));
                *reinterpret_cast<uint4*>(og + (long long)row * o_sn + c * 8) = val;
            }
        }
    }
}

}  // namespace cuflash
