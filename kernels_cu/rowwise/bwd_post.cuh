// cuflash/kernels_cu/rowwise/bwd_post.cuh
// Backward postprocessing: dQ = dq_acc * softmax_scale -> 16-bit, in the caller's strides.
#pragma once
#include "attn/mask.cuh"
#include "attn/params.cuh"
#include "core/convert.cuh"

namespace cuflash {

template <bool BF16, int D>
__device__ __forceinline__ void bwd_dq_convert(const float* __restrict__ dq_acc, elem_t* __restrict__ dq,
                                               const BwdParams& params) {
    const long long dq_sb = params.dq_sb, dq_sn = params.dq_sn, dq_sh = params.dq_sh;
    const int n_heads = params.heads, seqlen_q = params.seqlen_q, seqlen_q_pad = params.seqlen_q_pad;
    const float scale = params.scale;
    const long long n_rows = params.q_rows;  // dQ rows over (batch*heads)
    constexpr int CH = D / 8;
    const long long gt = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long r = gt / CH;  // unpadded row index over (batch*heads) x seqlen_q
    if (r >= n_rows) return;
    const int c = (int)(gt % CH);
    if (c >= params.head_dim / 8) return;  // dq_acc rows are D wide, dq's the call's head dim
    const int bh = (int)(r / seqlen_q), i = (int)(r - (long long)bh * seqlen_q);
    const int b = bh / n_heads, h = bh - b * n_heads;
    const float4* src = reinterpret_cast<const float4*>(dq_acc + ((long long)bh * seqlen_q_pad + i) * D + c * 8);
    float4 a = src[0], bb = src[1];
    uint4 out;
    out.x = pack2<BF16>(a.x * scale, a.y * scale);
    out.y = pack2<BF16>(a.z * scale, a.w * scale);
    out.z = pack2<BF16>(bb.x * scale, bb.y * scale);
    out.w = pack2<BF16>(bb.z * scale, bb.w * scale);
    *reinterpret_cast<uint4*>(dq + b * dq_sb + i * dq_sn + h * dq_sh + c * 8) = out;
}

// The same for a dq_acc in the sm90 backward's fragment order (its dq_bulk 2-4 tiles, sm90/bwd.cuh):
// 64-row x 64-column blocks, block (bh, m, c) at ((bh * seqlen_q_pad / 64 + m) * D / 64 + c) * 4096
// floats, inside which float4 nt * 128 + ctid holds consumer thread ctid's acc_dq[nt][0..3]:
// rows 16 warp + g and + 8, columns 8 nt + 2 t (+1) (warp = ctid / 32, g = ctid % 32 / 4,
// t = ctid % 4). One thread per row pair (16 warp + g, + 8) and 8 columns (one nt) of a block, 256
// per block, nt fastest: it reads the 64 contiguous bytes of ctid = 32 warp + 4 g + t, t = 0..3
// (each one's x, y are the first row's, z, w the second's) and writes 16 bytes to each row, so that
// 8 neighbouring threads write a row's whole 128 bytes. (A thread per float4, writing 4 bytes to
// two rows, ran 15-70% slower than cuDNN's conversion on the H200: half-sector writes.)
template <bool BF16, int D>
__device__ __forceinline__ void bwd_dq_convert_frag(const float* __restrict__ dq_acc, elem_t* __restrict__ dq,
                                                    const BwdParams& params) {
    static_assert(D % 64 == 0, "64-column blocks");
    const long long gt = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (gt >= params.ws_rows * (D / 16)) return;
    const int within = (int)(gt % 256), nt = within % 8, pair = within / 8, warp = pair / 8, g = pair % 8;
    const long long blk = gt / 256;
    const int c = (int)(blk % (D / 64));
    const long long bm = blk / (D / 64);
    const int m_blocks = params.seqlen_q_pad / 64;
    const int bh = (int)(bm / m_blocks), m = (int)(bm - (long long)bh * m_blocks);
    const int row = m * 64 + 16 * warp + g, col = 64 * c + 8 * nt;
    if (col >= params.head_dim || row >= params.seqlen_q) return;  // head_dim: a multiple of 8
    const float4* src = reinterpret_cast<const float4*>(dq_acc) + blk * 1024 + nt * 128 + 32 * warp + 4 * g;
    float4 a[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) a[t] = src[t];
    const float scale = params.scale;
    const int b = bh / params.heads, h = bh - b * params.heads;
    elem_t* out = dq + b * params.dq_sb + (long long)row * params.dq_sn + h * params.dq_sh + col;
    uint4 lo, hi;
    lo.x = pack2<BF16>(a[0].x * scale, a[0].y * scale);
    lo.y = pack2<BF16>(a[1].x * scale, a[1].y * scale);
    lo.z = pack2<BF16>(a[2].x * scale, a[2].y * scale);
    lo.w = pack2<BF16>(a[3].x * scale, a[3].y * scale);
    hi.x = pack2<BF16>(a[0].z * scale, a[0].w * scale);
    hi.y = pack2<BF16>(a[1].z * scale, a[1].w * scale);
    hi.z = pack2<BF16>(a[2].z * scale, a[2].w * scale);
    hi.w = pack2<BF16>(a[3].z * scale, a[3].w * scale);
    *reinterpret_cast<uint4*>(out) = lo;
    if (row + 8 < params.seqlen_q) *reinterpret_cast<uint4*>(out + 8 * params.dq_sn) = hi;
}

// bwd_dq_convert_varlen's work for sequence b.
template <bool BF16, int D>
__device__ __forceinline__ void bwd_dq_convert_varlen_seq(const float* __restrict__ dq_acc, elem_t* __restrict__ dq,
                                                          const int* __restrict__ cu_seqlens_q, const BwdParams& params,
                                                          int b) {
    constexpr int CH = D / 8;
    const int h = blockIdx.y;
    const SeqSpan span{cu_seqlens_q[b], 0, cu_seqlens_q[b + 1] - cu_seqlens_q[b], 0};
    const long long gt = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int i = (int)(gt / CH), c = (int)(gt % CH);
    if (i >= span.seqlen_q || c >= params.head_dim / 8) return;
    const float scale = params.scale;
    const long long r = SeqSpan::varlen_ws_row0(span.q_start, b, h, params.seqlen_q_pad) + i;
    const float4* src = reinterpret_cast<const float4*>(dq_acc + r * D + c * 8);
    float4 a = src[0], bb = src[1];
    uint4 out;
    out.x = pack2<BF16>(a.x * scale, a.y * scale);
    out.y = pack2<BF16>(a.z * scale, a.w * scale);
    out.z = pack2<BF16>(bb.x * scale, bb.y * scale);
    out.w = pack2<BF16>(bb.z * scale, bb.w * scale);
    *reinterpret_cast<uint4*>(dq + ((long long)span.q_start + i) * params.dq_sn + h * params.dq_sh + c * 8) = out;
}

// Variable-length batches: the same over a grid of (row chunks, head, min(batch, 65535)), z striding
// over the params.batch sequences (as bwd_prep_varlen); dq packed (total_q, heads, D).
template <bool BF16, int D>
__device__ __forceinline__ void bwd_dq_convert_varlen(const float* __restrict__ dq_acc, elem_t* __restrict__ dq,
                                                      const int* __restrict__ cu_seqlens_q, const BwdParams& params) {
    for (int b = blockIdx.z; b < params.batch; b += gridDim.z)
        bwd_dq_convert_varlen_seq<BF16, D>(dq_acc, dq, cu_seqlens_q, params, b);
}

// Variable-length batches whose dq_acc is in the sm90 backward's fragment order (its dq_bulk 2 and 4
// tiles): sequence b's rows of head h start at workspace row SeqSpan::varlen_ws_row0 (a multiple of
// 128), in 64-row blocks laid out as bwd_dq_convert_frag's. One thread per row and 8 columns (one nt):
// the four float4 of consumer threads ctid = 32 warp + 4 g + t, t = 0..3, are 64 contiguous bytes, of
// which row 16 warp + g takes each one's x, y and row 16 warp + g + 8 its z, w. Grid as
// bwd_dq_convert_varlen's.
template <bool BF16, int D>
__device__ __forceinline__ void bwd_dq_convert_frag_varlen(const float* __restrict__ dq_acc, elem_t* __restrict__ dq,
                                                           const int* __restrict__ cu_seqlens_q,
                                                           const BwdParams& params) {
    static_assert(D % 64 == 0, "64-column blocks");
    constexpr int CH = D / 8;
    const int h = blockIdx.y;
    const long long gt = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int i = (int)(gt / CH), c8 = (int)(gt % CH);
    if (c8 >= params.head_dim / 8) return;
    const float scale = params.scale;
    for (int b = blockIdx.z; b < params.batch; b += gridDim.z) {
        const int q_start = cu_seqlens_q[b], seqlen = cu_seqlens_q[b + 1] - q_start;
        if (i >= seqlen) continue;
        const long long row0 = SeqSpan::varlen_ws_row0(q_start, b, h, params.seqlen_q_pad) + (i & ~63);
        const int r = i & 63, half = (r >> 3) & 1;
        const int ctid0 = 32 * (r >> 4) + 4 * (r & 7);  // t = 0
        // the 64-column block of column 8 c8, then float4 nt * 128 + ctid of it
        const float4* blk = reinterpret_cast<const float4*>(dq_acc + row0 * D + (c8 / 8) * 4096);
        const int nt = c8 % 8;
        float v[8];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const float4 a = blk[nt * 128 + ctid0 + t];
            v[2 * t] = half ? a.z : a.x;
            v[2 * t + 1] = half ? a.w : a.y;
        }
        uint4 out;
        out.x = pack2<BF16>(v[0] * scale, v[1] * scale);
        out.y = pack2<BF16>(v[2] * scale, v[3] * scale);
        out.z = pack2<BF16>(v[4] * scale, v[5] * scale);
        out.w = pack2<BF16>(v[6] * scale, v[7] * scale);
        *reinterpret_cast<uint4*>(dq + ((long long)q_start + i) * params.dq_sn + h * params.dq_sh + c8 * 8) = out;
    }
}

}  // namespace cuflash
