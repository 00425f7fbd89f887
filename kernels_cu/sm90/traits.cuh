// cuflash/kernels_cu/sm90/traits.cuh
// Compile-time shape of the sm90 forward: warpgroup roles, shared-memory carve-up, register
// split, barrier ids. Mirrored by cuflash/tiles.py Sm90FwdConfig (smem_bytes, structural_problem).
#pragma once
#include "core/types.cuh"

namespace cuflash {

template <int D, int BC, int CONSUMERS, int STAGES, int QSTAGES = 1>
struct Sm90FwdTraits {
    static_assert(D == 64 || D == 128 || D == 192 || D == 256, "head_dim 64, 128, 192 or 256 (whole 128-byte swizzle chunks; 256 is wgmma's largest N for O += P V)");
    static_assert(BC % 16 == 0 && BC >= 64 && BC <= 256, "block_k: a multiple of 16 in [64, 256] (TMA box, wgmma N)");
    static_assert(CONSUMERS >= 1 && CONSUMERS <= 3, "1 to 3 consumer warpgroups (block_q <= 192)");
    static_assert(STAGES >= 2 && STAGES <= 4, "2 to 4 K/V stages");
    static_assert(QSTAGES == 1 || QSTAGES == 2, "Q single or double buffered");

    // Warpgroup 0 is the producer (one thread issues every TMA load), 1..CONSUMERS compute; each
    // consumer owns 64 query rows (wgmma's M).
    static constexpr int kWarpgroups = CONSUMERS + 1;
    static constexpr int kThreads = 128 * kWarpgroups;
    static constexpr int kBlockQ = 64 * CONSUMERS;
    static constexpr int kChunks = D / 64;  // 64-column (128-byte) chunks of a row: the TMA box / swizzle unit

    // Registers per thread after setmaxnreg (multiples of 8, 128 * (producer + CONSUMERS *
    // consumer) <= 65536). One consumer has the whole file to itself.
    static constexpr int kProducerRegs = CONSUMERS == 3 ? 32 : CONSUMERS == 2 ? 24 : 56;
    static constexpr int kConsumerRegs = CONSUMERS == 3 ? 160 : CONSUMERS == 2 ? 240 : 256;

    // Shared memory (dynamic; the kernel rounds its base up to 1024 B): QSTAGES Q tiles (two: the
    // next tile's Q loads while this one computes), then STAGES K tiles, then STAGES V tiles, each
    // the TMA image [chunk][row][64] of 16-bit elements.
    static constexpr int kQBytes = kBlockQ * D * 2;
    static constexpr int kKVBytes = BC * D * 2;
    static constexpr int kQChunkBytes = kBlockQ * 128;
    static constexpr int kKVChunkBytes = BC * 128;
    static constexpr int kSmemBytes = QSTAGES * kQBytes + 2 * STAGES * kKVBytes + 1024;  // + alignment slack

    // wgmma k-steps: S = Q K^T contracts over D, O += P V over BC.
    static constexpr int kHeadSteps = D / 16;
    static constexpr int kKeySteps = BC / 16;

    // Named barrier ids (0 is __syncthreads): the consumers' issue order (ping-pong).
    static constexpr int kBarSchedule = 1;  // + consumer index
    // the epilogue (kStagedO in sm90/fwd.cuh): a consumer's O rows staged, and read back out
    static constexpr int kBarEpilogue = 4;  // + consumer index
};

}  // namespace cuflash
