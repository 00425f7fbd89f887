// cuflash/kernels_cu/core/frag.cuh
// Accumulator fragment <-> (row, col) maps: the contract every attn/ policy is written against.
//
// One warp's m16n8 C fragment (mma.sync m16n8k16, fp32): lane = 4 g + t holds 4 registers,
//     reg e -> row g + 8 (e / 2), col 2 t + (e % 2)          (g = lane / 4, t = lane % 4)
// A warp tile acc[MT][NT][4] of MT m16 rows by NT n8 columns stacks these:
//     acc[mt][nt][e] -> row 16 mt + g + 8 (e / 2), col 8 nt + 2 t + (e % 2)
// So each thread holds 2 rows per m16 tile ("half" = e / 2) and, per row, the column pairs
// {8 nt + 2 t, +1}; a row is complete across the 4 lanes of a quad (warp_max4 / warp_sum4).
// The sm90 wgmma m64nN accumulator has, per warp, exactly this layout (warp w of the warpgroup
// owns rows 16 w .. 16 w + 15), which is why the policies take (row, col) from here only.
//
// C -> A: the C fragments of two adjacent n8 tiles (2 kb, 2 kb + 1), packed to 16 bits in
// register order {c[2kb][0..1], c[2kb][2..3], c[2kb+1][0..1], c[2kb+1][2..3]}, are exactly the A
// fragment of k16 step kb (sm80/warp_gemm.cuh, c_to_a_frags).
//
// Transposed<F>: the dK/dV kernel computes S^T (rows = keys, cols = queries); its policies see
// (query, key) = (col, row) of the fragment.
#pragma once
#include "core/types.cuh"

namespace cuflash {

// Per-warp fragment of MT x NT m16n8 C tiles.
template <int MT_, int NT_>
struct FragSm80 {
    static constexpr int MT = MT_;  // m16 tiles (rows) per warp
    static constexpr int NT = NT_;  // n8 tiles (columns) per warp
    static constexpr int ROWS = 16 * MT;
    static constexpr int COLS = 8 * NT;
    // (row, col) of register e of tile (mt, nt) for lane `lane`, relative to the warp tile.
    __device__ __forceinline__ static int row(int lane, int mt, int e) { return 16 * mt + lane / 4 + 8 * (e / 2); }
    __device__ __forceinline__ static int col(int lane, int nt, int e) { return 8 * nt + 2 * (lane % 4) + (e % 2); }
    // The same with the row split as (mt, half): row 16 mt + g + 8 half, the index the row
    // statistics (row_max[mt][half]) use.
    __device__ __forceinline__ static int row_of_half(int lane, int mt, int half) { return 16 * mt + lane / 4 + 8 * half; }
};

// View of a fragment whose rows and columns are swapped in attention terms: the policies ask for
// (query, key) and get (col, row) of the underlying fragment.
template <class F>
struct Transposed {
    using Base = F;
    __device__ __forceinline__ static int query(int lane, int mt, int nt, int e) { return F::col(lane, nt, e); }
    __device__ __forceinline__ static int key(int lane, int mt, int nt, int e) { return F::row(lane, mt, e); }
};

// The untransposed view in the same vocabulary.
template <class F>
struct Direct {
    using Base = F;
    __device__ __forceinline__ static int query(int lane, int mt, int nt, int e) { return F::row(lane, mt, e); }
    __device__ __forceinline__ static int key(int lane, int mt, int nt, int e) { return F::col(lane, nt, e); }
};

}  // namespace cuflash
