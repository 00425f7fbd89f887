// cuflash/kernels_cu/attn/dropout.cuh
// Dropout keep bits: Philox4x32-10 keyed by the seed, counter by (head, 16x16 block, thread).
// THE one definition of which random bits belong to which attention element; forward v2, v1,
// the dK/dV kernel (transposed) and the deterministic dQ kernel all read it through here, and
// cuflash/philox.py is its NumPy twin.
//
// Element (query q, key k) of head bh (bh = batch * heads + head):
//     block (R, C) = (q / 16, k / 16); within it qr = q % 16, kc = k % 16
//     Philox counter = (4 C + (kc % 8) / 2, 8 R + qr % 8, bh, 0), key = (seed lo, seed hi)
//     bit  = keep_bit_index(qr, kc) = 4 (qr / 8) + 2 (kc / 8) + kc % 2   (in 0..7)
//     the element's 16-bit uniform is half (bit % 2) of output word bit / 2
//     kept iff that uniform >= threshold (threshold = round(p * 65536))
// In C-fragment terms (core/frag.cuh) the 8 bits one thread (g, t) gets for block (R, C) are
// the elements it holds of C tiles (2 kb, 2 kb + 1) of one m16 tile: register e of n8 tile
// s in {0, 1} is bit keep_bit_index(g + 8 (e / 2), 8 s + 2 t + e % 2) = 4 (e / 2) + 2 s + e % 2.
#pragma once
#include "core/types.cuh"

namespace cuflash {

// Philox4x32-10 (Salmon et al. 2011), counter-based: the same (counter, key) always gives the
// same 128 random bits, so the backward regenerates the forward's mask instead of storing it.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, u32 k0, u32 k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const u32 hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const u32 hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

// Bit of an element in its thread's 8-bit group, from its (query, key) position inside the
// 16x16 block: 4 * query half + 2 * key half + key parity.
__host__ __device__ constexpr int keep_bit_index(int q_in_block, int k_in_block) {
    return 4 * (q_in_block / 8) + 2 * (k_in_block / 8) + k_in_block % 2;
}

// The same from the C-fragment indices that hold it: register e of n8 tile nt (core/frag.cuh).
__host__ __device__ constexpr int keep_bit_of_frag(int nt, int e) { return 4 * (e / 2) + 2 * (nt % 2) + e % 2; }

// Keep bits of the 8 elements thread (g, t) holds in the 16x16 block (query block R, key block C)
// of head bh: bit keep_bit_index(g + 8 hh, 8 s + 2 t + e) is query 16R + g + 8hh, key
// 16C + 8s + 2t + e. An element is kept iff its 16-bit uniform value is >= threshold.
__device__ __forceinline__ u32 dropout_bits8(int R, int C, int g, int t, int bh, unsigned long long seed,
                                             u32 threshold) {
    const uint4 r = philox4x32_10(make_uint4(u32(C) * 4u + u32(t), u32(R) * 8u + u32(g), u32(bh), 0u),
                                  u32(seed), u32(seed >> 32));
    const u32 w[4] = {r.x, r.y, r.z, r.w};
    u32 bits = 0;
#pragma unroll
    for (int idx = 0; idx < 8; ++idx) {
        const u32 u = (w[idx / 2] >> (16 * (idx % 2))) & 0xffffu;
        bits |= u32(u >= threshold) << idx;
    }
    return bits;
}

// Dropout policy of one (head, call): the per-block bits and their application to fragments.
struct Dropout {
    unsigned long long seed;
    u32 threshold;
    int bh;

    __device__ __forceinline__ u32 bits8(int R, int C, int g, int t) const {
        return dropout_bits8(R, C, g, t, bh, seed, threshold);
    }

    // Zero the dropped elements of C tiles (2 kb, 2 kb + 1) of one m16 row tile, given the
    // block's 8 bits (forward: P o mask enters P V only).
    template <int NT>
    __device__ __forceinline__ static void zero_dropped(float (&acc)[NT][4], int kb, u32 bits) {
#pragma unroll
        for (int idx = 0; idx < 8; ++idx)  // idx = keep_bit_of_frag(nt, e): half*4 + s*2 + e
            if (!((bits >> idx) & 1u)) acc[2 * kb + (idx / 2) % 2][2 * (idx / 4) + idx % 2] = 0.f;
    }

    // Keep bit of register e of n8 tile nt, from the bits of its 16x16 block.
    __device__ __forceinline__ static bool kept(u32 bits, int nt, int e) { return (bits >> keep_bit_of_frag(nt, e)) & 1u; }

    // The transposed view (the dK/dV kernel's S^T, core/frag.cuh Transposed): thread (g, t) holds,
    // in the 16x16 block (query block R, key block C), keys 16C + g + 8h and queries
    // 16R + 8s + 2t + e (n8 tile s, row half h). Returns their keep bits as bit 4s + 2h + e, the
    // order of the A fragment registers r = 2s + h, half e, of that tile (sm80/warp_gemm.cuh,
    // tile_mma_ab). In the forward's grouping element (q, k) belongs to thread
    // (q % 8, (k % 8) / 2) = (2t + e, g / 2): two Philox calls (e = 0, 1), four bits from each.
    __device__ __forceinline__ u32 bits8_transposed(int R, int C, int g, int t) const {
        u32 out = 0;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const u32 bits = bits8(R, C, 2 * t + e, g / 2);
#pragma unroll
            for (int s = 0; s < 2; ++s)
#pragma unroll
                for (int h = 0; h < 2; ++h)  // keep_bit_index(8s + 2t + e, g + 8h) = 4s + 2h + g % 2
                    out |= ((bits >> keep_bit_index(8 * s, 8 * h + (g & 1))) & 1u) << (4 * s + 2 * h + e);
        }
        return out;
    }
};

}  // namespace cuflash
