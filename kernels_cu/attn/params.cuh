// cuflash/kernels_cu/attn/params.cuh
// The runtime parameter structs, one per pass: what every mainloop takes after its data pointers
// (`const FwdParams& params`). The generated extern "C" shells (cuflash/_compile.py) declare the
// struct's fields as scalar kernel parameters, in the host mirror's order, and gather them into
// one of these (scalar parameters stay constant-bank operands; one aggregate parameter cost up to
// +32 registers and spills). The data pointers stay separate leading parameters (they change per
// call); everything else a kernel needs is here, built once per plan on the host.
//
// Host mirror: cuflash/params.py (NumPy structured dtypes, C layout). The shells assign every
// field by name (a missing one fails the compile) and assert sizeof; tests/test_params.py checks
// the offset and type of every field. Layout rules: 8-byte fields first, then 4-byte fields; the
// dropout trio (drop_seed, drop_threshold, drop_scale) is contiguous (the only fields that change
// per call: the host replaces them when dropout is on).
//
// Strides are in elements and 64-bit, per tensor (batch, seqlen, head); head_dim's stride is 1.
// head_dim is the call's (a multiple of 8); an instance of head dim D > head_dim (V::kPartialD)
// zero-fills the columns >= head_dim of its tiles on load and skips them on store.
// Mask geometry: the canonical (window_left, window_right, offset) of attn/mask.cuh, computed on
// the host (cuflash/problem.py, which enforces mask.cuh's integer-range preconditions).
// Scales: scale_log2 is the softmax's factor of the score in exp2 units: softmax_scale * log2(e)
// on raw scores S = Q K^T, or, with softcap c (V::kSoftcap, attn/score_mod.cuh), c * log2(e) on
// the capped scores tanh(S * softcap_scale), softcap_scale = softmax_scale / c (FlashAttention's
// folding: c tanh(softmax_scale S / c) = c * tanh(S * softcap_scale)). `scale` (backward) stays
// softmax_scale: dQ and dK are softmax_scale * dS' K / Q with dS' = dS o (1 - tanh^2).
//
// v1 workspace (pointers, not here): ws_o fp32 (batch*heads, seqlen_q, D) contiguous; ws_ml fp32
// (batch*heads, seqlen_q, 2) = (m, l), m in raw (unscaled) score units. Neither needs initialising.
#pragma once
#include "core/types.cuh"

