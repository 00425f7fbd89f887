// tests/cu/mask.cu: harness for kernels_cu/attn/mask.cuh (and what it includes, core/frag.cuh).
// One warp per case (blockIdx.x): a dense fp32 tile s[case] is loaded into fragment registers
// (layout of core/frag.cuh), the mask is applied at origin (q0s[case], k0s[case]), and the
// registers are stored back densely into out[case]. The geometry is built from its fields,
// never from from_causal (the host will fill it from a parameter struct).
//
//   mask_direct_<L><R>: Mask<true>::apply<LEFT = L, RIGHT = R> on acc[MT][NT][4], MT = 2, NT = 4:
//                       tile rows = queries q0 + 0..31, cols = keys k0 + 0..31
//   mask_direct_11_nolocal: Mask<false>::apply<true, true> (a feature set without a bounded left
//                       edge: the left edge is never checked)
//   mask_transposed:    Mask<true>::apply_transposed<LEFT = left, RIGHT = right, NT = 4> on one m16
//                       tile acc[NT][4]: tile rows = keys k0 + 0..15, cols = queries q0 + 0..31
//   geometry_fields:    key_begin / key_end / query_first / query_last of queries/keys idx[i]
#include "attn/mask.cuh"

using namespace cuflash;

namespace {

constexpr int kMT = 2, kNT = 4;

__device__ MaskGeometry make_geometry(int window_left, int window_right, int offset, int seqlen_q, int seqlen_k) {
    MaskGeometry geo;
    geo.window_left = window_left;
    geo.window_right = window_right;
    geo.offset = offset;
    geo.seqlen_q = seqlen_q;
    geo.seqlen_k = seqlen_k;
    return geo;
}

// m16n8 C fragment: lane = 4 g + t, register e of tile (mt, nt) -> row 16 mt + g + 8 (e / 2),
// col 8 nt + 2 t + e % 2 (spelled out here; test_cu_frag checks frag.cuh says the same).
__device__ int row_of(int lane, int mt, int e) { return 16 * mt + lane / 4 + 8 * (e / 2); }
__device__ int col_of(int lane, int nt, int e) { return 8 * nt + 2 * (lane % 4) + e % 2; }

template <bool LOCAL, bool LEFT, bool RIGHT>
__device__ void mask_direct(const float* s, float* out, const int* q0s, const int* k0s, int window_left,
                            int window_right, int offset, int seqlen_q, int seqlen_k, float fill) {
    constexpr int ROWS = 16 * kMT, COLS = 8 * kNT;
    const int c = blockIdx.x, lane = threadIdx.x;
    const float* src = s + c * ROWS * COLS;
    float acc[kMT][kNT][4];
    for (int mt = 0; mt < kMT; ++mt)
        for (int nt = 0; nt < kNT; ++nt)
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = src[row_of(lane, mt, e) * COLS + col_of(lane, nt, e)];
    Mask<LOCAL> mask;
    mask.geo = make_geometry(window_left, window_right, offset, seqlen_q, seqlen_k);
    mask.template apply<LEFT, RIGHT>(acc, q0s[c], k0s[c], lane, fill);
    float* dst = out + c * ROWS * COLS;
    for (int mt = 0; mt < kMT; ++mt)
        for (int nt = 0; nt < kNT; ++nt)
            for (int e = 0; e < 4; ++e) dst[row_of(lane, mt, e) * COLS + col_of(lane, nt, e)] = acc[mt][nt][e];
}

}  // namespace

#define MASK_DIRECT(L, R, LOCAL, LEFT, RIGHT)                                                                   \
    extern "C" __global__ void mask_direct_##L##R(const float* s, float* out, const int* q0s, const int* k0s,  \
                                                  int window_left, int window_right, int offset, int seqlen_q, \
                                                  int seqlen_k, float fill) {                                  \
        mask_direct<LOCAL, LEFT, RIGHT>(s, out, q0s, k0s, window_left, window_right, offset, seqlen_q, seqlen_k, fill);    \
    }
MASK_DIRECT(0, 0, true, false, false)
MASK_DIRECT(0, 1, true, false, true)
MASK_DIRECT(1, 0, true, true, false)
MASK_DIRECT(1, 1, true, true, true)
MASK_DIRECT(1, 1_nolocal, false, true, true)

extern "C" __global__ void mask_transposed(const float* s, float* out, const int* q0s, const int* k0s, int window_left,
                                           int window_right, int offset, int seqlen_q, int seqlen_k, float fill,
                                           int left, int right) {
    constexpr int ROWS = 16, COLS = 8 * kNT;  // rows = keys, cols = queries
    const int c = blockIdx.x, lane = threadIdx.x;
    const float* src = s + c * ROWS * COLS;
    float acc[kNT][4];
    for (int nt = 0; nt < kNT; ++nt)
        for (int e = 0; e < 4; ++e) acc[nt][e] = src[row_of(lane, 0, e) * COLS + col_of(lane, nt, e)];
    Mask<true> mask;
    mask.geo = make_geometry(window_left, window_right, offset, seqlen_q, seqlen_k);
    if (left && right) mask.apply_transposed<true, true>(acc, q0s[c], k0s[c], lane, fill);
    else if (left) mask.apply_transposed<true, false>(acc, q0s[c], k0s[c], lane, fill);
    else if (right) mask.apply_transposed<false, true>(acc, q0s[c], k0s[c], lane, fill);
    else mask.apply_transposed<false, false>(acc, q0s[c], k0s[c], lane, fill);
    float* dst = out + c * ROWS * COLS;
    for (int nt = 0; nt < kNT; ++nt)
        for (int e = 0; e < 4; ++e) dst[row_of(lane, 0, e) * COLS + col_of(lane, nt, e)] = acc[nt][e];
}

// out[4 * i + j] = key_begin(idx[i]), key_end(idx[i]), query_first(idx[i]), query_last(idx[i]).
extern "C" __global__ void geometry_fields(const int* idx, int* out, int n, int window_left, int window_right,
                                           int offset, int seqlen_q, int seqlen_k) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const MaskGeometry geo = make_geometry(window_left, window_right, offset, seqlen_q, seqlen_k);
    out[4 * i + 0] = geo.key_begin(idx[i]);
    out[4 * i + 1] = geo.key_end(idx[i]);
    out[4 * i + 2] = geo.query_first(idx[i]);
    out[4 * i + 3] = geo.query_last(idx[i]);
}
