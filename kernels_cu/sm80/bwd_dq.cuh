// cuflash/kernels_cu/sm80/bwd_dq.cuh
// The deterministic dQ kernel: laid out like the forward (warps own 16 query rows each, K/V
// stream through a ring), recomputes S and dP and accumulates dQ = dS K in registers; no atomics,
// so bitwise reproducible. Costs 3 more GEMMs than the atomic dQ of the dK/dV kernel.
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

template <bool BF16, int D, int BR, int BC, int WARPS, int STAGES, class V>
__device__ __forceinline__ void flash_bwd_dq(const elem_t* __restrict__ q, const elem_t* __restrict__ k,
                                             const elem_t* __restrict__ v, const elem_t* __restrict__ dout, const float* __restrict__ lse2,
                                             const float* __restrict__ delta, elem_t* __restrict__ dq,
                                             const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
                                             const float* __restrict__ alibi_slopes,
                                             const void* const* __restrict__ mod_aux, const int* __restrict__ bm_counts,
                                             const int* __restrict__ bm_index, const BwdParams& params) {
    // The parameters this kernel reads, copied to registers once: a field read where it is used
    // would be re-read from the parameter space after every asm volatile (memory clobber).
    const long long q_sb = params.q_sb, q_sn = params.q_sn, q_sh = params.q_sh, k_sb = params.k_sb, k_sn = params.k_sn, k_sh = params.k_sh,
                    v_sb = params.v_sb, v_sn = params.v_sn, v_sh = params.v_sh, do_sb = params.do_sb, do_sn = params.do_sn, do_sh = params.do_sh,
                    dq_sb = params.dq_sb, dq_sn = params.dq_sn, dq_sh = params.dq_sh;
    const int n_heads = params.heads, seqlen_q_pad = params.seqlen_q_pad, m_blocks = params.m_blocks, group = params.group;
    const float scale_log2 = params.scale_log2, scale = params.scale, drop_scale = params.drop_scale;
    const unsigned long long drop_seed = params.drop_seed;
    const unsigned int drop_threshold = params.drop_threshold;
    // the call's 16-byte chunks per row (V::kPartialD: fewer than the instance's; else all of them)
    const int d_chunks = V::kPartialD ? params.head_dim / 8 : D / 8;
    const int v_chunks = V::kPartialD ? params.head_dim_v / 8 : D / 8;  // v's and dout's (v's own head dim)
    using S_ = Sm80DqTraits<D, BR, BC, WARPS, STAGES>;
    constexpr int CH = S_::kRowChunks, KD = S_::kHeadSteps, SN = S_::kScoreTiles, KB = S_::kKeySteps, DN = S_::kOutTiles;
    constexpr int THREADS = S_::kNumThreads;

    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 sQ = smem_u32(smem);
    const u32 sdO = sQ + S_::kQTileBytes;
    const u32 sK = sdO + S_::kQTileBytes;
    const u32 sV = sK + STAGES * S_::kKVBytes;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const MaskGeometry geo_call = MaskGeometry::of<V>(params);
    const BlockCoord blk = schedule_blocks(blockIdx.x, m_blocks, n_heads, geo_call.later_rows_heavier());
    const int bh = blk.bh, b = blk.batch, h = blk.head;
    const int r0 = blk.block * BR;
    // V::kVarlen: this batch's rows and lengths (else row 0 of its slice and the call's lengths);
    // a query block past its queries has nothing to write (uniform: before any barrier)
    const SeqSpan span = SeqSpan::of<V>(cu_seqlens_q, cu_seqlens_k, b, params.seqlen_q, params.seqlen_k);
    if (V::kVarlen && r0 >= span.seqlen_q) return;
    const int seqlen_q = span.seqlen_q, seqlen_k = span.seqlen_k;
    const MaskGeometry geo = geo_call.template for_span<V>(span, params.align_end);

    const elem_t* qg = q + (long long)b * q_sb + (long long)span.q_start * q_sn + (long long)h * q_sh;
    const int h_kv = h / group;  // GQA/MQA: the query heads of a group share one k/v head (MHA: group 1)
    const elem_t* kg = k + (long long)b * k_sb + (long long)span.k_start * k_sn + (long long)h_kv * k_sh;
    const elem_t* vg = v + (long long)b * v_sb + (long long)span.k_start * v_sn + (long long)h_kv * v_sh;
    const elem_t* dog = dout + (long long)b * do_sb + (long long)span.q_start * do_sn + (long long)h * do_sh;
    const long long ws0 = span.template ws_row0<V>(b, h, bh, seqlen_q_pad);  // lse2, delta rows

    const BlockRange range = key_blocks<BR, BC, V::kLocal>(geo, r0);  // the forward's key blocks and masks
    const Mask<V::kLocal> mask{geo};
    const ScoreMod<V> score_mod = ScoreMod<V>::of(params);
    // ALiBi in exp2 units: P = exp2(t c + bias c - lse2) (attn/score_mod.cuh; nothing without it)
    const AlibiBias<V> alibi = AlibiBias<V>::of(params, alibi_slopes, b, h, geo.offset, scale_log2);
    const UserMod<V> user_mod = UserMod<V>::of(params, mod_aux, b, h, geo.seqlen_q, geo.seqlen_k);
    const Dropout drop{drop_seed, drop_threshold, bh};
    // the range's key blocks, or those of them a block mask lists (the forward's lists at this tile)
    const BlockList<V::kBlockMask> blocks = BlockList<V::kBlockMask>::of(
        bm_counts, bm_index, V::kBlockMask ? block_list_row(params, b, h, m_blocks, blk.block) : 0, params.bm_nb, range);
    const int n_iter = blocks.size();

    // This thread's two query rows: their lse2 and delta (padded buffers, no guard needed).
    const int row_a = r0 + warp * 16 + g;
    const float L0 = lse2[ws0 + row_a], L1 = lse2[ws0 + row_a + 8];
    const float D0 = delta[ws0 + row_a], D1 = delta[ws0 + row_a + 8];

    float acc_q[DN][4];
#pragma unroll
    for (int i = 0; i < DN; ++i) acc_q[i][0] = acc_q[i][1] = acc_q[i][2] = acc_q[i][3] = 0.f;

    if (n_iter > 0) {
        // Prologue (ring contract, sm80/tile_copy.cuh): Q and dO join the first K/V group.
        load_tile<BR, CH, THREADS, V::kPartialD>(sQ, qg, q_sn, r0, seqlen_q, tid, d_chunks);
        load_tile<BR, CH, THREADS, V::kPartialD>(sdO, dog, do_sn, r0, seqlen_q, tid, v_chunks);
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < n_iter)
                load_kv_tile<BC, CH, THREADS, V::kPartialD>(sK + s * S_::kKVBytes, sV + s * S_::kKVBytes, kg, k_sn, vg, v_sn, blocks.at(s),
                                              seqlen_k, tid, d_chunks, v_chunks);
            cp_async_commit();
        }
    }

    const int lane_row = lane % 8;
    const u32 a_off = swz<CH>(warp * 16 + lane_row + ((lane / 8) % 2) * 8, lane / 16);
    const u32 bn_off = swz<CH>(lane_row + (lane / 16) * 8, (lane / 8) % 2);
    const u32 bt_off = swz<CH>(lane_row + ((lane / 8) % 2) * 8, lane / 16);
    constexpr u32 ROW16 = 16 * SmemRow<CH>::kBytes;
    u32 q_frag[S_::kQInRegs ? KD : 1][4];
    for (int it = 0; it < n_iter; ++it) {
        const int j = blocks.at(it);  // key block of this step
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        {
            int in = it + STAGES - 1;
            if (in < n_iter) {
                int slot = in % STAGES;
                load_kv_tile<BC, CH, THREADS, V::kPartialD>(sK + slot * S_::kKVBytes, sV + slot * S_::kKVBytes, kg, k_sn, vg, v_sn,
                                              blocks.at(in), seqlen_k, tid, d_chunks, v_chunks);
            }
            cp_async_commit();
        }
        const int slot = it % STAGES;
        const u32 sKj = sK + slot * S_::kKVBytes, sVj = sV + slot * S_::kKVBytes;
        if (S_::kQInRegs && it == 0) {
#pragma unroll
            for (int kd = 0; kd < (S_::kQInRegs ? KD : 0); ++kd)
                ldmatrix_x4(q_frag[kd][0], q_frag[kd][1], q_frag[kd][2], q_frag[kd][3], sQ + chunk_step<CH>(a_off, 2 * kd));
        }

        // ---- S = Q K^T, dP = dO V^T ----
        float acc_s[SN][4], acc_dp[SN][4];
#pragma unroll
        for (int i = 0; i < SN; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[i][e] = acc_dp[i][e] = 0.f;
#pragma unroll
        for (int kd = 0; kd < KD; ++kd) {
            u32 d0, d1, d2, d3;
            ldmatrix_x4(d0, d1, d2, d3, sdO + chunk_step<CH>(a_off, 2 * kd));
            u32 qa[4];  // Q's A fragment of step kd: held since step 0, or read here past d=128
            if constexpr (S_::kQInRegs) {
                qa[0] = q_frag[kd][0], qa[1] = q_frag[kd][1], qa[2] = q_frag[kd][2], qa[3] = q_frag[kd][3];
            } else {
                ldmatrix_x4(qa[0], qa[1], qa[2], qa[3], sQ + chunk_step<CH>(a_off, 2 * kd));
            }
#pragma unroll
            for (int np = 0; np < SN / 2; ++np) {
                u32 b0, b1, b2, b3;
                ldmatrix_x4(b0, b1, b2, b3, sKj + np * ROW16 + chunk_step<CH>(bn_off, 2 * kd));
                const u32* a = qa;
                mma_16816<BF16>(acc_s[2 * np], a[0], a[1], a[2], a[3], b0, b1);
                mma_16816<BF16>(acc_s[2 * np + 1], a[0], a[1], a[2], a[3], b2, b3);
                ldmatrix_x4(b0, b1, b2, b3, sVj + np * ROW16 + chunk_step<CH>(bn_off, 2 * kd));
                mma_16816<BF16>(acc_dp[2 * np], d0, d1, d2, d3, b0, b1);
                mma_16816<BF16>(acc_dp[2 * np + 1], d0, d1, d2, d3, b2, b3);
            }
        }

        // ---- P, dS (rows = queries, cols = keys); dropout bits as in the forward ----
        u32 dbits[V::kDropout ? KB : 1];
        if constexpr (V::kDropout) {
#pragma unroll
            for (int kb = 0; kb < KB; ++kb) dbits[kb] = drop.bits8((r0 + warp * 16) / 16, (j * BC) / 16 + kb, g, t);
        }
        // score modifier (softcap: t = tanh(S softcap_scale)), mask S (-inf, so P = exp2(-inf) = 0
        // there; c > 0), then P = exp2(S c - lse2) and dS = P o (dP o Z - delta) o grad(t), Z =
        // dropout keep / (1 - p), grad the modifier's derivative (attn/score_mod.cuh; 1 without)
        score_mod.apply_tile(acc_s);
        // a mask snippet (-inf where masked); a score snippet runs per element below, on the masked raw S
        if constexpr (!UserMod<V>::kScore) user_mod.apply_tile(acc_s, r0 + warp * 16, j * BC, lane);
        if (range.masked_tail(j)) mask.apply_tile<false, true>(acc_s, r0 + warp * 16, j * BC, lane, neg_inf());
        if (range.masked_head(j)) mask.apply_tile<true, false>(acc_s, r0 + warp * 16, j * BC, lane, neg_inf());
#pragma unroll
        for (int nt = 0; nt < SN; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float gu = 1.f;  // a score snippet's derivative (its value replaces the masked raw S)
                if constexpr (UserMod<V>::kScore)
                    acc_s[nt][e] = user_mod.value_grad(acc_s[nt][e], row_a + 8 * (e >> 1), j * BC + 8 * nt + 2 * t + (e & 1), gu);
                const float p = fast_exp2(fmaf(acc_s[nt][e], scale_log2,  // query row_a + 8 (e / 2), key j BC + 8 nt + 2 t + e % 2
                                               alibi.shift(-(e < 2 ? L0 : L1), row_a + 8 * (e >> 1), j * BC + 8 * nt + 2 * t + (e & 1))));
                float dp = acc_dp[nt][e];
                if constexpr (V::kDropout) dp = Dropout::kept(dbits[nt / 2], nt, e) ? dp * drop_scale : 0.f;
                float ds = p * (dp - (e < 2 ? D0 : D1));
                if constexpr (V::kSoftcap) ds *= ScoreMod<V>::grad(acc_s[nt][e]);
                if constexpr (UserMod<V>::kScore) ds *= gu;
                acc_dp[nt][e] = ds;
            }

        // ---- dQ += dS K ----
#pragma unroll
        for (int kb = 0; kb < KB; ++kb) {
            u32 a0 = pack2<BF16>(acc_dp[2 * kb][0], acc_dp[2 * kb][1]);
            u32 a1 = pack2<BF16>(acc_dp[2 * kb][2], acc_dp[2 * kb][3]);
            u32 a2 = pack2<BF16>(acc_dp[2 * kb + 1][0], acc_dp[2 * kb + 1][1]);
            u32 a3 = pack2<BF16>(acc_dp[2 * kb + 1][2], acc_dp[2 * kb + 1][3]);
#pragma unroll
            for (int dp = 0; dp < DN / 2; ++dp) {
                u32 b0, b1, b2, b3;
                ldmatrix_x4_trans(b0, b1, b2, b3, sKj + kb * ROW16 + chunk_step<CH>(bt_off, 2 * dp));
                mma_16816<BF16>(acc_q[2 * dp], a0, a1, a2, a3, b0, b1);
                mma_16816<BF16>(acc_q[2 * dp + 1], a0, a1, a2, a3, b2, b3);
            }
        }
    }
    cp_async_wait<0>();

    // ---- epilogue: dQ = scale * dQ~, through this warp's own Q rows ----
    __syncwarp();
    stash_c_tile<BF16, CH, DN>(sQ, warp * 16, acc_q, scale, lane);
    __syncwarp();
    const int q_start = SeqSpan::reload<V>(cu_seqlens_q, b);  // V::kVarlen (reloaded); else 0
    elem_t* dqg = dq + (long long)b * dq_sb + (long long)q_start * dq_sn + (long long)h * dq_sh;
    store_rows_warp<CH, 16, CH, V::kPartialD>(sQ, warp * 16, dqg, dq_sn, r0 + warp * 16, seqlen_q, lane, 0, d_chunks);
}

}  // namespace cuflash
