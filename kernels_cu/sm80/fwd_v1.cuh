// cuflash/kernels_cu/sm80/fwd_v1.cuh
// FlashAttention-1 forward ("v1" in the design notes): Algorithm 1 of Dao et al. 2022, as a real
// kernel, with the same tensor-core building blocks as the v2 forward (mma.sync m16n8k16,
// ldmatrix, cp.async, XOR swizzle, the same tile copy), so that v1 vs v2 isolates the algorithm.
//
//   grid : ONE thread block per (batch, head), blockIdx.x = head + heads * batch. This is what
//          FlashAttention-1 parallelises over; it does not split the sequence across blocks (that
//          is FlashAttention-2's second change), so B*H below the SM count leaves SMs idle.
//   outer: over K/V tiles j of BC rows; K_j and V_j are loaded into shared memory once and stay
//          there for the whole inner loop
//   inner: over Q tiles i of BR rows, streamed through a STAGES-deep cp.async ring (STAGES is the
//          depth of the Q ring here, where in v2 it is the depth of the K/V ring)
//   state: O_i, m_i, l_i live in device memory (fp32 workspace, "HBM" in the paper). Every step
//          (j, i) reads them, rescales, adds P~_ij V_j, renormalises by the new l and writes them
//          back (Algorithm 1, lines 8-13):
//            m_new = max(m_i, rowmax S_ij)
//            P~    = exp(S_ij - m_new)               (= e^{m~_ij - m_new} e^{S_ij - m~_ij})
//            l_new = e^{m_i - m_new} l_i + rowsum P~
//            O_i  <- diag(l_new)^-1 (diag(l_i e^{m_i - m_new}) O_i + P~ V_j)
//          So O is renormalised (one reciprocal per row, D multiplies per row) at every step and
//          makes an fp32 round trip through memory at every step: the work and traffic v2 removes.
//          Two round trips of Algorithm 1 are skipped because they carry no information: step
//          j = 0 starts from the initial values O = 0, m = -inf, l = 0 without reading them (the
//          paper writes them to HBM first and reads them back), and a Q tile's last step writes
//          the final 16-bit O and lse instead of fp32 state. No extra kernel, no extra pass.
//   warps: within a Q tile warp w owns rows [w*BR/WARPS, (w+1)*BR/WARPS) (16 rows per m-tile),
//          exactly as in v2, so a row's softmax statistics live in one warp.
//
// Memory ordering of the workspace. A block reads and writes only its own (batch, head) rows of
// the workspace, so blocks never communicate. Inside the block, the thread that owns an element
// of O_i at step (j, i) -- fixed by (warp, lane, m-tile, half, n-tile), i.e. by the row's position
// in its Q tile and the column, never by j -- is the thread that owns it at step (j+1, i): every
// workspace element is reread only by the thread that wrote it. m and l of a row are read and
// written by lane t == 0 of the row's quad only and broadcast to the other three lanes with a
// shuffle. CUDA orders a thread's own accesses to one address in program order, so the workspace
// needs no fence and no barrier (the __syncthreads below exist for the shared-memory buffers).
// The workspace pointers are deliberately not `const __restrict__`: data written by the kernel
// must never be read through the non-coherent (ld.global.nc) path.
//
// Semantics are identical to v2 (sm80/fwd.cuh): bottom-right causal mask (query i sees key j iff
// j <= i + Nk - Nq), seqlen tails zero-filled and masked, out 16-bit, lse float32 natural log,
// rows that see no key give out 0 and lse -inf. Same backward applies.
//
#pragma once
#include "attn/block_range.cuh"
#include "attn/dropout.cuh"
#include "attn/features.cuh"
#include "attn/mask.cuh"
#include "attn/params.cuh"
#include "attn/scheduler.cuh"
#include "attn/score_mod.cuh"
#include "attn/softmax.cuh"
#include "core/convert.cuh"
#include "sm80/tile_copy.cuh"
#include "sm80/traits.cuh"
#include "sm80/warp_gemm.cuh"

