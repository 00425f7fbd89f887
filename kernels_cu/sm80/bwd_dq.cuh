// cuflash/kernels_cu/sm80/bwd_dq.cuh
// The deterministic dQ kernel: laid out like the forward (warps own 16 query rows each, K/V
// stream through a ring), recomputes S and dP and accumulates dQ = dS K in registers; no atomics,
// so bitwise reproducible. Costs 3 more GEMMs than the atomic dQ of the dK/dV kernel.
#pragma once
#include "attn/dropout.cuh"
#include "attn/epilogue.cuh"
#include "attn/params.cuh"
#include "sm80/tile_copy.cuh"
#include "sm80/traits.cuh"
#include "sm80/warp_gemm.cuh"

namespace cuflash {

template <bool BF16, int D, int BR, int BC, int WARPS, int STAGES, bool DROPOUT>
__device__ __forceinline__ void flash_bwd_dq(CUFLASH_DQ_PARAMS) {
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
    const int bid = blockIdx.x;
    const int bh = bid / m_blocks;
    int mb = bid - bh * m_blocks;
    if (causal) mb = m_blocks - 1 - mb;  // heaviest query tiles first
    const int b = bh / n_heads, h = bh - b * n_heads;
    const int r0 = mb * BR;

    const elem_t* qg = q + (long long)b * q_sb + (long long)h * q_sh;
    const elem_t* kg = k + (long long)b * k_sb + (long long)h * k_sh;
    const elem_t* vg = v + (long long)b * v_sb + (long long)h * v_sh;
    const elem_t* dog = dout + (long long)b * do_sb + (long long)h * do_sh;

    const int off = seqlen_k - seqlen_q;
    int n_end = (seqlen_k + BC - 1) / BC;
    int n_full = seqlen_k / BC;
    if (causal) {
        int last_key = r0 + BR - 1 + off;
        n_end = min(n_end, last_key < 0 ? 0 : last_key / BC + 1);
        int first_row_keys = r0 + off + 1;
        n_full = min(n_full, first_row_keys < 0 ? 0 : first_row_keys / BC);
    }

    // This thread's two query rows: their lse2 and delta (padded buffers, no guard needed).
    const int row_a = r0 + warp * 16 + g;
    const float L0 = lse2[(long long)bh * seqlen_q_pad + row_a], L1 = lse2[(long long)bh * seqlen_q_pad + row_a + 8];
    const float D0 = delta[(long long)bh * seqlen_q_pad + row_a], D1 = delta[(long long)bh * seqlen_q_pad + row_a + 8];

    float acc_q[DN][4];
#pragma unroll
    for (int i = 0; i < DN; ++i) acc_q[i][0] = acc_q[i][1] = acc_q[i][2] = acc_q[i][3] = 0.f;

    if (n_end > 0) {
        load_tile<BR, CH, THREADS>(sQ, qg, q_sn, r0, seqlen_q, tid);
        load_tile<BR, CH, THREADS>(sdO, dog, do_sn, r0, seqlen_q, tid);
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < n_end) {
                load_tile<BC, CH, THREADS>(sK + s * S_::kKVBytes, kg, k_sn, s * BC, seqlen_k, tid);
                load_tile<BC, CH, THREADS>(sV + s * S_::kKVBytes, vg, v_sn, s * BC, seqlen_k, tid);
            }
            cp_async_commit();
        }
    }

    const int lane_row = lane % 8;
    const u32 a_off = swz<CH>(warp * 16 + lane_row + ((lane / 8) % 2) * 8, lane / 16);
    const u32 bn_off = swz<CH>(lane_row + (lane / 16) * 8, (lane / 8) % 2);
    const u32 bt_off = swz<CH>(lane_row + ((lane / 8) % 2) * 8, lane / 16);
    constexpr u32 ROW16 = 16 * CH * 16;
    u32 q_frag[KD][4];
    for (int j = 0; j < n_end; ++j) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        {
            int jn = j + STAGES - 1;
            if (jn < n_end) {
                int slot = jn % STAGES;
                load_tile<BC, CH, THREADS>(sK + slot * S_::kKVBytes, kg, k_sn, jn * BC, seqlen_k, tid);
                load_tile<BC, CH, THREADS>(sV + slot * S_::kKVBytes, vg, v_sn, jn * BC, seqlen_k, tid);
            }
            cp_async_commit();
        }
        const int slot = j % STAGES;
        const u32 sKj = sK + slot * S_::kKVBytes, sVj = sV + slot * S_::kKVBytes;
        if (j == 0) {
#pragma unroll
            for (int kd = 0; kd < KD; ++kd)
                ldmatrix_x4(q_frag[kd][0], q_frag[kd][1], q_frag[kd][2], q_frag[kd][3], sQ + (a_off ^ (32 * kd)));
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
            ldmatrix_x4(d0, d1, d2, d3, sdO + (a_off ^ (32 * kd)));
#pragma unroll
            for (int np = 0; np < SN / 2; ++np) {
                u32 b0, b1, b2, b3;
                ldmatrix_x4(b0, b1, b2, b3, sKj + np * ROW16 + (bn_off ^ (32 * kd)));
                const u32* a = q_frag[kd];
                mma_16816<BF16>(acc_s[2 * np], a[0], a[1], a[2], a[3], b0, b1);
                mma_16816<BF16>(acc_s[2 * np + 1], a[0], a[1], a[2], a[3], b2, b3);
                ldmatrix_x4(b0, b1, b2, b3, sVj + np * ROW16 + (bn_off ^ (32 * kd)));
                mma_16816<BF16>(acc_dp[2 * np], d0, d1, d2, d3, b0, b1);
                mma_16816<BF16>(acc_dp[2 * np + 1], d0, d1, d2, d3, b2, b3);
            }
        }

        // ---- P, dS (rows = queries, cols = keys); dropout bits as in the forward ----
        const bool need_mask = j >= n_full;
        u32 dbits[DROPOUT ? KB : 1];
        if constexpr (DROPOUT) {
#pragma unroll
            for (int kb = 0; kb < KB; ++kb)
                dbits[kb] = dropout_bits8((r0 + warp * 16) / 16, (j * BC) / 16 + kb, g, t, bh, drop_seed, drop_threshold);
        }
#pragma unroll
        for (int nt = 0; nt < SN; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const bool lo = e < 2;
                float p = fast_exp2(fmaf(acc_s[nt][e], scale_log2, -(lo ? L0 : L1)));
                if (need_mask) {
                    int key = j * BC + nt * 8 + 2 * t + (e & 1);
                    int row = row_a + (lo ? 0 : 8);
                    if (key >= seqlen_k || (causal && key > row + off)) p = 0.f;
                }
                float dp = acc_dp[nt][e];
                if constexpr (DROPOUT)  // dP o Z; bit half*4 + s*2 + e of the forward's grouping
                    dp = ((dbits[nt / 2] >> ((e / 2) * 4 + (nt % 2) * 2 + (e % 2))) & 1u) ? dp * drop_scale : 0.f;
                acc_dp[nt][e] = p * (dp - (lo ? D0 : D1));
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
                ldmatrix_x4_trans(b0, b1, b2, b3, sKj + kb * ROW16 + (bt_off ^ (32 * dp)));
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
    elem_t* dqg = dq + (long long)b * dq_sb + (long long)h * dq_sh;
    store_rows_warp<CH, 16>(sQ, warp * 16, dqg, dq_sn, r0 + warp * 16, seqlen_q, lane);
}

}  // namespace cuflash
