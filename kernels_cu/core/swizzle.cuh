// cuflash/kernels_cu/core/swizzle.cuh
// The sm80 shared-memory tile layout: rows of ROW_CHUNKS 16-byte chunks, in one of two forms,
// chosen by the row length. One address function (swz) for cp.async writes, ldmatrix reads and
// the epilogues, and one way to step along a row from a lane's offset (chunk_step).
//
//   ROW_CHUNKS % 8 == 0 (head dims 64, 128, 192, 256; dS^T rows): XOR-swizzled, chunk index
//     XORed with row % 8, rows packed (ROW_CHUNKS * 16 bytes). The 8 rows an ldmatrix 8x8 matrix
//     touches (and the 8 chunks a quarter-warp of cp.async writes) fall in 8 distinct 16-byte bank
//     groups. Stepping along the row is an XOR within the 8-chunk group and an addition across
//     groups: swz(r, c) = (swz(r, 0) ^ (16 (c % 8))) + 16 (c - c % 8); one XOR when ROW_CHUNKS is a
//     power of two (the row base then has no bits the XOR reaches).
//   otherwise, ROW_CHUNKS even (head dims 16 * odd: 32, 96, 160, ...): the XOR would leave the
//     row, so rows are padded by one chunk instead: a row stride of (ROW_CHUNKS + 1) * 16 bytes =
//     4 * odd words puts 8 consecutive rows at 8 distinct 16-byte bank groups. Stepping along the
//     row is an addition: swz(r, c) = swz(r, 0) + 16 c.
// tests/test_smem_layout_twin.py checks both forms (bijective within a tile, conflict-free
// ldmatrix phases, the stepping rule) in NumPy.
#pragma once
#include "core/types.cuh"

namespace cuflash {

template <int ROW_CHUNKS>
struct SmemRow {
    static_assert(ROW_CHUNKS >= 2 && ROW_CHUNKS % 2 == 0, "rows must hold an even number of 16-byte chunks");
    static constexpr bool kSwizzled = ROW_CHUNKS % 8 == 0;
    static constexpr int kBytes = (kSwizzled ? ROW_CHUNKS : ROW_CHUNKS + 1) * 16;  // row stride
};

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile whose rows hold ROW_CHUNKS chunks.
template <int ROW_CHUNKS>
__device__ __forceinline__ int swz(int row, int chunk) {
    if constexpr (SmemRow<ROW_CHUNKS>::kSwizzled)
        return (row * ROW_CHUNKS + (chunk ^ (row & 7))) * 16;
    else
        return row * SmemRow<ROW_CHUNKS>::kBytes + chunk * 16;
}

// The offset `chunks` chunks further along the row from `off` = swz(r, c0), for c0 in {0, 1} and
// `chunks` even (or c0 == 0): the lanes' ldmatrix offsets step along the head dim this way.
template <int ROW_CHUNKS>
__device__ __forceinline__ u32 chunk_step(u32 off, int chunks) {
    if constexpr (SmemRow<ROW_CHUNKS>::kSwizzled && (ROW_CHUNKS & (ROW_CHUNKS - 1)) == 0)
        return off ^ (16u * chunks);
    else if constexpr (SmemRow<ROW_CHUNKS>::kSwizzled)
        return (off ^ (16u * (chunks % 8))) + 16u * (chunks - chunks % 8);
    else
        return off + 16u * chunks;
}

}  // namespace cuflash
