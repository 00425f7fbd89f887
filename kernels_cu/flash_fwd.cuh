// cuflash/kernels_cu/flash_fwd.cuh
// FlashAttention-2 forward ("v2" in the design notes), tensor cores via mma.sync m16n8k16.
//
//   grid : one thread block per (Q tile of BR rows, head, batch), flattened into blockIdx.x
//   block: WARPS warps; warp w owns Q rows [w*BR/WARPS, (w+1)*BR/WARPS) of the tile, so the
//          softmax statistics of a row live in one warp and need no shared-memory reduction
//   loop : over K/V tiles of BC rows, STAGES-deep cp.async ring in shared memory
//   math : S = Q K^T (raw scores), m = running row max, P = exp2(S*c - m*c) with
//          c = softmax_scale*log2(e) folded into one FFMA, O~ += P V unnormalised,
//          O = O~ / l once at the end, lse = (m*c + log2 l) * ln 2
//
// Causal masks are aligned bottom-right: query row i sees key j iff j <= i + (Nk - Nq).
// Rows that see no key get O = 0 and lse = -inf.
// DROPOUT (a separate instantiation): P V uses P o mask, O = (P o mask) V * scale / l, with the
// mask from Philox (common.cuh, dropout_bits8); l and lse are those of the undropped P.
//
// Not compiled on its own: cuflash/_compile.py generates an extern "C" shell per config.
#pragma once
#include "common.cuh"

// Parameter list shared by the generated shells and the launch code in cuflash/_forward.py.
// Strides are in elements and 64-bit, so batch*seqlen*heads*head_dim may pass 2^31.
#define CUFLASH_FWD_PARAMS                                                              \
    const cuflash::elem_t* __restrict__ q, const cuflash::elem_t* __restrict__ k,       \
    const cuflash::elem_t* __restrict__ v, cuflash::elem_t* __restrict__ o,             \
    float* __restrict__ lse,                                                            \
    long long q_sb, long long q_sn, long long q_sh,                                     \
    long long k_sb, long long k_sn, long long k_sh,                                     \
    long long v_sb, long long v_sn, long long v_sh,                                     \
    long long o_sb, long long o_sn, long long o_sh,                                     \
    int n_heads, int seqlen_q, int seqlen_k, int m_blocks, float scale_log2, int causal, \
    unsigned long long drop_seed, unsigned int drop_threshold, float drop_scale
#define CUFLASH_FWD_ARGS                                                                \
    q, k, v, o, lse, q_sb, q_sn, q_sh, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh,              \
    o_sb, o_sn, o_sh, n_heads, seqlen_q, seqlen_k, m_blocks, scale_log2, causal,        \
    drop_seed, drop_threshold, drop_scale

