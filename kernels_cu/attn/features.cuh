// cuflash/kernels_cu/attn/features.cuh
// The compile-time feature set of one kernel instance, as one type: every mainloop template ends
// in `class V` (a Variant) and reads its members in `if constexpr`. Mirrors the boolean variant
// fields of cuflash/features.py (Features), in the same order: the generated shell passes
// Features.cxx() and static_asserts every member against its Python field (cuflash/_compile.py).
// Adding a feature: a parameter and member here, a `_variant` field in features.py, and the policy
// header that reads it.
#pragma once

namespace cuflash {

template <bool DROPOUT, bool LOCAL, bool SOFTCAP, bool PARTIAL_D, bool SEQUSED_K, bool VARLEN, bool SPLIT_KV, bool PAGED,
          bool ALIBI, bool USER_MOD, bool BLOCK_MASK, bool GROUP_LOOP, bool SINKS>
struct Variant {
    // Fused Philox dropout (attn/dropout.cuh): the plain instances carry no Philox code.
    static constexpr bool kDropout = DROPOUT;
    // The mask has a bounded LEFT window edge (sliding window): only these instances read
    // window_left and run the left-edge block-range and mask code (attn/mask.cuh,
    // attn/block_range.cuh); the others compile it out (it costs up to +46 registers).
    static constexpr bool kLocal = LOCAL;
    // Softcapped scores (Gemma 2, FlashAttention >= 2.6): S <- tanh(S * softcap_scale) before the
    // mask, the softmax scaled by softcap (attn/score_mod.cuh); the backward multiplies dS by the
    // tanh's derivative. A per-element MUFU op on every tile, so its own instantiation.
    static constexpr bool kSoftcap = SOFTCAP;
    // The call's head dim (params.head_dim, a multiple of 8) is less than the instance's D: tile
    // loads zero-fill the columns past it (cp.async src-size 0) and stores skip them, so q, k, v
    // and the outputs are used in place. Zero columns add nothing to Q K^T, dP = dO V^T or delta.
    static constexpr bool kPartialD = PARTIAL_D;
    // Per-batch key lengths (the KV cache, cuflash/kvcache.py): the kernel takes a device array
    // seqused_k (int32, one per batch) after its data pointers; batch b attends to the keys
    // [0, seqused_k[b]) with the mask bottom-right aligned to that length (MaskGeometry::for_batch).
    // params.seqlen_k is then the cache's capacity. Only the sm80 v2 forward has these instances.
    static constexpr bool kSeqUsedK = SEQUSED_K;
    // Variable-length batches (cuflash/varlen.py): q, out are packed (total_q, heads, head_dim), k,
    // v (total_k, heads_kv, head_dim), lse (heads, total_q); the kernel takes cu_seqlens_q and
    // cu_seqlens_k (int32, batch + 1 each) after its other pointers, and batch b is the rows
    // [cu_seqlens_q[b], cu_seqlens_q[b + 1]) against the keys [cu_seqlens_k[b], cu_seqlens_k[b + 1])
    // (attn/mask.cuh, SeqSpan). params.seqlen_q / seqlen_k are then total_q / total_k, and the
    // mask's offset gains each batch's seqlen_k - seqlen_q where params.align_end says so.
    // Only the sm80 v2 forward has these instances.
    static constexpr bool kVarlen = VARLEN;
    // Split-KV ("flash-decoding", cuflash/kvcache.py num_splits): params.n_splits blocks share each
    // (query block, head, batch), split s visiting key blocks [s split_blocks, (s + 1) split_blocks)
    // of its range, and each writes its partial O (normalised over its keys, fp32) and lse to
    // (n_splits, batch, ...) accumulators that the host merges (cuflash.merge_attention). The out
    // pointer is then the fp32 O accumulator. Only the sm80 v2 forward has these instances.
    static constexpr bool kSplitKV = SPLIT_KV;
    // Paged KV caches (cuflash/kvcache.py block_table): k and v are (num_pages, page_size, heads_kv,
    // head_dim) pages, params.k_sb / v_sb their page strides, and batch b's key row r is row
    // r % params.page_size of page block_table[b * params.table_stride + r / params.page_size]
    // (an int32 pointer after seqused_k). Only the decode kernel has these instances.
    static constexpr bool kPaged = PAGED;
    // ALiBi (attn/score_mod.cuh, AlibiBias): every score of (batch b, head h) gains
    // -slope |q + offset - k| in softmax units, offset the mask geometry's (bottom-right or top-left
    // alignment, per batch with kSeqUsedK / kVarlen). The kernel takes a float pointer alibi_slopes
    // after all its other pointers; slope = alibi_slopes[b * params.alibi_sb + h]. A per-element
    // FFMA on every tile, so its own instantiation. The v2 forwards and backwards (sm80, sm90)
    // and the decode kernel (per packed row: its head's slope) have these instances (not v1).
    static constexpr bool kAlibi = ALIBI;
    // A user score / mask modification (cuflash.ScoreMod; attn/score_mod.cuh UserMod): the shell
    // specialises UserModDefs<true> with the caller's CUDA C++ snippets (the snippets' hash joins
    // the kernel name) and the kernel takes a pointer table mod_aux (the snippets' auxiliary arrays)
    // after all its other pointers. With a score snippet the kernel's scores are in softmax units
    // (params.scale_log2 = log2(e), softcap_scale = softmax_scale). The v2 forwards (sm80, sm90).
    static constexpr bool kUserMod = USER_MOD;
    // A block mask (cuflash.BlockMask, attn/block_mask.cuh) for a mask snippet: the kernel takes its
    // per-query-block key-block lists (bm_counts, bm_index) after mod_aux and visits only the
    // listed blocks of each range (BlockList). Every v2 kernel: the forwards (sm80, sm90), the
    // dK/dV kernels (sm80, sm90: from the transposed lists) and the dQ kernel.
    static constexpr bool kBlockMask = BLOCK_MASK;
    // GQA/MQA in the Hopper dK/dV kernel (sm90/bwd.cuh): a CTA per (key block, K/V head, batch) runs
    // the group's query heads one after another, dK and dV summed over the group in its registers
    // and written to dk / dv (heads_kv heads) directly. Only that kernel has these instances.
    static constexpr bool kGroupLoop = GROUP_LOOP;
    // Learnable attention sinks (attn/sinks.cuh): the kernel takes a float pointer sinks (one logit
    // per query head) after all its other pointers, and each row's softmax gains the sink's column
    // in the epilogue (out and lse come out rescaled). The v2 forwards (sm80 without split-KV, sm90);
    // other kernels' results are rescaled after them (cuflash/sinks.py).
    static constexpr bool kSinks = SINKS;
};

}  // namespace cuflash
