// cuflash/kernels_cu/attn/mask.cuh
// Which (query, key) pairs are visible, in the canonical window form, and the mask applied to
// boundary tiles in fragment coordinates (core/frag.cuh). Block ranges (attn/block_range.cuh)
// are derived from the same MaskGeometry, so a tile is masked exactly when it needs to be.
//
// Canonical form (design/architecture.md §8.1 item 2): query row q sees key k iff
//     q + offset - window_left <= k <= q + offset + window_right   and   k < seqlen_k
// with kUnbounded for "no limit" on a side. Every mask is one of these:
//     no mask              (kUnbounded, kUnbounded, any offset)
//     bottom-right causal  (kUnbounded, 0, seqlen_k - seqlen_q)      <- the API's `causal`
//     top-left causal      (kUnbounded, 0, 0)
//     sliding window       (left, right, seqlen_k - seqlen_q)
// Integer range: every expression here and in block_range.cuh is one row or key index, plus the
// offset, plus one window side, plus at most a tile size. With seqlen_q, seqlen_k, |offset| <
// 2^28 and window sides <= kUnbounded = 2^30 that stays inside int (|.| < 2^30 + 2^29 + 2^16),
// so the sentinel needs no special case anywhere. Windows must not be empty: window_left +
// window_right >= 0 (the host canonicalises an empty mask away).
#pragma once
#include "core/frag.cuh"

namespace cuflash {

constexpr int kUnbounded = 1 << 30;  // window side without a limit

// Where batch b's rows are (V::kVarlen, attn/features.cuh): its queries are rows q_start ..
// q_start + seqlen_q - 1 of the packed q / out / lse, its keys rows k_start .. of the packed k / v.
// Without kVarlen: batch b is its own slice (the batch stride), starting at row 0, and the lengths
// are the call's; nothing is loaded.
struct SeqSpan {
    int q_start, k_start, seqlen_q, seqlen_k;

    template <class V>
    __device__ __forceinline__ static SeqSpan of(const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
                                                 int b, int seqlen_q, int seqlen_k) {
        SeqSpan s{0, 0, seqlen_q, seqlen_k};
        if constexpr (V::kVarlen) {
            s.q_start = cu_seqlens_q[b];
            s.seqlen_q = cu_seqlens_q[b + 1] - s.q_start;
            s.k_start = cu_seqlens_k[b];
            s.seqlen_k = cu_seqlens_k[b + 1] - s.k_start;
        }
        return s;
    }

    // The first row of (batch b, head h) in the backward's fp32 workspaces (lse2, delta, dq_acc;
    // rows of seqlen_q_pad per head). Dense: (b heads + h) seqlen_q_pad. V::kVarlen: per head,
    // the sequences' rows in order, each starting at (q_start + kVarlenRowPad b) rounded down to
    // kVarlenRowPad: 16-byte aligned, and at least ceil(seqlen_q / kVarlenRowPad) kVarlenRowPad rows
    // before the next one starts, so a query block past a sequence's end stays in its own padding.
    // seqlen_q_pad is then total_q + kVarlenRowPad batch, rounded up (cuflash/_backward.py).
    static constexpr int kVarlenRowPad = 128;
    __device__ __forceinline__ static long long varlen_ws_row0(int q_start, int b, int h, int seqlen_q_pad) {
        return (long long)h * seqlen_q_pad + (((long long)q_start + (long long)kVarlenRowPad * b) & ~(long long)(kVarlenRowPad - 1));
    }
    template <class V>
    __device__ __forceinline__ long long ws_row0(int b, int h, int bh, int seqlen_q_pad) const {
        if constexpr (V::kVarlen)
            return varlen_ws_row0(q_start, b, h, seqlen_q_pad);
        else
            return (long long)bh * seqlen_q_pad;
    }

    // One offset again, loaded from memory where it is used (volatile: the compiler cannot keep the
    // first load's value in a register through the mainloop; the backward's kernels sit at their
    // register limit). V::kVarlen only; else 0.
    template <class V>
    __device__ __forceinline__ static int reload(const int* __restrict__ cu_seqlens, int b) {
        int x = 0;
        if constexpr (V::kVarlen) asm volatile("ld.global.nc.s32 %0, [%1];" : "=r"(x) : "l"(cu_seqlens + b));
        return x;
    }

