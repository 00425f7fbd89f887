// cuflash/kernels_cu/common.cuh
// Small device helpers shared by every cuflash kernel: tensor-core MMA, ldmatrix, cp.async,
// packing fp32 pairs to 16-bit floats, the shared-memory swizzle. Inline PTX only, so the
// sources compile under NVRTC with no CUDA headers (no cuda_bf16.h / cuda_fp16.h needed).
//
// Not compiled on its own: cuflash/_compile.py generates an extern "C" shell per
// configuration that includes the kernel header, which includes this file.
#pragma once

namespace cuflash {

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// 16-bit element storage; the kernels never do arithmetic on it directly.
typedef u16 elem_t;

__device__ __forceinline__ u32 smem_u32(const void* p) {
    // Shared-window address for ldmatrix / cp.async (generic -> shared, truncated to 32 bits).
    u32 r;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// Pack two fp32 values into one register of two 16-bit floats, lo in the low half.
// cvt.rn.{bf16x2,f16x2}.f32 d, a, b puts a in the upper half and b in the lower.
template <bool BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    if constexpr (BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

// D += A * B with A 16x16 (row), B 16x8 (col), fp32 accumulate.
template <bool BF16>
__device__ __forceinline__ void mma_16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if constexpr (BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}

__device__ __forceinline__ void ldmatrix_x4(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// 16-byte global -> shared copy that bypasses L1. When `valid` is false nothing is read and
// the 16 bytes are zero-filled: tail rows of a tile become zeros, never garbage or NaN.
__device__ __forceinline__ void cp_async_16(u32 saddr, const void* gptr, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(saddr), "l"(gptr), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

__device__ __forceinline__ float fast_exp2(float x) {
    // MUFU.EX2; exp2(-inf) = 0, which the masking relies on.
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float warp_max4(float x) {
    // Reduce over the 4 lanes of a quad, which together hold one row of an MMA C fragment.
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
    return x;
}

__device__ __forceinline__ float warp_sum4(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return x;
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile whose rows hold ROW_CHUNKS chunks.
// Chunks are XOR-swizzled by row % 8, so the 8 rows an ldmatrix 8x8 matrix touches (and the
// 8 chunks a quarter-warp of cp.async writes) fall in 8 distinct 16-byte bank groups.
template <int ROW_CHUNKS>
__device__ __forceinline__ int swz(int row, int chunk) {
    static_assert(ROW_CHUNKS >= 8 && ROW_CHUNKS % 8 == 0, "rows must span at least 128 bytes");
    return (row * ROW_CHUNKS + (chunk ^ (row & 7))) * 16;
}

// Copy rows [row0, row0+ROWS) of one (batch, head) slice into a swizzled shared tile; rows
// at or past `n_rows` are zero-filled. Thread t copies chunk t % CH of rows t / CH + i*STEP:
// STEP is a multiple of 8, so every row a thread touches has the same swizzle and one pointer
// plus one 64-bit stride serve all of them.
template <int ROWS, int CH, int THREADS>
__device__ __forceinline__ void load_tile(u32 s_base, const elem_t* g, long long row_stride,
                                          int row0, int n_rows, int tid) {
    constexpr int STEP = THREADS / CH;
    static_assert(THREADS % CH == 0 && STEP % 8 == 0 && ROWS % STEP == 0, "tile copy layout");
    const int r = tid / CH, c = tid % CH;
    const elem_t* src = g + (long long)(row0 + r) * row_stride + c * 8;
    const long long src_step = (long long)STEP * row_stride;
    const u32 dst = s_base + swz<CH>(r, c);
#pragma unroll
    for (int i = 0; i < ROWS / STEP; ++i) {
        bool ok = row0 + r + i * STEP < n_rows;
        cp_async_16(dst + i * STEP * CH * 16, ok ? src + i * src_step : g, ok);
    }
}

// ------------------------------------------------------------------------------------ dropout
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

// Keep bits of the 8 elements one MMA thread (g = lane/4, t = lane%4) holds in the 16x16 block
// (query block R, key block C) of head bh: bit hh*4 + s*2 + e is query 16R + g + 8hh, key
// 16C + 8s + 2t + e. An element is kept iff its 16-bit uniform value is >= threshold. The mapping
// from (bh, query, key) to bits is fixed (cuflash/philox.py is its NumPy twin), so forward,
// backward, v1 and v2 and every tile shape see the same mask.
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

}  // namespace cuflash
