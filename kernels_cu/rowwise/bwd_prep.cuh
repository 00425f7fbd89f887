// cuflash/kernels_cu/rowwise/bwd_prep.cuh
// Backward preprocessing, per query row: delta = rowsum(dO * O); lse2 = lse * log2(e) with rows
// that see no key (lse = -inf) and padding rows mapped to +inf (so P = 0 there); zeroes the fp32
// dQ accumulator. Buffers are padded to a multiple of 128 rows so the main kernels copy them with
// unguarded 16-byte cp.async.
#pragma once
#include "attn/mask.cuh"
#include "attn/params.cuh"
#include "core/convert.cuh"

namespace cuflash {

template <bool BF16, int D>
__device__ __forceinline__ void bwd_prep(const elem_t* __restrict__ o, const elem_t* __restrict__ dout,
                                         const float* __restrict__ lse, float* __restrict__ delta,
                                         float* __restrict__ lse2, float* __restrict__ dq_acc, const BwdParams& params) {
    const long long o_sb = params.o_sb, o_sn = params.o_sn, o_sh = params.o_sh, do_sb = params.do_sb, do_sn = params.do_sn, do_sh = params.do_sh;
    const int n_heads = params.heads, seqlen_q = params.seqlen_q, seqlen_q_pad = params.seqlen_q_pad;
    const long long n_rows = params.ws_rows;  // padded rows over (batch*heads)
    constexpr int CH = D / 8;  // 16-byte chunks per row
    // threads per row: CH rounded up to a power of two (the shuffle reduction's width; the host's
    // grid, cuflash/_backward.py prep_threads_per_row, mirrors it), one chunk each, the rest idle
    constexpr int TPR = CH <= 1 ? 1 : CH <= 2 ? 2 : CH <= 4 ? 4 : CH <= 8 ? 8 : CH <= 16 ? 16 : 32;
    static_assert(CH <= 32, "a row's threads must sit in one warp");
    const long long gt = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long r = gt / TPR;  // padded row index over (batch*heads) x seqlen_q_pad
    const int c = (int)(gt % TPR);
    // the call's chunks (params.head_dim_v <= D, v's head dim: o and dout rows hold only those; dq_acc rows all CH)
    const int d_chunks = params.head_dim_v / 8;
    const bool in_range = r < n_rows, has_chunk = c < d_chunks;
    const int bh = in_range ? (int)(r / seqlen_q_pad) : 0;
    const int i = in_range ? (int)(r - (long long)bh * seqlen_q_pad) : seqlen_q;
    float dot = 0.f;
    if (i < seqlen_q && has_chunk) {
        const int b = bh / n_heads, h = bh - b * n_heads;
        uint4 x = *reinterpret_cast<const uint4*>(o + b * o_sb + i * o_sn + h * o_sh + c * 8);
        uint4 y = *reinterpret_cast<const uint4*>(dout + b * do_sb + i * do_sn + h * do_sh + c * 8);
        const u32 xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float a0, a1, b0, b1;
            unpack2<BF16>(xs[e], a0, a1);
            unpack2<BF16>(ys[e], b0, b1);
            dot = fmaf(a0, b0, fmaf(a1, b1, dot));
        }
    }
#pragma unroll
    for (int s = 1; s < TPR; s *= 2) dot += __shfl_xor_sync(0xffffffffu, dot, s);
    if (!in_range) return;
    if (c == 0) {
        const float POS_INF = __int_as_float(0x7f800000);
        float l = i < seqlen_q ? lse[(long long)bh * seqlen_q + i] : POS_INF;
        delta[r] = dot;
        lse2[r] = (l == -POS_INF) ? POS_INF : l * kLog2e;
    }
    if (dq_acc != nullptr && c < CH) {
        float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
        float4* p = reinterpret_cast<float4*>(dq_acc + r * D + c * 8);
        p[0] = z;
        p[1] = z;
    }
}

