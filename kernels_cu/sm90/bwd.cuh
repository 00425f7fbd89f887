// cuflash/kernels_cu/sm90/bwd.cuh
// FlashAttention backward on Hopper (sm_90a): the dK/dV kernel with dQ added to an fp32
// accumulator by atomics (the sm80 backward's bwd_prep and bwd_dq_convert run around it). The
// attention math is the shared policies' (attn/: scheduler, block_range, mask, features); the
// structure is FlashAttention-3's (design/hopper.md §4), first version:
//
//   grid     one CTA per (key block of BC = 128 keys, head, batch) (attn/scheduler.cuh)
//   WG 0     producer: one thread loads K, V once and Q_i, dO_i per query block by TMA into a
//            STAGES-deep ring (one full/empty mbarrier pair per stage carries both)
//   WG 1, 2  consumers, 64 keys each (wgmma M = 64), per query block i of BR = 64 rows:
//              S^T = K_w Q_i^T, dP^T = V_w dO_i^T      (SS wgmma, N = BR; keys are M, so P^T and
//                                                      dS^T come out as the A operands dV and
//                                                      dK need, in registers)
//              P^T = exp2(S^T c - lse2), 0 where masked; dS^T = P^T o (dP^T - delta)
//                                                     (softcap: S^T capped first, attn/score_mod.cuh,
//                                                     masked before the exp, and P^T o (1 - t^2)
//                                                     parked in the dS^T image for dS^T)
//              dV += P^T dO_i, dK += dS^T Q_i          (RS wgmma, N = D)
//              dS^T -> smem (two buffers, one barrier per block); dQ_i[:, 64c..] = dS K
//                                                     (SS wgmma, both operands MN-major, N = 64:
//                                                      consumer c < D/64 takes D columns 64c..)
//              dQ_i added to dq_acc (fp32; bwd_dq_convert scales and converts): red.global.add by
//              each thread, or (DQ_BULK 1) staged in smem and added by a store warp of WG 0 with
//              1-D bulk reductions, one per row, or (DQ_BULK 2) staged in fragment order and added
//              by one 1-D bulk reduction per block that the consumer issues (dq_acc in fragment
//              order: bwd_dq_convert_frag), or (DQ_BULK 4) as 2 but issued by the store warp
//              (FlashAttention-3's arrangement: the consumers only stage and arrive)
//   end      dK = scale dK, dV from registers to global memory.
//   lse2, delta  bulk-copied per query block with Q_i and dO_i (same mbarrier) into shared memory
//   OVERLAP  a block's element-wise work under its own GEMMs (Sm90BwdTraits::kSdpTogether,
//            kDvAfterDs, kDqFirst); V::kVarlen: a CTA's sequence from cu_seqlens (SeqSpan)
//   dropout  the forward's Philox keep bits regenerated per block (attn/dropout.cuh, transposed
//            view: one register per thread for its 16 keys x 64 queries); dS^T takes
//            P^T o (Z o dP^T / (1 - p) - delta) from the undropped P^T, then P^T's dropped elements
//            are zeroed in place for dV (issued after dS^T for that reason), and dV is scaled by
//            1 / (1 - p) at the end
//   DQ_BULK 3  the deterministic mode: DQ_BULK 2 with each dQ block's reductions in a fixed order
//            of its key blocks. dq_sem holds one turn counter per dQ block (bh, m, dQ consumer),
//            zeroed by the plan. The consumers stage their blocks for store warps of the producer
//            warpgroup (one per dQ consumer and staging set; two sets, alternate query blocks, where
//            shared memory allows: Sm90BwdTraits::kDqSets), whose lane 0 first waits until a block's
//            counter equals its key block's rank (sm90/det_order.cuh), issues the reduction, and
//            once it is complete increments the counter. Two orders (sm90/det_order.cuh): rotated (params.det_rotate,
//            where the host knows a head's key blocks fit on the GPU at once, and each CTA's
//            sequence allows it, varlen included), each key block walking its query blocks from
//            its own first one, every dQ block taking its key blocks as they reach it (none waits in
//            step), the CTAs in the atomic mode's order (whole heads per wave); or the staircase,
//            every key block walking from the last query block, each dQ block taking its key blocks
//            in ascending order, so a CTA only ever waits for CTAs of lower index (dispatched no
//            later), the CTAs by head groups (attn/scheduler.cuh, schedule_blocks_grouped) so few
//            of a head's key blocks wait at once.
// Not yet: overlap across query blocks, a persistent schedule.
#pragma once
#include "attn/block_mask.cuh"
#include "attn/block_range.cuh"
#include "attn/dropout.cuh"
#include "attn/features.cuh"
#include "attn/mask.cuh"
#include "attn/params.cuh"
#include "attn/scheduler.cuh"
#include "attn/score_mod.cuh"
#include "core/ptx_sm90.cuh"
#include "core/wgmma_sm90_mn.cuh"
#include "sm80/warp_gemm.cuh"
#include "sm90/bwd_traits.cuh"
#include "sm90/det_order.cuh"

namespace cuflash {

// x, opaque to the compiler (it cannot hoist or CSE across it). A loop-invariant address that an
// unrolled loop offsets by constants is otherwise hoisted as one register per offset (here: 16 for
// lse2, 16 for delta, 16 dS^T smem addresses), which the backward's 240 registers cannot hold;
// from an opaque base the offsets become immediates of the loads and stores.
__device__ __forceinline__ u64 opaque(u64 x) {
    asm volatile("mov.b64 %0, %0;" : "+l"(x));
    return x;
}
__device__ __forceinline__ u32 opaque(u32 x) {
    asm volatile("mov.b32 %0, %0;" : "+r"(x));
    return x;
}

// A query block's per-row statistic (lse2 or delta) as this thread's float2 pairs nt = 0 .. NT-1
// (its queries 8 nt + 2 t, +1; pair nt at row + 32 nt): read from shared memory where used
// (RowStatSmem: no registers held), or all read ahead into registers (RowStatRegs), before the wait
// for the wgmma whose result they meet. Read after the wait, the loads' latency was exposed there:
// on the H200 (ncu, d128 N2048) the first use of lse2 stalled on them for ~7% of the consumers'
// samples.
struct RowStatSmem {
    u32 row;
    __device__ __forceinline__ explicit RowStatSmem(u32 r) : row(r) {}
    __device__ __forceinline__ float2 at(int nt) const {
        float2 v;
        asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(row + 32 * nt));
        return v;
    }
};
template <int NT>
struct RowStatRegs {
    float2 v[NT];
    __device__ __forceinline__ explicit RowStatRegs(u32 row) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) v[nt] = RowStatSmem{row}.at(nt);
    }
    __device__ __forceinline__ float2 at(int nt) const { return v[nt]; }
};
template <bool AHEAD, int NT>
struct RowStatsOf {
    using type = RowStatSmem;
};
template <int NT>
struct RowStatsOf<true, NT> {
    using type = RowStatRegs<NT>;
};
// The non-split tile's two scheduling choices (constants, so that an A/B can flip one with sed:
// scripts/gpu_run.sh bwdab): lse2 and delta read ahead of their wgmma waits (RowStatRegs), and each
// dQ block handed to the store warp (its proxy fence and barrier arrival) only once the next block's
// S^T / dP^T are issued, so that the fence's wait for the 16 KB of staging stores to drain runs
// under the tensor cores instead of stalling the consumer between its GEMMs.
constexpr bool kBwdRowStatsAhead = true;
constexpr bool kBwdDqHandoffLate = true;

