// cuflash/kernels_cu/flash_bwd.cuh
// FlashAttention-2 backward, tensor cores via mma.sync m16n8k16. Four kernels:
//
//   bwd_prep        per query row: delta = rowsum(dO * O); lse2 = lse * log2(e) with rows that
//                   see no key (lse = -inf) and padding rows mapped to +inf (so P = 0 there);
//                   zeroes the fp32 dQ accumulator. Buffers are padded to a multiple of 128 rows
//                   so the main kernels copy them with unguarded 16-byte cp.async.
//   flash_bwd_dkdv  one block per (key tile of BC rows, head, batch); warp w owns keys
//                   [16w, 16w+16) and keeps their dK, dV in registers while the block walks the
//                   query tiles (BR rows) through a cp.async ring. Per query tile, per warp:
//                     S^T  = K_w Q^T          P^T = exp2(S^T c - lse2)   (recomputed, never stored)
//                     dP^T = V_w dO^T         dS^T = P^T o (dP^T - delta)
//                     dV  += P^T dO           dK += dS^T Q
//                   Warps owning keys means S^T's C fragments are already the A fragments of
//                   the dV and dK products: no shared-memory round trip for P or dS there.
//                   With dq_acc != null the block also adds dQ += dS K for the tile into the
//                   fp32 accumulator with atomics (dS^T goes through shared memory once).
//   bwd_dq_convert  dQ = dq_acc * softmax_scale -> 16-bit, in the caller's strides.
//   (DROPOUT instantiations regenerate the forward's Philox mask: dV uses P o mask, and
//   dS = P o (dP o Z - delta) with Z = mask / (1 - p).)
//   flash_bwd_dq    the deterministic dQ: laid out like the forward (warps own query rows, K/V
//                   stream through a ring), recomputes S and dP and accumulates dQ = dS K in
//                   registers; no atomics, so bitwise reproducible. Costs 3 more GEMMs.
//
// Scales: S is raw Q K^T; c = softmax_scale * log2(e) is folded into the exp2; dK and dQ get
// their softmax_scale factor once at the end. Causal masks are bottom-right aligned, as in the
// forward: query i sees key j iff j <= i + (seqlen_k - seqlen_q).
//
// Not compiled on its own: cuflash/_compile.py generates an extern "C" shell per config.
#pragma once
#include "common.cuh"

#define CUFLASH_PREP_PARAMS                                                               \
    const cuflash::elem_t* __restrict__ o, const cuflash::elem_t* __restrict__ dout,      \
    const float* __restrict__ lse, float* __restrict__ delta, float* __restrict__ lse2,   \
    float* __restrict__ dq_acc,                                                           \
    long long o_sb, long long o_sn, long long o_sh,                                       \
    long long do_sb, long long do_sn, long long do_sh,                                    \
    int n_heads, int seqlen_q, int seqlen_q_pad, long long n_rows
#define CUFLASH_PREP_ARGS                                                                 \
    o, dout, lse, delta, lse2, dq_acc, o_sb, o_sn, o_sh, do_sb, do_sn, do_sh, n_heads,    \
    seqlen_q, seqlen_q_pad, n_rows

#define CUFLASH_CONVERT_PARAMS                                                            \
    const float* __restrict__ dq_acc, cuflash::elem_t* __restrict__ dq,                   \
    long long dq_sb, long long dq_sn, long long dq_sh,                                    \
    int n_heads, int seqlen_q, int seqlen_q_pad, float scale, long long n_rows
#define CUFLASH_CONVERT_ARGS dq_acc, dq, dq_sb, dq_sn, dq_sh, n_heads, seqlen_q, seqlen_q_pad, scale, n_rows

#define CUFLASH_BWD_PARAMS                                                                \
    const cuflash::elem_t* __restrict__ q, const cuflash::elem_t* __restrict__ k,         \
    const cuflash::elem_t* __restrict__ v, const cuflash::elem_t* __restrict__ dout,      \
    const float* __restrict__ lse2, const float* __restrict__ delta,                      \
    float* __restrict__ dq_acc, cuflash::elem_t* __restrict__ dk,                         \
    cuflash::elem_t* __restrict__ dv,                                                     \
    long long q_sb, long long q_sn, long long q_sh,                                       \
    long long k_sb, long long k_sn, long long k_sh,                                       \
    long long v_sb, long long v_sn, long long v_sh,                                       \
    long long do_sb, long long do_sn, long long do_sh,                                    \
    long long dk_sb, long long dk_sn, long long dk_sh,                                    \
    long long dv_sb, long long dv_sn, long long dv_sh,                                    \
    int n_heads, int seqlen_q, int seqlen_k, int seqlen_q_pad, int n_blocks,              \
    float scale_log2, float scale, int causal,                                            \
    unsigned long long drop_seed, unsigned int drop_threshold, float drop_scale
