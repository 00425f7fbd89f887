// cuflash/kernels_cu/attn/mask.cuh
// Which (query, key) pairs are visible: the seqlen_k tail and the bottom-right causal diagonal.
// Written against fragment coordinates (core/frag.cuh); runs only on tiles BlockRange marks.
#pragma once
#include "core/frag.cuh"

namespace cuflash {

struct Mask {
    int seqlen_k;
    int offset;  // seqlen_k - seqlen_q: bottom-right alignment
    int causal;

    // Keys [0, key_end(q)) are visible to query q.
    __device__ __forceinline__ int key_end(int q) const { return causal ? min(seqlen_k, q + offset + 1) : seqlen_k; }
    __device__ __forceinline__ bool masked(int q, int k) const { return k >= seqlen_k || (causal && k > q + offset); }

    // Set the invisible elements of a warp's S tile acc[MT][NT][4] (rows = queries from q0,
    // cols = keys from k0) to `fill` (-inf before the softmax).
    template <int MT, int NT>
    __device__ __forceinline__ void apply(float (&acc)[MT][NT][4], int q0, int k0, int lane, float fill) const {
        using F = FragSm80<MT, NT>;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int key_limit = key_end(q0 + F::row_of_half(lane, mt, half));
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (k0 + F::col(lane, nt, e) >= key_limit) acc[mt][nt][2 * half + e] = fill;
            }
    }
};

}  // namespace cuflash
