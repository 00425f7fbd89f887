// cuflash/kernels_cu/sm80/bwd_dkdv.cuh
// FlashAttention-2 backward, dK/dV kernel (+ dQ by fp32 atomics), sm80 mainloop. One block per
// (key tile of BC rows, head, batch); warp w owns keys [16w, 16w+16) and keeps their dK, dV in
// registers while the block walks the query tiles (BR rows) through a cp.async ring. Per query
// tile, per warp:
//   S^T  = K_w Q^T          P^T = exp2(S^T c - lse2)   (recomputed, never stored)
//   dP^T = V_w dO^T         dS^T = P^T o (dP^T - delta)
//   dV  += P^T dO           dK += dS^T Q
// Warps owning keys means S^T's C fragments are already the A fragments of the dV and dK
// products: no shared-memory round trip for P or dS there. With dq_acc != null the block also adds
// dQ += dS K for the tile into the fp32 accumulator with atomics (dS^T goes through shared memory
// once). The policies see S^T through a transposed fragment view (core/frag.cuh, Transposed).
// The dropout instances (V::kDropout) regenerate the forward's Philox mask: dV uses P o mask, and
// dS = P o (dP o Z - delta) with Z = mask / (1 - p).
// The softcap instances (V::kSoftcap, attn/score_mod.cuh) cap S^T before the exp (t), mask t
// (-inf) instead of P, and park P^T o (1 - t^2), which is all dS^T needs of P, in this tile's dS^T
// buffer until the dS^T phase: dS = P o (1 - t^2) o (dP - delta).
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
#include "sm80/tile_copy.cuh"
#include "sm80/traits.cuh"
#include "sm80/warp_gemm.cuh"

