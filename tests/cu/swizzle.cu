// tests/cu/swizzle.cu: harness for kernels_cu/core/swizzle.cuh (and nothing else).
// swz_table_<CH>: out[row * CH + chunk] = swz<CH>(row, chunk) for rows [0, rows), every chunk.
#include "core/swizzle.cuh"

using namespace cuflash;

template <int CH>
__device__ void swz_table(int* out, int rows) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * CH) out[i] = swz<CH>(i / CH, i % CH);
}

extern "C" __global__ void swz_table_8(int* out, int rows) { swz_table<8>(out, rows); }    // head dim 64
extern "C" __global__ void swz_table_16(int* out, int rows) { swz_table<16>(out, rows); }  // head dim 128
extern "C" __global__ void swz_table_32(int* out, int rows) { swz_table<32>(out, rows); }  // head dim 256
extern "C" __global__ void swz_table_4(int* out, int rows) { swz_table<4>(out, rows); }    // head dim 32 (padded rows)
extern "C" __global__ void swz_table_12(int* out, int rows) { swz_table<12>(out, rows); }  // head dim 96 (padded rows)
