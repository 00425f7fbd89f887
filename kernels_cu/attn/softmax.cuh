// cuflash/kernels_cu/attn/softmax.cuh
// Online softmax over a warp's rows (FA2 Algorithm 1, lines 8-10), in fragment coordinates:
// row_max[mt][half] / row_sum[mt][half] belong to row 16 mt + g + 8 half (core/frag.cuh).
//
//   max_get_scale : m_new = max(m_old, rowmax S); m_scaled = m_new * c (0 for a row with no
//                   visible key yet: exp2 then gives 0, not NaN from -inf - -inf);
//                   corr = exp2(RN(m_old * c) - m_scaled): exactly 1 when the max did not move
//                   (an FFMA would leave m_old c's rounding error in, 1 +- an ulp, so visiting a
//                   block that changes nothing would still change bits: block masks, attn/
//                   block_mask.cuh, promise the same bits with and without the skipped blocks)
//   exp_and_sum   : P = exp2(S * c - m_scaled) in place (one FFMA + MUFU.EX2), thread-partial
//                   row sums (each thread holds 2 * NT of a row's columns)
//   rescale_o     : O~ *= corr per row
//   update_sum    : l = l * corr + sum (thread-partial; quad-reduced once in finalize)
//   finalize      : l = quad-sum; lse = (m c + log2 l) ln 2, -inf for rows with l = 0
// with c = softmax_scale * log2(e) (scale_log2). S stays raw Q K^T: the scale is folded into
// the exp2 argument.
#pragma once
#include "core/convert.cuh"

namespace cuflash {

template <int MT>
struct OnlineSoftmax {
    float row_max[MT][2], row_sum[MT][2];

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            row_max[mt][0] = row_max[mt][1] = neg_inf();
            row_sum[mt][0] = row_sum[mt][1] = 0.f;
        }
    }

    // One row (mt, half): new max over this step's scores; returns m_scaled, writes corr.
    template <int NT>
    __device__ __forceinline__ float max_get_scale(const float (&s)[NT][4], int mt, int half, float scale_log2,
                                                   float& corr) {
        float mx = row_max[mt][half];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * half], s[nt][2 * half + 1]));
        mx = warp_max4(mx);
        const float m_scaled = (mx == neg_inf()) ? 0.f : mx * scale_log2;
        corr = fast_exp2(__fmul_rn(row_max[mt][half], scale_log2) - m_scaled);  // no FFMA: see the top
        row_max[mt][half] = mx;
        return m_scaled;
    }

    // max_get_scale for scores that lack a term `shift`, constant over this thread's part of the row
    // (ALiBi's split form, attn/score_mod.cuh; it may differ between the row's four lanes): the row
    // max is the quad max of max(S) + shift; the caller passes exp_and_sum m_scaled - shift c, which
    // gives exp2((S + shift) c - m c).
    template <int NT>
    __device__ __forceinline__ float max_get_scale_shifted(const float (&s)[NT][4], int mt, int half, float scale_log2,
                                                           float& corr, float shift) {
        float mx = neg_inf();
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * half], s[nt][2 * half + 1]));
        mx = fmaxf(row_max[mt][half], warp_max4(mx + shift));  // shift may differ between a row's lanes
        const float m_scaled = (mx == neg_inf()) ? 0.f : mx * scale_log2;
        corr = fast_exp2(__fmul_rn(row_max[mt][half], scale_log2) - m_scaled);  // no FFMA: see the top
        row_max[mt][half] = mx;
        return m_scaled;
    }

    // P = exp2(S c - m_scaled) in place for row (mt, half); returns the thread-partial sum.
    template <int NT>
    __device__ __forceinline__ static float exp_and_sum(float (&s)[NT][4], int half, float scale_log2, float m_scaled) {
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float p = fast_exp2(fmaf(s[nt][2 * half + e], scale_log2, -m_scaled));
                s[nt][2 * half + e] = p;
                sum += p;
            }
        return sum;
    }

    template <int ON>
    __device__ __forceinline__ static void rescale_o(float (&o)[ON][4], int half, float corr) {
#pragma unroll
        for (int i = 0; i < ON; ++i) {
            o[i][2 * half] *= corr;
            o[i][2 * half + 1] *= corr;
        }
    }

    // The whole FA2 step for every row of the warp: max, rescale O~ and l, P in place.
    template <int NT, int ON>
    __device__ __forceinline__ void step(float (&s)[MT][NT][4], float (&o)[MT][ON][4], float scale_log2) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float corr;
                const float m_scaled = max_get_scale(s[mt], mt, half, scale_log2, corr);
                const float sum = exp_and_sum(s[mt], half, scale_log2, m_scaled);
                row_sum[mt][half] = row_sum[mt][half] * corr + sum;  // thread-partial; quad-reduced at the end
                rescale_o(o[mt], half, corr);
            }
    }

    // step for a warp of one m16 tile (MT 1) whose O is rescaled only when a row's max moved
    // (corr != 1 in some lane: a product by exactly 1 changes no bit, so the result is step's).
    // For the decode kernel, whose O (16 x D) is rescaled every 16 keys: after the first tiles the
    // max rarely moves, and a thread's D / 2 multiplies were an eighth of the d128 mainloop.
    template <int NT, int ON>
    __device__ __forceinline__ void step_lazy(float (&s)[1][NT][4], float (&o)[1][ON][4], float scale_log2) {
        static_assert(MT == 1, "one m16 tile per warp");
        float corr[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float m_scaled = max_get_scale(s[0], 0, half, scale_log2, corr[half]);
            const float sum = exp_and_sum(s[0], half, scale_log2, m_scaled);
            row_sum[0][half] = row_sum[0][half] * corr[half] + sum;
        }
        if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
            rescale_o(o[0], 0, corr[0]);
            rescale_o(o[0], 1, corr[1]);
        }
    }

    // FA1 (v1) form: l is kept quad-reduced per row and O normalised, so the step is
    // l_new = corr l + rowsum P and O~ is rescaled by corr l (returned) instead of corr.
    __device__ __forceinline__ float update_sum_reduced(int mt, int half, float corr, float sum) {
        const float l = row_sum[mt][half];
        row_sum[mt][half] = corr * l + warp_sum4(sum);
        return corr * l;
    }

    // Final row sum (quad-reduced) of row (mt, half).
    __device__ __forceinline__ float final_sum(int mt, int half) const { return warp_sum4(row_sum[mt][half]); }

    // Natural-log lse of a row from its max (raw units) and final sum; -inf where l = 0.
    // FUSED: m c + log2 l as one fma (FFMA), else as the rounded product m c plus log2 l (FMUL,
    // FADD). Written with .rn intrinsics because ptxas contracts a plain `m * c + x` or not
    // depending on the rest of the kernel (the product m c also feeds max_get_scale), so a change
    // elsewhere flipped the lse bits: the v1 d64 128x96 instance lost the FFMA the
    // pre-restructure kernel had (12 golden-output diffs). The pre-restructure kernels had FFMA in
    // every v2 instance and every v1 instance but d = 128 (tests/golden/outputs.json holds those
    // bits; see the callers).
    template <bool FUSED = true>
    __device__ __forceinline__ static float lse(float m, float l, float scale_log2) {
        return l != 0.f ? (FUSED ? __fmaf_rn(m, scale_log2, __log2f(l)) : __fadd_rn(__fmul_rn(m, scale_log2), __log2f(l))) * kLn2
                       : neg_inf();
    }
};

}  // namespace cuflash