#define CUFLASH_BWD_ARGS                                                                  \
    q, k, v, dout, lse2, delta, dq_acc, dk, dv, q_sb, q_sn, q_sh, k_sb, k_sn, k_sh,       \
    v_sb, v_sn, v_sh, do_sb, do_sn, do_sh, dk_sb, dk_sn, dk_sh, dv_sb, dv_sn, dv_sh,      \
    n_heads, seqlen_q, seqlen_k, seqlen_q_pad, n_blocks, scale_log2, scale, causal,       \
    drop_seed, drop_threshold, drop_scale

#define CUFLASH_DQ_PARAMS                                                                 \
    const cuflash::elem_t* __restrict__ q, const cuflash::elem_t* __restrict__ k,         \
    const cuflash::elem_t* __restrict__ v, const cuflash::elem_t* __restrict__ dout,      \
    const float* __restrict__ lse2, const float* __restrict__ delta,                      \
    cuflash::elem_t* __restrict__ dq,                                                     \
    long long q_sb, long long q_sn, long long q_sh,                                       \
    long long k_sb, long long k_sn, long long k_sh,                                       \
    long long v_sb, long long v_sn, long long v_sh,                                       \
    long long do_sb, long long do_sn, long long do_sh,                                    \
    long long dq_sb, long long dq_sn, long long dq_sh,                                    \
    int n_heads, int seqlen_q, int seqlen_k, int seqlen_q_pad, int m_blocks,              \
    float scale_log2, float scale, int causal,                                            \
    unsigned long long drop_seed, unsigned int drop_threshold, float drop_scale
#define CUFLASH_DQ_ARGS                                                                   \
    q, k, v, dout, lse2, delta, dq, q_sb, q_sn, q_sh, k_sb, k_sn, k_sh, v_sb, v_sn, v_sh, \
    do_sb, do_sn, do_sh, dq_sb, dq_sn, dq_sh, n_heads, seqlen_q, seqlen_k, seqlen_q_pad,  \
    m_blocks, scale_log2, scale, causal, drop_seed, drop_threshold, drop_scale

// Unroll factor of the head-dim loop of the S^T / dP^T products (see tile_mma_abt).
#ifndef CUFLASH_BWD_KD_UNROLL
#define CUFLASH_BWD_KD_UNROLL 2
#endif

namespace cuflash {

// Two 16-bit floats of one register -> fp32 (lo = low half).
template <bool BF16>
__device__ __forceinline__ void unpack2(u32 x, float& lo, float& hi) {
    if constexpr (BF16) {
        lo = __uint_as_float(x << 16);
        hi = __uint_as_float(x & 0xffff0000u);
    } else {
        asm("{ .reg .f16 a, b; mov.b32 {a, b}, %2; cvt.f32.f16 %0, a; cvt.f32.f16 %1, b; }"
            : "=f"(lo), "=f"(hi) : "r"(x));
    }
}

// Two fp32 adds into global memory; one vector reduction on sm_90+.
__device__ __forceinline__ void red_add2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(p), "f"(a), "f"(b) : "memory");
#else
    asm volatile("red.global.add.f32 [%0], %1;" :: "l"(p), "f"(a) : "memory");
    asm volatile("red.global.add.f32 [%0], %1;" :: "l"(p + 1), "f"(b) : "memory");
#endif
}

// Copy 16-byte chunks of `rows` rows (tile rows row0.., CH chunks each) from a swizzled shared
// tile to global rows grow0.., skipping rows at or past n_rows. Called by one warp.
template <int CH, int ROWS>
__device__ __forceinline__ void store_rows_warp(u32 s_base, int row0, elem_t* g, long long row_stride,
                                                int grow0, int n_rows, int lane) {
    constexpr int CHUNKS = ROWS * CH;
#pragma unroll
    for (int it = 0; it < (CHUNKS + 31) / 32; ++it) {
        int idx = it * 32 + lane;
        if (idx < CHUNKS) {
            int tr = idx / CH, c = idx % CH;
            if (grow0 + tr < n_rows) {
                uint4 val;
                asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                             : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                             : "r"(s_base + swz<CH>(row0 + tr, c)));
                *reinterpret_cast<uint4*>(g + (long long)(grow0 + tr) * row_stride + c * 8) = val;
            }
        }
    }
}