namespace cuflash {

template <bool BF16, int D, int BR, int BC, int WARPS, int STAGES, class V>
__device__ __forceinline__ void flash_fwd_v1(const elem_t* __restrict__ q, const elem_t* __restrict__ k,
                                             const elem_t* __restrict__ v, elem_t* __restrict__ o, float* __restrict__ lse,
                                             float* ws_o, float* ws_ml, const FwdParams& params) {
    // The parameters this kernel reads, copied to registers once: a field read where it is used
    // would be re-read from the parameter space after every asm volatile (memory clobber).
    const long long q_sb = params.q_sb, q_sn = params.q_sn, q_sh = params.q_sh, k_sb = params.k_sb, k_sn = params.k_sn, k_sh = params.k_sh,
                    v_sb = params.v_sb, v_sn = params.v_sn, v_sh = params.v_sh, o_sb = params.o_sb, o_sn = params.o_sn, o_sh = params.o_sh;
    const int n_heads = params.heads, seqlen_q = params.seqlen_q, seqlen_k = params.seqlen_k, m_blocks = params.m_blocks,
              group = params.group;
    const float scale_log2 = params.scale_log2, drop_scale = params.drop_scale;
    const unsigned long long drop_seed = params.drop_seed;
    const unsigned int drop_threshold = params.drop_threshold;
    // the call's 16-byte chunks per row (V::kPartialD: fewer than the instance's; else all of them)
    const int d_chunks = V::kPartialD ? params.head_dim / 8 : D / 8;
    using S_ = Sm80FwdV1Traits<D, BR, BC, WARPS, STAGES>;
    constexpr int MT = S_::kRowTiles, SN = S_::kScoreTiles, ON = S_::kOutTiles, KD = S_::kHeadSteps, KB = S_::kKeySteps, CH = S_::kRowChunks;
    constexpr int THREADS = S_::kNumThreads;
    const float NEG_INF = __int_as_float(0xff800000);

    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 sK = smem_u32(smem);
    const u32 sV = sK + S_::kKVTileBytes;
    const u32 sQ = sV + S_::kKVTileBytes;  // STAGES slots

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;  // MMA fragment row group / column pair
    const int quad0 = lane & ~3;           // lane t == 0 of this lane's quad

    // One block per (batch, head): FlashAttention-1's parallelisation.
    const BlockCoord blk = schedule_heads(blockIdx.x, n_heads);
    const int bh = blk.bh, b = blk.batch, h = blk.head;

    const elem_t* qg = q + (long long)b * q_sb + (long long)h * q_sh;
    const int h_kv = h / group;  // GQA/MQA: the query heads of a group share one k/v head (MHA: group 1)
    const elem_t* kg = k + (long long)b * k_sb + (long long)h_kv * k_sh;
    const elem_t* vg = v + (long long)b * v_sb + (long long)h_kv * v_sh;
    elem_t* og = o + (long long)b * o_sb + (long long)h * o_sh;
    float* lse_row = lse + (long long)bh * seqlen_q;
    float* wo = ws_o + (long long)bh * seqlen_q * D;  // this block's rows only
    float* wml = ws_ml + (long long)bh * seqlen_q * 2;

    const MaskGeometry geo = MaskGeometry::of<V>(params);
    const Mask<V::kLocal> mask{geo};
    const ScoreMod<V> score_mod = ScoreMod<V>::of(params);
    const Dropout drop{drop_seed, drop_threshold, bh};
    const int n_kv = (seqlen_k + BC - 1) / BC;

    // ---- Q tiles that see no key at all (outside live_query_blocks): no step ever visits them
    // -> out 0, lse -inf. They are a head (causal, Nq > Nk) and/or a tail (bounded left edge). ----
    {
        const BlockRange live = live_query_blocks<BR, BC, V::kLocal>(geo, m_blocks);
        const int head_rows = min(seqlen_q, live.begin * BR), tail_row = min(seqlen_q, live.end * BR);
        const int dead_rows = head_rows + (seqlen_q - tail_row);
        for (int idx = tid; idx < dead_rows * CH; idx += THREADS) {
            const int r = idx / CH, c = idx % CH;
            const int row = r < head_rows ? r : tail_row + (r - head_rows);
            if (!V::kPartialD || c < d_chunks)
                *reinterpret_cast<uint4*>(og + (long long)row * o_sn + c * 8) = make_uint4(0u, 0u, 0u, 0u);
        }
        for (int r = tid; r < dead_rows; r += THREADS) lse_row[r < head_rows ? r : tail_row + (r - head_rows)] = NEG_INF;
    }

    const int warp_row0 = warp * S_::kRowsPerWarp;
    // ldmatrix per-lane offsets at k-chunk 0; chunk c is chunk_step(offset, c), as in v2.
    using Ld = LdmatrixOffsets<CH>;
    const u32 q_frag_off = Ld::a_operand(warp_row0, lane);
    const u32 k_frag_off = Ld::b_operand(lane);
    const u32 v_frag_off = Ld::b_trans(lane);
    const u32 no_q_regs[1][4] = {};  // Q comes from shared memory (warp_mma_abt)

    for (int j = 0; j < n_kv; ++j) {  // ======== OUTER loop: K/V tiles ========
        // Q tiles [i0, i0 + n_i) see tile j (the same pairs key_blocks gives from the Q side).
        const BlockRange qr = query_blocks<BR, BC, V::kLocal>(geo, j, m_blocks);
        if (qr.size() == 0) continue;  // uniform over the block; nothing was issued for this tile
        const int i0 = qr.begin, n_i = qr.size();
        // Every warp has finished the previous outer step: K/V and all Q slots may be refilled.
        __syncthreads();
        // Prologue: K_j, V_j join the first Q tile's group; Q tiles i0 .. i0+STAGES-2 in flight.
        load_tile<BC, CH, THREADS, V::kPartialD>(sK, kg, k_sn, j * BC, seqlen_k, tid, d_chunks);
        load_tile<BC, CH, THREADS, V::kPartialD>(sV, vg, v_sn, j * BC, seqlen_k, tid, d_chunks);
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < n_i) load_tile<BR, CH, THREADS, V::kPartialD>(sQ + s * S_::kQTileBytes, qg, q_sn, (i0 + s) * BR, seqlen_q, tid, d_chunks);
            cp_async_commit();  // empty groups keep the wait count uniform
        }

