// cuflash/kernels_cu/sm90/bwd_traits.cuh
// Compile-time shape of the sm90 backward (sm90/bwd.cuh): roles, register split, smem carve-up,
// k-steps, barrier ids. (Its own file: the forward's sources, which key its tuned entries, stay
// untouched by backward work.)
#pragma once
#include "core/types.cuh"

namespace cuflash {

// The sm90 dK/dV (+ atomic dQ) kernel: one CTA per key block of BC = 64 * CONSUMERS keys, K and V
// loaded once, Q and dO streamed per query block of BR rows through a STAGES-deep TMA ring.
// D > 128 (kSplitD): BC = 64 keys shared by both consumers, which split the head dim instead
// (docs/sm90-backward-plan.md, "Head dims 192 and 256").
template <int D, int BR, int CONSUMERS, int STAGES, int DQ_BULK = 0, int OVERLAP = 0>
struct Sm90BwdTraits {
    static_assert(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256");
    // the split-head-dim tile: each consumer holds dK and dV for all BC keys and half the head dim
    // (dK + dV: D / 2 registers a thread, 128 at d256, where whole rows would take 256 of 240), and
    // computes S^T and dP^T for half the block's queries; P^T goes through a shared-memory image
    static constexpr bool kSplitD = D > 128;
    static_assert(!kSplitD || ((DQ_BULK == 0 || DQ_BULK == 4) && OVERLAP == 0 && STAGES == 2),
                  "the split-head-dim tile: dQ by atomics or the store warp, two stages, its own order (shared memory: 218 KB)");
    // kSplitD, DQ_BULK 4: no staging of its own (no room: 1 KiB short of one 64 KB set). Each consumer
    // stages its two 64 x 64 fp32 dQ blocks (fragment order, 16 KB each) over its column half of the
    // block's own Q and dO images (2 x 8 KB chunks each), which nothing reads once the consumer's dK
    // and dV are done (both consumers' S^T and dP^T, the images' other readers, precede the dS^T
    // barrier); the store warp's bulk reductions read them, and then it frees the stage
    static constexpr bool kDqInStage = kSplitD && DQ_BULK == 4;
    static_assert(BR == 64, "block_q 64: the dS^T image is one 64-query chunk (the dQ product's A)");
    static_assert(CONSUMERS == 2, "two consumer warpgroups (128 keys)");
    static_assert(STAGES >= 2 && STAGES <= 4, "2 to 4 Q/dO stages");

    static constexpr int kWarpgroups = CONSUMERS + 1;
    static constexpr int kThreads = 128 * kWarpgroups;
    static constexpr int kBlockK = kSplitD ? 64 : 64 * CONSUMERS;  // keys per CTA (BC)
    static constexpr int kQN = kSplitD ? BR / 2 : BR;         // queries of a block in a consumer's S^T, dP^T (N)
    static constexpr int kColsWg = kSplitD ? D / 2 : D;       // head-dim columns of a consumer's dK, dV (N)
    // setmaxnreg moves registers within the CTA's allocation: kThreads x the per-thread count the
    // launch bounds allow, rounded down to a multiple of 8 (168 at 384 threads: 64512, not 65536).
    // A consumer's setmaxnreg.inc waits until the producer's .dec has freed enough, forever if the
    // split asks for more than the allocation: the DQ_BULK tiles hung on the H200 with a producer
    // at 32 (128 x 32 + 256 x 240 = 65536). The store warp lives within the producer's 24.
    static constexpr int kProducerRegs = 24;
    static constexpr int kConsumerRegs = 240;
    static_assert(128 * kProducerRegs + 128 * CONSUMERS * kConsumerRegs <= kThreads * ((65536 / kThreads) & ~7),
                  "the setmaxnreg split exceeds the CTA's register allocation (the consumers would wait forever)");

    static constexpr int kKVBytes = kBlockK * D * 2;  // K or V: [D/64 chunk][BC rows][64]
    static constexpr int kQBytes = BR * D * 2;        // Q or dO of one stage: [D/64 chunk][BR rows][64]
    static constexpr int kDSBytes = kBlockK * BR * 2; // dS^T: [1 query chunk][BC key rows][64 queries]
    static constexpr int kDSBuffers = 2;              // block i writes buffer i % 2: no wait for block i-1's readers
    static constexpr int kKVChunkBytes = kBlockK * 128;
    static constexpr int kQChunkBytes = BR * 128;
    // DQ_BULK 1: each dQ consumer stages its 64 x 64 fp32 block here (rows padded by 16 B: the
    // fragment stores are 2-way bank conflicted at most), and a store warp adds it to dq_acc row by
    // row. DQ_BULK 2: in fragment order (kDqFragBytes each, no padding: thread ctid's float4 nt at
    // (nt * 128 + ctid) * 16, conflict-free), added by one 1-D bulk reduction of the whole block,
    // issued by the consumer itself, into a dq_acc in the same order (bwd_dq_convert_frag reads it)
    // DQ_BULK 3: as 2, each block's reduction in key-block order, issued by the store warp (the
    // deterministic mode, sm90/bwd.cuh); 4: as 2, issued by the store warp
    static_assert(DQ_BULK >= 0 && DQ_BULK <= 4, "dq_bulk 0 to 4");
    static constexpr int kDqRowBytes = 64 * 4 + 16;
    static constexpr int kDqFragBytes = 64 * 64 * 4;
    // one staging set: a block per dQ consumer
    static constexpr int kDqSetBytes = kDqInStage ? 0
                                       : DQ_BULK == 1 ? (D / 64) * 64 * kDqRowBytes
                                       : DQ_BULK >= 2 ? (D / 64) * kDqFragBytes : 0;
    // per stage, the query block's lse2 and delta (BR floats each): bulk-copied with Q_i and dO_i
    // (read from global memory per block, they were a third of the stalls under ncu)
    static constexpr int kStatBytes = BR * 4;
    // kSplitD: the P^T image (dV's A operand), one buffer: a barrier per block frees it (sm90/bwd.cuh)
    static constexpr int kPBytes = kSplitD ? kBlockK * BR * 2 : 0;
    static constexpr int kSmemWithoutDq = 2 * kKVBytes + 2 * STAGES * kQBytes + kDSBuffers * kDSBytes + kPBytes
                                          + 2 * STAGES * kStatBytes + 1024;  // + alignment slack
    // DQ_BULK 3 (the deterministic mode): two staging sets where they fit (the launch asks for
    // kSmemBytes + 1 KiB, cuflash/tiles.py, and static barriers take some of the 227 KiB), used by
    // alternate query blocks, so a consumer stages block i + 1 while block i waits for its turn
    // and its reduction's round trip (with one set the dQ consumers waited for free staging 30-41%
    // of a CTA's time on the H200, scripts/trace_det_waits.py, against 2-3% in the atomic mode)
    static constexpr int kDqSets = DQ_BULK == 3 && kSmemWithoutDq + 2 * kDqSetBytes + 2048 <= 227 * 1024 ? 2 : 1;
    static constexpr int kDqStageBytes = kDqSets * kDqSetBytes;
    static constexpr int kSmemBytes = kSmemWithoutDq + kDqStageBytes;

    static_assert(!kDqInStage || (kColsWg == 128 && 2 * kQChunkBytes == kDqFragBytes),
                  "kDqInStage: a consumer's two dQ blocks fill its column half of Q and of dO");

    static constexpr int kHeadSteps = D / 16;        // S^T, dP^T contract over D
    static constexpr int kQuerySteps = BR / 16;      // dV, dK contract over the BR queries
    static constexpr int kKeySteps = kBlockK / 16;   // dQ contracts over the BC keys
    static constexpr int kDqWarpgroups = D / 64;     // consumers that run the dQ product, 64 columns of D each
    // DQ_BULK 3: the producer warpgroup's store warps (warps 1..), one per (staging set, dQ consumer),
    // each taking its set's query blocks and its consumer's block of each: the turn waits and round
    // trips of different blocks then run side by side, not one after another in a single warp
    static constexpr int kDqStoreWarps = DQ_BULK == 3 ? kDqSets * kDqWarpgroups : 1;
    static_assert(kDqStoreWarps <= 3, "warp 0 of the producer warpgroup issues the loads");
    // S^T and dP^T issued back to back (the tensor cores run dP^T under the exp of S^T) where the
    // registers allow: at D = 128 both next to dK and dV spilled ~480 B (ptxas, sm_90a) while acc_dq
    // was live around the loop (see dq_wg in sm90/bwd.cuh); since, 0 B, and OVERLAP takes it
    static_assert(OVERLAP == 0 || OVERLAP == 1, "overlap 0 or 1");
    static constexpr bool kSdpTogether = D <= 64 || OVERLAP;
    // OVERLAP: the element-wise work of a block under its own GEMMs, as FlashAttention-3 orders it:
    // dP^T under the exp of S^T (kSdpTogether), dV issued after dS^T is stored so it runs under the
    // consumers' dS^T barrier, and dQ before dK so that dQ's store (atomics or staging) runs under dK
    static constexpr bool kDvAfterDs = OVERLAP;
    static constexpr bool kDqFirst = OVERLAP;

    // named barriers (0 is __syncthreads): both consumers' halves of dS^T are in smem; (DQ_BULK)
    // consumer c's dQ block staged / its staging free again, between its 128 threads and the
    // producer warpgroup's store warp (160 threads)
    static constexpr int kBarDsFull = 1;
    static constexpr int kBarDqFull = 2;   // + consumer
    static constexpr int kBarDqEmpty = 4;  // + consumer
    static constexpr int kDqBarThreads = 128 + 32;
    // DQ_BULK 3: staging set 1's pair after the epilogue's barriers (9 + consumer, 11 + consumer)
    static constexpr int kBarDqSet1 = 7;
    __device__ static constexpr int bar_dq_full(int set, int c) { return kBarDqFull + c + set * kBarDqSet1; }
    __device__ static constexpr int bar_dq_empty(int set, int c) { return kBarDqEmpty + c + set * kBarDqSet1; }
    // the epilogue: both consumers' last GEMMs done (the dK, dV staging overwrites their operands);
    // + 1 + consumer: that consumer's rows staged
    static constexpr int kBarEpilogue = 6;
    // kSplitD: both consumers' dV of the last block done (it read the P^T image), before P^T's stores
    static constexpr int kBarPFree = 13;
    static_assert(kBarEpilogue + CONSUMERS < kBarDqFull + kBarDqSet1 && kBarDqEmpty + kBarDqSet1 + 1 < 16,
                  "named barrier ids: 16 per CTA, none shared");
};

}  // namespace cuflash
