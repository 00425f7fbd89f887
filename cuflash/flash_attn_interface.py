"""flash-attn 2 compatible entry points: switch a code base with one import.

    from cuflash.flash_attn_interface import flash_attn_func   # was: from flash_attn import ...

The functions take flash-attn 2's arguments with its meanings and return conventions and run
cuflash.attention (so torch tensors get autograd, and CuPy / DLPack arrays work too). Layouts are
flash-attn's: (batch, seqlen, nheads, headdim); packed qkv (batch, seqlen, 3, nheads, headdim) and
kv (batch, seqlen, 2, nheads_k, headdim) are split into strided views, not copied. Every option of
flash-attn 2's signatures is supported (return_attn_probs with a difference, below).

Differences to know:
- return_attn_probs=True returns (out, softmax_lse, None): the attention probabilities
  (S_dmask, a testing aid in flash-attn) are never materialised.
- softcap: flash-attn's (c tanh(softmax_scale q.k / c)), forward and backward; unlike flash-attn 2
  it composes with dropout (flash-attn 2 refuses softcap with dropout_p > 0).
- dropout: flash-attn draws its Philox seed from torch's generator, as cuflash's torch path does
  (cuflash.attention without a seed); the masks differ (different generators), the statistics
  do not.
"""
from __future__ import annotations

__all__ = [
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]


def _run(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs,
         alibi_slopes=None):
    from .api import attention

    window = tuple(window_size) if window_size is not None else (-1, -1)
    res = attention(q, k, v, causal=bool(causal), softmax_scale=softmax_scale, dropout_p=float(dropout_p),
                    deterministic=bool(deterministic), window_size=window, softcap=softcap,
                    return_lse=bool(return_attn_probs), alibi_slopes=alibi_slopes)
    if return_attn_probs:
        out, lse = res
        return out, lse, None
    return res


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2's flash_attn_func: q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k,
    nheads_k, headdim); causal aligned to the bottom right; window_size (left, right), -1 = infinite.
    alibi_slopes: float32 (nheads,) or (batch, nheads), bias -slope |i + seqlen_k - seqlen_q - j|.
    Returns out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse, None) with return_attn_probs."""
    return _run(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs,
                alibi_slopes)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """qkv (batch, seqlen, 3, nheads, headdim): q, k, v as strided views of it (no copy)."""
    q, k, v = (qkv[:, :, i] for i in range(3))
    return _run(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs,
                alibi_slopes)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (batch, seqlen_q, nheads, headdim), kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    return _run(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                return_attn_probs, alibi_slopes)


def _run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                window_size, softcap, alibi_slopes, return_attn_probs, block_table=None, deterministic=False):
    """cuflash.attention_varlen (differentiable on torch tensors)."""
    from .varlen import attention_varlen

    window = tuple(window_size) if window_size is not None else (-1, -1)
    res = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=bool(causal),
                           softmax_scale=softmax_scale, window_size=window, softcap=softcap,
                           return_lse=bool(return_attn_probs), deterministic=bool(deterministic),
                           dropout_p=float(dropout_p), alibi_slopes=alibi_slopes, block_table=block_table)
    if return_attn_probs:
        out, lse = res
        return out, lse, None
    return res


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2's flash_attn_varlen_func: q (total_q, nheads, headdim), k and v (total_k, nheads_k,
    headdim), cu_seqlens int32 (batch + 1,); causal aligned to the bottom right of each sequence.
    cuflash.attention_varlen, differentiable on torch tensors (dropout draws its seed from torch's
    generator). block_table (batch, max_num_blocks_per_seq) int32: k and v are paged caches
    (num_blocks, page_block_size, nheads_k, headdim), any page size, forward only (as flash-attn's).
    Returns out (total_q, nheads, headdim), or (out, softmax_lse (nheads, total_q), None) with
    return_attn_probs."""
    return _run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                       causal, window_size, softcap, alibi_slopes, return_attn_probs, block_table, deterministic)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv (total, 3, nheads, headdim): q, k, v as strided views of it (no copy)."""
    q, k, v = (qkv[:, i] for i in range(3))
    return _run_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                       window_size, softcap, alibi_slopes, return_attn_probs, deterministic=deterministic)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (total_q, nheads, headdim), kv (total_k, 2, nheads_k, headdim)."""
    return _run_varlen(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                       softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                       deterministic=deterministic)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn 2's flash_attn_with_kvcache. Supported: contiguous caches (batch, seqlen_cache,
    nheads_k, headdim) and paged ones (num_blocks, page_block_size, nheads_k, headdim) with
    `block_table`; `cache_seqlens` (per-batch valid lengths) with `k`/`v` appended in place at
    them (cuflash.attention_with_kvcache, forward only); without cache_seqlens and k/v, attention
    over the whole caches (contiguous). num_splits: split-KV decoding there (0: heuristic; 1: none);
    rotary_cos / rotary_sin / rotary_interleaved: rotary embedding of q and k there.
    cache_batch_idx (batch,) integers: batch b uses sequence cache_batch_idx[b] of a contiguous
    cache (batch_cache, seqlen_cache, nheads_k, headdim), for attention and the append; without
    cache_seqlens every batch sees its whole sequence. Not with block_table (as flash-attn).
    cache_leftpad (batch,) integers: batch b's keys start at row cache_leftpad[b] (left-padded
    prompts; k / v still appended at cache_seqlens, rotary positions still from row 0); with
    contiguous caches as flash-attn, and also with block_table or cache_batch_idx. Rotary without
    cache_seqlens raises ValueError (the positions come from it). alibi_slopes: as flash-attn's, on
    every path."""
    if block_table is not None and cache_seqlens is None:
        raise ValueError("flash_attn_with_kvcache: a paged cache (block_table) needs cache_seqlens")
    whole_caches = cache_seqlens is None and k is None and v is None
    if whole_caches and (rotary_cos is not None or rotary_sin is not None):
        raise ValueError("flash_attn_with_kvcache: rotary embedding needs cache_seqlens (its positions)")
    if whole_caches and (cache_batch_idx is not None or cache_leftpad is not None):
        cache_seqlens = int(k_cache.shape[1])  # every batch attends to its whole cache sequence
    if cache_seqlens is not None or k is not None or v is not None:
        from .kvcache import attention_with_kvcache

        if cache_seqlens is None:
            raise ValueError("flash_attn_with_kvcache: appending k/v needs cache_seqlens (where to append)")
        window = tuple(window_size) if window_size is not None else (-1, -1)
        res = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, k_new=k, v_new=v,
                                     causal=bool(causal), softmax_scale=softmax_scale, window_size=window,
                                     softcap=softcap, return_lse=bool(return_softmax_lse), num_splits=num_splits,
                                     rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                     rotary_interleaved=bool(rotary_interleaved), block_table=block_table,
                                     alibi_slopes=alibi_slopes, cache_batch_idx=cache_batch_idx,
                                     cache_leftpad=cache_leftpad)
        return res
    res = _run(q, k_cache, v_cache, 0.0, softmax_scale, causal, window_size, softcap, False, return_softmax_lse,
               alibi_slopes)
    return res[:2] if return_softmax_lse else res