        for (int ii = 0; ii < n_i; ++ii) {  // ======== INNER loop: Q tiles ========
            // Q tile ii has landed once at most STAGES-2 younger groups are pending; the barrier
            // also says every warp finished step ii-1, whose slot is refilled next.
            cp_async_wait<STAGES - 2>();
            __syncthreads();
            {
                const int in = ii + STAGES - 1;
                if (in < n_i)
                    load_tile<BR, CH, THREADS, V::kPartialD>(sQ + (in % STAGES) * S_::kQTileBytes, qg, q_sn, (i0 + in) * BR,
                                               seqlen_q, tid, d_chunks);
                cp_async_commit();
            }
            const int r0 = (i0 + ii) * BR;
            const u32 sQi = sQ + (ii % STAGES) * S_::kQTileBytes;
            // This Q tile's key blocks: j is its first step (state starts at 0, -inf, 0), its last
            // (writes the final O and lse), and may need the mask at either end.
            const BlockRange kr = key_blocks<BR, BC, V::kLocal>(geo, r0);
            const bool first = (j == kr.begin), last = (j == kr.end - 1);

            // ---- read O_i, m_i, l_i from the workspace (none at the first step: initial 0, -inf, 0) ----
            float acc_o[MT][ON][4];
            OnlineSoftmax<MT> sm;  // row_sum holds the quad-reduced l here (FA1 keeps l per row)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int row = r0 + warp_row0 + mt * 16 + g + 8 * half;
                    const bool stored = !first && row < seqlen_q;
                    float2 ml = make_float2(NEG_INF, 0.f);
                    if (stored && t == 0) ml = *reinterpret_cast<const float2*>(wml + 2 * (long long)row);
                    sm.row_max[mt][half] = __shfl_sync(0xffffffffu, ml.x, quad0);
                    sm.row_sum[mt][half] = __shfl_sync(0xffffffffu, ml.y, quad0);
                    const float* src = wo + (long long)row * D + 2 * t;
#pragma unroll
                    for (int n = 0; n < ON; ++n) {
                        float2 x = make_float2(0.f, 0.f);
                        if (stored) x = *reinterpret_cast<const float2*>(src + 8 * n);
                        acc_o[mt][n][2 * half] = x.x;
                        acc_o[mt][n][2 * half + 1] = x.y;
                    }
                }

            // ---- S = Q_i K_j^T (raw, unscaled) ----
            float acc_s[MT][SN][4];
            warp_mma_abt<BF16, CH, KD, MT, SN, false>(acc_s, no_q_regs, sQi, q_frag_off, sK, k_frag_off);

            // ---- score modifier (softcap, attn/score_mod.cuh), then the mask (seqlen_k tail /
            // right window edge; left window edge); m in the workspace is in modified units ----
            score_mod.apply(acc_s);
            if (kr.masked_tail(j)) mask.apply<false, true>(acc_s, r0 + warp_row0, j * BC, lane, NEG_INF);
            if (kr.masked_head(j)) mask.apply<true, false>(acc_s, r0 + warp_row0, j * BC, lane, NEG_INF);

