// cuflash/kernels_cu/core/swizzle.cuh
// The sm80 shared-memory tile layout: rows of ROW_CHUNKS 16-byte chunks, chunk index XORed
// with row % 8. One address function for cp.async writes, ldmatrix reads and the epilogue.
#pragma once
#include "core/types.cuh"

namespace cuflash {

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile whose rows hold ROW_CHUNKS chunks.
// Chunks are XOR-swizzled by row % 8, so the 8 rows an ldmatrix 8x8 matrix touches (and the
// 8 chunks a quarter-warp of cp.async writes) fall in 8 distinct 16-byte bank groups.
// Consequence used by the mainloops: every row r with r % 8 == x has chunk c at
// swz(r, 0) ^ (16 c), so stepping along the head dim is one XOR with a constant.
template <int ROW_CHUNKS>
__device__ __forceinline__ int swz(int row, int chunk) {
    static_assert(ROW_CHUNKS >= 8 && ROW_CHUNKS % 8 == 0, "rows must span at least 128 bytes");
    return (row * ROW_CHUNKS + (chunk ^ (row & 7))) * 16;
}

}  // namespace cuflash