namespace cuflash {

// dQ rows [q0, q0+BR), columns [col0, col0 + kSplitCols) += dS K over this block's BC keys, into
// the fp32 accumulator (atomics). A = dS (rows = queries, k = keys) is read transposed out of dS^T
// (rows = keys); warps split the BR x kSplitCols product as a WM x WN grid.
template <bool BF16, class S_>
__device__ __forceinline__ void bwd_dq_product(u32 sdS_buf, u32 sK, float* dq_rows, int col0, int warp, int lane) {
    constexpr int QM = S_::kDqRowTiles, QN = S_::kDqColTiles, KK = S_::kKeySteps, SCH = S_::kDsRowChunks, CH = S_::kRowChunks, D = S_::kRowChunks * 8;
    constexpr u32 ROW16 = 16 * SmemRow<CH>::kBytes;
    const int g = lane / 4, t = lane % 4, lane_row = lane % 8;
    const int wm = warp % S_::kDqWarpsM, wn = warp / S_::kDqWarpsM;
    const u32 bt_off = swz<CH>(lane_row + ((lane / 8) % 2) * 8, lane / 16);
    // matrices (q 0-7 | 8-15) x (keys 0-7 | 8-15) in a0..a3 order
    const u32 ds_off = swz<SCH>(lane_row + (lane / 16) * 8, (wm * S_::kDqRowsPerWarp) / 8 + (lane / 8) % 2);
    float acc_q[QM][QN][4];
#pragma unroll
    for (int mi = 0; mi < QM; ++mi)
#pragma unroll
        for (int i = 0; i < QN; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_q[mi][i][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KK; ++kk) {
        u32 a[QM][4];
#pragma unroll
        for (int mi = 0; mi < QM; ++mi)
            ldmatrix_x4_trans(a[mi][0], a[mi][1], a[mi][2], a[mi][3], sdS_buf + kk * 16 * SmemRow<SCH>::kBytes + chunk_step<SCH>(ds_off, 2 * mi));
#pragma unroll
        for (int dp = 0; dp < QN / 2; ++dp) {
            u32 b0, b1, b2, b3;
            ldmatrix_x4_trans(b0, b1, b2, b3, sK + kk * ROW16 + chunk_step<CH>(bt_off, (col0 + wn * S_::kDqColsPerWarp) / 8 + 2 * dp));
#pragma unroll
            for (int mi = 0; mi < QM; ++mi) {
                mma_16816<BF16>(acc_q[mi][2 * dp], a[mi][0], a[mi][1], a[mi][2], a[mi][3], b0, b1);
                mma_16816<BF16>(acc_q[mi][2 * dp + 1], a[mi][0], a[mi][1], a[mi][2], a[mi][3], b2, b3);
            }
        }
    }
    float* dqg = dq_rows + wm * S_::kDqRowsPerWarp * D + col0 + wn * S_::kDqColsPerWarp;
#pragma unroll
    for (int mi = 0; mi < QM; ++mi)
#pragma unroll
        for (int i = 0; i < QN; ++i)
#pragma unroll
            for (int half = 0; half < 2; ++half)
                red_add2(dqg + (mi * 16 + g + 8 * half) * D + i * 8 + 2 * t, acc_q[mi][i][2 * half],
                         acc_q[mi][i][2 * half + 1]);
}

template <bool BF16, int D, int BR, int BC, int WARPS, int STAGES, class V>
__device__ __forceinline__ void flash_bwd_dkdv(const elem_t* __restrict__ q, const elem_t* __restrict__ k,
                                               const elem_t* __restrict__ v, const elem_t* __restrict__ dout, const float* __restrict__ lse2,
                                               const float* __restrict__ delta, float* __restrict__ dq_acc, elem_t* __restrict__ dk,
                                               elem_t* __restrict__ dv, const int* __restrict__ cu_seqlens_q,
                                               const int* __restrict__ cu_seqlens_k, const float* __restrict__ alibi_slopes,
                                               const void* const* __restrict__ mod_aux, const int* __restrict__ bm_counts,
                                               const int* __restrict__ bm_index, const BwdParams& params) {
    // The parameters this kernel reads, copied to registers once: a field read where it is used
    // would be re-read from the parameter space after every asm volatile (memory clobber).
    const long long q_sb = params.q_sb, q_sn = params.q_sn, q_sh = params.q_sh, k_sb = params.k_sb, k_sn = params.k_sn, k_sh = params.k_sh,
                    v_sb = params.v_sb, v_sn = params.v_sn, v_sh = params.v_sh, do_sb = params.do_sb, do_sn = params.do_sn, do_sh = params.do_sh,
                    dk_sb = params.dk_sb, dk_sn = params.dk_sn, dk_sh = params.dk_sh, dv_sb = params.dv_sb, dv_sn = params.dv_sn, dv_sh = params.dv_sh;
    const int n_heads = params.heads, seqlen_q_pad = params.seqlen_q_pad, n_blocks = params.n_blocks, group = params.group;
    const float scale_log2 = params.scale_log2, scale = params.scale, drop_scale = params.drop_scale;
    const unsigned long long drop_seed = params.drop_seed;
    const unsigned int drop_threshold = params.drop_threshold;
    // the call's 16-byte chunks per row (V::kPartialD: fewer than the instance's; else all of them)
    const int d_chunks = V::kPartialD ? params.head_dim / 8 : D / 8;
    // v's, dout's and dV's chunks (v's own head dim, params.head_dim_v: d_chunks unless they differ)
    const int v_chunks = V::kPartialD ? params.head_dim_v / 8 : D / 8;
    using S_ = Sm80BwdTraits<D, BR, BC, WARPS, STAGES, V::kDropout>;
    constexpr int CH = S_::kRowChunks, SCH = S_::kDsRowChunks, KD = S_::kHeadSteps, SN = S_::kQueryTiles, KQ = S_::kQuerySteps, DN = S_::kOutTiles;
    constexpr int THREADS = S_::kNumThreads;

    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 sK = smem_u32(smem);
    const u32 sV = sK + S_::kKVBytes;
    const u32 sQ = sV + S_::kKVBytes;
    const u32 sdO = sQ + STAGES * S_::kQTileBytes;
    const u32 sdS = sdO + STAGES * S_::kQTileBytes;
    const u32 sL = sdS + S_::kDsBuffers * S_::kDsBytes;  // STAGES x BR floats of lse2
    const u32 sDelta = sL + STAGES * S_::kStatBytes;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;

    // Block -> (key block, head, batch); key blocks fastest, in natural order: under a causal
    // mask the early key blocks see the most query tiles, so the heaviest blocks start first.
    // n_blocks counts key blocks x kColSplits: the column splits of one key block are neighbours.
    const BlockCoord blk = schedule_blocks(blockIdx.x, n_blocks, n_heads, false);
    const int bh = blk.bh, b = blk.batch, h = blk.head, nb = blk.block / S_::kColSplits;
    const int col0 = (blk.block % S_::kColSplits) * S_::kSplitCols;  // this block's dK/dV/dQ columns
    const int c0 = nb * BC;
    // V::kVarlen: this batch's rows of the packed arrays and its lengths (else row 0 of its slice
    // and the call's lengths); a key block past its keys has nothing to write (uniform: no barrier yet)
    const SeqSpan span = SeqSpan::of<V>(cu_seqlens_q, cu_seqlens_k, b, params.seqlen_q, params.seqlen_k);
    if (V::kVarlen && c0 >= span.seqlen_k) return;
    const int seqlen_q = span.seqlen_q, seqlen_k = span.seqlen_k;
    const MaskGeometry geo = MaskGeometry::of<V>(params).template for_span<V>(span, params.align_end);

    const elem_t* qg = q + (long long)b * q_sb + (long long)span.q_start * q_sn + (long long)h * q_sh;
    const int h_kv = h / group;  // GQA/MQA: k/v head of query head h (MHA: group 1); dK/dV go per query head
    const elem_t* kg = k + (long long)b * k_sb + (long long)span.k_start * k_sn + (long long)h_kv * k_sh;
    const elem_t* vg = v + (long long)b * v_sb + (long long)span.k_start * v_sn + (long long)h_kv * v_sh;
    const elem_t* dog = dout + (long long)b * do_sb + (long long)span.q_start * do_sn + (long long)h * do_sh;
    const long long ws0 = span.template ws_row0<V>(b, h, bh, seqlen_q_pad);  // lse2, delta, dq_acc rows
    const float* lse2g = lse2 + ws0;
    const float* deltag = delta + ws0;
    // the same row, recomputed where dQ is added (V::kVarlen: from a reloaded offset, so that no
    // 64-bit row index lives through the mainloop)
    auto ws_rows0 = [&]() {
        if constexpr (V::kVarlen)
            return SeqSpan::varlen_ws_row0(SeqSpan::reload<V>(cu_seqlens_q, b), b, h, seqlen_q_pad);
        else
            return (long long)bh * seqlen_q_pad;
    };

    // Query tiles that see any of this block's keys, and which of them need the mask.
    const int m_blocks = (seqlen_q + BR - 1) / BR;
    const BlockRange range = query_blocks<BR, BC, V::kLocal>(geo, nb, m_blocks);
    const Mask<V::kLocal> mask{geo};
    const ScoreMod<V> score_mod = ScoreMod<V>::of(params);
    // ALiBi in exp2 units: P^T = exp2(t c + bias c - lse2) (attn/score_mod.cuh; nothing without it)
    const AlibiBias<V> alibi = AlibiBias<V>::of(params, alibi_slopes, b, h, geo.offset, scale_log2);
    const UserMod<V> user_mod = UserMod<V>::of(params, mod_aux, b, h, geo.seqlen_q, geo.seqlen_k);
    // a score modifier whose derivative dS needs: softcap's (from t), a user score snippet's (from S)
    constexpr bool kGrad = V::kSoftcap || UserMod<V>::kScore;
    const Dropout drop{drop_seed, drop_threshold, bh};
    // the range's query blocks, or those of them a block mask lists (its transposed lists: per key
    // block nb of n_blocks / kColSplits, bm_mb entries each)
    const BlockList<V::kBlockMask> blocks = BlockList<V::kBlockMask>::of(
        bm_counts, bm_index, V::kBlockMask ? block_list_row(params, b, h, n_blocks / S_::kColSplits, nb) : 0,
        params.bm_mb, range);
    const int n_iter = blocks.size();

    auto load_q_tile = [&](int it) {
        const int slot = it % STAGES;
        const int r0 = blocks.at(it) * BR;
        load_tile<BR, CH, THREADS, V::kPartialD>(sQ + slot * S_::kQTileBytes, qg, q_sn, r0, seqlen_q, tid, d_chunks);
        load_tile<BR, CH, THREADS, V::kPartialD>(sdO + slot * S_::kQTileBytes, dog, do_sn, r0, seqlen_q, tid, v_chunks);
        // lse2 and delta: BR/4 chunks each, from buffers padded past seqlen_q (no guard needed)
        constexpr int SC = BR / 4;
        static_assert(2 * SC <= THREADS, "one thread per stats chunk");
        if (tid < SC) {
            cp_async_16(sL + slot * S_::kStatBytes + tid * 16, lse2g + r0 + tid * 4, true);
        } else if (tid < 2 * SC) {
            cp_async_16(sDelta + slot * S_::kStatBytes + (tid - SC) * 16, deltag + r0 + (tid - SC) * 4, true);
        }
    };

    float acc_dk[DN][4], acc_dv[DN][4];
#pragma unroll
    for (int i = 0; i < DN; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dk[i][e] = acc_dv[i][e] = 0.f;

    if (n_iter > 0) {
        load_tile<BC, CH, THREADS, V::kPartialD>(sK, kg, k_sn, c0, seqlen_k, tid, d_chunks);
        load_tile<BC, CH, THREADS, V::kPartialD>(sV, vg, v_sn, c0, seqlen_k, tid, v_chunks);
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < n_iter) load_q_tile(s);
            cp_async_commit();
        }
    }

    // ldmatrix lane offsets (see flash_fwd.cuh): A operand rows of this warp's keys; B operand
    // non-transposed (rows = n, as Q and dO in S^T, dP^T); B operand transposed (rows = k, as
    // Q and dO in dK, dV); and for the dQ product A = dS read transposed out of dS^T.
    const int lane_row = lane % 8;
    const u32 a_off = swz<CH>(warp * 16 + lane_row + ((lane / 8) % 2) * 8, lane / 16);
    const u32 bn_off = swz<CH>(lane_row + (lane / 16) * 8, (lane / 8) % 2);
    const u32 bt_off = swz<CH>(lane_row + ((lane / 8) % 2) * 8, lane / 16);
    const int key_w = c0 + warp * 16;  // first key of this warp

    for (int it = 0; it < n_iter; ++it) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (it + STAGES - 1 < n_iter) load_q_tile(it + STAGES - 1);
        cp_async_commit();
        const int slot = it % STAGES;
        const u32 sQs = sQ + slot * S_::kQTileBytes, sdOs = sdO + slot * S_::kQTileBytes;
        const int m = blocks.at(it);  // query block of this step
        const int q0 = m * BR;
        constexpr int NDS = S_::kDsBuffers;
        const u32 sdS_it = sdS + (it % NDS) * S_::kDsBytes;
        // dQ of the previous query tile: its dS^T is complete now that every warp passed the
        // barrier above. Deferring it by one tile saves the second barrier per tile (with one
        // dS^T buffer, not: every warp must be done reading it before any parks or stores the
        // next tile's in it).
        if (dq_acc != nullptr && it > 0) {
            bwd_dq_product<BF16, S_>(sdS + ((it - 1) % NDS) * S_::kDsBytes, sK,
                                     dq_acc + (ws_rows0() + q0 - BR) * D, col0, warp, lane);
            if constexpr (NDS == 1) __syncthreads();
        }

        // ---- dropout keep bits (first, while few registers are live), in S^T's A-fragment order
        // (Dropout::bits8_transposed): byte kq % 4 of keep[kq / 4], bit 4s + 2h + e, is key g + 8h,
        // query 16kq + 8s + 2t + e. Packed 4 query blocks to a register: registers are the scarce
        // resource here. ----
        u32 keep[V::kDropout ? (KQ + 3) / 4 : 1];
        if constexpr (V::kDropout) {
#pragma unroll
            for (int w = 0; w < (KQ + 3) / 4; ++w) keep[w] = 0;
#pragma unroll
            for (int kq = 0; kq < KQ; ++kq) keep[kq / 4] |= drop.bits8_transposed(q0 / 16 + kq, key_w / 16, g, t) << ((kq % 4) * 8);
        }
        // Phases are ordered so that at most one 16 x BR fp32 tile is live next to dK, dV:
        // S^T -> P^T (packed) -> dV; then dP^T -> dS^T (packed) -> dK.
        const float* sLf = reinterpret_cast<const float*>(smem + (sL - sK) + slot * S_::kStatBytes);
        const float* sDf = reinterpret_cast<const float*>(smem + (sDelta - sK) + slot * S_::kStatBytes);
        u32 frag[KQ][4];  // P^T, then dS^T, as A fragments (k = queries)
        // softcap: the dS^T slot of C tile nt, element pair `half` (frag[nt / 2][2 (nt % 2) + half],
        // see the dS^T stores below), where P^T o (1 - t^2) waits for the dS^T phase. Not in
        // registers (KQ * 4 more: the d64 tile reached 255 and spilled with dropout). The buffer
        // is free (its last reader, tile it-2's dQ product, ran before this step's barrier, or
        // with one buffer tile it-1's, before the barrier after it; the deterministic mode never
        // uses it) and only this thread touches these slots until it overwrites them with dS^T.
        auto park_slot = [&](int nt, int half) { return sdS_it + swz<SCH>(warp * 16 + g + 8 * half, nt) + 4 * t; };

        // ---- S^T = K_w Q^T; score modifier; P^T = exp2(S^T c - lse2), 0 where masked ----
        {
            float acc[SN][4];
            tile_mma_abt<BF16, CH, KD, SN, S_::kHeadUnroll>(acc, sK, a_off, sQs, bn_off);
            // in query order the masked head is the right edge + seqlen_k tail, the tail the left
            // edge (local instances only): one pass checks both edges on either kind of tile
            if constexpr (kGrad) {
                // t = the capped S^T (or a user snippet's score), masked to -inf before the exp (P = 0
                // and 1 - t^2 = 0 there); P^T o grad parked for the dS^T phase
                score_mod.apply_tile(acc);  // softcap (a score snippet: per element below, on the masked raw S)
                if constexpr (!UserMod<V>::kScore) user_mod.apply_transposed(acc, q0, key_w, lane);  // a mask snippet
                if (range.masked_head(m) || (V::kLocal && range.masked_tail(m))) mask.apply_transposed<true, true>(acc, q0, key_w, lane, neg_inf());
#pragma unroll
                for (int nt = 0; nt < SN; ++nt) {
                    const float2 L = *reinterpret_cast<const float2*>(sLf + nt * 8 + 2 * t);
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int qc = q0 + 8 * nt + 2 * t, kr = key_w + g + 8 * half;  // (query, key) of the pair
                        float g0, g1;
                        if constexpr (UserMod<V>::kScore) {
                            acc[nt][2 * half] = user_mod.value_grad(acc[nt][2 * half], qc, kr, g0);
                            acc[nt][2 * half + 1] = user_mod.value_grad(acc[nt][2 * half + 1], qc + 1, kr, g1);
                        } else {
                            g0 = ScoreMod<V>::grad(acc[nt][2 * half]), g1 = ScoreMod<V>::grad(acc[nt][2 * half + 1]);
                        }
                        acc[nt][2 * half] = fast_exp2(fmaf(acc[nt][2 * half], scale_log2, alibi.shift(-L.x, qc, kr)));
                        acc[nt][2 * half + 1] = fast_exp2(fmaf(acc[nt][2 * half + 1], scale_log2, alibi.shift(-L.y, qc + 1, kr)));
                        st_shared_u32(park_slot(nt, half), pack2<BF16>(acc[nt][2 * half] * g0, acc[nt][2 * half + 1] * g1));
                    }
                }
            } else {
                user_mod.apply_transposed(acc, q0, key_w, lane);  // a mask snippet: -inf, so P = 0
#pragma unroll
                for (int nt = 0; nt < SN; ++nt) {
                    const float2 L = *reinterpret_cast<const float2*>(sLf + nt * 8 + 2 * t);
#pragma unroll
                    for (int e = 0; e < 4; ++e)  // element e: query q0 + 8 nt + 2 t + e % 2, key key_w + g + 8 (e / 2)
                        acc[nt][e] = fast_exp2(fmaf(acc[nt][e], scale_log2,
                                                    alibi.shift(-((e & 1) ? L.y : L.x), q0 + 8 * nt + 2 * t + (e & 1), key_w + g + 8 * (e >> 1))));
                }
                if (range.masked_head(m) || (V::kLocal && range.masked_tail(m))) mask.apply_transposed<true, true>(acc, q0, key_w, lane, 0.f);
            }
            c_to_a_frags<BF16, KQ>(frag, acc);
        }
        // ---- dV += (P o mask)^T dO (the 1/(1-p) scale is applied to dV once, at the end) ----
        tile_mma_ab<BF16, CH, KQ, DN, V::kDropout, S_::kSplitCols / 8>(acc_dv, frag, sdOs, bt_off, col0 != 0, keep);

