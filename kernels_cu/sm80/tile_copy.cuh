// cuflash/kernels_cu/sm80/tile_copy.cuh
// Global -> shared tile copies with cp.async, and the per-lane ldmatrix offsets.
//
// Ring contract (fwd, dq: K/V; v1, dK/dV: Q): tile i lives in slot i % STAGES. The prologue
// issues tiles 0 .. STAGES-2, one commit group each (empty groups when there are fewer tiles,
// so the wait count stays uniform). Step i: cp_async_wait<STAGES-2>() + __syncthreads() (tile i
// has landed, and every warp has finished step i-1), then issue tile i+STAGES-1 into the slot
// step i-1 used, commit, compute on slot i % STAGES. One barrier per step.
#pragma once
#include "core/ptx_sm80.cuh"
#include "core/swizzle.cuh"

namespace cuflash {

// The shared address of the same chunk `rows` rows further down a tile, from its address in row r,
// where the low three bits of r and of rows are disjoint (r < STEP and rows a multiple of STEP, a
// power of two; or rows a multiple of 8): swizzled rows then have (r + rows) % 8 = r ^ (rows % 8),
// so the chunk's place is one XOR and an offset away.
template <int CH>
__device__ __forceinline__ u32 rows_below(u32 dst, int rows) {
    return SmemRow<CH>::kSwizzled ? (dst ^ (16u * (rows & 7))) + rows * SmemRow<CH>::kBytes : dst + rows * SmemRow<CH>::kBytes;
}

// Copy rows [row0, row0+ROWS) of one (batch, head) slice into a shared tile (core/swizzle.cuh);
// rows at or past `n_rows` are zero-filled. Fast form (CH divides THREADS): thread t copies chunk
// t % CH of rows r + i*STEP (r = t / CH < STEP), so one pointer plus one 64-bit stride serve all of
// them; in the swizzled form STEP is a power of two, so row r + i*STEP has row % 8 =
// r ^ (i*STEP % 8) and its address is a constant XOR and offset away from row r's.
// General form (e.g. CH = 12, head dim 96): chunk idx = t + i*THREADS of the tile, row idx / CH.
// PARTIAL (Variant::kPartialD): the slice's rows hold only d_chunks chunks (the call's head dim / 8);
// chunks at or past it are zero-filled too, so the tile reads as the row padded with zeros.
template <int ROWS, int CH, int THREADS, bool PARTIAL = false>
__device__ __forceinline__ void load_tile(u32 s_base, const elem_t* g, long long row_stride,
                                          int row0, int n_rows, int tid, int d_chunks = CH) {
    constexpr int STEP = THREADS / CH;
    constexpr bool kFast = THREADS % CH == 0 && STEP > 0 && ROWS % STEP == 0 &&
                           (!SmemRow<CH>::kSwizzled || (STEP & (STEP - 1)) == 0);
    if constexpr (kFast) {
        const int r = tid / CH, c = tid % CH;
        const elem_t* src = g + (long long)(row0 + r) * row_stride + c * 8;
        const long long src_step = (long long)STEP * row_stride;
        const u32 dst = s_base + swz<CH>(r, c);
        const bool col_ok = !PARTIAL || c < d_chunks;
#pragma unroll
        for (int i = 0; i < ROWS / STEP; ++i) {
            bool ok = row0 + r + i * STEP < n_rows && col_ok;
            cp_async_16(rows_below<CH>(dst, i * STEP), ok ? src + i * src_step : g, ok);
        }
    } else {
        constexpr int CHUNKS = ROWS * CH;
#pragma unroll
        for (int i = 0; i < (CHUNKS + THREADS - 1) / THREADS; ++i) {
            const int idx = tid + i * THREADS;
            if (CHUNKS % THREADS == 0 || idx < CHUNKS) {
                const int r = idx / CH, c = idx % CH;
                const bool ok = row0 + r < n_rows && (!PARTIAL || c < d_chunks);
                cp_async_16(s_base + swz<CH>(r, c), ok ? g + (long long)(row0 + r) * row_stride + c * 8 : g, ok);
            }
        }
    }
}

// load_tile's fast form with each chunk's source formed as the thread's first chunk's plus i STEP
// rows (one 64-bit stride) and, for WHOLE tiles (every row before n_rows), no predicate. Under
// load_tile's `ok ? src + i step : g` ptxas formed every chunk's address anew as a 64-bit
// (row0 + r + i STEP) * stride product (the decode kernel's d128 mainloop, sm_90a: ~300 of its 556
// instructions per warp and tile were the copy's). Both forms share the addressing, so a loop
// holding both (whole tiles, then a partial last one) keeps one set of registers for it.
template <int ROWS, int CH, int THREADS>
struct StridedTileCopy {
    static constexpr int kStep = THREADS / CH;
    static constexpr bool kApplies = THREADS % CH == 0 && kStep > 0 && ROWS % kStep == 0 &&
                                     (!SmemRow<CH>::kSwizzled || (kStep & (kStep - 1)) == 0);

