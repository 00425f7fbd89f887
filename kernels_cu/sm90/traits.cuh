// cuflash/kernels_cu/sm90/traits.cuh
// Compile-time shape of the sm90 forward: warpgroup roles, shared-memory carve-up, register
// split, barrier ids. Mirrored by cuflash/tiles.py Sm90FwdConfig (smem_bytes, structural_problem).
#pragma once
#include "core/types.cuh"

namespace cuflash {

template <int D, int BC, int CONSUMERS, int STAGES>
struct Sm90FwdTraits {
    static_assert(D == 64 || D == 128, "head_dim 64 or 128");
    static_assert(BC % 16 == 0 && BC >= 64 && BC <= 256, "block_k: a multiple of 16 in [64, 256] (TMA box, wgmma N)");
    static_assert(CONSUMERS >= 1 && CONSUMERS <= 3, "1 to 3 consumer warpgroups (block_q <= 192)");
    static_assert(STAGES >= 2 && STAGES <= 4, "2 to 4 K/V stages");

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

    // Shared memory (dynamic; the kernel rounds its base up to 1024 B): Q, then STAGES K tiles,
    // then STAGES V tiles, each the TMA image [chunk][row][64] of 16-bit elements.
    static constexpr int kQBytes = kBlockQ * D * 2;
    static constexpr int kKVBytes = BC * D * 2;
    static constexpr int kQChunkBytes = kBlockQ * 128;
    static constexpr int kKVChunkBytes = BC * 128;
    static constexpr int kSmemBytes = kQBytes + 2 * STAGES * kKVBytes + 1024;  // + alignment slack

    // wgmma k-steps: S = Q K^T contracts over D, O += P V over BC.
    static constexpr int kHeadSteps = D / 16;
    static constexpr int kKeySteps = BC / 16;

    // Named barrier ids (0 is __syncthreads): the consumers' issue order (ping-pong).
    static constexpr int kBarSchedule = 1;  // + consumer index
};

}  // namespace cuflash

namespace cuflash {

// The sm90 dK/dV (+ atomic dQ) kernel: one CTA per key block of BC = 64 * CONSUMERS keys, K and V
// loaded once, Q and dO streamed per query block of BR rows through a STAGES-deep TMA ring.
template <int D, int BR, int CONSUMERS, int STAGES>
struct Sm90BwdTraits {
    static_assert(D == 64 || D == 128, "head_dim 64 or 128");
    static_assert(BR == 64, "block_q 64: the dS^T image is one 64-query chunk (the dQ product's A)");
    static_assert(CONSUMERS == 2, "two consumer warpgroups (128 keys)");
    static_assert(STAGES >= 2 && STAGES <= 4, "2 to 4 Q/dO stages");

    static constexpr int kWarpgroups = CONSUMERS + 1;
    static constexpr int kThreads = 128 * kWarpgroups;
    static constexpr int kBlockK = 64 * CONSUMERS;  // keys per CTA (BC)
    static constexpr int kProducerRegs = 24;
    static constexpr int kConsumerRegs = 240;

    static constexpr int kKVBytes = kBlockK * D * 2;  // K or V: [D/64 chunk][BC rows][64]
    static constexpr int kQBytes = BR * D * 2;        // Q or dO of one stage: [D/64 chunk][BR rows][64]
    static constexpr int kDSBytes = kBlockK * BR * 2; // dS^T: [1 query chunk][BC key rows][64 queries]
    static constexpr int kKVChunkBytes = kBlockK * 128;
    static constexpr int kQChunkBytes = BR * 128;
    static constexpr int kSmemBytes = 2 * kKVBytes + 2 * STAGES * kQBytes + kDSBytes + 1024;  // + alignment slack

    static constexpr int kHeadSteps = D / 16;        // S^T, dP^T contract over D
    static constexpr int kQuerySteps = BR / 16;      // dV, dK contract over the BR queries
    static constexpr int kKeySteps = kBlockK / 16;   // dQ contracts over the BC keys
    static constexpr int kDqWarpgroups = D / 64;     // consumers that run the dQ product, 64 columns of D each

    // named barriers (0 is __syncthreads): dS^T complete in smem / every dQ product done reading it
    static constexpr int kBarDsFull = 1, kBarDsFree = 2;
};

}  // namespace cuflash