namespace cuflash {

// The forward pass: flash_fwd (v2) and flash_fwd_v1. o is the output.
struct FwdParams {
    long long q_sb, q_sn, q_sh;
    long long k_sb, k_sn, k_sh;
    long long v_sb, v_sn, v_sh;
    long long o_sb, o_sn, o_sh;
    unsigned long long drop_seed;  // dropout: Philox key, keep threshold (of 2^16), 1/(1-p)
    unsigned int drop_threshold;
    float drop_scale;
    int heads, seqlen_q, seqlen_k;
    int m_blocks;  // query blocks of BR rows per (batch, head): ceil(seqlen_q / BR) of the launched tile
    int window_left, window_right, offset;
    float scale_log2;  // softmax_scale * log2(e); softcap * log2(e) with softcap (see Scales above)
    int tiles;         // work tiles m_blocks * heads * batch; a persistent grid (sm90) strides over them
    int heads_kv;      // heads of k and v (GQA/MQA: fewer than heads, dividing it; MHA: heads)
    int group;         // heads / heads_kv: query head h reads k/v head h / group (1 for MHA)
    float softcap_scale;  // softcap: softmax_scale / softcap, the raw score's factor inside the tanh (0: off; attn/score_mod.cuh)
    int head_dim;      // the call's head dim (<= the instance's D; less only in V::kPartialD instances)
    int align_end;     // V::kVarlen: 1 adds each batch's seqlen_k - seqlen_q to offset (bottom-right alignment); 0 otherwise
    int n_splits;      // V::kSplitKV: blocks per (query block, head, batch), each a slice of the key blocks (else 1)
    int split_blocks;  // V::kSplitKV: key blocks per split
    int page_size;     // V::kPaged: key rows per page of k and v
    int table_stride;  // V::kPaged: block_table's entries per batch (pages per sequence at most)
    float alibi_scale; // V::kAlibi: a softmax-unit bias in score units: 1 / softmax_scale (1 / softcap with softcap)
    int alibi_sb;      // V::kAlibi: alibi_slopes' batch stride in elements (0: one slope per head)
    int bm_sb, bm_sh;  // V::kBlockMask: the batch and head strides of a key-block list row, in query blocks' rows (0: broadcast)
    int bm_nb;         // V::kBlockMask: entries per list (the key blocks of the lists' tile)
    int head_dim_v;    // v's and out's head dim (<= D; other than head_dim only in V::kPartialD instances)
    int seqused_add;   // the decode kernel: added to seqused_k[b] before the clip into [0, seqlen_k] (sm80/decode.cuh)
    int reserved0;     // the tail to 8 bytes, named as cuflash/params.py names every byte; unused
};

// The backward pass, one struct for its four kernels; each reads what it needs:
//   bwd_prep        o, do strides, heads, seqlen_q, seqlen_q_pad, ws_rows
//   flash_bwd_dkdv  q, k, v, do, dk, dv strides, sizes, n_blocks, geometry, scales, dropout
//   flash_bwd_dq    q, k, v, do, dq strides, sizes, m_blocks, geometry, scales, dropout
//   bwd_dq_convert  dq strides, heads, seqlen_q, seqlen_q_pad, scale, q_rows
//   bwd_dkdv_reduce kv_rows, group (GQA only)
// lse2 / delta / dq_acc are padded to seqlen_q_pad rows per (batch, head).
// GQA/MQA (group > 1): the dK/dV kernels read k/v head h / group and write dK/dV per QUERY head
// into expanded (batch, seqlen_k, heads, D) buffers, whose strides dk_s*/dv_s* are;
// bwd_dkdv_reduce sums each group into the (batch, seqlen_k, heads_kv, D) gradients.
struct BwdParams {
    long long q_sb, q_sn, q_sh;
    long long k_sb, k_sn, k_sh;
    long long v_sb, v_sn, v_sh;
    long long o_sb, o_sn, o_sh;     // the forward's output (bwd_prep)
    long long do_sb, do_sn, do_sh;  // its gradient
    long long dq_sb, dq_sn, dq_sh;
    long long dk_sb, dk_sn, dk_sh;
    long long dv_sb, dv_sn, dv_sh;
    long long ws_rows;  // batch * heads * seqlen_q_pad: the padded rows bwd_prep covers
    long long q_rows;   // batch * heads * seqlen_q: the dQ rows bwd_dq_convert covers
    long long kv_rows;  // batch * seqlen_k * heads_kv: the dK/dV rows bwd_dkdv_reduce writes (0: MHA, no reduction)
    unsigned long long drop_seed;
    unsigned int drop_threshold;
    float drop_scale;
    int heads, seqlen_q, seqlen_k, seqlen_q_pad;
    int n_blocks;  // key blocks of the dK/dV tile (BC keys) per (batch, head)
    int m_blocks;  // query blocks of the dQ tile (BR rows) per (batch, head); 0 when flash_bwd_dq does not run
    int window_left, window_right, offset;
    float scale_log2, scale;  // as FwdParams' (softcap * log2(e) with softcap), softmax_scale
    int heads_kv;             // heads of k and v (GQA/MQA: fewer than heads, dividing it; MHA: heads)
    int group;                // heads / heads_kv: query head h reads k/v head h / group (1 for MHA)
    float softcap_scale;      // softcap: softmax_scale / softcap, as FwdParams' (0: off)
    int head_dim;             // the call's head dim (<= the instance's D; less only in V::kPartialD instances)
    int align_end;            // V::kVarlen: as FwdParams' (seqlen_q / seqlen_k are then total_q / total_k, seqlen_q_pad the workspace rows per head)
    float alibi_scale;        // V::kAlibi: as FwdParams' (the dK/dV and dQ kernels multiply it by scale_log2)
    int alibi_sb;             // V::kAlibi: as FwdParams'
    int bm_sb, bm_sh;         // V::kBlockMask: as FwdParams' (both kernels' list rows)
    int bm_nb;                // V::kBlockMask: the dQ kernel's entries per list (its tile's key blocks)
    int bm_mb;                // V::kBlockMask: the dK/dV kernel's entries per transposed list (its tile's query blocks)
    int head_dim_v;           // as FwdParams' (v, out, dout, dv)
    int batch;                // the batch (V::kVarlen: the sequences, past the 65,535 of a grid's z: the row-wise kernels stride over them)
    int det_rotate;           // the sm90 deterministic backward's rotated order (sm90/det_order.cuh; cuflash/_backward.py)
    int head_chunk;           // V::kGroupLoop: > 0: the CTAs in chunks of this many (batch, K/V head)s, the head fastest within one, so each chunk's heaviest key blocks go first (sm90/bwd.cuh); 0: a head's key blocks fastest
};

static_assert(alignof(FwdParams) == 8 && sizeof(FwdParams) == 216, "FwdParams layout changed: update cuflash/params.py");
static_assert(alignof(BwdParams) == 8 && sizeof(BwdParams) == 336, "BwdParams layout changed: update cuflash/params.py");
// (The dropout trio's contiguity and every field's offset and type are checked against cuflash/params.py
// by tests/test_params.py: NVRTC 13.0 does not know __builtin_offsetof, so it cannot be asserted here.)

// For the generated shells' field-type checks (NVRTC has no <type_traits>).
template <class A, class B>
struct same_type {
    static constexpr bool value = false;
};
template <class A>
struct same_type<A, A> {
    static constexpr bool value = true;
};

}  // namespace cuflash
