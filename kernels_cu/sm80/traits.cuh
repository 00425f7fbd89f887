// cuflash/kernels_cu/sm80/traits.cuh
// Every compile-time number of the sm80 kernels, derived from the tile integers in one place,
// with the divisibility rules as static_asserts. Python mirrors kSmemBytes in cuflash/tiles.py
// (the *Config.smem_bytes properties, with tiles.smem_row_bytes for SmemRow::kBytes); tests/test_compile_v1.py checks one mirror under NVRTC.
//
// Fragment-count vocabulary (core/frag.cuh): an "m16 tile" is 16 rows of an MMA A/C fragment,
// an "n8 tile" 8 columns of a C fragment, a "k16 step" one mma.sync reduction step.
#pragma once
#include "core/swizzle.cuh"

namespace cuflash {

// v2 forward (sm80/fwd.cuh): warps own query rows, K/V stream through a kStages ring.
template <int D, int BR, int BC, int WARPS, int STAGES>
struct Sm80FwdTraits {
    static constexpr int kNumThreads = WARPS * 32;
    static constexpr int kRowsPerWarp = BR / WARPS;
    static constexpr int kRowTiles = kRowsPerWarp / 16;  // m16 tiles per warp
    static constexpr int kScoreTiles = BC / 8;           // n8 tiles of S per m16 tile
    static constexpr int kOutTiles = D / 8;              // n8 tiles of O
    static constexpr int kHeadSteps = D / 16;            // k16 steps of Q K^T (over head dim)
    static constexpr int kKeySteps = BC / 16;            // k16 steps of P V (over keys)
    static constexpr int kRowChunks = D / 8;             // 16-byte chunks per row
    static constexpr int kQBytes = BR * SmemRow<kRowChunks>::kBytes;
    static constexpr int kKVTileBytes = BC * SmemRow<kRowChunks>::kBytes;
    static constexpr int kSmemBytes = kQBytes + 2 * STAGES * kKVTileBytes;
    // With one m16 tile per warp, Q's A fragments (kHeadSteps x 4 registers) stay in registers for
    // the whole loop: an eighth less shared-memory traffic, which bounds the kRowTiles == 1 configs.
    // Not past d=128: at d=256 Q's fragments (64 registers) next to O (128) spill.
    static constexpr bool kQInRegs = (kRowTiles == 1) && D <= 128;
    static_assert(D % 16 == 0 && D >= 16 && D <= 256, "head_dim must be a multiple of 16 in [16, 256]");
    static_assert(kRowsPerWarp % 16 == 0 && kRowTiles >= 1, "BR must be a multiple of 16*WARPS");
    static_assert(BC % 16 == 0, "BC must be a multiple of 16");
    static_assert(STAGES >= 2, "the single-barrier pipeline needs at least 2 stages");
};

// v1 forward (sm80/fwd_v1.cuh): K/V tile single-buffered, Q tiles through a kStages ring.
template <int D, int BR, int BC, int WARPS, int STAGES>
struct Sm80FwdV1Traits {
    static constexpr int kNumThreads = WARPS * 32;
    static constexpr int kRowsPerWarp = BR / WARPS;
    static constexpr int kRowTiles = kRowsPerWarp / 16;
    static constexpr int kScoreTiles = BC / 8;
    static constexpr int kOutTiles = D / 8;
    static constexpr int kHeadSteps = D / 16;
    static constexpr int kKeySteps = BC / 16;
    static constexpr int kRowChunks = D / 8;
    static constexpr int kQTileBytes = BR * SmemRow<kRowChunks>::kBytes;
    static constexpr int kKVTileBytes = BC * SmemRow<kRowChunks>::kBytes;
    // K tile + V tile (single-buffered: they change once per outer step) + STAGES Q slots
    // (mirrors V1Config.smem_bytes in cuflash/_configs.py)
    static constexpr int kSmemBytes = 2 * kKVTileBytes + STAGES * kQTileBytes;
    static constexpr int SMEM_BYTES = kSmemBytes;  // the name tests/test_compile_v1.py checks
    static_assert(D % 16 == 0 && D >= 16 && D <= 256, "head_dim must be a multiple of 16 in [16, 256]");
    static_assert(kRowsPerWarp % 16 == 0 && kRowTiles >= 1, "BR must be a multiple of 16*WARPS");
    static_assert(BC % 16 == 0, "BC must be a multiple of 16");
    static_assert(STAGES >= 2, "the single-barrier Q ring needs at least 2 stages");
};
// The v1 traits' former name, still used by tests/test_compile_v1.py.
template <int D, int BR, int BC, int WARPS, int STAGES>
using FwdV1Shape = Sm80FwdV1Traits<D, BR, BC, WARPS, STAGES>;

// dK/dV (+ atomic dQ) backward (sm80/bwd_dkdv.cuh): warps own 16 keys each; Q, dO, lse2, delta
// stream through a kStages ring.
template <int D, int BR, int BC, int WARPS, int STAGES, bool DROPOUT>
struct Sm80BwdTraits {
    static constexpr int kNumThreads = WARPS * 32;
    static constexpr int kRowChunks = D / 8;       // 16-byte chunks per K/V/Q/dO row
    static constexpr int kDsRowChunks = BR / 8;    // 16-byte chunks per dS^T row (BR queries)
    static constexpr int kHeadSteps = D / 16;      // k16 steps over the head dim
    static constexpr int kQueryTiles = BR / 8;     // n8 tiles of S^T (queries)
    static constexpr int kQuerySteps = BR / 16;    // k16 steps over queries (dV, dK products)
    // Head-dim column splits: past d=128 a warp's dK and dV (16 keys x D fp32 each, 256 registers
    // at d=256) do not fit, so kColSplits blocks share a key tile, each recomputing S^T and dP^T
    // (full head dim) and owning kSplitCols columns of dK, dV and of the dQ product.
    static constexpr int kColSplits = D > 128 ? 2 : 1;
    static constexpr int kSplitCols = D / kColSplits;
    static_assert(kColSplits <= 2, "tile_mma_ab addresses the second split only (its `hi`)");
    static constexpr int kOutTiles = kSplitCols / 8;  // n8 tiles of this block's dK, dV columns
    static constexpr int kKeySteps = BC / 16;      // k16 steps over keys (dQ product)
    // dQ product warp grid: kDqWarpsM x kDqWarpsN warps over the BR x kSplitCols tile
    static constexpr int kDqWarpsM = (WARPS < BR / 16) ? WARPS : BR / 16;
    static constexpr int kDqWarpsN = WARPS / kDqWarpsM;
    static constexpr int kDqRowsPerWarp = BR / kDqWarpsM;
    static constexpr int kDqRowTiles = kDqRowsPerWarp / 16;  // m16 tiles of dQ per warp
    static constexpr int kDqColsPerWarp = kSplitCols / kDqWarpsN;
    static constexpr int kDqColTiles = kDqColsPerWarp / 8;   // n8 tiles of dQ per warp
    static constexpr int kKVBytes = BC * SmemRow<kRowChunks>::kBytes;
    static constexpr int kQTileBytes = BR * SmemRow<kRowChunks>::kBytes;
    static constexpr int kDsBytes = BC * SmemRow<kDsRowChunks>::kBytes;
    // dS^T buffers: two let a query tile's dQ product (deferred to the next tile, after its
    // barrier) read one while the warps write the next, saving a barrier per tile. The 2-warp
    // tiles, the fallbacks of d192 / d256 for the ~99 KB of cc 8.6 / 8.9 GPUs (d256's fits with
    // one buffer, to the byte), keep one and pay the barrier: 64 threads meet quickly.
    static constexpr int kDsBuffers = WARPS == 2 ? 1 : 2;
    static constexpr int kStatBytes = BR * 4;
    static constexpr int kSmemBytes = 2 * kKVBytes + 2 * STAGES * kQTileBytes + kDsBuffers * kDsBytes + 2 * STAGES * kStatBytes;
    // Unroll factor of the head-dim loop of the S^T / dP^T products (sm80/warp_gemm.cuh,
    // tile_mma_abt). Fully unrolled, ptxas hoists every B fragment ahead of the MMAs and the dK,
    // dV accumulators no longer fit; with dropout the keep bits take the room of the second step.
    static constexpr int kHeadUnroll = DROPOUT ? 1 : 2;
    static_assert(D % 16 == 0 && D >= 16 && D <= 256, "head_dim must be a multiple of 16 in [16, 256]");
    static_assert(BC == 16 * WARPS, "each warp owns 16 keys");
    static_assert(BR % 32 == 0, "BR must be a multiple of 32 (dS^T rows of whole 64-byte halves)");
    static_assert(WARPS % kDqWarpsM == 0 && kDqColsPerWarp % 16 == 0 && kDqRowsPerWarp % 16 == 0, "dQ warp grid");
    static_assert(STAGES >= 2, "the single-barrier pipeline needs at least 2 stages");
};

// Deterministic dQ backward (sm80/bwd_dq.cuh): laid out like the forward, 16 query rows per warp.
template <int D, int BR, int BC, int WARPS, int STAGES>
struct Sm80DqTraits {
    static constexpr int kNumThreads = WARPS * 32;
    static constexpr int kRowChunks = D / 8;
    static constexpr int kHeadSteps = D / 16;
    static constexpr int kScoreTiles = BC / 8;  // n8 tiles of S (keys)
    static constexpr int kKeySteps = BC / 16;   // k16 steps over keys (dQ product)
    static constexpr int kOutTiles = D / 8;     // n8 tiles of dQ
    static constexpr int kQTileBytes = BR * SmemRow<kRowChunks>::kBytes;
    static constexpr int kKVBytes = BC * SmemRow<kRowChunks>::kBytes;
    static constexpr int kSmemBytes = 2 * kQTileBytes + 2 * STAGES * kKVBytes;
    // Q's A fragments stay in registers for the whole loop up to d=128; at d=256 (64 registers next
    // to dQ's 128) they are read from shared memory per k16 step like dO's.
    static constexpr bool kQInRegs = D <= 128;
    static_assert(D % 16 == 0 && D >= 16 && D <= 256, "head_dim must be a multiple of 16 in [16, 256]");
    static_assert(BR == 16 * WARPS, "each warp owns 16 query rows");
    static_assert(BC % 16 == 0 && STAGES >= 2, "tile shape");
};

}  // namespace cuflash