    // Batch b's first query row and query count again, loaded from memory (V::kVarlen; volatile, so
    // the compiler cannot keep the first load's values): the forward's epilogue takes them here
    // instead of holding two registers through the mainloop (the softcap instances spilled).
    template <class V>
    __device__ __forceinline__ static void reload_queries(const int* __restrict__ cu_seqlens_q, int b, int& start,
                                                          int& count) {
        int end;
        asm volatile("ld.global.nc.s32 %0, [%1];" : "=r"(start) : "l"(cu_seqlens_q + b));
        asm volatile("ld.global.nc.s32 %0, [%1];" : "=r"(end) : "l"(cu_seqlens_q + b + 1));
        count = end - start;
    }
};

struct MaskGeometry {
    int window_left, window_right, offset;
    int seqlen_q, seqlen_k;

    // The geometry of a pass's parameter struct (attn/params.cuh: FwdParams, BwdParams), whose
    // window and offset the host computed (cuflash/problem.py checks the preconditions above),
    // for a kernel built with the feature set V (attn/features.cuh). Only V::kLocal instances
    // (sliding window) read window_left; the others take the constant kUnbounded, which the host
    // guarantees equal (cuflash/params.py refuses a bounded left edge for non-local features),
    // and, with Mask<false> and the block ranges' LOCAL = false, compile the left-edge code out:
    // as a runtime value in every kernel it cost up to +46 registers and new spills.
    template <class V, class Params>
    __device__ __forceinline__ static MaskGeometry of(const Params& p) {
        MaskGeometry m;
        m.window_left = V::kLocal ? p.window_left : kUnbounded;
        m.window_right = p.window_right;
        m.offset = p.offset;
        m.seqlen_q = p.seqlen_q;
        m.seqlen_k = p.seqlen_k;
        return m;
    }

    // The geometry of batch b (V::kSeqUsedK, the KV cache): its key length seqused_k[b] instead of
    // params.seqlen_k (the cache's capacity, against which the host computed the offset), and the
    // offset moved with it, so the mask stays bottom-right aligned to the batch's own keys: query i
    // of the n_q new ones sits at key position seqused_k[b] - n_q + i. (The shift keeps bottom-right
    // alignment only; the KV-cache entry point has no top-left option.) Block ranges and tile loads
    // read the result, so they follow. Without kSeqUsedK: the geometry unchanged, no load.
    // NULLABLE (the decode kernel's contiguous instances): a null seqused_k is every batch at
    // seqlen_k, the geometry as it is (a dense call on the decode kernel, cuflash/kvcache.py
    // plan_dense_decode). (Not elsewhere: the test cost the prefill kernel's d96 split-KV instance
    // and the d192 paged decode one 8 B of spills.)
    template <class V, bool NULLABLE = false>
    __device__ __forceinline__ MaskGeometry for_batch(const int* __restrict__ seqused_k, int b) const {
        if constexpr (V::kSeqUsedK) return with_length((NULLABLE && seqused_k == nullptr) ? seqlen_k : seqused_k[b]);
        return *this;
    }

    // The geometry with `len` keys instead of seqlen_k, the offset moved with it (for_batch's step;
    // the decode kernel clips its length first).
    __device__ __forceinline__ MaskGeometry with_length(int len) const {
        MaskGeometry m = *this;
        m.offset = offset + (len - seqlen_k);
        m.seqlen_k = len;
        return m;
    }

    // The geometry of one variable-length batch (V::kVarlen): its own lengths, and the offset the
    // host gave (the window's, alignment aside) plus, when align_end (bottom-right alignment), its
    // seqlen_k - seqlen_q. Without kVarlen: unchanged.
    template <class V>
    __device__ __forceinline__ MaskGeometry for_span(const SeqSpan& s, int align_end) const {
        MaskGeometry m = *this;
        if constexpr (V::kVarlen) {
            m.seqlen_q = s.seqlen_q;
            m.seqlen_k = s.seqlen_k;
            m.offset = offset + (align_end ? s.seqlen_k - s.seqlen_q : 0);
        }
        return m;
    }