// C fragments of a 16 x (8*NT) fp32 tile -> 16-bit, into rows row0.. of a swizzled smem tile.
template <bool BF16, int CH, int NT>
__device__ __forceinline__ void stash_c_tile(u32 s_base, int row0, const float (&acc)[NT][4], float mul, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            u32 packed = pack2<BF16>(acc[i][2 * half] * mul, acc[i][2 * half + 1] * mul);
            u32 addr = s_base + swz<CH>(row0 + g + 8 * half, i) + 4 * t;
            asm volatile("st.shared.u32 [%0], %1;" :: "r"(addr), "r"(packed) : "memory");
        }
}

// ------------------------------------------------------------------------------------ prep
template <bool BF16, int D>
__device__ __forceinline__ void bwd_prep(CUFLASH_PREP_PARAMS) {
    constexpr int CH = D / 8;  // threads per row, one 16-byte chunk each
    static_assert(32 % CH == 0, "a row's threads must sit in one warp");
    const long long gt = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long r = gt / CH;  // padded row index over (batch*heads) x seqlen_q_pad
    const int c = (int)(gt % CH);
    const bool in_range = r < n_rows;
    const int bh = in_range ? (int)(r / seqlen_q_pad) : 0;
    const int i = in_range ? (int)(r - (long long)bh * seqlen_q_pad) : seqlen_q;
    float dot = 0.f;
    if (i < seqlen_q) {
        const int b = bh / n_heads, h = bh - b * n_heads;
        uint4 x = *reinterpret_cast<const uint4*>(o + b * o_sb + i * o_sn + h * o_sh + c * 8);
        uint4 y = *reinterpret_cast<const uint4*>(dout + b * do_sb + i * do_sn + h * do_sh + c * 8);
        const u32 xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float a0, a1, b0, b1;
            unpack2<BF16>(xs[e], a0, a1);
            unpack2<BF16>(ys[e], b0, b1);
            dot = fmaf(a0, b0, fmaf(a1, b1, dot));
        }
    }
#pragma unroll
    for (int s = 1; s < CH; s *= 2) dot += __shfl_xor_sync(0xffffffffu, dot, s);
    if (!in_range) return;
    if (c == 0) {
        const float POS_INF = __int_as_float(0x7f800000);
        float l = i < seqlen_q ? lse[(long long)bh * seqlen_q + i] : POS_INF;
        delta[r] = dot;
        lse2[r] = (l == -POS_INF) ? POS_INF : l * 1.4426950408889634f;
    }
    if (dq_acc != nullptr) {
        float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
        float4* p = reinterpret_cast<float4*>(dq_acc + r * D + c * 8);
        p[0] = z;
        p[1] = z;
    }
}

// ------------------------------------------------------------------------------------ convert
template <bool BF16, int D>
__device__ __forceinline__ void bwd_dq_convert(CUFLASH_CONVERT_PARAMS) {
    constexpr int CH = D / 8;
    const long long gt = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long r = gt / CH;  // unpadded row index over (batch*heads) x seqlen_q
    if (r >= n_rows) return;
    const int c = (int)(gt % CH);
    const int bh = (int)(r / seqlen_q), i = (int)(r - (long long)bh * seqlen_q);
    const int b = bh / n_heads, h = bh - b * n_heads;
    const float4* src = reinterpret_cast<const float4*>(dq_acc + ((long long)bh * seqlen_q_pad + i) * D + c * 8);
    float4 a = src[0], bb = src[1];
    uint4 out;
    out.x = pack2<BF16>(a.x * scale, a.y * scale);
    out.y = pack2<BF16>(a.z * scale, a.w * scale);
    out.z = pack2<BF16>(bb.x * scale, bb.y * scale);
    out.w = pack2<BF16>(bb.z * scale, bb.w * scale);
    *reinterpret_cast<uint4*>(dq + b * dq_sb + i * dq_sn + h * dq_sh + c * 8) = out;
}