namespace cuflash {

template <int D, int BR, int BC, int WARPS, int STAGES>
struct FwdShape {
    static constexpr int THREADS = WARPS * 32;
    static constexpr int ROWS_PER_WARP = BR / WARPS;
    static constexpr int MT = ROWS_PER_WARP / 16;  // m16 tiles per warp
    static constexpr int SN = BC / 8;              // n8 tiles of S per warp row-tile
    static constexpr int ON = D / 8;               // n8 tiles of O
    static constexpr int KD = D / 16;              // k16 steps of Q K^T (over head dim)
    static constexpr int KB = BC / 16;             // k16 steps of P V (over keys)
    static constexpr int CH = D / 8;               // 16-byte chunks per row
    static constexpr int Q_BYTES = BR * D * 2;
    static constexpr int KV_TILE_BYTES = BC * D * 2;
    static constexpr int SMEM_BYTES = Q_BYTES + 2 * STAGES * KV_TILE_BYTES;
    static_assert(D % 64 == 0, "head_dim must be a multiple of 64 (rows of >= 128 bytes)");
    static_assert(ROWS_PER_WARP % 16 == 0 && MT >= 1, "BR must be a multiple of 16*WARPS");
    static_assert(BC % 16 == 0, "BC must be a multiple of 16");
    static_assert(STAGES >= 2, "the single-barrier pipeline needs at least 2 stages");
};

template <bool BF16, int D, int BR, int BC, int WARPS, int STAGES, bool DROPOUT>
__device__ __forceinline__ void flash_fwd(CUFLASH_FWD_PARAMS) {
    using S_ = FwdShape<D, BR, BC, WARPS, STAGES>;
    constexpr int MT = S_::MT, SN = S_::SN, ON = S_::ON, KD = S_::KD, KB = S_::KB, CH = S_::CH;
    constexpr int THREADS = S_::THREADS;
    const float NEG_INF = __int_as_float(0xff800000);

    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 sQ = smem_u32(smem);
    const u32 sK = sQ + S_::Q_BYTES;
    const u32 sV = sK + STAGES * S_::KV_TILE_BYTES;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;  // MMA fragment row group / column pair

    // Block -> (m_block, head, batch). m_block is fastest so blocks running together share
    // one head's K/V in L2; causal runs the heaviest (last) Q tiles first.
    const int bid = blockIdx.x;
    const int bh = bid / m_blocks;
    int mb = bid - bh * m_blocks;
    if (causal) mb = m_blocks - 1 - mb;
    const int b = bh / n_heads, h = bh - b * n_heads;
    const int r0 = mb * BR;

    const elem_t* qg = q + (long long)b * q_sb + (long long)h * q_sh;
    const elem_t* kg = k + (long long)b * k_sb + (long long)h * k_sh;
    const elem_t* vg = v + (long long)b * v_sb + (long long)h * v_sh;

    // K/V tiles this Q tile needs, and how many of them need no mask at all.
    const int off = seqlen_k - seqlen_q;  // bottom-right alignment offset
    int n_end = (seqlen_k + BC - 1) / BC;
    int n_full = seqlen_k / BC;
    if (causal) {
        int last_key = r0 + BR - 1 + off;  // largest key the tile's last row may see
        n_end = min(n_end, last_key < 0 ? 0 : last_key / BC + 1);
        int first_row_keys = r0 + off + 1;  // keys [0, first_row_keys) visible to every row
        n_full = min(n_full, first_row_keys < 0 ? 0 : first_row_keys / BC);
    }

    float acc_o[MT][ON][4];
    float row_max[MT][2], row_sum[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < ON; ++i) acc_o[mt][i][0] = acc_o[mt][i][1] = acc_o[mt][i][2] = acc_o[mt][i][3] = 0.f;
        row_max[mt][0] = row_max[mt][1] = NEG_INF;
        row_sum[mt][0] = row_sum[mt][1] = 0.f;
    }

    if (n_end > 0) {
        // Prologue: Q joins the first K/V group; tiles 0..STAGES-2 in flight.
        load_tile<BR, CH, THREADS>(sQ, qg, q_sn, r0, seqlen_q, tid);
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < n_end) {
                load_tile<BC, CH, THREADS>(sK + s * S_::KV_TILE_BYTES, kg, k_sn, s * BC, seqlen_k, tid);
                load_tile<BC, CH, THREADS>(sV + s * S_::KV_TILE_BYTES, vg, v_sn, s * BC, seqlen_k, tid);
            }
            cp_async_commit();  // empty groups keep the wait count uniform
        }
    }

    const int warp_row0 = warp * S_::ROWS_PER_WARP;
    // With one m16 tile per warp, Q's A fragments (KD x 4 registers) stay in registers for the
    // whole loop: an eighth less shared-memory traffic, which is what bounds the MT == 1 configs.
    constexpr bool Q_IN_REGS = (MT == 1);
    u32 q_frag[Q_IN_REGS ? KD : 1][4];
    // Per-lane byte offsets of the ldmatrix rows at k-chunk 0. Every row a lane addresses has
    // row % 8 == lane % 8, so chunk c of it sits at (offset of chunk 0) ^ (16 c): stepping along
    // the head dim is one XOR with a constant, not a fresh swizzle (keeps address registers few).
    const int lane_row = lane % 8;
    const u32 q_frag_off = swz<CH>(warp_row0 + lane_row + ((lane / 8) % 2) * 8, lane / 16);
    const u32 k_frag_off = swz<CH>(lane_row + (lane / 16) * 8, (lane / 8) % 2);
    const u32 v_frag_off = swz<CH>(lane_row + ((lane / 8) % 2) * 8, lane / 16);
    constexpr u32 ROW16 = 16 * CH * 16;  // bytes of 16 tile rows
    for (int j = 0; j < n_end; ++j) {
        // Tile j has landed once at most STAGES-2 younger groups are pending. The barrier also
        // tells every warp that all others finished tile j-1, whose slot is refilled next.
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        {
            int jn = j + STAGES - 1;
            if (jn < n_end) {
                int slot = jn % STAGES;
                load_tile<BC, CH, THREADS>(sK + slot * S_::KV_TILE_BYTES, kg, k_sn, jn * BC, seqlen_k, tid);
                load_tile<BC, CH, THREADS>(sV + slot * S_::KV_TILE_BYTES, vg, v_sn, jn * BC, seqlen_k, tid);
            }
            cp_async_commit();
        }
        const int slot = j % STAGES;
        const u32 sKj = sK + slot * S_::KV_TILE_BYTES;
        const u32 sVj = sV + slot * S_::KV_TILE_BYTES;

        if constexpr (Q_IN_REGS) {
            if (j == 0) {  // Q landed with tile 0's group
#pragma unroll
                for (int kd = 0; kd < KD; ++kd)
                    ldmatrix_x4(q_frag[kd][0], q_frag[kd][1], q_frag[kd][2], q_frag[kd][3], sQ + (q_frag_off ^ (32 * kd)));
            }
        }

        // ---- S = Q K_j^T (raw, unscaled) ----
        float acc_s[MT][SN][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < SN; ++i) acc_s[mt][i][0] = acc_s[mt][i][1] = acc_s[mt][i][2] = acc_s[mt][i][3] = 0.f;
#pragma unroll
        for (int kd = 0; kd < KD; ++kd) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if constexpr (Q_IN_REGS) {
                    a[mt][0] = q_frag[kd][0], a[mt][1] = q_frag[kd][1], a[mt][2] = q_frag[kd][2], a[mt][3] = q_frag[kd][3];
                } else {
                    ldmatrix_x4(a[mt][0], a[mt][1], a[mt][2], a[mt][3], sQ + mt * ROW16 + (q_frag_off ^ (32 * kd)));
                }
            }
