// tests/cu/dropout.cu: harness for kernels_cu/attn/dropout.cuh (and what it includes, core/types.cuh).
// dropout_blocks: one warp per 16 x 16 block (query block R = r0 + blockIdx.y, key block
// C = c0 + blockIdx.x) of head bh; lane = 4 g + t. Outputs, b = blockIdx.y * gridDim.x + blockIdx.x:
//   bits[b][lane]   = Dropout::bits8(R, C, g, t)            (the forward's 8 keep bits)
//   free_[b][lane]  = dropout_bits8(R, C, g, t, bh, ..)     (the free function, same thing)
//   bits_t[b][lane] = Dropout::bits8_transposed(R, C, g, t) (the dK/dV kernel's S^T order)
//   keep[q][k]      = Dropout::kept(bits, nt, e) for register e of n8 tile nt (nt = 0, 1) of the
//                     m16 tile: q = 16 by + g + 8 (e / 2), k = 16 bx + 8 nt + 2 t + e % 2
//   keep_t[q][k]    = bit 4 s + 2 h + e of bits_t: key 16 bx + g + 8 h, query 16 by + 8 s + 2 t + e
//   zeroed[q][k]    = Dropout::zero_dropped(acc, kb = 1, bits) on acc[4][4] of ones, tiles 2, 3
//                     (the block's two n8 tiles), same (q, k) as keep
//   others[b][lane] = 1 iff zero_dropped left tiles 0, 1 (the other k16 step) all ones
// with (q, k) relative to block (r0, c0), dense rows of 16 gridDim.x.
#include "attn/dropout.cuh"

using namespace cuflash;

extern "C" __global__ void dropout_blocks(unsigned long long seed, unsigned int threshold, int bh, int r0, int c0,
                                          unsigned int* bits_out, unsigned int* free_out, unsigned int* bits_t_out,
                                          unsigned char* keep, unsigned char* keep_t, float* zeroed, int* others) {
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    const int R = r0 + blockIdx.y, C = c0 + blockIdx.x;
    const int b = blockIdx.y * gridDim.x + blockIdx.x, n_cols = 16 * gridDim.x;
    Dropout drop;
    drop.seed = seed;
    drop.threshold = threshold;
    drop.bh = bh;

    const u32 bits = drop.bits8(R, C, g, t);
    const u32 bits_t = drop.bits8_transposed(R, C, g, t);
    bits_out[32 * b + lane] = bits;
    free_out[32 * b + lane] = dropout_bits8(R, C, g, t, bh, seed, threshold);
    bits_t_out[32 * b + lane] = bits_t;

    float acc[4][4];
    for (int nt = 0; nt < 4; ++nt)
        for (int e = 0; e < 4; ++e) acc[nt][e] = 1.f;
    Dropout::zero_dropped(acc, 1, bits);

    int untouched = 1;
    for (int nt = 0; nt < 2; ++nt)
        for (int e = 0; e < 4; ++e) {
            const int q = 16 * blockIdx.y + g + 8 * (e / 2), k = 16 * blockIdx.x + 8 * nt + 2 * t + e % 2;
            keep[q * n_cols + k] = Dropout::kept(bits, nt, e) ? 1 : 0;
            zeroed[q * n_cols + k] = acc[2 + nt][e];
            untouched &= acc[nt][e] == 1.f;
        }
    others[32 * b + lane] = untouched;

    for (int s = 0; s < 2; ++s)
        for (int h = 0; h < 2; ++h)
            for (int e = 0; e < 2; ++e) {
                const int q = 16 * blockIdx.y + 8 * s + 2 * t + e, k = 16 * blockIdx.x + g + 8 * h;
                keep_t[q * n_cols + k] = (bits_t >> (4 * s + 2 * h + e)) & 1u;
            }
}