// ------------------------------------------------------------------------------------ warp tile products
// acc[SN] (16 x 8*SN) = A (16 x 16*KD, rows at a_addr, row-major in smem) * B^T where B's rows
// (8*SN of them, 16*KD wide) are in smem at b_base: the S = Q K^T shape. Offsets are the
// per-lane ldmatrix offsets at k-chunk 0; stepping along k is an XOR (see flash_fwd.cuh).
template <bool BF16, int CH, int KD, int SN, int UNROLL = CUFLASH_BWD_KD_UNROLL>
__device__ __forceinline__ void tile_mma_abt(float (&acc)[SN][4], u32 a_base, u32 a_off, u32 b_base, u32 b_off) {
#pragma unroll
    for (int i = 0; i < SN; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    // Partly unrolled: fully unrolled, ptxas hoists every B fragment of the tile ahead of the MMAs and
    // the dK, dV accumulators (128 registers at d=128) no longer fit next to them.
#pragma unroll UNROLL
    for (int kd = 0; kd < KD; ++kd) {
        u32 a0, a1, a2, a3;
        ldmatrix_x4(a0, a1, a2, a3, a_base + (a_off ^ (32 * kd)));
#pragma unroll
        for (int np = 0; np < SN / 2; ++np) {
            u32 b0, b1, b2, b3;
            ldmatrix_x4(b0, b1, b2, b3, b_base + np * 16 * CH * 16 + (b_off ^ (32 * kd)));
            mma_16816<BF16>(acc[2 * np], a0, a1, a2, a3, b0, b1);
            mma_16816<BF16>(acc[2 * np + 1], a0, a1, a2, a3, b2, b3);
        }
    }
}

// acc[DN] (16 x 8*DN) += A (16 x 16*KQ, given as A fragments) * B where B (16*KQ rows of 8*DN)
// is row-major in smem at b_base (read with ldmatrix.trans): the O += P V shape.
// With MASK, element pair r of a[kq] (C tile 2kq + r/2, rows g + 8(r%2)) is ANDed with keep
// bits 8(kq%4) + 2r, +1 of keep[kq/4] (the dropout mask), so dropped entries enter as 0.
template <bool BF16, int CH, int KQ, int DN, bool MASK = false>
__device__ __forceinline__ void tile_mma_ab(float (&acc)[DN][4], const u32 (&a_in)[KQ][4], u32 b_base, u32 b_off,
                                            const u32* keep = nullptr) {
#pragma unroll
    for (int kq = 0; kq < KQ; ++kq) {
        u32 a[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            a[r] = a_in[kq][r];
            if constexpr (MASK) {
                const u32 b = keep[kq / 4] >> ((kq % 4) * 8 + 2 * r);
                a[r] &= ((b & 1u) ? 0x0000ffffu : 0u) | ((b & 2u) ? 0xffff0000u : 0u);
            }
        }
#pragma unroll
        for (int dp = 0; dp < DN / 2; ++dp) {
            u32 b0, b1, b2, b3;
            ldmatrix_x4_trans(b0, b1, b2, b3, b_base + kq * 16 * CH * 16 + (b_off ^ (32 * dp)));
            mma_16816<BF16>(acc[2 * dp], a[0], a[1], a[2], a[3], b0, b1);
            mma_16816<BF16>(acc[2 * dp + 1], a[0], a[1], a[2], a[3], b2, b3);
        }
    }
}

// C fragments of two adjacent n8 tiles are exactly the A fragment of one k16 step.
template <bool BF16, int KQ>
__device__ __forceinline__ void c_to_a_frags(u32 (&a)[KQ][4], const float (&c)[2 * KQ][4]) {
#pragma unroll
    for (int kq = 0; kq < KQ; ++kq) {
        a[kq][0] = pack2<BF16>(c[2 * kq][0], c[2 * kq][1]);
        a[kq][1] = pack2<BF16>(c[2 * kq][2], c[2 * kq][3]);
        a[kq][2] = pack2<BF16>(c[2 * kq + 1][0], c[2 * kq + 1][1]);
        a[kq][3] = pack2<BF16>(c[2 * kq + 1][2], c[2 * kq + 1][3]);
    }
}

// Element e of C tile nt, read back from its packed A-fragment copy.
template <bool BF16, int KQ>
__device__ __forceinline__ float a_frag_elem(const u32 (&a)[KQ][4], int nt, int e) {
    u32 w = a[nt / 2][(nt % 2) * 2 + e / 2];
    float lo, hi;
    unpack2<BF16>(w, lo, hi);
    return (e & 1) ? hi : lo;
}

// ------------------------------------------------------------------------------------ dK, dV
template <int D, int BR, int BC, int WARPS, int STAGES>
struct BwdShape {
    static constexpr int THREADS = WARPS * 32;
    static constexpr int CH = D / 8;        // 16-byte chunks per K/V/Q/dO row
    static constexpr int SCH = BR / 8;      // 16-byte chunks per dS^T row (BR queries)
    static constexpr int KD = D / 16;       // k16 steps over the head dim
    static constexpr int SN = BR / 8;       // n8 tiles of S^T (queries)
    static constexpr int KQ = BR / 16;      // k16 steps over queries (dV, dK products)
    static constexpr int DN = D / 8;        // n8 tiles of dK, dV
    static constexpr int KK = BC / 16;      // k16 steps over keys (dQ product)
    static constexpr int WM = (WARPS < BR / 16) ? WARPS : BR / 16;  // dQ warp grid: WM x WN
    static constexpr int WN = WARPS / WM;
    static constexpr int RM = BR / WM;      // dQ rows per warp
    static constexpr int QM = RM / 16;      // m16 tiles of dQ per warp
    static constexpr int CN = D / WN;       // dQ columns per warp
    static constexpr int QN = CN / 8;       // n8 tiles of dQ per warp
    static constexpr int KV_BYTES = BC * D * 2;
    static constexpr int QT_BYTES = BR * D * 2;
    static constexpr int DS_BYTES = BC * BR * 2;
    static constexpr int STAT_BYTES = BR * 4;
    static constexpr int SMEM_BYTES = 2 * KV_BYTES + 2 * STAGES * QT_BYTES + 2 * DS_BYTES + 2 * STAGES * STAT_BYTES;
    static_assert(BC == 16 * WARPS, "each warp owns 16 keys");
    static_assert(BR % 64 == 0, "dS^T rows must span at least 128 bytes");
    static_assert(WARPS % WM == 0 && CN % 16 == 0 && RM % 16 == 0, "dQ warp grid");
    static_assert(STAGES >= 2, "the single-barrier pipeline needs at least 2 stages");
};

// dQ rows [q0, q0+BR) += dS K over this block's BC keys, into the fp32 accumulator (atomics).
// A = dS (rows = queries, k = keys) is read transposed out of dS^T (rows = keys); warps split
// the BR x D product as a WM x WN grid.
template <bool BF16, class S_>
__device__ __forceinline__ void bwd_dq_product(u32 sdS_buf, u32 sK, float* dq_rows, int warp, int lane) {
    constexpr int QM = S_::QM, QN = S_::QN, KK = S_::KK, SCH = S_::SCH, CH = S_::CH, D = S_::CH * 8;
    constexpr u32 ROW16 = 16 * CH * 16;
    const int g = lane / 4, t = lane % 4, lane_row = lane % 8;
    const int wm = warp % S_::WM, wn = warp / S_::WM;
    const u32 bt_off = swz<CH>(lane_row + ((lane / 8) % 2) * 8, lane / 16);
    // matrices (q 0-7 | 8-15) x (keys 0-7 | 8-15) in a0..a3 order
    const u32 ds_off = swz<SCH>(lane_row + (lane / 16) * 8, (wm * S_::RM) / 8 + (lane / 8) % 2);
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
            ldmatrix_x4_trans(a[mi][0], a[mi][1], a[mi][2], a[mi][3], sdS_buf + kk * 16 * SCH * 16 + (ds_off ^ (32 * mi)));
#pragma unroll
        for (int dp = 0; dp < QN / 2; ++dp) {
            u32 b0, b1, b2, b3;
            ldmatrix_x4_trans(b0, b1, b2, b3, sK + kk * ROW16 + (bt_off ^ (16 * (wn * S_::CN / 8) + 32 * dp)));
#pragma unroll
            for (int mi = 0; mi < QM; ++mi) {
                mma_16816<BF16>(acc_q[mi][2 * dp], a[mi][0], a[mi][1], a[mi][2], a[mi][3], b0, b1);
                mma_16816<BF16>(acc_q[mi][2 * dp + 1], a[mi][0], a[mi][1], a[mi][2], a[mi][3], b2, b3);
            }
        }
    }
    float* dqg = dq_rows + wm * S_::RM * D + wn * S_::CN;
#pragma unroll
    for (int mi = 0; mi < QM; ++mi)
#pragma unroll
        for (int i = 0; i < QN; ++i)
#pragma unroll
            for (int half = 0; half < 2; ++half)
                red_add2(dqg + (mi * 16 + g + 8 * half) * D + i * 8 + 2 * t, acc_q[mi][i][2 * half],
                         acc_q[mi][i][2 * half + 1]);
}