            // ---- softmax against the new max; rescale the stored (normalised) O_i by l_i e^{m_i - m_new}
            // (attn/softmax.cuh: the v2 pieces, with FA1's per-row l: update_sum_reduced) ----
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    float alpha;
                    const float m_scaled = sm.max_get_scale(acc_s[mt], mt, half, scale_log2, alpha);
                    const float sum = OnlineSoftmax<MT>::exp_and_sum(acc_s[mt], half, scale_log2, m_scaled);
                    OnlineSoftmax<MT>::rescale_o(acc_o[mt], half, sm.update_sum_reduced(mt, half, alpha, sum));
                }

            // ---- dropout (Algorithm 2 of the FlashAttention paper): P~ o mask enters P~ V only;
            // l stays the undropped sum and the 1/(1-p) scale is applied once, at the last step.
            // Same Philox mask as v2 (attn/dropout.cuh). ----
            if constexpr (V::kDropout) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int kb = 0; kb < KB; ++kb)
                        Dropout::zero_dropped(acc_s[mt], kb, drop.bits8((r0 + warp_row0) / 16 + mt, (j * BC) / 16 + kb, g, t));
            }

            // ---- P to 16-bit A fragments (C layout of two n8 tiles = A layout of one k16 step) ----
            u32 p_frag[MT][KB][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) c_to_a_frags<BF16, KB>(p_frag[mt], acc_s[mt]);

            // ---- O~ += P~ V_j ----
            warp_mma_ab<BF16, CH, KB, MT, ON>(acc_o, p_frag, sV, v_frag_off);

            if (!last) {
                // ---- O_i <- O~ / l_new, written back with m_new, l_new (fp32 round trip per step) ----
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const int row = r0 + warp_row0 + mt * 16 + g + 8 * half;
                        const float l = sm.row_sum[mt][half];
                        const float inv = l != 0.f ? 1.f / l : 0.f;
                        if (row < seqlen_q) {
                            float* dst = wo + (long long)row * D + 2 * t;
#pragma unroll
                            for (int n = 0; n < ON; ++n)
                                *reinterpret_cast<float2*>(dst + 8 * n) =
                                    make_float2(acc_o[mt][n][2 * half] * inv, acc_o[mt][n][2 * half + 1] * inv);
                            if (t == 0)
                                *reinterpret_cast<float2*>(wml + 2 * (long long)row) = make_float2(sm.row_max[mt][half], l);
                        }
                    }
            } else {
                // ---- last step of this Q tile: O = O~ / l in 16 bits and lse, as v2's epilogue.
                // O is staged through this warp's own rows of the Q slot (the warp is done reading
                // them; the slot is refilled only after the next barrier) for 16-byte stores. ----
                __syncwarp();
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const float l = sm.row_sum[mt][half];
                        const float inv = l != 0.f ? (V::kDropout ? drop_scale : 1.f) / l : 0.f;
                        const int tile_row = warp_row0 + mt * 16 + g + 8 * half;
                        const int row = r0 + tile_row;
                        // lse rounded as in the pre-restructure kernel (golden outputs): one FFMA,
                        // but the rounded product m c plus log2 l at d = 128 (OnlineSoftmax::lse)
                        if (t == 0 && row < seqlen_q)
                            lse_row[row] = OnlineSoftmax<MT>::template lse<D != 128>(sm.row_max[mt][half], l, scale_log2);
#pragma unroll
                        for (int n = 0; n < ON; ++n) {
                            const u32 packed = pack2<BF16>(acc_o[mt][n][2 * half] * inv, acc_o[mt][n][2 * half + 1] * inv);
                            const u32 addr = sQi + swz<CH>(tile_row, n) + 4 * t;
                            asm volatile("st.shared.u32 [%0], %1;" :: "r"(addr), "r"(packed) : "memory");
                        }
                    }
                __syncwarp();
                constexpr int WARP_CHUNKS = S_::kRowsPerWarp * CH;
#pragma unroll
                for (int it = 0; it < (WARP_CHUNKS + 31) / 32; ++it) {
                    const int idx = it * 32 + lane;
                    if (idx < WARP_CHUNKS) {
                        const int tr = warp_row0 + idx / CH, c = idx % CH;
                        const int row = r0 + tr;
                        if (row < seqlen_q && (!V::kPartialD || c < d_chunks)) {
                            uint4 val;
                            asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                                         : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w) : "r"(sQi + swz<CH>(tr, c)));
                            *reinterpret_cast<uint4*>(og + (long long)row * o_sn + c * 8) = val;
                        }
                    }
                }
            }
        }
    }
    cp_async_wait<0>();
}

}  // namespace cuflash
