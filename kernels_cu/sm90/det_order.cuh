// cuflash/kernels_cu/sm90/det_order.cuh
// The Hopper deterministic backward's order of dQ's reductions (sm90/bwd.cuh, DQ_BULK 3): the rank
// of key block n among the key blocks that add into query block m's dQ. Every (m, n) pair the
// kernel visits gets a rank in [0, contributors of m), and the ranks of one m are a permutation
// (tests/test_det_order_twin.py checks both, and simulates the turns), so dQ's fp32 sums are taken
// in one order whatever the CTAs' timing.
//
//   staircase (stride 0: det_stride; every V::kLocal instance): ascending key blocks, from the
//            first that sees m. Every key block walks its query blocks from the last, so key
//            block n reaches m when n - 1 has (a wave's key blocks of one head form a staircase);
//            a CTA waits only for CTAs of lower index.
//   rotated  (stride r >= 1, det_stride; the host allows it where every head's key blocks fit on
//            the GPU at once, and each CTA takes it where its sequence has at least as many query
//            blocks as key blocks or a right bound): each
//            dQ block takes its key blocks in the order they reach it, walking as sm90/bwd.cuh's
//            block_at does:
//            - right-bounded masks (causal; r 1): key block n walks up from its first query block,
//              which never decreases with n, so m is reached by its last key block first: rank =
//              (last key block that sees m) - n, each predecessor a step or more earlier (square
//              causal with 64-row query blocks and 128-key blocks: two steps);
//            - no right bound (every key block sees every query block, M of them; r = M / NB,
//              rounded down, for NB key blocks): key block n walks m = r n, r n + 1, ..., M - 1,
//              0, ..., r n - 1, reaching m at step (m - r n) mod M: m is reached by key blocks
//              a = min(m / r, NB - 1), a - 1, ..., 0, then NB - 1, ..., a + 1, each r or more
//              steps after the one before (time for the predecessor's reduction to complete and
//              its turn to pass before this one's block is staged). A key block then waits for a
//              higher one (the cycle closes through NB - 1 and 0): the reason the host wants a
//              head's CTAs co-resident.
#pragma once
#include "attn/block_range.cuh"
#include "attn/mask.cuh"
#include "attn/params.cuh"

namespace cuflash {

// The CTA's order: 0 the staircase, else rotated with this stride. params.det_rotate (the host,
// cuflash/_backward.py det_rotation) says the grid is in the rotated order's CTA order and every
// group's key blocks fit on the GPU at once; each CTA then rotates where its sequence allows:
// right-bounded masks always (stride 1: the walk is the range's own order), unmasked where the
// sequence has at least as many query blocks as key blocks (stride m_blocks / its key blocks).
template <int BR, int BC, bool LOCAL>
__device__ __forceinline__ int det_stride(const BwdParams& params, int m_blocks, int seqlen_k) {
    if (LOCAL || !params.det_rotate) return 0;
    if (params.window_right < kUnbounded) return 1;
    return m_blocks / ((seqlen_k + BC - 1) / BC);
}

// Key block n's rank at query block m, for the CTA's stride r (det_stride).
template <int BR, int BC, bool LOCAL>
__device__ __forceinline__ int det_rank(const MaskGeometry& geo, const BwdParams& params, int r, int n, int m) {
    const BlockRange keys = key_blocks<BR, BC, LOCAL>(geo, m * BR);  // the key blocks that see query block m
    if (LOCAL || !r) return n - keys.begin;
    if (params.window_right < kUnbounded) return keys.end - 1 - n;
    const int nb = keys.end;           // unmasked: every key block of the sequence (keys.begin 0)
    const int a = min(m / r, nb - 1);  // the first key block to reach m
    return n <= a ? a - n : a + nb - n;
}

}  // namespace cuflash