template <bool BF16, int D, int BR, int BC, int WARPS, int STAGES, bool DROPOUT>
__device__ __forceinline__ void flash_bwd_dkdv(CUFLASH_BWD_PARAMS) {
    using S_ = BwdShape<D, BR, BC, WARPS, STAGES>;
    constexpr int CH = S_::CH, SCH = S_::SCH, KD = S_::KD, SN = S_::SN, KQ = S_::KQ, DN = S_::DN;
    constexpr int THREADS = S_::THREADS;

    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 sK = smem_u32(smem);
    const u32 sV = sK + S_::KV_BYTES;
    const u32 sQ = sV + S_::KV_BYTES;
    const u32 sdO = sQ + STAGES * S_::QT_BYTES;
    const u32 sdS = sdO + STAGES * S_::QT_BYTES;
    const u32 sL = sdS + 2 * S_::DS_BYTES;       // (dS^T is double-buffered) STAGES x BR floats of lse2
    const u32 sDelta = sL + STAGES * S_::STAT_BYTES;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;

    // Block -> (key block, head, batch); key blocks fastest. Under a causal mask the early key
    // blocks see the most query tiles, so the heaviest blocks start first.
    const int bid = blockIdx.x;
    const int bh = bid / n_blocks;
    const int nb = bid - bh * n_blocks;
    const int b = bh / n_heads, h = bh - b * n_heads;
    const int c0 = nb * BC;

    const elem_t* qg = q + (long long)b * q_sb + (long long)h * q_sh;
    const elem_t* kg = k + (long long)b * k_sb + (long long)h * k_sh;
    const elem_t* vg = v + (long long)b * v_sb + (long long)h * v_sh;
    const elem_t* dog = dout + (long long)b * do_sb + (long long)h * do_sh;
    const float* lse2g = lse2 + (long long)bh * seqlen_q_pad;
    const float* deltag = delta + (long long)bh * seqlen_q_pad;

    // Query tiles that see any of this block's keys, and from which on no mask is needed.
    const int off = seqlen_k - seqlen_q;
    const int m_blocks = (seqlen_q + BR - 1) / BR;
    int m_begin = 0;
    if (causal) {
        int first_row = c0 - off;  // first query that sees key c0
        m_begin = first_row <= 0 ? 0 : min(m_blocks, first_row / BR);
    }
    const bool key_tail = c0 + BC > seqlen_k;
    const int n_iter = m_blocks - m_begin;

    auto load_q_tile = [&](int it) {
        const int slot = it % STAGES;
        const int r0 = (m_begin + it) * BR;
        load_tile<BR, CH, THREADS>(sQ + slot * S_::QT_BYTES, qg, q_sn, r0, seqlen_q, tid);
        load_tile<BR, CH, THREADS>(sdO + slot * S_::QT_BYTES, dog, do_sn, r0, seqlen_q, tid);
        // lse2 and delta: BR/4 chunks each, from buffers padded past seqlen_q (no guard needed)
        constexpr int SC = BR / 4;
        static_assert(2 * SC <= THREADS, "one thread per stats chunk");
        if (tid < SC) {
            cp_async_16(sL + slot * S_::STAT_BYTES + tid * 16, lse2g + r0 + tid * 4, true);
        } else if (tid < 2 * SC) {
            cp_async_16(sDelta + slot * S_::STAT_BYTES + (tid - SC) * 16, deltag + r0 + (tid - SC) * 4, true);
        }
    };

    float acc_dk[DN][4], acc_dv[DN][4];
#pragma unroll
    for (int i = 0; i < DN; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dk[i][e] = acc_dv[i][e] = 0.f;

    if (n_iter > 0) {
        load_tile<BC, CH, THREADS>(sK, kg, k_sn, c0, seqlen_k, tid);
        load_tile<BC, CH, THREADS>(sV, vg, v_sn, c0, seqlen_k, tid);
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
    constexpr u32 ROW16 = 16 * CH * 16;
    const int key_w = c0 + warp * 16;  // first key of this warp

    for (int it = 0; it < n_iter; ++it) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (it + STAGES - 1 < n_iter) load_q_tile(it + STAGES - 1);
        cp_async_commit();
        const int slot = it % STAGES;
        const u32 sQs = sQ + slot * S_::QT_BYTES, sdOs = sdO + slot * S_::QT_BYTES;
        const int q0 = (m_begin + it) * BR;
        const u32 sdS_it = sdS + (it % 2) * S_::DS_BYTES;
        // dQ of the previous query tile: its dS^T is complete now that every warp passed the
        // barrier above. Deferring it by one tile saves the second barrier per tile.
        if (dq_acc != nullptr && it > 0)
            bwd_dq_product<BF16, S_>(sdS + ((it - 1) % 2) * S_::DS_BYTES, sK,
                                     dq_acc + ((long long)bh * seqlen_q_pad + q0 - BR) * D, warp, lane);

        // ---- dropout keep bits (first, while few registers are live): keep[kq] bit s*4 + h*2 + e is key g + 8h, query 16kq + 8s + 2t + e.
        // In the mask's own (query-major) grouping these 8 elements come from two Philox calls,
        // each giving 4 of them (see dropout_bits8). ----
        // Packed 4 query blocks to a register (8 bits each): registers are the scarce resource here.
        u32 keep[DROPOUT ? (KQ + 3) / 4 : 1];
        if constexpr (DROPOUT) {
#pragma unroll
            for (int w = 0; w < (KQ + 3) / 4; ++w) keep[w] = 0;
#pragma unroll
            for (int kq = 0; kq < KQ; ++kq) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const u32 bits = dropout_bits8(q0 / 16 + kq, key_w / 16, 2 * t + e, g / 2, bh, drop_seed,
                                                   drop_threshold);
#pragma unroll
                    for (int s = 0; s < 2; ++s)
#pragma unroll
                        for (int h = 0; h < 2; ++h)
                            keep[kq / 4] |= ((bits >> (s * 4 + h * 2 + (g & 1))) & 1u) << ((kq % 4) * 8 + s * 4 + h * 2 + e);
                }
            }
        }
        // Phases are ordered so that at most one 16 x BR fp32 tile is live next to dK, dV:
        // S^T -> P^T (packed) -> dV; then dP^T -> dS^T (packed) -> dK.
        const bool need_mask = key_tail || (causal && q0 + off < c0 + BC - 1);
        const float* sLf = reinterpret_cast<const float*>(smem + (sL - sK) + slot * S_::STAT_BYTES);
        const float* sDf = reinterpret_cast<const float*>(smem + (sDelta - sK) + slot * S_::STAT_BYTES);
        u32 frag[KQ][4];  // P^T, then dS^T, as A fragments (k = queries)

        // ---- S^T = K_w Q^T; P^T = exp2(S^T c - lse2), masked ----
        {
            float acc[SN][4];
            tile_mma_abt<BF16, CH, KD, SN, DROPOUT ? 1 : CUFLASH_BWD_KD_UNROLL>(acc, sK, a_off, sQs, bn_off);
#pragma unroll
            for (int nt = 0; nt < SN; ++nt) {
                const float2 L = *reinterpret_cast<const float2*>(sLf + nt * 8 + 2 * t);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float p = fast_exp2(fmaf(acc[nt][e], scale_log2, -((e & 1) ? L.y : L.x)));
                    if (need_mask) {
                        int key = key_w + g + 8 * (e / 2);
                        int qi = q0 + nt * 8 + 2 * t + (e & 1);
                        if (key >= seqlen_k || (causal && key > qi + off)) p = 0.f;
                    }
                    acc[nt][e] = p;
                }
            }
            c_to_a_frags<BF16, KQ>(frag, acc);
        }
        // ---- dV += (P o mask)^T dO (the 1/(1-p) scale is applied to dV once, at the end) ----
        tile_mma_ab<BF16, CH, KQ, DN, DROPOUT>(acc_dv, frag, sdOs, bt_off, keep);

        // ---- dP^T = V_w dO^T; dS^T = P^T (dP^T - delta), P^T recomputed from S^T ----
        {
            float acc[SN][4];
            tile_mma_abt<BF16, CH, KD, SN, DROPOUT ? 1 : CUFLASH_BWD_KD_UNROLL>(acc, sV, a_off, sdOs, bn_off);
#pragma unroll
            for (int nt = 0; nt < SN; ++nt) {
                const float2 Dl = *reinterpret_cast<const float2*>(sDf + nt * 8 + 2 * t);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    // P^T from its packed 16-bit copy: the same rounding the dV product used.
                    float dp = acc[nt][e];
                    if constexpr (DROPOUT)  // dP o Z, Z = mask / (1 - p)
                        dp = ((keep[nt / 8] >> (((nt / 2) % 4) * 8 + (nt % 2) * 4 + e)) & 1u) ? dp * drop_scale : 0.f;
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
        tile_mma_ab<BF16, CH, KQ, DN>(acc_dk, frag, sQs, bt_off);

    }
    cp_async_wait<0>();
    __syncthreads();  // the last dS^T is complete
    if (dq_acc != nullptr && n_iter > 0) {
        bwd_dq_product<BF16, S_>(sdS + ((n_iter - 1) % 2) * S_::DS_BYTES, sK,
                                 dq_acc + ((long long)bh * seqlen_q_pad + (m_begin + n_iter - 1) * BR) * D, warp, lane);
        __syncthreads();  // every warp is done reading K: its rows take dK for the store
    }

    // ---- epilogue: dK = scale * dK~, dV; through this warp's own K/V rows ----
    stash_c_tile<BF16, CH, DN>(sK, warp * 16, acc_dk, scale, lane);
    stash_c_tile<BF16, CH, DN>(sV, warp * 16, acc_dv, DROPOUT ? drop_scale : 1.f, lane);
    __syncwarp();
    elem_t* dkg = dk + (long long)b * dk_sb + (long long)h * dk_sh;
    elem_t* dvg = dv + (long long)b * dv_sb + (long long)h * dv_sh;
    store_rows_warp<CH, 16>(sK, warp * 16, dkg, dk_sn, key_w, seqlen_k, lane);
    store_rows_warp<CH, 16>(sV, warp * 16, dvg, dv_sn, key_w, seqlen_k, lane);
}

