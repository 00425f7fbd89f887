// tests/cu/softmax.cu: harness for kernels_cu/attn/softmax.cuh (and what it includes, core/convert.cuh).
// softmax_steps: one warp, OnlineSoftmax<MT = 2> over `steps` S tiles of 32 x 32 (NT = 4) and an
// O~ tile of 32 x 16 (ON = 2), all dense fp32 in memory and fragment layout in registers.
// For each step i:
//   * the pieces, on a copy of the state: probe.max_get_scale -> m_scaled, corr; exp_and_sum on a
//     copy of S -> P and the thread-partial row sum            -> m_scaled/corr/part/p_pieces[i]
//   * the composed step on the real state: sm.step(s, o, c)    -> p[i], o_out[i]
//   * the state after the step: row_max, thread-partial row_sum, final_sum (quad-reduced) and
//     lse(row_max, final_sum, c)                               -> row_max/row_sum/l/lse[i]
// Per-row outputs are per lane: x[i][lane][mt][half] (row 16 mt + lane / 4 + 8 half).
#include "attn/softmax.cuh"

using namespace cuflash;

namespace {

constexpr int kMT = 2, kNT = 4, kON = 2;
constexpr int kRows = 16 * kMT, kCols = 8 * kNT, kOCols = 8 * kON;

// m16n8 C fragment (core/frag.cuh, spelled out; test_cu_frag checks it).
__device__ int row_of(int lane, int mt, int e) { return 16 * mt + lane / 4 + 8 * (e / 2); }
__device__ int col_of(int lane, int nt, int e) { return 8 * nt + 2 * (lane % 4) + e % 2; }

template <int NT>
__device__ void load(float (&acc)[kMT][NT][4], const float* src, int lane) {
    for (int mt = 0; mt < kMT; ++mt)
        for (int nt = 0; nt < NT; ++nt)
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = src[row_of(lane, mt, e) * 8 * NT + col_of(lane, nt, e)];
}

template <int NT>
__device__ void store(float* dst, const float (&acc)[kMT][NT][4], int lane) {
    for (int mt = 0; mt < kMT; ++mt)
        for (int nt = 0; nt < NT; ++nt)
            for (int e = 0; e < 4; ++e) dst[row_of(lane, mt, e) * 8 * NT + col_of(lane, nt, e)] = acc[mt][nt][e];
}

}  // namespace

extern "C" __global__ void softmax_steps(const float* s_in, const float* o_in, int steps, float scale_log2,
                                         float* p_out, float* p_pieces, float* o_out, float* m_scaled_out,
                                         float* corr_out, float* part_out, float* row_max_out, float* row_sum_out,
                                         float* l_out, float* lse_out) {
    const int lane = threadIdx.x;
    OnlineSoftmax<kMT> sm;
    sm.init();
    float o[kMT][kON][4];
    load(o, o_in, lane);
    for (int i = 0; i < steps; ++i) {
        float s[kMT][kNT][4], q[kMT][kNT][4];
        load(s, s_in + i * kRows * kCols, lane);
        load(q, s_in + i * kRows * kCols, lane);
        const int r0 = (i * 32 + lane) * kMT * 2;  // x[i][lane][mt][half] = x[r0 + 2 mt + half]

        OnlineSoftmax<kMT> probe = sm;
        for (int mt = 0; mt < kMT; ++mt)
            for (int half = 0; half < 2; ++half) {
                float corr;
                const float m_scaled = probe.max_get_scale(q[mt], mt, half, scale_log2, corr);
                const float part = OnlineSoftmax<kMT>::exp_and_sum(q[mt], half, scale_log2, m_scaled);
                m_scaled_out[r0 + 2 * mt + half] = m_scaled;
                corr_out[r0 + 2 * mt + half] = corr;
                part_out[r0 + 2 * mt + half] = part;
            }
        store(p_pieces + i * kRows * kCols, q, lane);

        sm.step(s, o, scale_log2);
        store(p_out + i * kRows * kCols, s, lane);
        store(o_out + i * kRows * kOCols, o, lane);
        for (int mt = 0; mt < kMT; ++mt)
            for (int half = 0; half < 2; ++half) {
                const float l = sm.final_sum(mt, half);
                row_max_out[r0 + 2 * mt + half] = sm.row_max[mt][half];
                row_sum_out[r0 + 2 * mt + half] = sm.row_sum[mt][half];
                l_out[r0 + 2 * mt + half] = l;
                lse_out[r0 + 2 * mt + half] = OnlineSoftmax<kMT>::lse(sm.row_max[mt][half], l, scale_log2);
            }
    }
}