    template <bool WHOLE>
    __device__ __forceinline__ static void copy(u32 s_base, const elem_t* g, long long row_stride, int row0, int n_rows,
                                                int tid) {
        static_assert(kApplies, "needs load_tile's fast form");
        const int r = tid / CH, c = tid % CH;
        const elem_t* src = g + (long long)(row0 + r) * row_stride + c * 8;
        const long long src_step = (long long)kStep * row_stride;
        const u32 dst = s_base + swz<CH>(r, c);
#pragma unroll
        for (int i = 0; i < ROWS / kStep; ++i) {
            const u32 dst_i = rows_below<CH>(dst, i * kStep);
            if constexpr (WHOLE) {
                cp_async_16(dst_i, src + i * src_step);
            } else {  // rows at or past n_rows zero-filled: src-size 0 reads nothing (CUTLASS's zfill
                      // copies alike; memcheck clean with such rows past the allocation, scripts/
                      // sanitize_decode.py), so their address is formed as any other's (a select of
                      // g instead kept g live and spilled at d64 / d128)
                const bool ok = row0 + r + i * kStep < n_rows;
                cp_async_16(dst_i, src + i * src_step, ok);
            }
        }
    }
};

// A tile copy in which thread t copies chunk t % CH of kRowsPer CONSECUTIVE rows, from row
// (t / CH) kRowsPer (StridedTileCopy's threads take rows kStep apart): a thread's rows then share
// whatever holds a run of rows, e.g. one page of a paged KV cache whose page size kRowsPer divides,
// so one lookup and one address serve them all. The caller forms the thread's first source (its
// row's chunk); the rest are whole row strides further. A quarter-warp still writes 8 chunks of
// one row (CH >= 8). kRowsPer a power of two (or a multiple of 8) keeps rows_below exact.
template <int ROWS, int CH, int THREADS>
struct RowGroupTileCopy {
    static constexpr int kGroups = THREADS / CH;
    static constexpr int kRowsPer = kGroups > 0 ? ROWS / kGroups : 0;
    static constexpr bool kApplies = THREADS % CH == 0 && kGroups > 0 && ROWS % kGroups == 0 &&
                                     (!SmemRow<CH>::kSwizzled || (kRowsPer & (kRowsPer - 1)) == 0 || kRowsPer % 8 == 0);

    // this thread's first row within the tile
    __device__ __forceinline__ static int first_row(int tid) { return tid / CH * kRowsPer; }

    // rows from src (this thread's first row, its chunk) into the tile at s_base; with !WHOLE, the
    // thread's rows from n_ok on are zero-filled (src-size 0: their addresses are formed, never read)
    template <bool WHOLE>
    __device__ __forceinline__ static void copy(u32 s_base, const elem_t* src, long long row_stride, int n_ok, int tid) {
        static_assert(kApplies, "needs THREADS a multiple of CH and whole row groups");
        const u32 dst = s_base + swz<CH>(first_row(tid), tid % CH);
#pragma unroll
        for (int j = 0; j < kRowsPer; ++j) cp_async_16(rows_below<CH>(dst, j), src + j * row_stride, WHOLE || j < n_ok);
    }
};

// K and V tiles of one ring slot (the forward's and the dQ kernel's stage); PARTIAL: K's rows hold
// d_chunks chunks, V's v_chunks (v's own head dim; d_chunks when it is q's and k's).
template <int BC, int CH, int THREADS, bool PARTIAL = false>
__device__ __forceinline__ void load_kv_tile(u32 sK_slot, u32 sV_slot, const elem_t* kg, long long k_sn,
                                             const elem_t* vg, long long v_sn, int n_block, int seqlen_k, int tid,
                                             int d_chunks = CH, int v_chunks = CH) {
    load_tile<BC, CH, THREADS, PARTIAL>(sK_slot, kg, k_sn, n_block * BC, seqlen_k, tid, d_chunks);
    load_tile<BC, CH, THREADS, PARTIAL>(sV_slot, vg, v_sn, n_block * BC, seqlen_k, tid, v_chunks);
}

// Per-lane byte offsets of the ldmatrix rows at k-chunk 0 (chunk c is offset ^ (16 c), see
// core/swizzle.cuh). For a warp tile of 16 rows from row0:
//   a_operand  : A fragment (rows = m, row-major tile), matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15)
//   b_operand  : B fragment of two n8 tiles from a row-major (n x k) tile, as K in Q K^T
//   b_trans    : B fragment read with .trans from a row-major (k x n) tile, as V in P V
template <int CH>
struct LdmatrixOffsets {
    __device__ __forceinline__ static u32 a_operand(int row0, int lane) {
        return swz<CH>(row0 + lane % 8 + ((lane / 8) % 2) * 8, lane / 16);
    }
    __device__ __forceinline__ static u32 b_operand(int lane) { return swz<CH>(lane % 8 + (lane / 16) * 8, (lane / 8) % 2); }
    __device__ __forceinline__ static u32 b_trans(int lane) { return swz<CH>(lane % 8 + ((lane / 8) % 2) * 8, lane / 16); }
};

}  // namespace cuflash
