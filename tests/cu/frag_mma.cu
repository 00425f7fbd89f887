// tests/cu/frag_mma.cu: the fragment contract of core/frag.cuh against the hardware. One warp runs
// mma.sync m16n8k16 (core/ptx_sm80.cuh) on A = I (16 x 16) and B[k][n] = 16 k + n (16 x 8, exact in
// bf16 and fp16), so C[row][col] = 16 row + col, and each lane writes its 4 C registers:
//   out[lane][e] = c[e]          (the test decodes (row, col) from the value)
// A and B are built in registers from the PTX ISA's m16n8k16 operand layouts (g = lane / 4,
// t = lane % 4), independently of frag.cuh:
//   A reg r (0..3), halves h (lo, hi): row g + 8 (r % 2), col 2 t + 8 (r / 2) + h
//   B reg r (0..1), halves h (lo, hi): k   2 t + 8 r + h,   n g
#include "core/ptx_sm80.cuh"
#include "core/convert.cuh"

using namespace cuflash;

template <bool BF16>
__device__ void mma_contract(float* out) {
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    u32 a[4], b[2];
    for (int r = 0; r < 4; ++r) {
        const int row = g + 8 * (r % 2), col = 2 * t + 8 * (r / 2);
        a[r] = pack2<BF16>(row == col ? 1.f : 0.f, row == col + 1 ? 1.f : 0.f);
    }
    for (int r = 0; r < 2; ++r) {
        const int k = 2 * t + 8 * r;
        b[r] = pack2<BF16>(float(16 * k + g), float(16 * (k + 1) + g));
    }
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    mma_16816<BF16>(c, a[0], a[1], a[2], a[3], b[0], b[1]);
    for (int e = 0; e < 4; ++e) out[lane * 4 + e] = c[e];
}

extern "C" __global__ void mma_contract_bf16(float* out) { mma_contract<true>(out); }
extern "C" __global__ void mma_contract_f16(float* out) { mma_contract<false>(out); }