#pragma unroll
            for (int np = 0; np < SN / 2; ++np) {
                u32 b0, b1, b2, b3;
                ldmatrix_x4(b0, b1, b2, b3, sKj + np * ROW16 + (k_frag_off ^ (32 * kd)));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816<BF16>(acc_s[mt][2 * np], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
                    mma_16816<BF16>(acc_s[mt][2 * np + 1], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b2, b3);
                }
            }
        }

        // ---- mask (only tiles that cross the seqlen_k tail or the causal diagonal) ----
        if (j >= n_full) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    int row = r0 + warp_row0 + mt * 16 + g + 8 * half;
                    int key_limit = causal ? min(seqlen_k, row + off + 1) : seqlen_k;  // keys < limit visible
#pragma unroll
                    for (int nt = 0; nt < SN; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            int key = j * BC + nt * 8 + 2 * t + e;
                            if (key >= key_limit) acc_s[mt][nt][2 * half + e] = NEG_INF;
                        }
                }
        }

        // ---- online softmax: new max, rescale O~ and l by exp2((m_old - m_new) c) ----
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float mx = row_max[mt][half];
#pragma unroll
                for (int nt = 0; nt < SN; ++nt)
                    mx = fmaxf(mx, fmaxf(acc_s[mt][nt][2 * half], acc_s[mt][nt][2 * half + 1]));
                mx = warp_max4(mx);
                // A row that has seen only masked keys keeps max -inf; subtract 0 instead so
                // exp2 gives 0 rather than NaN from (-inf) - (-inf).
                float m_scaled = (mx == NEG_INF) ? 0.f : mx * scale_log2;
                float corr = fast_exp2(row_max[mt][half] * scale_log2 - m_scaled);
                row_max[mt][half] = mx;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < SN; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float p = fast_exp2(fmaf(acc_s[mt][nt][2 * half + e], scale_log2, -m_scaled));
                        acc_s[mt][nt][2 * half + e] = p;
                        sum += p;
                    }
                row_sum[mt][half] = row_sum[mt][half] * corr + sum;  // thread-partial; quad-reduced at the end