// bwd_prep_varlen's work for sequence b.
template <bool BF16, int D>
__device__ __forceinline__ void bwd_prep_varlen_seq(const elem_t* __restrict__ o, const elem_t* __restrict__ dout,
                                                    const float* __restrict__ lse, float* __restrict__ delta,
                                                    float* __restrict__ lse2, float* __restrict__ dq_acc,
                                                    const int* __restrict__ cu_seqlens_q, const BwdParams& params, int b) {
    constexpr int CH = D / 8;
    constexpr int TPR = CH <= 1 ? 1 : CH <= 2 ? 2 : CH <= 4 ? 4 : CH <= 8 ? 8 : CH <= 16 ? 16 : 32;
    static_assert(CH <= 32, "a row's threads must sit in one warp");
    constexpr int PAD = SeqSpan::kVarlenRowPad;
    const int h = blockIdx.y;
    const SeqSpan span{cu_seqlens_q[b], 0, cu_seqlens_q[b + 1] - cu_seqlens_q[b], 0};
    const int seqlen_q = span.seqlen_q, rows = (seqlen_q + PAD - 1) / PAD * PAD;
    const long long gt = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int i = (int)(gt / TPR), c = (int)(gt % TPR);
    const int d_chunks = params.head_dim_v / 8;  // o's and dout's (v's head dim)
    float dot = 0.f;
    if (i < seqlen_q && c < d_chunks) {
        const long long row = span.q_start + i;
        uint4 x = *reinterpret_cast<const uint4*>(o + row * params.o_sn + h * params.o_sh + c * 8);
        uint4 y = *reinterpret_cast<const uint4*>(dout + row * params.do_sn + h * params.do_sh + c * 8);
        const u32 xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float a0, a1, b0, b1;
            unpack2<BF16>(xs[e], a0, a1);
            unpack2<BF16>(ys[e], b0, b1);
            dot = fmaf(a0, b0, fmaf(a1, b1, dot));
        }
    }
#pragma unroll
    for (int s = 1; s < TPR; s *= 2) dot += __shfl_xor_sync(0xffffffffu, dot, s);
    if (i >= rows) return;
    const long long r = SeqSpan::varlen_ws_row0(span.q_start, b, h, params.seqlen_q_pad) + i;
    if (c == 0) {
        const float POS_INF = __int_as_float(0x7f800000);
        float l = i < seqlen_q ? lse[(long long)h * params.seqlen_q + span.q_start + i] : POS_INF;
        delta[r] = dot;
        lse2[r] = (l == -POS_INF) ? POS_INF : l * kLog2e;
    }
    if (dq_acc != nullptr && c < CH) {
        float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
        float4* p = reinterpret_cast<float4*>(dq_acc + r * D + c * 8);
        p[0] = z;
        p[1] = z;
    }
}

// Variable-length batches (cuflash/varlen.py): the same per row, over a grid of (row chunks, head,
// min(batch, 65535)): head h = blockIdx.y, and z strides over the params.batch sequences b (there
// may be more than a grid's z holds); each sequence's workspace rows from ws_row0 (attn/mask.cuh:
// each sequence padded to a multiple of SeqSpan::kVarlenRowPad rows, those past its length set as
// padding: delta 0, lse2 +inf, dq_acc 0). o, dout are packed (total_q, heads, D), lse (heads,
// total_q) with total_q = params.seqlen_q.
template <bool BF16, int D>
__device__ __forceinline__ void bwd_prep_varlen(const elem_t* __restrict__ o, const elem_t* __restrict__ dout,
                                                const float* __restrict__ lse, float* __restrict__ delta,
                                                float* __restrict__ lse2, float* __restrict__ dq_acc,
                                                const int* __restrict__ cu_seqlens_q, const BwdParams& params) {
    // every thread of a block takes the same sequences: the per-row shuffles stay warp-uniform
    for (int b = blockIdx.z; b < params.batch; b += gridDim.z)
        bwd_prep_varlen_seq<BF16, D>(o, dout, lse, delta, lse2, dq_acc, cu_seqlens_q, params, b);
}

}  // namespace cuflash