        // ---- dP^T = V_w dO^T; dS^T = P^T (dP^T - delta), P^T recomputed from S^T ----
        {
            float acc[SN][4];
            tile_mma_abt<BF16, CH, KD, SN, S_::kHeadUnroll>(acc, sV, a_off, sdOs, bn_off);
#pragma unroll
            for (int nt = 0; nt < SN; ++nt) {
                const float2 Dl = *reinterpret_cast<const float2*>(sDf + nt * 8 + 2 * t);
                float pg[kGrad ? 4 : 1];  // softcap / a score snippet: P^T o grad, parked by the S^T phase
                if constexpr (kGrad) {
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        u32 w;
                        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(w) : "r"(park_slot(nt, half)) : "memory");
                        unpack2<BF16>(w, pg[2 * half], pg[2 * half + 1]);
                    }
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    // P^T from its packed 16-bit copy: the same rounding the dV product used.
                    float dp = acc[nt][e];
                    if constexpr (V::kDropout)  // dP o Z, Z = mask / (1 - p)
                        dp = ((keep[nt / 8] >> (((nt / 2) % 4) * 8 + (nt % 2) * 4 + e)) & 1u) ? dp * drop_scale : 0.f;
                    if constexpr (kGrad)
                        acc[nt][e] = pg[e] * (dp - ((e & 1) ? Dl.y : Dl.x));
                    else
                        acc[nt][e] = a_frag_elem<BF16, KQ>(frag, nt, e) * (dp - ((e & 1) ? Dl.y : Dl.x));
                }
            }
            c_to_a_frags<BF16, KQ>(frag, acc);
        }

        // ---- dS^T to shared memory for the dQ product (rows = keys, 4-byte pairs of queries) ----
        if (dq_acc != nullptr) {
#pragma unroll
            for (int kq = 0; kq < KQ; ++kq)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    // frag[kq][j]: key row g + 8*(j%2), query cols (2kq + j/2)*8 + 2t
                    u32 addr = sdS_it + swz<SCH>(warp * 16 + g + 8 * (j % 2), 2 * kq + j / 2) + 4 * t;
                    asm volatile("st.shared.u32 [%0], %1;" :: "r"(addr), "r"(frag[kq][j]) : "memory");
                }
        }
        // ---- dK += dS^T Q ----
        tile_mma_ab<BF16, CH, KQ, DN, false, S_::kSplitCols / 8>(acc_dk, frag, sQs, bt_off, col0 != 0);

    }
    cp_async_wait<0>();
    __syncthreads();  // the last dS^T is complete
    if (dq_acc != nullptr && n_iter > 0) {
        bwd_dq_product<BF16, S_>(sdS + ((n_iter - 1) % S_::kDsBuffers) * S_::kDsBytes, sK,
                                 dq_acc + (ws_rows0() + blocks.at(n_iter - 1) * BR) * D, col0, warp, lane);
        __syncthreads();  // every warp is done reading K: its rows take dK for the store
    }

    // ---- epilogue: dK = scale * dK~, dV; through this warp's own K/V rows ----
    stash_c_tile<BF16, CH, DN>(sK, warp * 16, acc_dk, scale, lane, col0 / 8);
    stash_c_tile<BF16, CH, DN>(sV, warp * 16, acc_dv, V::kDropout ? drop_scale : 1.f, lane, col0 / 8);
    __syncwarp();
    const int k_start = SeqSpan::reload<V>(cu_seqlens_k, b);  // V::kVarlen (reloaded); else 0
    elem_t* dkg = dk + (long long)b * dk_sb + (long long)k_start * dk_sn + (long long)h * dk_sh;
    elem_t* dvg = dv + (long long)b * dv_sb + (long long)k_start * dv_sn + (long long)h * dv_sh;
    store_rows_warp<CH, 16, DN, V::kPartialD>(sK, warp * 16, dkg, dk_sn, key_w, seqlen_k, lane, col0 / 8, d_chunks);
    store_rows_warp<CH, 16, DN, V::kPartialD>(sV, warp * 16, dvg, dv_sn, key_w, seqlen_k, lane, col0 / 8, v_chunks);
}

}  // namespace cuflash
