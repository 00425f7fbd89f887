// tests/cu/score_mod.cu: harness for kernels_cu/attn/score_mod.cuh (and attn/features.cuh).
// One warp per case (blockIdx.x): a dense fp32 tile s[case] (32 x 32) is loaded into fragment
// registers acc[MT = 2][NT = 4][4] (core/frag.cuh's layout, spelled out below), ScoreMod<V>
// built from a parameter struct with `softcap_scale` is applied, and the registers are stored back
// densely into out[case]; grad_out[case] gets ScoreMod<V>::grad of each modified element.
//
//   score_mod_softcap: V::kSoftcap = true  (t = tanh.approx(s * softcap_scale), grad 1 - t^2)
//   score_mod_plain:   V::kSoftcap = false (s unchanged, grad 1)
//   grad_softcap:      ScoreMod<softcap>::grad of the raw values x[i] (one thread per value)
#include "attn/score_mod.cuh"

using namespace cuflash;

namespace {

constexpr int kMT = 2, kNT = 4;

struct Params {  // the one field ScoreMod::of reads (attn/params.cuh: FwdParams, BwdParams)
    float softcap_scale;
};

__device__ int row_of(int lane, int mt, int e) { return 16 * mt + lane / 4 + 8 * (e / 2); }
__device__ int col_of(int lane, int nt, int e) { return 8 * nt + 2 * (lane % 4) + e % 2; }

template <bool SOFTCAP>
__device__ void run(const float* s, float* out, float* grad_out, float softcap_scale) {
    constexpr int ROWS = 16 * kMT, COLS = 8 * kNT;
    const int c = blockIdx.x, lane = threadIdx.x;
    const float* src = s + c * ROWS * COLS;
    float acc[kMT][kNT][4];
    for (int mt = 0; mt < kMT; ++mt)
        for (int nt = 0; nt < kNT; ++nt)
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = src[row_of(lane, mt, e) * COLS + col_of(lane, nt, e)];
    using SM = ScoreMod<Variant<false, false, SOFTCAP, false, false, false, false, false, false, false, false, false, false>>;
    const SM mod = SM::of(Params{softcap_scale});
    mod.apply(acc);
    for (int mt = 0; mt < kMT; ++mt)
        for (int nt = 0; nt < kNT; ++nt)
            for (int e = 0; e < 4; ++e) {
                const int i = c * ROWS * COLS + row_of(lane, mt, e) * COLS + col_of(lane, nt, e);
                out[i] = acc[mt][nt][e];
                grad_out[i] = SM::grad(acc[mt][nt][e]);
            }
}

}  // namespace

extern "C" __global__ void score_mod_softcap(const float* s, float* out, float* grad_out, float softcap_scale) {
    run<true>(s, out, grad_out, softcap_scale);
}

extern "C" __global__ void score_mod_plain(const float* s, float* out, float* grad_out, float softcap_scale) {
    run<false>(s, out, grad_out, softcap_scale);
}

extern "C" __global__ void grad_softcap(const float* x, float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = ScoreMod<Variant<false, false, true, false, false, false, false, false, false, false, false, false, false>>::grad(x[i]);
}
