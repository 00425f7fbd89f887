// cuflash/kernels_cu/attn/sinks.cuh
// Learnable attention sinks in the v2 forwards' epilogue (V::kSinks; gpt-oss, transformers'
// s_aux): head h's logit sink_h (softmax units, like the lse) joins every row's softmax as one more
// column that has no value, so the row's sum gains e^(sink_h - max) and nothing else changes:
//   out' = O~ / (l + e^(sink - max)),   lse' = log(e^lse + e^sink).
// cuflash/sinks.py computes the same from (out, lse) after a kernel without this variant (v1,
// the decode kernel, split-KV); here it costs a few instructions per row, not a pass over out.
// In log2 units, with mc = the row's max times scale_log2 and sl = sink_h log2(e), both terms are
// taken against r = max(mc, sl), so nothing overflows however far the sink is from the scores:
//   L = l 2^(mc - r) + 2^(sl - r),   out' = O~ 2^(mc - r) / L,   lse' = (r + log2 L) ln 2.
// A row that sees no key (l = 0, O~ = 0) gets out' = 0 and lse' = sink.
#pragma once
#include "core/types.cuh"

namespace cuflash {

template <class V>
struct SinkLogit {
    float sl;  // sink_h log2(e) (V::kSinks; else unused)

    __device__ __forceinline__ static SinkLogit of(const float* __restrict__ sinks, int head) {
        if constexpr (V::kSinks) return {sinks[head] * kLog2e};
        else return {0.f};
    }

    // A row's factor for O~ (before dropout's 1 / (1 - p)) and its lse', from its max m (raw
    // units, as OnlineSoftmax keeps it) and final sum l.
    __device__ __forceinline__ void finish(float m, float l, float scale_log2, float& o_scale, float& lse) const {
        const float mc = l != 0.f ? m * scale_log2 : neg_inf();
        const float r = fmaxf(mc, sl);
        const float a = exp2f(mc - r);  // 0 for a row without keys
        const float sum = fmaf(l, a, exp2f(sl - r));
        o_scale = a / sum;
        lse = (r + __log2f(sum)) * kLn2;
    }
};

}  // namespace cuflash
