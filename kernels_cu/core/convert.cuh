// cuflash/kernels_cu/core/convert.cuh
// Register-level conversions and reductions: fp32 pairs <-> 16-bit pairs, ex2.approx, and the
// quad (4-lane) reductions that complete a row of an MMA C fragment (core/frag.cuh).
#pragma once
#include "core/types.cuh"

namespace cuflash {

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

}  // namespace cuflash