// 1-D bulk reduction shared -> global (sm_90): dst[i] += src[i] for `bytes` bytes (a multiple of 16,
// both ends 16-byte aligned), in the bulk-async group of the issuing thread.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
// 1-D bulk copy global -> shared (sm_90) of `bytes` (a multiple of 16, both ends 16-byte aligned),
// completing on the mbarrier `bar` (complete_tx::bytes), as a TMA tile load does.
__device__ __forceinline__ void bulk_load_1d(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Until the shared-memory sources of every committed bulk group have been read.
__device__ __forceinline__ void bulk_wait_read0() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// Until every committed bulk group has completed (its writes performed).
__device__ __forceinline__ void bulk_wait0() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

template <bool BF16, int D, int BR, int CONSUMERS, int STAGES, int DQ_BULK, int OVERLAP, class V>
__device__ __forceinline__ void flash_bwd_sm90(const TmaMap& tq, const TmaMap& tk, const TmaMap& tv, const TmaMap& tdo,
                                               const float* __restrict__ lse2, const float* __restrict__ delta,
                                               float* __restrict__ dq_acc, elem_t* __restrict__ dk,
                                               elem_t* __restrict__ dv, int* dq_sem, const int* __restrict__ cu_seqlens_q,
                                               const int* __restrict__ cu_seqlens_k, const float* __restrict__ alibi_slopes,
                                               const void* const* __restrict__ mod_aux, const int* __restrict__ bm_counts,
                                               const int* __restrict__ bm_index, const BwdParams& params) {
    using Tr = Sm90BwdTraits<D, BR, CONSUMERS, STAGES, DQ_BULK, OVERLAP>;
    constexpr int BC = Tr::kBlockK;
    static_assert(!V::kDropout || BR <= 64, "dropout keep bits: 8 per 16x16 block, one u32 for 64 queries");
    // dV after dS^T: with dropout dS^T reads the undropped P^T, which dV's A operand then loses
    constexpr bool kDvLate = Tr::kDvAfterDs || V::kDropout;
    // how dQ reaches dq_acc: the tile's DQ_BULK. The fragment order's 64-row blocks start at a
    // multiple of 64 workspace rows for variable-length batches too (each sequence's rows start at a
    // multiple of 128 in its head's, SeqSpan::varlen_ws_row0), so its bulk reductions never reach
    // another sequence's rows; bwd_dq_convert_frag_varlen reads that layout back
    constexpr int kDqMode = DQ_BULK;
    // the deterministic mode: dQ's reductions in key-block order (the plan refuses varlen and block
    // masks there: their dq_acc layout / an arbitrary set of key blocks per query block)
    constexpr bool kOrdered = DQ_BULK == 3;
    // fragment-order blocks staged for the producer's store warp, which issues their reductions
    // (3: in key-block order; 4: as they come)
    constexpr bool kFragWarp = kDqMode >= 3;
    static_assert(!kOrdered || !V::kBlockMask, "the ordered dQ does not take block masks");
    // V::kGroupLoop (GQA/MQA): one CTA per (key block, K/V head, batch), whose steps run over the
    // group's query heads and each one's query blocks (step it: query head it / n_iter_head of the
    // group, its block it % n_iter_head), so dK and dV sum the group in registers (no per-query-head
    // scratch, no bwd_dkdv_reduce pass) and K / V are loaded once for it. Not with the features whose
    // per-head state lives through the loop (dropout's stream, ALiBi's slope, a user modification's
    // head), the ordered dQ or block masks: those keep a CTA per query head (cuflash/_backward.py)
    constexpr bool kGroup = V::kGroupLoop;
    static_assert(!kGroup || (!kOrdered && !V::kBlockMask && !V::kDropout && !V::kAlibi && !V::kUserMod),
                  "the group loop keeps no per-query-head state through the loop");

    extern __shared__ unsigned char smem[];
    // [0] K and V landed; [1 + s] stage s full (Q_i and dO_i), [1 + STAGES + s] stage s free;
    // Tr::kDqInStage: [1 + 2 STAGES + CONSUMERS s + c] consumer c's dQ blocks staged in stage s
    constexpr int kDqStagedBars = Tr::kDqInStage ? STAGES * CONSUMERS : 0;
    __shared__ __align__(8) u64 bar_storage[1 + 2 * STAGES + kDqStagedBars];
    const u32 bar_kv = smem_u32(bar_storage);
    auto bar_full = [&](int s) { return bar_kv + 8 * (1 + s); };
    auto bar_free = [&](int s) { return bar_kv + 8 * (1 + STAGES + s); };
    auto bar_dq_staged = [&](int s, int c) { return bar_kv + 8 * (1 + 2 * STAGES + CONSUMERS * s + c); };
    const u32 sK = (smem_u32(smem) + 1023u) & ~1023u;  // TMA 128B-swizzle images need 1024-B alignment
    const u32 sV = sK + Tr::kKVBytes;
    const u32 sQ = sV + Tr::kKVBytes;
    const u32 sdO = sQ + STAGES * Tr::kQBytes;
    const u32 sDS = sdO + STAGES * Tr::kQBytes;
    const u32 sP = sDS + Tr::kDSBuffers * Tr::kDSBytes;   // kSplitD: the P^T image
    const u32 sDQ = sP + Tr::kPBytes;                      // DQ_BULK: the dQ consumers' staging
    // per stage: the query block's lse2 and delta rows (BR floats each), loaded with Q_i and dO_i
    const u32 sLse = sDQ + Tr::kDqStageBytes;
    const u32 sDelta = sLse + STAGES * Tr::kStatBytes;

    const int n_heads = kGroup ? params.heads_kv : params.heads;  // the grid's heads (kGroup: K/V heads)
    const int n_blocks = params.n_blocks;
    // key blocks fastest, in natural order: under a causal mask the early key blocks see the most
    // query blocks, so the heaviest CTAs start first. kOrdered: heads fastest within groups
    // (attn/scheduler.cuh: schedule_blocks_grouped), against the turns' staircase. kGroup with
    // params.head_chunk (the host's, under a causal mask): the (batch, K/V head)s in chunks, and in a
    // chunk every head's key block 0, then every one's block 1, ...: heaviest first per chunk. A
    // group's CTA does `group` times a query head's work, so in the per-head order the last heads'
    // heavy key blocks started late and ran alone at the end (causal GQA 32/8, d128, N8192: 0.967x
    // our MHA's TFLOP/s, H200); one chunk of the whole grid, though, has every head's Q and dO in
    // flight at once, past L2 (cuflash/params.py GQA_CAUSAL_HEAD_CHUNK)
    const int bh_total = params.batch * n_heads;
    const BlockCoord blk = kOrdered && !params.det_rotate ? schedule_blocks_grouped(blockIdx.x, n_blocks, n_heads, bh_total,
                                                              ordered_group_heads(bh_total, (params.seqlen_q + BR - 1) / BR))
                           : kGroup && params.head_chunk ? schedule_blocks_grouped(blockIdx.x, n_blocks, n_heads, bh_total,
                                                                                   params.head_chunk)
                                                            : schedule_blocks(blockIdx.x, n_blocks, n_heads, false);
    const int n0 = blk.block * BC;
    // V::kVarlen: q, k, v, dout (and dq, dk, dv) are packed (total, heads, D), mapped as one batch of
    // all the rows; blk.batch is the sequence, its rows and lengths the offsets'; the maps read past
    // a sequence's end into the next one's rows (keys masked, queries with lse2 = +inf in the
    // workspace padding: P = 0 there). A key block past its sequence's keys has no rows to write.
    const SeqSpan span = SeqSpan::of<V>(cu_seqlens_q, cu_seqlens_k, blk.batch, params.seqlen_q, params.seqlen_k);
    // A 64-row x 64-column dQ block in fragment order: workspace rows row0.. (a multiple of 64) and
    // columns 64 c.., at floats row0 * D + c * 4096 of dq_acc (the rows' own span: bwd_dq_convert_frag)
    auto dq_frag_block = [&](long long row0, int c) { return dq_acc + row0 * D + c * (Tr::kDqFragBytes / 4); };
    if (V::kVarlen && n0 >= span.seqlen_k) return;
    const int seqlen_k = span.seqlen_k;
    const MaskGeometry geo = MaskGeometry::of<V>(params).template for_span<V>(span, params.align_end);
    const int tb = V::kVarlen ? 0 : blk.batch;  // the maps' batch coordinate
    const int m_blocks = (span.seqlen_q + BR - 1) / BR;
    const BlockRange range = query_blocks<BR, BC, V::kLocal>(geo, blk.block, m_blocks);
    // the range's query blocks, or those of them a block mask lists (its transposed lists, bm_mb
    // entries per key block)
    const BlockList<V::kBlockMask> blocks = BlockList<V::kBlockMask>::of(
        bm_counts, bm_index, V::kBlockMask ? block_list_row(params, blk.batch, blk.head, n_blocks, blk.block) : 0,
        params.bm_mb, range);
    // steps: the query blocks of each query head the CTA takes (kGroup: the group's; else its one)
    const int n_iter_head = blocks.size();
    const int n_iter = kGroup ? n_iter_head * params.group : n_iter_head;
    // the query head of step it, and its (batch, head) index (the workspace rows' and dq_acc's)
    auto head_at = [&](int it) { return kGroup ? blk.head * params.group + it / n_iter_head : blk.head; };
    auto bh_at = [&](int it) { return kGroup ? blk.batch * params.heads + head_at(it) : blk.bh; };
    // kOrdered: this CTA's order of dQ's reductions (sm90/det_order.cuh): 0 the staircase, else
    // rotated with this stride (its sequence's query and key blocks decide, varlen included)
    const int det_r = kOrdered ? det_stride<BR, BC, V::kLocal>(params, m_blocks, seqlen_k) : 0;
    // the query block of step it: the range's (or list's) order; kOrdered, from its end (the turn
    // staircase), or rotated (det_r, never V::kLocal): under a right-bounded mask up from the key
    // block's first query block, else from query block det_r n (the range is every query block of
    // the sequence, n_iter >= det_r x its key blocks > det_r n: one wrap). (params read again
    // where used: the producer has 24 registers.)
    auto block_at = [&](int it) {
        if (kGroup) return blocks.at(it % n_iter_head);
        if (!kOrdered || (!V::kLocal && det_r && params.window_right < kUnbounded)) return blocks.at(it);
        if (V::kLocal || !det_r) return blocks.at(n_iter - 1 - it);
        const int i = it + det_r * blk.block;
        return blocks.at(i >= n_iter ? i - n_iter : i);
    };

    const int tid = threadIdx.x;
    if (tid == 0) {
        mbar_init(bar_kv, 1);
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bar_full(s), 1);
            // every consumer thread, after its own reads; Tr::kDqInStage: the store warp, once its
            // reductions have read the dQ blocks staged over the stage's images
            mbar_init(bar_free(s), Tr::kDqInStage ? 1 : 128 * CONSUMERS);
            if constexpr (Tr::kDqInStage) {
#pragma unroll
                for (int c = 0; c < CONSUMERS; ++c) mbar_init(bar_dq_staged(s, c), 128);
            }
        }
        fence_barrier_init();
    }
    __syncthreads();  // the last CTA-wide barrier: after the role split warps leave at different times

    if (tid / 128 == 0) {
        // ---------------- producer ----------------
        setmaxnreg_dec<Tr::kProducerRegs>();
        if (tid == 0 && n_iter > 0) {
            mbar_arrive_expect_tx(bar_kv, 2 * Tr::kKVBytes);
            // GQA/MQA: k/v head h / group (MHA: group 1); dK/dV are written per query head into the
            // expanded buffers that bwd_dkdv_reduce sums over the group
            // (kGroup: the CTA's head is the K/V head, its steps the group's query heads)
            const int h_kv = kGroup ? blk.head : blk.head / params.group;
            tma_load_5d(sK, tk, bar_kv, 0, span.k_start + n0, 0, h_kv, tb);
            tma_load_5d(sV, tv, bar_kv, 0, span.k_start + n0, 0, h_kv, tb);
            const long long ws0 = kGroup ? 0 : span.template ws_row0<V>(blk.batch, blk.head, blk.bh, params.seqlen_q_pad);
            for (int it = 0; it < n_iter; ++it) {
                const int s = it % STAGES;
                const int m0 = block_at(it) * BR;
                const int hq = head_at(it);
                mbar_wait(bar_free(s), ((it / STAGES) & 1) ^ 1);  // a fresh barrier counts as released
                mbar_arrive_expect_tx(bar_full(s), 2 * Tr::kQBytes + 2 * Tr::kStatBytes);
                tma_load_5d(sQ + s * Tr::kQBytes, tq, bar_full(s), 0, span.q_start + m0, 0, hq, tb);
                tma_load_5d(sdO + s * Tr::kQBytes, tdo, bar_full(s), 0, span.q_start + m0, 0, hq, tb);
                // lse2 / delta have seqlen_q_pad rows per (batch, head), a multiple of 128 (varlen:
                // each sequence's rows padded to 128 in its head's, SeqSpan::ws_row0): in bounds
                const long long row = (kGroup ? span.template ws_row0<V>(blk.batch, hq, bh_at(it), params.seqlen_q_pad) : ws0) + m0;
                bulk_load_1d(sLse + s * Tr::kStatBytes, lse2 + row, Tr::kStatBytes, bar_full(s));
                bulk_load_1d(sDelta + s * Tr::kStatBytes, delta + row, Tr::kStatBytes, bar_full(s));
            }
        }
        if constexpr (kOrdered) {
            // the deterministic mode's dQ store warps (Sm90BwdTraits::kDqStoreWarps): warp 1 + w
            // takes staging set w / kDqWarpgroups (the query blocks it = set, set + kDqSets, ...) and
            // of each the block of dQ consumer w % kDqWarpgroups. Per block: at this key block's
            // turn (its rank among the key blocks that reach the query block, sm90/det_order.cuh),
            // one bulk reduction; the staging freed once it is read; the turn passed on once the
            // reduction is done in global memory. A warp passes a block's turn before it waits for
            // its next one, and waits only for its own CTA's consumers in between, so the turns
            // chain as with one store warp. Here, not in the consumers: the turn's wait and the
            // round trip stalled a consumer warpgroup every block (0.65-0.7x the atomic mode on the
            // H200 when the consumers did it)
            const int w = tid / 32 - 1;
            if (w >= 0 && w < Tr::kDqStoreWarps && n_iter > 0) {
                const int set = w / Tr::kDqWarpgroups, c = w % Tr::kDqWarpgroups;
                const int lane = tid % 32;
                const long long pad = params.seqlen_q_pad;
                const u32 stage = sDQ + set * Tr::kDqSetBytes + c * Tr::kDqFragBytes;
                if (set < n_iter) named_bar_arrive(Tr::bar_dq_empty(set, c), Tr::kDqBarThreads);
                for (int it = set; it < n_iter; it += Tr::kDqSets) {
                    const int m = block_at(it);
                    const int rank = det_rank<BR, BC, V::kLocal>(geo, params, det_r, blk.block, m);
                    // the block's turn counter (varlen: each sequence's rows start at a multiple of
                    // 128, so no two sequences share one)
                    const long long row0 = span.template ws_row0<V>(blk.batch, blk.head, blk.bh, pad) + m * 64;
                    int* sem = dq_sem + row0 / 64 * Tr::kDqWarpgroups + c;
                    named_bar_sync(Tr::bar_dq_full(set, c), Tr::kDqBarThreads);
                    if (lane == 0) {
                        while (ld_acquire_gpu(sem) != rank) __nanosleep(32);
                        fence_proxy_async_global();  // the reduction below after what the acquire saw
                        bulk_reduce_add_f32(dq_frag_block(row0, c), stage, Tr::kDqFragBytes);
                        bulk_commit();
                        bulk_wait_read0();
                    }
                    __syncwarp();
                    // the consumer's last block of this set has no next staging to wait for
                    if (it + Tr::kDqSets < n_iter) named_bar_arrive(Tr::bar_dq_empty(set, c), Tr::kDqBarThreads);
                    if (lane == 0) {
                        bulk_wait0();                // the reduction is done in global memory, not only read
                        fence_proxy_async_global();  // ... and ordered before the release
                        red_release_gpu_add(sem, 1);
                    }
                }
            }
        } else if constexpr (Tr::kDqInStage) {
            if (tid / 32 == 1 && n_iter > 0) {
                // the split tile's dQ store warp: per query block, each consumer's two blocks, staged
                // over its column half of the block's Q and dO images (Sm90BwdTraits::kDqInStage), go
                // to dq_acc by one bulk reduction each; once they are read, the stage is free. The
                // per-stage mbarriers keep this provable: consumer c arrives for block it + STAGES
                // only after the stage is loaded again, which waits for this warp's free of block it
                const int lane = tid % 32;
                const long long pad = params.seqlen_q_pad;
                for (int it = 0; it < n_iter; ++it) {
                    const int s = it % STAGES;
                    const long long row0 = span.template ws_row0<V>(blk.batch, head_at(it), bh_at(it), pad) + block_at(it) * 64;
#pragma unroll
                    for (int c = 0; c < CONSUMERS; ++c) {
                        mbar_wait(bar_dq_staged(s, c), (it / STAGES) & 1);
                        if (lane == 0) {
                            bulk_reduce_add_f32(dq_frag_block(row0, 2 * c), sQ + s * Tr::kQBytes + c * Tr::kDqFragBytes,
                                                Tr::kDqFragBytes);
                            bulk_reduce_add_f32(dq_frag_block(row0, 2 * c + 1), sdO + s * Tr::kQBytes + c * Tr::kDqFragBytes,
                                                Tr::kDqFragBytes);
                            bulk_commit();
                        }
                    }
                    if (lane == 0) {
                        bulk_wait_read0();
                        mbar_arrive(bar_free(s));
                    }
                    __syncwarp();
                }
            }
        } else if constexpr (kDqMode == 1 || kFragWarp) {
            if (tid / 32 == 1 && n_iter > 0) {
                // the dQ store warp: per query block, each dQ consumer's staged block goes to
                // dq_acc by bulk reductions, and its staging is freed once they have read it.
                // DQ_BULK 1: one 256-byte reduction per row (two rows per lane). Fragment order
                // (4): one reduction per block
                const int lane = tid % 32;
                const long long pad = params.seqlen_q_pad;
#pragma unroll
                for (int c = 0; c < Tr::kDqWarpgroups; ++c) named_bar_arrive(Tr::kBarDqEmpty + c, Tr::kDqBarThreads);
                for (int it = 0; it < n_iter; ++it) {
                    if constexpr (kFragWarp) {
                        const int m = block_at(it);
                        // the block's first workspace row
                        const long long row0 = span.template ws_row0<V>(blk.batch, head_at(it), bh_at(it), pad) + m * 64;
#pragma unroll
                        for (int c = 0; c < Tr::kDqWarpgroups; ++c) {
                            named_bar_sync(Tr::kBarDqFull + c, Tr::kDqBarThreads);
                            if (lane == 0) {
                                bulk_reduce_add_f32(dq_frag_block(row0, c), sDQ + c * Tr::kDqFragBytes, Tr::kDqFragBytes);
                                bulk_commit();
                            }
                        }
                        if (lane == 0) bulk_wait_read0();
                        __syncwarp();
                        // the consumers' last block has no next staging to wait for
                        if (it + 1 < n_iter) {
#pragma unroll
                            for (int c = 0; c < Tr::kDqWarpgroups; ++c) named_bar_arrive(Tr::kBarDqEmpty + c, Tr::kDqBarThreads);
                        }
                    } else {
                        const int m0 = block_at(it) * BR;
#pragma unroll
                        for (int c = 0; c < Tr::kDqWarpgroups; ++c) {
                            named_bar_sync(Tr::kBarDqFull + c, Tr::kDqBarThreads);
                            float* rows = dq_acc + (span.template ws_row0<V>(blk.batch, head_at(it), bh_at(it), pad) + m0) * D + 64 * c;
                            const u32 stage = sDQ + c * 64 * Tr::kDqRowBytes;
#pragma unroll
                            for (int r = lane; r < 64; r += 32)
                                bulk_reduce_add_f32(rows + (long long)r * D, stage + r * Tr::kDqRowBytes, 64 * 4);
                            bulk_commit();
                            bulk_wait_read0();
                            __syncwarp();
                            // the consumer's last block has no next staging to wait for
                            if (it + 1 < n_iter) named_bar_arrive(Tr::kBarDqEmpty + c, Tr::kDqBarThreads);
                        }
                    }
                }
            }
        }
    } else {
        // ---------------- consumers ----------------
        // (the two roles are the two branches of one if/else: ptxas applies setmaxnreg per branch)
        setmaxnreg_inc<Tr::kConsumerRegs>();
        const int cw = tid / 128 - 1, ctid = tid % 128, warp = ctid / 32, lane = tid % 32;
        const int g = lane / 4, t = lane % 4;
        const int key_w = n0 + (Tr::kSplitD ? 0 : 64 * cw) + 16 * warp;  // this warp's first key (kSplitD: both consumers' rows)
        const float scale_log2 = params.scale_log2;
        const Mask<V::kLocal> mask{geo};
        const ScoreMod<V> score_mod = ScoreMod<V>::of(params);
        // ALiBi in exp2 units: P^T = exp2(t c + bias c - lse2) (attn/score_mod.cuh; nothing without it)
        const AlibiBias<V> alibi = AlibiBias<V>::of(params, alibi_slopes, blk.batch, blk.head, geo.offset, scale_log2);
        const UserMod<V> user_mod = UserMod<V>::of(params, mod_aux, blk.batch, blk.head, geo.seqlen_q, geo.seqlen_k);
        // a score modifier whose derivative dS needs: softcap's (from t), a user score snippet's (from S)
        constexpr bool kGrad = V::kSoftcap || UserMod<V>::kScore;
        const Dropout drop{params.drop_seed, params.drop_threshold, blk.bh};
        const long long pad = params.seqlen_q_pad;
        // step it's (batch, query head)'s first workspace row (lse2, delta, dq_acc), recomputed where
        // used (V::kVarlen: from a reloaded offset, so that no register holds it through the loop)
        auto ws_row0 = [&](int it) -> long long {
            if constexpr (V::kVarlen)
                return SeqSpan::varlen_ws_row0(SeqSpan::reload<V>(cu_seqlens_q, blk.batch), blk.batch, head_at(it), (int)pad);
            else
                return (long long)bh_at(it) * pad;
        };

        // Descriptors. K-major (contraction over D): this consumer's 64 K / V rows (A of S^T, dP^T),
        // Q / dO of slot 0 (B of S^T, dP^T). MN-major (contraction over rows): Q / dO of slot 0 (B of
        // dK, dV), the dS^T image (A of dQ), K's column chunk of this consumer (B of dQ).
        // Every operand sits at a compile-time offset from sK (plus this consumer's rows), so each
        // descriptor is one runtime value, sK >> 4, plus constants, formed at its wgmma.
        const u64 base0 = (u64)((sK & 0x3FFFF) >> 4);
        auto desc = [&](u32 offset, u64 fields) { return base0 + (u64)(offset >> 4) + fields; };
        const u32 oV = Tr::kKVBytes, oQ = 2 * Tr::kKVBytes, odO = oQ + STAGES * Tr::kQBytes, oDS = odO + STAGES * Tr::kQBytes;
        auto dk_a = [&]() { return desc(cw * 64 * 128, kDescKMajorSw128); };           // K rows of this consumer
        auto dv_a = [&]() { return desc(oV + cw * 64 * 128, kDescKMajorSw128); };      // V rows of this consumer
        auto dq_b = [&]() { return desc(oQ, kDescKMajorSw128); };                      // Q, slot 0
        auto ddo_b = [&]() { return desc(odO, kDescKMajorSw128); };                    // dO, slot 0
        auto dq_mn = [&]() { return desc(oQ, desc_mn_major_sw128(BR)); };
        auto ddo_mn = [&]() { return desc(odO, desc_mn_major_sw128(BR)); };
        auto dds_mn = [&]() { return desc(oDS, desc_mn_major_sw128(BC)); };            // dS^T image as A of dQ
        auto dds_k = [&]() { return desc(oDS + cw * 64 * 128, kDescKMajorSw128); };    // its rows of this consumer, A of dK
        auto dkt_mn = [&]() { return desc(cw * Tr::kKVChunkBytes, desc_mn_major_sw128(BC)); };  // K's D-chunk cw, B of dQ
        auto kmajor_step = [](int kk, int chunk_bytes) { return (u64)(((kk / 4) * chunk_bytes + (kk % 4) * 32) >> 4); };
        auto slot_off = [](int slot) { return (u64)((slot * Tr::kQBytes) >> 4); };
        constexpr u64 kRowStep = 2048 >> 4;  // 16 rows of a 128-byte-row image

        // The dS^T image slot of this thread's n8 tile nt at image rows `rows` (128-byte rows, row %
        // 8 = g): 16-byte chunk nt, or kSplitD this consumer's 4 cw + nt, swizzled by the row
        constexpr int NT = Tr::kQN / 8;  // n8 tiles of queries in a consumer's S^T
        auto slot_at = [&](u32 rows, int nt) {
            return rows + ((((Tr::kSplitD ? NT * cw : 0) + nt) ^ g) << 4) + 4 * t;
        };
        // lse2 / delta of a block: read where used, or ahead of their wgmma waits (kBwdRowStatsAhead)
        // (not with dropout: its keep bits leave no room, 4-12 B of spills at d128 under NVRTC 13.5;
        // nor with a score modifier's gradient, kGrad: ALiBi + window + softcap spilled 4 B at d128
        // under 13.5; nor in the split tile, whose loop reads them where used)
        using RowStats = typename RowStatsOf<kBwdRowStatsAhead && !V::kDropout && !kGrad && !Tr::kSplitD, NT>::type;
        // P^T = exp2(S^T c + bias - lse2) in place over this thread's n8 tiles of queries from qb
        // (element e: query qb + 8 nt + 2 t + e % 2, key key_w + g + 8 (e / 2); lse: their lse2,
        // padded rows +inf so that P = 0 there). kGrad: P o grad parked at the dS^T slot of
        // image rows park_rows (+8 rows for e / 2), where this thread's dS^T goes (both tiles' loops)
        auto exp_scores = [&](float (&acc)[NT][4], int qb, const RowStats& lse, u32 park_rows) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const float2 L = lse.at(nt);
                if constexpr (kGrad) {
#pragma unroll
                    for (int e = 0; e < 4; e += 2) {
                        const int qc = qb + 8 * nt + 2 * t, kr = key_w + g + 8 * (e / 2);  // (query, key) of e
                        float g0, g1;
                        if constexpr (UserMod<V>::kScore) {
                            acc[nt][e] = user_mod.value_grad(acc[nt][e], qc, kr, g0);
                            acc[nt][e + 1] = user_mod.value_grad(acc[nt][e + 1], qc + 1, kr, g1);
                        } else {
                            g0 = ScoreMod<V>::grad(acc[nt][e]), g1 = ScoreMod<V>::grad(acc[nt][e + 1]);
                        }
                        acc[nt][e] = fast_exp2(fmaf(acc[nt][e], scale_log2, alibi.shift(-L.x, qc, kr)));
                        acc[nt][e + 1] = fast_exp2(fmaf(acc[nt][e + 1], scale_log2, alibi.shift(-L.y, qc + 1, kr)));
                        st_shared_u32(slot_at(park_rows, nt) + 8 * (e / 2) * 128,
                                      pack2<BF16>(acc[nt][e] * g0, acc[nt][e + 1] * g1));
                    }
                } else {
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        acc[nt][e] = fast_exp2(fmaf(acc[nt][e], scale_log2,
                                                    alibi.shift(-((e & 1) ? L.y : L.x), qb + 8 * nt + 2 * t + (e & 1),
                                                                key_w + g + 8 * (e >> 1))));
                }
            }
        };
        // dS^T = P^T o (dP^T - delta) into the image rows `rows` (+8 for half), P^T from its
        // undropped 16-bit copy p_frag (the rounding dV used), or kGrad from the P o grad parked
        // there; dropout: dP^T o Z / (1 - p), Z the keep bit (bit 4 nt + 2 half + e; dropped: 0);
        // delta_rows: the queries' delta (both tiles' loops)
        auto store_ds = [&](const float (&acc_dp)[NT][4], const u32 (&p_frag)[NT / 2][4], u32 keep, const RowStats& delta_rows, u32 rows) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const float2 Dl = delta_rows.at(nt);
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    float dp0 = acc_dp[nt][2 * half], dp1 = acc_dp[nt][2 * half + 1];
                    if constexpr (V::kDropout) {
                        dp0 = (keep >> (4 * nt + 2 * half)) & 1u ? dp0 * params.drop_scale : 0.f;
                        dp1 = (keep >> (4 * nt + 2 * half + 1)) & 1u ? dp1 * params.drop_scale : 0.f;
                    }
                    const u32 at = slot_at(rows, nt) + 8 * half * 128;
                    if constexpr (kGrad) {
                        u32 pw;
                        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(pw) : "r"(at) : "memory");
                        float p0, p1;
                        unpack2<BF16>(pw, p0, p1);
                        st_shared_u32(at, pack2<BF16>(p0 * (dp0 - Dl.x), p1 * (dp1 - Dl.y)));
                    } else {
                        const float d0 = a_frag_elem<BF16, NT / 2>(p_frag, nt, 2 * half) * (dp0 - Dl.x);
                        const float d1 = a_frag_elem<BF16, NT / 2>(p_frag, nt, 2 * half + 1) * (dp1 - Dl.y);
                        st_shared_u32(at, pack2<BF16>(d0, d1));
                    }
                }
            }
        };

        // A 64 x 64 dQ block of this thread's fragments (rows 16 warp + g (+8), columns 8 nt + 2 t (+1))
        // to shared memory in fragment order (float4 nt of thread ctid at (nt 128 + ctid) 16 from
        // `stage`: conflict-free, the layout dq_acc keeps for the bulk reductions), or added to dq_acc
        // at the block's first row m0 and column col0 by per-element atomics (dq_acc has seqlen_q_pad
        // rows per (batch, head), so the block's rows need no guard); both tiles' loops
        auto stage_dq_frag = [&](const float (&acc_dq)[8][4], u32 stage) {
            const u32 sthr = opaque(stage) + 16 * ctid;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
                asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" :: "r"(sthr + nt * 128 * 16),
                             "f"(acc_dq[nt][0]), "f"(acc_dq[nt][1]), "f"(acc_dq[nt][2]), "f"(acc_dq[nt][3]) : "memory");
        };
        auto add_dq_atomic = [&](const float (&acc_dq)[8][4], int it, int m0, int col0) {
            float* dq_rows = reinterpret_cast<float*>(
                opaque((u64)(dq_acc + (ws_row0(it) + m0 + 16 * warp + g) * D + col0 + 2 * t)));
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int half = 0; half < 2; ++half)
                    red_add2(dq_rows + 8 * half * D + 8 * nt, acc_dq[nt][2 * half], acc_dq[nt][2 * half + 1]);
        };

        // the store-warp modes' dQ hand-off: block `it`'s staging (in generic-proxy stores) to the
        // store warp's bulk reduction (async proxy); kLateHandoff: one block later, under its GEMMs
        // (not with dropout: 8-44 B of spills at d128, its keep bits live across the hand-off)
        constexpr bool kLateHandoff = kBwdDqHandoffLate && kFragWarp && !V::kDropout;
        const bool dq_consumer = Tr::kDqWarpgroups >= CONSUMERS || cw < Tr::kDqWarpgroups;
        auto hand_off_dq = [&](int it) {
            fence_proxy_async();
            named_bar_arrive(Tr::bar_dq_full(kOrdered ? it % Tr::kDqSets : 0, cw), Tr::kDqBarThreads);
        };

        float acc_dk[Tr::kColsWg / 8][4], acc_dv[Tr::kColsWg / 8][4];
        if (n_iter > 0) mbar_wait(bar_kv, 0);
        if constexpr (Tr::kSplitD) {
            // ---- the split-head-dim tile (D > 128, Sm90BwdTraits::kSplitD). Both consumers take all
            // BC = 64 keys as their wgmma rows; consumer cw computes S^T and dP^T for the block's
            // queries QN cw .. QN cw + QN - 1 (N = QN = 32), and dK, dV for head-dim columns
            // cw D/2 .. (cw + 1) D/2 - 1 over all 64 queries, from the P^T and dS^T images both
            // consumers fill (one 256-thread barrier), and dQ's 64-column chunks 2 cw, 2 cw + 1 of
            // its half (per-element atomics, DQ_BULK 0; or DQ_BULK 4, staged over its column half of
            // the block's Q and dO images for the store warp, Sm90BwdTraits::kDqInStage). Per block: S^T, dP^T issued together;
            // P^T (16-bit, o the keep bits with dropout) to its image once both consumers' dV of the
            // last block is done (kBarPFree: the image is single-buffered); dS^T to its image
            // (double-buffered as in the other tile); the barrier; dV, dK, dQ chunk 0; dQ chunk 1.
            constexpr int QN = Tr::kQN;
            constexpr int kQSteps = QN / 16;  // k16 steps of a consumer's queries (its p_frag)
            const u32 oP = oDS + Tr::kDSBuffers * Tr::kDSBytes;
            // this consumer's column half of the Q / dO images (B of dK, dV), in 16-byte units
            const u64 colh = (u64)((cw * (Tr::kColsWg / 64) * Tr::kQChunkBytes) >> 4);
            for (int it = 0; it < n_iter; ++it) {
                const int s = it % STAGES, m = block_at(it), m0 = m * BR, q0 = m0 + QN * cw;
                const int db = it & 1;  // this block's dS^T buffer
                const u64 ds_off = (u64)((db * Tr::kDSBytes) >> 4);
                mbar_wait(bar_full(s), (it / STAGES) & 1);

                float acc_s[QN / 8][4], acc_dp[QN / 8][4];
                u32 p_frag[kQSteps][4];
                u32 keep = 0;  // V::kDropout: this thread's keep bits of its queries, bit 4 nt + 2 half + e
                fence_regs(acc_s);
                fence_regs(acc_dp);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < Tr::kHeadSteps; ++kk)
                    WgmmaMN<QN, BF16>::ss(acc_s, desc(0, kDescKMajorSw128) + kmajor_step(kk, Tr::kKVChunkBytes),
                                          desc(oQ + cw * QN * 128, kDescKMajorSw128) + slot_off(s)
                                              + kmajor_step(kk, Tr::kQChunkBytes), kk > 0);
                wgmma_commit();
#pragma unroll
                for (int kk = 0; kk < Tr::kHeadSteps; ++kk)
                    WgmmaMN<QN, BF16>::ss(acc_dp, desc(oV, kDescKMajorSw128) + kmajor_step(kk, Tr::kKVChunkBytes),
                                          desc(odO + cw * QN * 128, kDescKMajorSw128) + slot_off(s)
                                              + kmajor_step(kk, Tr::kQChunkBytes), kk > 0);
                wgmma_commit();
                if constexpr (V::kDropout) {
#pragma unroll
                    for (int kb = 0; kb < QN / 16; ++kb)
                        keep |= drop.bits8_transposed(q0 / 16 + kb, key_w / 16, g, t) << (8 * kb);
                }
                wgmma_wait<1>();  // S^T
                fence_regs(acc_s);
                score_mod.apply_tile(acc_s);
                if constexpr (!UserMod<V>::kScore) user_mod.apply_transposed(acc_s, q0, key_w, lane);
                if constexpr (kGrad) {
                    if (range.masked_head(m) || (V::kLocal && range.masked_tail(m)))
                        mask.template apply_transposed<true, true>(acc_s, q0, key_w, lane, neg_inf());
                }
                // rows of both images: key 16 warp + g (+8); this consumer's 16-byte chunks 4 cw + nt
                // of the 128-byte rows (its QN queries), swizzled by the row (row % 8 = g)
                const u32 lrow = opaque(sLse + s * Tr::kStatBytes) + 4 * QN * cw + 8 * t;
                const u32 ds_rows = opaque(sDS + db * Tr::kDSBytes) + (16 * warp + g) * 128;
                exp_scores(acc_s, q0, RowStats(lrow), ds_rows);
                if (!kGrad && (range.masked_head(m) || (V::kLocal && range.masked_tail(m))))
                    mask.template apply_transposed<true, true>(acc_s, q0, key_w, lane, 0.f);
                c_to_a_frags<BF16, kQSteps>(p_frag, acc_s);

                // P^T (o Z with dropout: what dV reads) into the image, once both consumers' dV of
                // the last block, its last reader, is done (each waited for its own before this)
                if (it > 0) named_bar_sync(Tr::kBarPFree, 128 * CONSUMERS);
                {
                    const u32 p_rows = opaque(sP) + (16 * warp + g) * 128;
#pragma unroll
                    for (int kk = 0; kk < kQSteps; ++kk)
#pragma unroll
                        for (int r = 0; r < 4; ++r) {
                            // register r of k16 step kk: half r % 2 of n8 tile 2 kk + r / 2
                            u32 pw = p_frag[kk][r];
                            if constexpr (V::kDropout) {
                                const u32 b = keep >> (8 * kk + 2 * r);
                                pw &= ((b & 1u) ? 0x0000ffffu : 0u) | ((b & 2u) ? 0xffff0000u : 0u);
                            }
                            st_shared_u32(slot_at(p_rows, 2 * kk + r / 2) + 8 * (r % 2) * 128, pw);
                        }
                }

                wgmma_wait<0>();  // dP^T
                fence_regs(acc_dp);
                // ---- dS^T = P^T o (dP^T - delta) into this block's image (rows 16 warp + g (+8),
                // this consumer's query chunks), from the undropped 16-bit P^T ----
                store_ds(acc_dp, p_frag, keep, RowStats(opaque(sDelta + s * Tr::kStatBytes) + 4 * QN * cw + 8 * t), ds_rows);
                fence_proxy_async();  // generic-proxy stores, read next by wgmma (async proxy)
                named_bar_sync(Tr::kBarDsFull, 128 * CONSUMERS);  // both consumers' P^T and dS^T are in

                // ---- dV += P^T dO[:, half], dK += dS^T Q[:, half] (A: the images, all 64 keys,
                // K-major over the 64 queries; B: the column half, MN-major), dQ chunk 2 cw ----
                fence_regs(acc_dv);
                fence_regs(acc_dk);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < Tr::kQuerySteps; ++kk)
                    WgmmaMN<Tr::kColsWg, BF16>::ss_bmn(acc_dv, desc(oP, kDescKMajorSw128) + kmajor_step(kk, Tr::kDSBytes),
                                                     ddo_mn() + slot_off(s) + colh + kRowStep * kk, it > 0 || kk > 0);
                wgmma_commit();
