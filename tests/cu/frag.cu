// tests/cu/frag.cu: harness for kernels_cu/core/frag.cuh (and nothing else).
// frag_map_<MT>x<NT>: one warp; lane writes, for every register [mt][nt][e] of a warp tile
// acc[MT][NT][4], what the header says it holds:
//   out[f][lane][mt][nt][e], f = 0 row, 1 col (FragSm80), 2 query, 3 key (Direct<F>),
//                                4 query, 5 key (Transposed<F>)
//   halves[lane][mt][half] = FragSm80::row_of_half(lane, mt, half)
//   shape = {ROWS, COLS, MT, NT}
#include "core/frag.cuh"

using namespace cuflash;

template <int MT, int NT>
__device__ void frag_map(int* out, int* halves, int* shape) {
    using F = FragSm80<MT, NT>;
    constexpr int N = 32 * MT * NT * 4;
    const int lane = threadIdx.x;
    for (int mt = 0; mt < MT; ++mt)
        for (int nt = 0; nt < NT; ++nt)
            for (int e = 0; e < 4; ++e) {
                const int i = ((lane * MT + mt) * NT + nt) * 4 + e;
                out[0 * N + i] = F::row(lane, mt, e);
                out[1 * N + i] = F::col(lane, nt, e);
                out[2 * N + i] = Direct<F>::query(lane, mt, nt, e);
                out[3 * N + i] = Direct<F>::key(lane, mt, nt, e);
                out[4 * N + i] = Transposed<F>::query(lane, mt, nt, e);
                out[5 * N + i] = Transposed<F>::key(lane, mt, nt, e);
            }
    for (int mt = 0; mt < MT; ++mt)
        for (int half = 0; half < 2; ++half) halves[(lane * MT + mt) * 2 + half] = F::row_of_half(lane, mt, half);
    if (lane == 0) {
        shape[0] = F::ROWS;
        shape[1] = F::COLS;
        shape[2] = F::MT;
        shape[3] = F::NT;
    }
}

#define FRAG_MAP(MT, NT) \
    extern "C" __global__ void frag_map_##MT##x##NT(int* out, int* halves, int* shape) { frag_map<MT, NT>(out, halves, shape); }
FRAG_MAP(1, 1)
FRAG_MAP(1, 8)
FRAG_MAP(2, 4)
FRAG_MAP(4, 2)
