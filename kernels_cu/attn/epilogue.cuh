// cuflash/kernels_cu/attn/epilogue.cuh
// Output epilogue pieces: a C tile times a scale -> 16-bit -> the warp's own rows of a swizzled
// shared tile (stash_c_tile), then 16-byte row-contiguous global stores (store_rows_warp).
// Used by the backward kernels; the forward epilogues (O = O~ / l, lse) are still inline in
// sm80/fwd.cuh and sm80/fwd_v1.cuh (README.md, "Not yet extracted").
// Sync contract: the caller's warp must own the shared rows it stages through (no other warp
// reads or writes them between the two __syncwarp()s here).
#pragma once
#include "core/convert.cuh"
#include "core/ptx_sm80.cuh"
#include "core/swizzle.cuh"

namespace cuflash {

// Copy 16-byte chunks [c0, c0 + NCH) (all CH by default) of ROWS rows (tile rows row0.., CH
// chunks each) from a shared tile to global rows grow0.., skipping rows at or past n_rows and, with
// PARTIAL, chunks at or past d_chunks (the call's head dim / 8). Called by one warp.
template <int CH, int ROWS, int NCH = CH, bool PARTIAL = false>
__device__ __forceinline__ void store_rows_warp(u32 s_base, int row0, elem_t* g, long long row_stride,
                                                int grow0, int n_rows, int lane, int c0 = 0, int d_chunks = CH) {
    constexpr int CHUNKS = ROWS * NCH;
#pragma unroll
    for (int it = 0; it < (CHUNKS + 31) / 32; ++it) {
        int idx = it * 32 + lane;
        if (idx < CHUNKS) {
            int tr = idx / NCH, c = c0 + idx % NCH;
            if (grow0 + tr < n_rows && (!PARTIAL || c < d_chunks)) {
                const uint4 val = ld_shared_v4(s_base + swz<CH>(row0 + tr, c));
                *reinterpret_cast<uint4*>(g + (long long)(grow0 + tr) * row_stride + c * 8) = val;
            }
        }
    }
}

// C fragments of a 16 x (8*NT) fp32 tile -> 16-bit, into rows row0.., chunks c0.. of a smem tile.
template <bool BF16, int CH, int NT>
__device__ __forceinline__ void stash_c_tile(u32 s_base, int row0, const float (&acc)[NT][4], float mul, int lane,
                                             int c0 = 0) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int i = 0; i < NT; ++i) {
            u32 packed = pack2<BF16>(acc[i][2 * half] * mul, acc[i][2 * half + 1] * mul);
            st_shared_u32(s_base + swz<CH>(row0 + g + 8 * half, c0 + i) + 4 * t, packed);
        }
}

}  // namespace cuflash
