// cuflash/kernels_cu/rowwise/bwd_dkdv_reduce.cuh
// GQA/MQA backward postprocessing: dK, dV of a k/v head = the sum of its group's per-query-head
// gradients. The dK/dV kernels (sm80 and sm90) write dK and dV per QUERY head into expanded,
// C-contiguous (batch, seqlen_k, heads, D) 16-bit buffers; this sums the `group` consecutive heads
// of each k/v head in fp32, in head order (deterministic), and rounds once into the C-contiguous
// (batch, seqlen_k, heads_kv, D) gradients. Runs only when group > 1 (MHA writes dK, dV directly).
//
// With both buffers contiguous and heads = heads_kv * group, output row r (over batch, seqlen_k,
// heads_kv) sums expanded rows r * group .. r * group + group - 1. One thread per 16-byte chunk.
#pragma once
#include "attn/params.cuh"
#include "core/convert.cuh"

namespace cuflash {

template <bool BF16>
__device__ __forceinline__ void add8(float (&acc)[8], uint4 x) {
    const u32 xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        float a0, a1;
        unpack2<BF16>(xs[e], a0, a1);
        acc[2 * e] += a0;
        acc[2 * e + 1] += a1;
    }
}

template <bool BF16>
__device__ __forceinline__ uint4 pack8(const float (&acc)[8]) {
    uint4 out;
    out.x = pack2<BF16>(acc[0], acc[1]);
    out.y = pack2<BF16>(acc[2], acc[3]);
    out.z = pack2<BF16>(acc[4], acc[5]);
    out.w = pack2<BF16>(acc[6], acc[7]);
    return out;
}

template <bool BF16, int D>
__device__ __forceinline__ void bwd_dkdv_reduce(const elem_t* __restrict__ dk_exp, const elem_t* __restrict__ dv_exp,
                                                elem_t* __restrict__ dk, elem_t* __restrict__ dv,
                                                const BwdParams& params) {
    const long long n_rows = params.kv_rows;  // batch * seqlen_k * heads_kv
    const int group = params.group;
    constexpr int CH = D / 8;
    const long long gt = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long r = gt / CH;
    if (r >= n_rows) return;
    const int c = (int)(gt % CH);
    // the call's (<= D): dK's rows are head_dim wide, dV's head_dim_v (v's own head dim)
    const int d = params.head_dim, dv_w = params.head_dim_v;
    const bool has_k = c < d / 8, has_v = c < dv_w / 8;
    if (!has_k && !has_v) return;
    float ak[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, av[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int g = 0; g < group; ++g) {
        if (has_k) add8<BF16>(ak, *reinterpret_cast<const uint4*>(dk_exp + (r * group + g) * d + c * 8));
        if (has_v) add8<BF16>(av, *reinterpret_cast<const uint4*>(dv_exp + (r * group + g) * dv_w + c * 8));
    }
    if (has_k) *reinterpret_cast<uint4*>(dk + r * d + c * 8) = pack8<BF16>(ak);
    if (has_v) *reinterpret_cast<uint4*>(dv + r * dv_w + c * 8) = pack8<BF16>(av);
}

}  // namespace cuflash