// ------------------------------------------------------------------------------------ dQ (deterministic)
template <int D, int BR, int BC, int WARPS, int STAGES>
struct DqShape {
    static constexpr int THREADS = WARPS * 32;
    static constexpr int CH = D / 8;
    static constexpr int KD = D / 16;
    static constexpr int SN = BC / 8;   // n8 tiles of S (keys)
    static constexpr int KB = BC / 16;  // k16 steps over keys (dQ product)
    static constexpr int DN = D / 8;
    static constexpr int QT_BYTES = BR * D * 2;
    static constexpr int KV_BYTES = BC * D * 2;
    static constexpr int SMEM_BYTES = 2 * QT_BYTES + 2 * STAGES * KV_BYTES;
    static_assert(BR == 16 * WARPS, "each warp owns 16 query rows");
    static_assert(BC % 16 == 0 && STAGES >= 2, "tile shape");
};

template <bool BF16, int D, int BR, int BC, int WARPS, int STAGES, bool DROPOUT>
__device__ __forceinline__ void flash_bwd_dq(CUFLASH_DQ_PARAMS) {
    using S_ = DqShape<D, BR, BC, WARPS, STAGES>;
    constexpr int CH = S_::CH, KD = S_::KD, SN = S_::SN, KB = S_::KB, DN = S_::DN;
    constexpr int THREADS = S_::THREADS;

    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 sQ = smem_u32(smem);
    const u32 sdO = sQ + S_::QT_BYTES;
    const u32 sK = sdO + S_::QT_BYTES;
    const u32 sV = sK + STAGES * S_::KV_BYTES;

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
                load_tile<BC, CH, THREADS>(sK + s * S_::KV_BYTES, kg, k_sn, s * BC, seqlen_k, tid);
                load_tile<BC, CH, THREADS>(sV + s * S_::KV_BYTES, vg, v_sn, s * BC, seqlen_k, tid);
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
                load_tile<BC, CH, THREADS>(sK + slot * S_::KV_BYTES, kg, k_sn, jn * BC, seqlen_k, tid);
                load_tile<BC, CH, THREADS>(sV + slot * S_::KV_BYTES, vg, v_sn, jn * BC, seqlen_k, tid);
            }
            cp_async_commit();
        }
        const int slot = j % STAGES;
        const u32 sKj = sK + slot * S_::KV_BYTES, sVj = sV + slot * S_::KV_BYTES;
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