#pragma unroll
                for (int kk = 0; kk < Tr::kQuerySteps; ++kk)
                    WgmmaMN<Tr::kColsWg, BF16>::ss_bmn(acc_dk, desc(oDS, kDescKMajorSw128) + ds_off + kmajor_step(kk, Tr::kDSBytes),
                                                     dq_mn() + slot_off(s) + colh + kRowStep * kk, it > 0 || kk > 0);
                wgmma_commit();
#pragma unroll 1
                for (int jj = 0; jj < Tr::kColsWg / 64; ++jj) {
                    const int j = (Tr::kColsWg / 64) * cw + jj;  // dQ's 64-column chunk
                    float acc_dq[8][4];
                    fence_regs(acc_dq);
                    wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < Tr::kKeySteps; ++kk)
                        WgmmaMN<64, BF16>::ss_mn(acc_dq, dds_mn() + ds_off + kRowStep * kk,
                                                 desc(j * Tr::kKVChunkBytes, desc_mn_major_sw128(BC)) + kRowStep * kk, kk > 0);
                    wgmma_commit();
                    wgmma_wait<0>();
                    fence_regs(acc_dq);
                    if (jj == 0) {
                        fence_regs(acc_dv);
                        fence_regs(acc_dk);
                        // Q_i, dO_i, lse2 and delta are read (this thread's part); kDqInStage: the
                        // store warp frees the stage once the dQ blocks staged over it are read
                        if constexpr (!Tr::kDqInStage) mbar_arrive(bar_free(s));
                    }
                    if constexpr (Tr::kDqInStage) {
                        // chunk jj over this consumer's column half of the block's Q (jj 0) or dO (1)
                        // image, which its dK / dV, their last readers, have finished with (the wait above)
                        stage_dq_frag(acc_dq, (jj == 0 ? sQ : sdO) + s * Tr::kQBytes + cw * Tr::kDqFragBytes);
                        if (jj == Tr::kColsWg / 64 - 1) {
                            fence_proxy_async();  // generic-proxy stores, read next by the bulk reductions
                            mbar_arrive(bar_dq_staged(s, cw));
                        }
                    } else {
                        add_dq_atomic(acc_dq, it, m0, 64 * j);
                    }
                }
            }
        } else {
        for (int it = 0; it < n_iter; ++it) {
            const int s = it % STAGES, m = block_at(it), m0 = m * BR;
            const int db = it & 1;  // this block's dS^T buffer
            const u64 ds_off = (u64)((db * Tr::kDSBytes) >> 4);
            mbar_wait(bar_full(s), (it / STAGES) & 1);

            // ---- S^T = K_w Q_i^T; P^T = exp2(S^T c - lse2), 0 where masked; dV += P^T dO_i (RS);
            // dP^T = V_w dO_i^T (SS): issued with S^T where the registers allow (kSdpTogether),
            // else with dV, so that S^T and dP^T are never live together ----
            u32 p_frag[Tr::kQuerySteps][4];
            float acc_dp[BR / 8][4];
            u32 keep = 0;  // V::kDropout: this thread's keep bits of the block, bit 4 nt + 2 half + e
            auto issue_dp = [&]() {
#pragma unroll
                for (int kk = 0; kk < Tr::kHeadSteps; ++kk)
                    Wgmma<BR, BF16>::ss(acc_dp, dv_a() + kmajor_step(kk, Tr::kKVChunkBytes),
                                        ddo_b() + slot_off(s) + kmajor_step(kk, Tr::kQChunkBytes), kk > 0);
                wgmma_commit();
            };
            {
                float acc_s[BR / 8][4];
                fence_regs(acc_s);
                if constexpr (Tr::kSdpTogether) fence_regs(acc_dp);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < Tr::kHeadSteps; ++kk)
                    Wgmma<BR, BF16>::ss(acc_s, dk_a() + kmajor_step(kk, Tr::kKVChunkBytes),
                                        dq_b() + slot_off(s) + kmajor_step(kk, Tr::kQChunkBytes), kk > 0);
                wgmma_commit();
                if constexpr (Tr::kSdpTogether) issue_dp();
                if constexpr (V::kDropout) {
                    // this warp's 16 keys (one 16-key block) x the block's BR queries: byte kb is
                    // query block m0 / 16 + kb, bit 4 s + 2 h + e (Dropout::bits8_transposed) is
                    // element e of half h of n8 tile 2 kb + s, i.e. bit 4 nt + 2 h + e, computed
                    // while the tensor cores run S^T
#pragma unroll
                    for (int kb = 0; kb < BR / 16; ++kb)
                        keep |= drop.bits8_transposed(m0 / 16 + kb, key_w / 16, g, t) << (8 * kb);
                }
                // the last block's dQ to the store warp (kBwdDqHandoffLate), under this block's GEMMs
                if constexpr (kLateHandoff) {
                    if (dq_consumer && it > 0) hand_off_dq(it - 1);
                }
                // this thread's queries are columns 8 nt + 2 t (+1): their lse2 (padded rows have
                // +inf, so P = 0 there), read ahead of the wait (kBwdRowStatsAhead) or where used.
                // One opaque row pointer per block: its 8 nt offsets become immediates of the loads
                // (else the per-nt pointers, loop invariants, are hoisted: 16 registers each for
                // lse2 and delta)
                const u32 lrow = opaque(sLse + s * Tr::kStatBytes) + 8 * t;  // this block's lse2, in smem
                const RowStats lse(lrow);
                if constexpr (Tr::kSdpTogether) {
                    wgmma_wait<1>();
                } else {
                    wgmma_wait<0>();
                }
                fence_regs(acc_s);
                score_mod.apply_tile(acc_s);
                // a mask snippet (-inf where masked); a score snippet runs per element below, on the masked raw S
                if constexpr (!UserMod<V>::kScore) user_mod.apply_transposed(acc_s, m0, key_w, lane);
                // softcap: the mask goes on t (-inf) before the exp, so that P = 0 and grad = 0 there
                if constexpr (kGrad) {
                    if (range.masked_head(m) || (V::kLocal && range.masked_tail(m)))
                        mask.template apply_transposed<true, true>(acc_s, m0, key_w, lane, neg_inf());
                }
                // softcap: P o (1 - t^2), which is what dS^T needs of P, waits for dS^T (after dV) in
                // this block's dS^T image, in the very slots this thread writes dS^T to below: in
                // registers (16 more per thread) the d128 consumers spilled. The buffer is free here
                // (see the dS^T stores) and only this thread touches these slots until then.
                const u32 pg_rows = kGrad ? opaque(sDS + db * Tr::kDSBytes) + (64 * cw + 16 * warp + g) * 128 : 0u;
                exp_scores(acc_s, m0, lse, pg_rows);
                // in query order the masked head is the right edge + seqlen_k tail, the tail the
                // left edge (local instances only; the softcap ones masked t above)
                if (!kGrad && (range.masked_head(m) || (V::kLocal && range.masked_tail(m))))
                    mask.template apply_transposed<true, true>(acc_s, m0, key_w, lane, 0.f);
                c_to_a_frags<BF16, Tr::kQuerySteps>(p_frag, acc_s);
            }
            auto issue_dv = [&]() {
                fence_regs(acc_dv);
                fence_regs(p_frag);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < Tr::kQuerySteps; ++kk)
                    Wgmma<D, BF16>::rs(acc_dv, p_frag[kk], ddo_mn() + slot_off(s) + kRowStep * kk, it > 0 || kk > 0);
                wgmma_commit();
            };
            {
                if constexpr (!Tr::kSdpTogether) fence_regs(acc_dp);
                if constexpr (!kDvLate) issue_dv();
                if constexpr (!Tr::kSdpTogether) issue_dp();
                // this block's delta, in smem: read ahead of the wait (kBwdRowStatsAhead) or where used
                const RowStats delta_rows(opaque(sDelta + s * Tr::kStatBytes) + 8 * t);
                wgmma_wait<0>();  // dP^T and dV (p_frag, read below, is dV's A operand until then)
                if constexpr (!kDvLate) fence_regs(acc_dv);
                fence_regs(p_frag);
                fence_regs(acc_dp);
                // ---- dS^T = P^T o (dP^T - delta), P^T from its 16-bit copy (the rounding dV used),
                // straight into the smem image [BC key rows][64 queries] (128B swizzle) that both
                // the dK product (A, K-major) and the dQ product (A, MN-major) read ----
                // Block i writes buffer i % 2. Its last readers were block i-2's products, which every
                // consumer waited for before it arrived at block i-1's kBarDsFull, which this
                // consumer passed. (The image's base is made opaque per block: otherwise the 16
                // swizzled addresses, loop invariants, are hoisted and held in registers.)
                const u32 ds_rows = opaque(sDS + db * Tr::kDSBytes) + (64 * cw + 16 * warp + g) * 128;
                store_ds(acc_dp, p_frag, keep, delta_rows, ds_rows);
            }
            if constexpr (V::kDropout) {
                // P^T o Z for dV: register r of k16 step kk holds elements (lo, hi) = e 0, 1 of
                // half r % 2 of n8 tile 2 kk + r / 2, bits 8 kk + 2 r (+1) of keep
#pragma unroll
                for (int kk = 0; kk < Tr::kQuerySteps; ++kk)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const u32 b = keep >> (8 * kk + 2 * r);
                        p_frag[kk][r] &= ((b & 1u) ? 0x0000ffffu : 0u) | ((b & 2u) ? 0xffff0000u : 0u);
                    }
            }
            // kDvLate: dV runs under the dS^T barrier and the dK / dQ issue (p_frag stays its A
            // operand until the wait below)
            if constexpr (kDvLate) issue_dv();
            fence_proxy_async();  // generic-proxy stores, read next by wgmma (async proxy)
            named_bar_sync(Tr::kBarDsFull, 128 * CONSUMERS);  // both halves of dS^T are in

            // ---- dK += dS^T Q_i (A: this consumer's 64 key rows of the image, K-major) ----
            auto issue_dk = [&]() {
                fence_regs(acc_dk);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < Tr::kQuerySteps; ++kk)
                    WgmmaMN<D, BF16>::ss_bmn(acc_dk, dds_k() + ds_off + kmajor_step(kk, Tr::kDSBytes),
                                           dq_mn() + slot_off(s) + kRowStep * kk, it > 0 || kk > 0);
                wgmma_commit();
            };
            // ---- dQ_i[:, 64 cw ..] = dS K[:, 64 cw ..], added to dq_acc ----
            // (the dQ product's consumers; at D = 128 every consumer, as a constant: a condition
            // ptxas cannot prove the same at the product and at its store kept acc_dq live around
            // the whole loop, 32 registers, on the path where it is never written)
            const bool dq_wg = Tr::kDqWarpgroups >= CONSUMERS || cw < Tr::kDqWarpgroups;
            float acc_dq[8][4];
            auto issue_dq = [&]() {
                fence_regs(acc_dq);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < Tr::kKeySteps; ++kk)
                    WgmmaMN<64, BF16>::ss_mn(acc_dq, dds_mn() + ds_off + kRowStep * kk, dkt_mn() + kRowStep * kk, kk > 0);
                wgmma_commit();
            };
            if constexpr (Tr::kDqFirst) {
                // dQ first: its store below runs under the dK product
                if (dq_wg) issue_dq();
                issue_dk();
                wgmma_wait<1>();  // dV and dQ done (dK may run on)
            } else {
                issue_dk();
                if (dq_wg) issue_dq();
                wgmma_wait<0>();
                fence_regs(acc_dk);
                if constexpr (kDvLate) {
                    fence_regs(acc_dv);
                    fence_regs(p_frag);
                }
                mbar_arrive(bar_free(s));  // Q_i, dO_i, lse2 and delta are read (this thread's part)
            }
            if (dq_wg) {
                fence_regs(acc_dq);
                if constexpr (kDqMode >= 2) {
                    // the block in fragment order (Sm90BwdTraits::kDqStageBytes), then one bulk
                    // reduction of all of it into dq_acc's block (bh, m, cw), stored in that order
                    // (DQ_BULK 3: staging set it % kDqSets, with its own barrier pair and store warp)
                    const int set = kOrdered ? it % Tr::kDqSets : 0;
                    const u32 stage = sDQ + set * Tr::kDqSetBytes + cw * Tr::kDqFragBytes;
                    if constexpr (kOrdered) {
                        named_bar_sync(Tr::bar_dq_empty(set, cw), Tr::kDqBarThreads);  // its store warp has read the set's last block
                    } else if constexpr (kFragWarp) {
                        named_bar_sync(Tr::kBarDqEmpty + cw, Tr::kDqBarThreads);  // the store warp has read the last block
                    } else {
                        if (ctid == 0) bulk_wait_read0();  // the last block's reduction has read the staging
                        named_bar_sync(Tr::kBarDqFull + cw, 128);
                    }
                    stage_dq_frag(acc_dq, stage);
                    if constexpr (kFragWarp) {
                        // to the store warp, here or (kLateHandoff) under the next block's GEMMs
                        if constexpr (!kLateHandoff) hand_off_dq(it);
                    } else {
                        fence_proxy_async();  // generic-proxy stores, read next by the bulk reduction
                        named_bar_sync(Tr::kBarDqFull + cw, 128);
                        if (ctid == 0) {
                            bulk_reduce_add_f32(dq_frag_block(ws_row0(it) + m * 64, cw), stage, Tr::kDqFragBytes);
                            bulk_commit();
                        }
                    }
                } else if constexpr (kDqMode == 1) {
                    // stage the block (rows 16 warp + g (+8), columns 8 nt + 2 t) for the store warp
                    named_bar_sync(Tr::kBarDqEmpty + cw, Tr::kDqBarThreads);
                    const u32 srow = opaque(sDQ + cw * 64 * Tr::kDqRowBytes) + (16 * warp + g) * Tr::kDqRowBytes + 8 * t;
#pragma unroll
                    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                        for (int half = 0; half < 2; ++half)
                            asm volatile("st.shared.v2.f32 [%0], {%1, %2};" :: "r"(srow + 8 * half * Tr::kDqRowBytes + 32 * nt),
                                         "f"(acc_dq[nt][2 * half]), "f"(acc_dq[nt][2 * half + 1]) : "memory");
                    fence_proxy_async();  // generic-proxy stores, read next by the bulk reductions
                    named_bar_arrive(Tr::kBarDqFull + cw, Tr::kDqBarThreads);
                } else {
                    add_dq_atomic(acc_dq, it, m0, 64 * cw);  // columns: D columns 64 cw ..
                }
            }
            if constexpr (Tr::kDqFirst) {
                wgmma_wait<0>();  // dK
                fence_regs(acc_dk);
                fence_regs(acc_dv);
                fence_regs(p_frag);
                mbar_arrive(bar_free(s));  // Q_i, dO_i, lse2 and delta are read (this thread's part)
            }
        }
        // the last block's dQ, which no next block hands off
        if constexpr (kLateHandoff) {
            if (dq_consumer && n_iter > 0) hand_off_dq(n_iter - 1);
        }
        }  // !kSplitD

        // DQ_BULK 2: the last reduction's source is this CTA's shared memory (3, 4: the store warp's)
        if constexpr (kDqMode == 2) {
            if (ctid == 0) bulk_wait_read0();
        }

        // ---------------- epilogue: dK = scale dK~, dV (x 1 / (1 - p) with dropout) ----------------
        // Staged through shared memory, then copied out in whole rows: the fragment layout's direct
        // stores (4 bytes a thread, a warp's store touching 8 rows) took ~5 us a CTA at d128 on the
        // H200, two iterations' time (scripts/trace_bwd_tiles.py). The staging rows (D 16-bit values
        // at a pitch of D * 2 + 16 bytes: the fragment stores hit 32 distinct banks) lie over the K,
        // V, Q, dO and dS^T images, free once both consumers' last GEMMs are done (each waited for
        // its own; the barrier below for the other's) and the producer has loaded its last block
        // (every block it loads, the consumers waited for). Each consumer copies its own 64 rows.
        constexpr int kPitch = D * 2 + 16;
        static_assert(2 * Tr::kBlockK * kPitch <= 2 * Tr::kKVBytes + 2 * STAGES * Tr::kQBytes + Tr::kDSBuffers * Tr::kDSBytes,
                      "the dK, dV staging fits over the K, V, Q, dO and dS^T images");
        if constexpr (Tr::kDqInStage) {
            // the staging below reaches into stage 0's Q image, where dQ blocks may still wait for the
            // store warp's reductions: until it has freed the last blocks' stages
            for (int j = n_iter > STAGES ? n_iter - STAGES : 0; j < n_iter; ++j)
                mbar_wait(bar_free(j % STAGES), (j / STAGES) & 1);
        }
        named_bar_sync(Tr::kBarEpilogue, 128 * CONSUMERS);
        const float scale = params.scale;
        const float dv_scale = V::kDropout ? params.drop_scale : 1.f;
        const bool live = n_iter > 0;  // a key block no query sees: dK = dV = 0
        const u32 stage_k = sK, stage_v = sK + Tr::kBlockK * kPitch;
        {
            // kSplitD: every consumer's rows are all BC keys, its columns its head-dim half
            const u32 srow = opaque(stage_k) + (Tr::kSplitD ? (16 * warp + g) * kPitch + cw * Tr::kColsWg * 2
                                                            : (64 * cw + 16 * warp + g) * kPitch) + 4 * t;
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int nt = 0; nt < Tr::kColsWg / 8; ++nt) {
                    const u32 off = 8 * half * kPitch + 16 * nt;
                    st_shared_u32(srow + off, pack2<BF16>(live ? acc_dk[nt][2 * half] * scale : 0.f,
                                                          live ? acc_dk[nt][2 * half + 1] * scale : 0.f));
                    st_shared_u32(srow + (stage_v - stage_k) + off,
                                  pack2<BF16>(live ? acc_dv[nt][2 * half] * dv_scale : 0.f,
                                              live ? acc_dv[nt][2 * half + 1] * dv_scale : 0.f));
                }
        }
        if constexpr (Tr::kSplitD) {
            named_bar_sync(Tr::kBarEpilogue, 128 * CONSUMERS);  // both column halves of every row are staged
        } else {
            named_bar_sync(Tr::kBarEpilogue + 1 + cw, 128);  // this consumer's rows are staged
        }
        // 16 bytes a thread: CH chunks a row, 128 / CH rows a pass, kRowsPerWg rows a consumer
        // (its own 64, or kSplitD half of the 64 shared ones)
        constexpr int CH = D / 8, kRowsPerPass = 128 / CH, kRowsPerWg = Tr::kSplitD ? Tr::kBlockK / 2 : 64;
        const int chunk = ctid % CH;
        elem_t* dkg = dk + (long long)blk.batch * params.dk_sb + (long long)span.k_start * params.dk_sn
                      + (long long)blk.head * params.dk_sh + 8 * chunk;
        elem_t* dvg = dv + (long long)blk.batch * params.dv_sb + (long long)span.k_start * params.dv_sn
                      + (long long)blk.head * params.dv_sh + 8 * chunk;
        // the call's head dims (V::kPartialD: less than D; dv's may differ from dk's)
        const bool k_col = 8 * chunk < params.head_dim, v_col = 8 * chunk < params.head_dim_v;
#pragma unroll
        for (int pass = 0; pass < kRowsPerWg / kRowsPerPass; ++pass) {
            const int r = kRowsPerWg * cw + pass * kRowsPerPass + ctid / CH;  // row of the key block
            const int row = n0 + r;
            const u32 src = stage_k + r * kPitch + 16 * chunk;
            uint4 a, b;
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(a.x), "=r"(a.y), "=r"(a.z), "=r"(a.w) : "r"(src));
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(b.x), "=r"(b.y), "=r"(b.z), "=r"(b.w) : "r"(src + (stage_v - stage_k)));
            if (row < seqlen_k) {
                if (k_col) *reinterpret_cast<uint4*>(dkg + (long long)row * params.dk_sn) = a;
                if (v_col) *reinterpret_cast<uint4*>(dvg + (long long)row * params.dv_sn) = b;
            }
        }
    }
}

}  // namespace cuflash