#pragma unroll
                for (int i = 0; i < ON; ++i) {
                    acc_o[mt][i][2 * half] *= corr;
                    acc_o[mt][i][2 * half + 1] *= corr;
                }
            }

        // ---- dropout: zero the dropped P entries for P V only (l keeps the undropped sum, the
        // 1/(1-p) scale joins the final 1/l) ----
        if constexpr (DROPOUT) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int kb = 0; kb < KB; ++kb) {
                    const u32 bits = dropout_bits8((r0 + warp_row0) / 16 + mt, (j * BC) / 16 + kb, g, t, bh,
                                                   drop_seed, drop_threshold);
#pragma unroll
                    for (int idx = 0; idx < 8; ++idx)  // idx = half*4 + s*2 + e
                        if (!((bits >> idx) & 1u)) acc_s[mt][2 * kb + (idx / 2) % 2][2 * (idx / 4) + idx % 2] = 0.f;
                }
        }

        // ---- P to 16-bit A fragments now, so the fp32 S accumulators die before P V ----
        // (the C layout of two adjacent n8 tiles is exactly the A layout of one k16 step)
        u32 p_frag[MT][KB][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int kb = 0; kb < KB; ++kb) {
                p_frag[mt][kb][0] = pack2<BF16>(acc_s[mt][2 * kb][0], acc_s[mt][2 * kb][1]);
                p_frag[mt][kb][1] = pack2<BF16>(acc_s[mt][2 * kb][2], acc_s[mt][2 * kb][3]);
                p_frag[mt][kb][2] = pack2<BF16>(acc_s[mt][2 * kb + 1][0], acc_s[mt][2 * kb + 1][1]);
                p_frag[mt][kb][3] = pack2<BF16>(acc_s[mt][2 * kb + 1][2], acc_s[mt][2 * kb + 1][3]);
            }

        // ---- O~ += P V_j ----
#pragma unroll
        for (int kb = 0; kb < KB; ++kb) {
#pragma unroll
            for (int dp = 0; dp < ON / 2; ++dp) {
                u32 b0, b1, b2, b3;
                ldmatrix_x4_trans(b0, b1, b2, b3, sVj + kb * ROW16 + (v_frag_off ^ (32 * dp)));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const u32* a = p_frag[mt][kb];
                    mma_16816<BF16>(acc_o[mt][2 * dp], a[0], a[1], a[2], a[3], b0, b1);
                    mma_16816<BF16>(acc_o[mt][2 * dp + 1], a[0], a[1], a[2], a[3], b2, b3);
                }
            }
        }
    }
    cp_async_wait<0>();

    // ---- epilogue: O = O~ / l, lse; stage O through this warp's own Q rows in smem so the
    // global stores are 16-byte and row-contiguous ----
    __syncwarp();
    float* lse_row = lse + (long long)bh * seqlen_q;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float l = warp_sum4(row_sum[mt][half]);
            float inv = l > 0.f ? (DROPOUT ? drop_scale : 1.f) / l : 0.f;
            int tile_row = warp_row0 + mt * 16 + g + 8 * half;
            int row = r0 + tile_row;
            if (t == 0 && row < seqlen_q)
                lse_row[row] = l > 0.f ? (row_max[mt][half] * scale_log2 + __log2f(l)) * 0.69314718055994531f
                                       : NEG_INF;
#pragma unroll
            for (int i = 0; i < ON; ++i) {
                u32 packed = pack2<BF16>(acc_o[mt][i][2 * half] * inv, acc_o[mt][i][2 * half + 1] * inv);
                u32 addr = sQ + swz<CH>(tile_row, i) + 4 * t;
                asm volatile("st.shared.u32 [%0], %1;" :: "r"(addr), "r"(packed) : "memory");
            }
        }
    __syncwarp();
    elem_t* og = o + (long long)b * o_sb + (long long)h * o_sh;
    constexpr int WARP_CHUNKS = S_::ROWS_PER_WARP * CH;
#pragma unroll
    for (int it = 0; it < (WARP_CHUNKS + 31) / 32; ++it) {
        int idx = it * 32 + lane;
        if (idx < WARP_CHUNKS) {
            int tr = warp_row0 + idx / CH, c = idx % CH;
            int row = r0 + tr;
            if (row < seqlen_q) {
                uint4 val;
                asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                             : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w) : "r"(sQ + swz<CH>(tr, c)));
                *reinterpret_cast<uint4*>(og + (long long)row * o_sn + c * 8) = val;
            }
        }
    }
}

}  // namespace cuflash
