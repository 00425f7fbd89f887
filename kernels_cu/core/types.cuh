// cuflash/kernels_cu/core/types.cuh
// Scalar types and constants every device header uses. No CUDA headers: NVRTC compiles the
// sources with nothing but the built-ins (uint4, float2, __shfl_*_sync, __int_as_float, ...).
#pragma once

namespace cuflash {

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// 16-bit element storage (bf16 or fp16 by the template flag BF16); the kernels never do
// arithmetic on it directly, only pack2 / unpack2 (core/convert.cuh).
typedef u16 elem_t;

// log2(e) and ln(2) as fp32 literals (the host twin of kLog2e is LOG2E in cuflash/_forward.py).
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.69314718055994531f;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace cuflash
