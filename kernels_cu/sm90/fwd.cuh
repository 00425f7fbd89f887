// cuflash/kernels_cu/sm90/fwd.cuh
// FlashAttention forward on Hopper (sm_90a): TMA loads, warp specialisation, wgmma. The attention
// math is the shared policies' (attn/: scheduler, block_range, mask, softmax, dropout); this file is
// the data movement and the issue order. design/hopper.md §1 explains the structure; in short:
//
//   grid     one CTA per (query block of 64*CONSUMERS rows, head, batch) (attn/scheduler.cuh)
//   WG 0     producer: one thread loads Q once and K_j, V_j per key block by TMA into a
//            STAGES-deep ring (full/empty mbarrier pairs, K and V separate), then leaves
//   WG 1..C  consumers, 64 query rows each (wgmma M = 64), registers raised by setmaxnreg:
//              S = Q K_j^T   (SS wgmma, N = BC)  -> mask (boundary blocks) -> online softmax
//              -> dropout -> P to A registers -> O += P V_j (RS wgmma, N = D)
//            OVERLAP: block j's P V_j is issued right after S_{j+1} = Q K_{j+1}^T, so the
//            softmax of block j+1 runs while the tensor cores do P V_j (FA3 §3.2)
//            PINGPONG: the consumers issue their GEMMs in turn (named barriers), so one's
//            softmax runs under the other's GEMMs (FA3 §3.1)
//   end      O = O~ / l staged through the consumer's own Q rows (swizzled) into 16-byte
//            row stores; lse from registers. Rows that see no key get O = 0 and lse = -inf.
// The accumulator of a m64nN wgmma is, per warp, the m16 C-fragment layout of core/frag.cuh, so
// Mask, OnlineSoftmax and Dropout apply to it unchanged (MT = 1 per warp).
#pragma once
#include "attn/block_range.cuh"
#include "attn/dropout.cuh"
#include "attn/mask.cuh"
#include "attn/params.cuh"
#include "attn/scheduler.cuh"
#include "attn/softmax.cuh"
#include "core/ptx_sm90.cuh"
#include "sm80/warp_gemm.cuh"
#include "sm90/traits.cuh"

