// cuflash/kernels_cu/sm80/warp_gemm.cuh
// Warp-level tile products on mma.sync m16n8k16 with operands from swizzled shared memory
// (ldmatrix) or registers, and the C -> A fragment repacking (core/frag.cuh).
#pragma once
#include "core/convert.cuh"
#include "core/ptx_sm80.cuh"
#include "core/swizzle.cuh"

namespace cuflash {

// acc[MT][SN] (16 MT x 8 SN) = A (16 MT x 16 KD) * B^T, B's rows (8 SN of them, 16 KD wide) in
// smem at b_base: the S = Q K^T shape. A is either ldmatrix'ed from a_base (rows 16 mt ..
// at a_base + mt * 16 rows) or, with A_IN_REGS, given as a_regs[KD][4] (MT == 1). Offsets are
// the per-lane ldmatrix offsets at k-chunk 0; stepping along k is chunk_step (core/swizzle.cuh).
template <bool BF16, int CH, int KD, int MT, int SN, bool A_IN_REGS>
__device__ __forceinline__ void warp_mma_abt(float (&acc)[MT][SN][4], const u32 (&a_regs)[A_IN_REGS ? KD : 1][4],
                                             u32 a_base, u32 a_off, u32 b_base, u32 b_off) {
    constexpr u32 ROW16 = 16 * SmemRow<CH>::kBytes;  // bytes of 16 tile rows
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < SN; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.f;
#pragma unroll
    for (int kd = 0; kd < KD; ++kd) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            if constexpr (A_IN_REGS) {
                a[mt][0] = a_regs[kd][0], a[mt][1] = a_regs[kd][1], a[mt][2] = a_regs[kd][2], a[mt][3] = a_regs[kd][3];
            } else {
                ldmatrix_x4(a[mt][0], a[mt][1], a[mt][2], a[mt][3], a_base + mt * ROW16 + chunk_step<CH>(a_off, 2 * kd));
            }
        }
#pragma unroll
        for (int np = 0; np < SN / 2; ++np) {
            u32 b0, b1, b2, b3;
            ldmatrix_x4(b0, b1, b2, b3, b_base + np * ROW16 + chunk_step<CH>(b_off, 2 * kd));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_16816<BF16>(acc[mt][2 * np], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
                mma_16816<BF16>(acc[mt][2 * np + 1], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b2, b3);
            }
        }
    }
}

// acc[MT][DN] += P (A fragments p[MT][KB][4]) * B, B (16 KB rows of 8 DN) row-major in smem at
// b_base, read with ldmatrix.trans: the O += P V shape.
template <bool BF16, int CH, int KB, int MT, int DN>
__device__ __forceinline__ void warp_mma_ab(float (&acc)[MT][DN][4], const u32 (&p)[MT][KB][4], u32 b_base, u32 b_off) {
    constexpr u32 ROW16 = 16 * SmemRow<CH>::kBytes;
#pragma unroll
    for (int kb = 0; kb < KB; ++kb) {
#pragma unroll
        for (int dp = 0; dp < DN / 2; ++dp) {
            u32 b0, b1, b2, b3;
            ldmatrix_x4_trans(b0, b1, b2, b3, b_base + kb * ROW16 + chunk_step<CH>(b_off, 2 * dp));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const u32* a = p[mt][kb];
                mma_16816<BF16>(acc[mt][2 * dp], a[0], a[1], a[2], a[3], b0, b1);
                mma_16816<BF16>(acc[mt][2 * dp + 1], a[0], a[1], a[2], a[3], b2, b3);
            }
        }
    }
}

// acc[SN] (16 x 8*SN) = A (16 x 16*KD, rows at a_addr, row-major in smem) * B^T where B's rows
// (8*SN of them, 16*KD wide) are in smem at b_base: the S^T = K Q^T shape of the dK/dV kernel.
// UNROLL partly unrolls the k loop: fully unrolled, ptxas hoists every B fragment of the tile
// ahead of the MMAs and the dK, dV accumulators (128 registers at d=128) no longer fit next to
// them (Sm80BwdTraits::kHeadUnroll).
template <bool BF16, int CH, int KD, int SN, int UNROLL>
__device__ __forceinline__ void tile_mma_abt(float (&acc)[SN][4], u32 a_base, u32 a_off, u32 b_base, u32 b_off) {
#pragma unroll
    for (int i = 0; i < SN; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll UNROLL
    for (int kd = 0; kd < KD; ++kd) {
        u32 a0, a1, a2, a3;
        ldmatrix_x4(a0, a1, a2, a3, a_base + chunk_step<CH>(a_off, 2 * kd));
#pragma unroll
        for (int np = 0; np < SN / 2; ++np) {
            u32 b0, b1, b2, b3;
            ldmatrix_x4(b0, b1, b2, b3, b_base + np * 16 * SmemRow<CH>::kBytes + chunk_step<CH>(b_off, 2 * kd));
            mma_16816<BF16>(acc[2 * np], a0, a1, a2, a3, b0, b1);
            mma_16816<BF16>(acc[2 * np + 1], a0, a1, a2, a3, b2, b3);
        }
    }
}

// acc[DN] (16 x 8*DN) += A (16 x 16*KQ, given as A fragments) * B where B (16*KQ rows of 8*DN)
// is row-major in smem at b_base (read with ldmatrix.trans): the dV += P^T dO shape. With `hi`,
// B's columns start at chunk SPLIT_CHUNKS (the second column split's first dK/dV column). Each
// ldmatrix address is one chunk_step from the lane's offset, with both candidates' steps known at
// compile time: two swizzled steps do not compose when a row is not a power of two chunks (d=192:
// chunk 12 + 2dp is not chunk 12's address XORed with 2dp), and a runtime step costs registers.
// With MASK, element pair r of a[kq] (C tile 2kq + r/2, rows g + 8(r%2)) is ANDed with keep
// bits 8(kq%4) + 2r, +1 of keep[kq/4] (the dropout mask), so dropped entries enter as 0.
template <bool BF16, int CH, int KQ, int DN, bool MASK = false, int SPLIT_CHUNKS = 0>
__device__ __forceinline__ void tile_mma_ab(float (&acc)[DN][4], const u32 (&a_in)[KQ][4], u32 b_base, u32 b_off,
                                            bool hi, const u32* keep = nullptr) {
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
            ldmatrix_x4_trans(b0, b1, b2, b3, b_base + kq * 16 * SmemRow<CH>::kBytes + (hi ? chunk_step<CH>(b_off, SPLIT_CHUNKS + 2 * dp) : chunk_step<CH>(b_off, 2 * dp)));
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

}  // namespace cuflash