    // Query q sees the keys [key_begin(q), key_end(q)) (key_begin may be negative: from key 0).
    __device__ __forceinline__ int key_begin(int q) const { return q + offset - window_left; }
    __device__ __forceinline__ int key_end(int q) const { return min(seqlen_k, q + offset + window_right + 1); }
    // Key k is seen by the queries [query_first(k), query_last(k)] (k < seqlen_k; no seqlen_q clip).
    __device__ __forceinline__ int query_first(int k) const { return k - offset - window_right; }
    __device__ __forceinline__ int query_last(int k) const { return k - offset + window_left; }
    // Under a bounded right edge and no left edge, later query rows see more keys (scheduling hint).
    __device__ __forceinline__ bool later_rows_heavier() const { return window_right < kUnbounded && window_left >= kUnbounded; }
};

// The mask of one call: sets the invisible elements of a warp's score (or probability) tile to
// `fill` (-inf before the softmax, 0 after an exp). Runs only on tiles BlockRange marks, one edge
// at a time: LEFT checks the window's left edge (k >= key_begin(q)), RIGHT the right edge and the
// seqlen_k tail (k < key_end(q)). A tile in the masked head of a range needs LEFT, one in the
// masked tail RIGHT, one in both (a narrow window) both; splitting them keeps the common case
// (causal: tail only) at one compare per element. Checking an edge a tile does not need is
// harmless (it only ever drops invisible elements). LOCAL = false (a feature set without a
// bounded left edge, attn/features.cuh): the left edge is never checked, whatever LEFT says.
template <bool LOCAL>
struct Mask {
    static constexpr bool kLocal = LOCAL;
    MaskGeometry geo;

    // One m16 tile acc[NT][4] whose rows are queries q0 + 0..15 and columns keys k0 + 0..8 NT-1
    // (core/frag.cuh, Direct view): the forward and the dQ kernel.
    template <bool LEFT, bool RIGHT, int NT>
    __device__ __forceinline__ void apply_tile(float (&acc)[NT][4], int q0, int k0, int lane, float fill) const {
        using F = FragSm80<1, NT>;
        constexpr bool kLeft = LEFT && LOCAL;
        if constexpr (kLeft || RIGHT) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int q = q0 + F::row_of_half(lane, 0, half);
                const int kb = geo.key_begin(q), ke = geo.key_end(q);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int k = k0 + F::col(lane, nt, e);
                        if ((kLeft && k < kb) || (RIGHT && k >= ke)) acc[nt][2 * half + e] = fill;
                    }
            }
        }
    }

    // A warp tile acc[MT][NT][4] (rows = queries from q0, cols = keys from k0).
    template <bool LEFT, bool RIGHT, int MT, int NT>
    __device__ __forceinline__ void apply(float (&acc)[MT][NT][4], int q0, int k0, int lane, float fill) const {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) apply_tile<LEFT, RIGHT>(acc[mt], q0 + 16 * mt, k0, lane, fill);
    }

    // The transposed tile of the dK/dV kernel, S^T: one m16 tile acc[NT][4] whose rows are keys
    // k0 + 0..15 and columns queries q0 + 0..8 NT-1 (Transposed<FragSm80<1, NT>>). Query q sees
    // key k iff query_first(k) <= q <= query_last(k) and k < seqlen_k: in query terms the
    // window's right edge gives the lower bound (with the tail: RIGHT) and the left edge the
    // upper bound (LEFT).
    template <bool LEFT, bool RIGHT, int NT>
    __device__ __forceinline__ void apply_transposed(float (&acc)[NT][4], int q0, int k0, int lane, float fill) const {
        using T = Transposed<FragSm80<1, NT>>;
        constexpr bool kLeft = LEFT && LOCAL;
        if constexpr (kLeft || RIGHT) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int k = k0 + T::key(lane, 0, 0, 2 * half);
                const int qf = (k >= geo.seqlen_k ? kUnbounded : geo.query_first(k)), ql = geo.query_last(k);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int q = q0 + T::query(lane, 0, nt, e);
                        if ((RIGHT && q < qf) || (kLeft && q > ql)) acc[nt][2 * half + e] = fill;
                    }
            }
        }
    }
};

}  // namespace cuflash