namespace cuflash {

// The consumers' GEMM issue order when they take turns (PINGPONG): consumer c waits on barrier
// kBarSchedule + c, issues, then lets the next one go. Each barrier counts the 128 threads that
// wait on it plus the 128 of the consumer before it that arrive.
template <int CONSUMERS, bool ON>
struct IssueOrder {
    int me;
    __device__ __forceinline__ void start(int bar0) const {  // the last consumer lets consumer 0 go first
        if constexpr (ON) if (me == CONSUMERS - 1) named_bar_arrive(bar0, 256);
    }
    __device__ __forceinline__ void wait_turn(int bar0) const {
        if constexpr (ON) named_bar_sync(bar0 + me, 256);
    }
    // `last`: this consumer's final turn. The last consumer's final hand-off has no taker, and is
    // skipped so that no barrier is left half-arrived.
    __device__ __forceinline__ void pass_turn(int bar0, bool last) const {
        if constexpr (ON) if (!(last && me == CONSUMERS - 1)) named_bar_arrive(bar0 + (me + 1) % CONSUMERS, 256);
    }
};

template <bool BF16, int D, int BC, int CONSUMERS, int STAGES, int PINGPONG, int OVERLAP, bool DROPOUT>
__device__ __forceinline__ void flash_fwd_sm90(const TmaMap& tq, const TmaMap& tk, const TmaMap& tv,
                                               elem_t* __restrict__ o, float* __restrict__ lse,
                                               const FwdParams& params) {
    using Tr = Sm90FwdTraits<D, BC, CONSUMERS, STAGES>;
    constexpr int BR = Tr::kBlockQ;
    static_assert(!PINGPONG || (CONSUMERS >= 2 && OVERLAP), "ping-pong needs two consumers and the overlapped loop");

    extern __shared__ unsigned char smem[];
    // full[s]: the producer's expect_tx + TMA bytes; empty[s]: one arrival per consumer.
    __shared__ __align__(8) u64 bar_storage[1 + 4 * STAGES];
    const u32 bar_q = smem_u32(&bar_storage[0]);
    const u32 bar_k_full = bar_q + 8, bar_k_empty = bar_k_full + 8 * STAGES;
    const u32 bar_v_full = bar_k_empty + 8 * STAGES, bar_v_empty = bar_v_full + 8 * STAGES;
    const u32 sQ = (smem_u32(smem) + 1023u) & ~1023u;  // TMA 128B-swizzle images need 1024-B alignment
    const u32 sK = sQ + Tr::kQBytes;
    const u32 sV = sK + STAGES * Tr::kKVBytes;

    const int n_heads = params.heads, seqlen_q = params.seqlen_q, m_blocks = params.m_blocks;
    const MaskGeometry geo = MaskGeometry::of(params);
    const BlockCoord blk = schedule_blocks(blockIdx.x, m_blocks, n_heads, geo.later_rows_heavier());
    const int r0 = blk.block * BR;
    const BlockRange range = key_blocks<BR, BC>(geo, r0);
    const int n_begin = range.begin, n_iter = range.size();

    const int tid = threadIdx.x;
    if (tid == 0) {
        mbar_init(bar_q, 1);
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bar_k_full + 8 * s, 1);
            mbar_init(bar_v_full + 8 * s, 1);
            mbar_init(bar_k_empty + 8 * s, CONSUMERS);
            mbar_init(bar_v_empty + 8 * s, CONSUMERS);
        }
        fence_barrier_init();
    }
    __syncthreads();  // the last CTA-wide barrier: after the role split warps leave at different times

    const int wg = tid / 128;
    if (wg == 0) {
        // ---------------- producer ----------------
        setmaxnreg_dec<Tr::kProducerRegs>();
        if (tid == 0 && n_iter > 0) {
            prefetch_tma_map(tq);
            prefetch_tma_map(tk);
            prefetch_tma_map(tv);
            mbar_arrive_expect_tx(bar_q, Tr::kQBytes);
            tma_load_5d(sQ, tq, bar_q, 0, r0, 0, blk.head, blk.batch);
            for (int it = 0; it < n_iter; ++it) {
                const int s = it % STAGES;
                const u32 parity = ((it / STAGES) & 1) ^ 1;  // a fresh slot counts as released
                const int key0 = (n_begin + it) * BC;
                mbar_wait(bar_k_empty + 8 * s, parity);
                mbar_arrive_expect_tx(bar_k_full + 8 * s, Tr::kKVBytes);
                tma_load_5d(sK + s * Tr::kKVBytes, tk, bar_k_full + 8 * s, 0, key0, 0, blk.head, blk.batch);
                mbar_wait(bar_v_empty + 8 * s, parity);
                mbar_arrive_expect_tx(bar_v_full + 8 * s, Tr::kKVBytes);
                tma_load_5d(sV + s * Tr::kKVBytes, tv, bar_v_full + 8 * s, 0, key0, 0, blk.head, blk.batch);
            }
        }
    } else {
    // ---------------- consumers ----------------
    // (the two roles are the two branches of one if/else: ptxas applies setmaxnreg per branch)
    setmaxnreg_inc<Tr::kConsumerRegs>();
    const int cw = wg - 1, ctid = tid % 128, warp = ctid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;
    const int warp_row0 = 64 * cw + 16 * warp;  // this warp's first row in the Q tile
    const float scale_log2 = params.scale_log2;
    const Mask mask{geo};
    const Dropout drop{params.drop_seed, params.drop_threshold, blk.bh};
    const IssueOrder<CONSUMERS, PINGPONG != 0> order{cw};

    // Descriptors: this consumer's 64 Q rows in every chunk; K and V of slot s.
    const u64 desc_q = make_desc(sQ + cw * 64 * 128, kDescKMajorSw128);
    const u64 desc_k0 = make_desc(sK, kDescKMajorSw128);
    const u64 desc_v0 = make_desc(sV, desc_mn_major_sw128(BC));
    // k-step kk of a K-major operand: chunk kk / 4, then 32 B per 16 columns (in 16-B units)
    auto kmajor_step = [](int kk, int chunk_bytes) { return (u64)(((kk / 4) * chunk_bytes + (kk % 4) * 32) >> 4); };

    float acc_s[1][BC / 8][4];
    float acc_o[1][D / 8][4];
    u32 p_frag[Tr::kKeySteps][4];
    OnlineSoftmax<1> softmax;
    softmax.init();

    auto issue_qk = [&](int slot) {
        const u64 dk = desc_k0 + (u64)((slot * Tr::kKVBytes) >> 4);
#pragma unroll
        for (int kk = 0; kk < Tr::kHeadSteps; ++kk)
            Wgmma<BC, BF16>::ss(acc_s[0], desc_q + kmajor_step(kk, Tr::kQChunkBytes),
                                dk + kmajor_step(kk, Tr::kKVChunkBytes), kk > 0);
    };
    auto issue_pv = [&](int slot, bool accumulate) {
        const u64 dv = desc_v0 + (u64)((slot * Tr::kKVBytes) >> 4);
#pragma unroll
        for (int kk = 0; kk < Tr::kKeySteps; ++kk)
            Wgmma<D, BF16>::rs(acc_o[0], p_frag[kk], dv + (u64)((2048 * kk) >> 4), accumulate || kk > 0);
    };
    // After S of key block j landed: mask, softmax statistics, P = exp2(S c - m c) in place.
    // Returns nothing; corr[half] is O's rescale factor for this block.
    auto softmax_block = [&](int j, float (&corr)[2]) {
        if (range.masked_tail(j)) mask.apply<false, true>(acc_s, r0 + warp_row0, j * BC, lane, neg_inf());
        if (range.masked_head(j)) mask.apply<true, false>(acc_s, r0 + warp_row0, j * BC, lane, neg_inf());
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float m_scaled = softmax.max_get_scale(acc_s[0], 0, half, scale_log2, corr[half]);
            const float sum = OnlineSoftmax<1>::exp_and_sum(acc_s[0], half, scale_log2, m_scaled);
            softmax.row_sum[0][half] = softmax.row_sum[0][half] * corr[half] + sum;
        }
    };
    // P (after softmax_block) -> dropout -> the A registers of P V.
    auto pack_p = [&](int j) {
        if constexpr (DROPOUT) {
#pragma unroll
            for (int kb = 0; kb < Tr::kKeySteps; ++kb)
                Dropout::zero_dropped(acc_s[0], kb, drop.bits8((r0 + warp_row0) / 16, (j * BC) / 16 + kb, g, t));
        }
        c_to_a_frags<BF16, Tr::kKeySteps>(p_frag, acc_s[0]);
    };
    auto release = [&](u32 bar) {
        if (ctid == 0) mbar_arrive(bar);
    };

    if (n_iter > 0) {
        mbar_wait(bar_q, 0);
        order.start(Tr::kBarSchedule);
        if constexpr (OVERLAP) {
            // prologue: S_0, its softmax; P_0 waits in registers for the first P V
            mbar_wait(bar_k_full, 0);
            order.wait_turn(Tr::kBarSchedule);
            fence_regs(acc_s[0]);
            wgmma_fence();
            issue_qk(0);
            wgmma_commit();
            order.pass_turn(Tr::kBarSchedule, false);
            wgmma_wait<0>();
            fence_regs(acc_s[0]);
            release(bar_k_empty);
            {
                float corr[2];
                softmax_block(n_begin, corr);
            }
            pack_p(n_begin);
            for (int it = 1; it < n_iter; ++it) {
                const int s = it % STAGES, sp = (it - 1) % STAGES;
                const u32 ph = (it / STAGES) & 1, php = ((it - 1) / STAGES) & 1;
                const int j = n_begin + it;
                mbar_wait(bar_k_full + 8 * s, ph);
                mbar_wait(bar_v_full + 8 * sp, php);
                order.wait_turn(Tr::kBarSchedule);
                fence_regs(acc_s[0]);
                fence_regs(acc_o[0]);
                fence_regs(p_frag);
                wgmma_fence();
                issue_qk(s);  // S_j
                wgmma_commit();
                issue_pv(sp, it > 1);  // O += P_{j-1} V_{j-1}
                wgmma_commit();
                order.pass_turn(Tr::kBarSchedule, false);
                wgmma_wait<1>();  // S_j is in; P V may still run
                fence_regs(acc_s[0]);
                release(bar_k_empty + 8 * s);
                float corr[2];
                softmax_block(j, corr);
                wgmma_wait<0>();  // P_{j-1} V_{j-1} done: O and the P registers are free
                fence_regs(acc_o[0]);
                fence_regs(p_frag);
                release(bar_v_empty + 8 * sp);
#pragma unroll
                for (int half = 0; half < 2; ++half) OnlineSoftmax<1>::rescale_o(acc_o[0], half, corr[half]);
                pack_p(j);
            }
            // tail: the last block's P V
            const int sl = (n_iter - 1) % STAGES;
            mbar_wait(bar_v_full + 8 * sl, ((n_iter - 1) / STAGES) & 1);
            order.wait_turn(Tr::kBarSchedule);
            fence_regs(acc_o[0]);
            fence_regs(p_frag);
            wgmma_fence();
            issue_pv(sl, n_iter > 1);
            wgmma_commit();
            order.pass_turn(Tr::kBarSchedule, true);
            wgmma_wait<0>();
            fence_regs(acc_o[0]);
            release(bar_v_empty + 8 * sl);
        } else {
            for (int it = 0; it < n_iter; ++it) {
                const int s = it % STAGES;
                const u32 ph = (it / STAGES) & 1;
                const int j = n_begin + it;
                mbar_wait(bar_k_full + 8 * s, ph);
                fence_regs(acc_s[0]);
                wgmma_fence();
                issue_qk(s);
                wgmma_commit();
                wgmma_wait<0>();
                fence_regs(acc_s[0]);
                release(bar_k_empty + 8 * s);
                float corr[2];
                softmax_block(j, corr);
                if (it > 0) {
#pragma unroll
                    for (int half = 0; half < 2; ++half) OnlineSoftmax<1>::rescale_o(acc_o[0], half, corr[half]);
                }
                pack_p(j);
                mbar_wait(bar_v_full + 8 * s, ph);
                fence_regs(acc_o[0]);
                fence_regs(p_frag);
                wgmma_fence();
                issue_pv(s, it > 0);
                wgmma_commit();
                wgmma_wait<0>();
                fence_regs(acc_o[0]);
                release(bar_v_empty + 8 * s);
            }
        }
    }

    // ---------------- epilogue ----------------
    // O = O~ / l (x 1/(1-p) with dropout) into this consumer's own Q rows (its last S GEMM is
    // done, and no other warpgroup reads them), in the TMA image layout, then 16-byte row stores.
    const int bh = blk.bh, b = blk.batch, h = blk.head;
    float* lse_row = lse + (long long)bh * seqlen_q;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float l = n_iter > 0 ? softmax.final_sum(0, half) : 0.f;
        const float inv = l > 0.f ? (DROPOUT ? params.drop_scale : 1.f) / l : 0.f;
        const int tile_row = warp_row0 + g + 8 * half;
        const int row = r0 + tile_row;
        if (t == 0 && row < seqlen_q) lse_row[row] = OnlineSoftmax<1>::lse(softmax.row_max[0][half], l, scale_log2);
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            const float x0 = l > 0.f ? acc_o[0][nt][2 * half] * inv : 0.f;
            const float x1 = l > 0.f ? acc_o[0][nt][2 * half + 1] * inv : 0.f;
            const int col = 8 * nt + 2 * t;
            const u32 addr = sQ + (col / 64) * Tr::kQChunkBytes + tile_row * 128 + ((((col % 64) / 8) ^ (tile_row % 8)) << 4) +
                             (col % 8) * 2;
            st_shared_u32(addr, pack2<BF16>(x0, x1));
        }
    }
    named_bar_sync(Tr::kBarEpilogue + cw, 128);
    elem_t* og = o + (long long)b * params.o_sb + (long long)h * params.o_sh;
    const long long o_sn = params.o_sn;
    constexpr int kUnits = 64 * D / 8;  // 16-byte units of this consumer's 64 rows
#pragma unroll
    for (int i = 0; i < kUnits / 128; ++i) {
        const int idx = i * 128 + ctid;
        const int tr = 64 * cw + idx / (D / 8), u = idx % (D / 8);
        const int row = r0 + tr;
        if (row < seqlen_q) {
            const u32 addr = sQ + (u / 8) * Tr::kQChunkBytes + tr * 128 + (((u % 8) ^ (tr % 8)) << 4);
            uint4 val;
            asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w) : "r"(addr));
            *reinterpret_cast<uint4*>(og + (long long)row * o_sn + u * 8) = val;
        }
    }
}
    }

}  // namespace cuflash
