"""cuflash as a Hugging Face transformers attention implementation (transformers >= 5).

The one-liner:

    import cuflash.integrations.transformers as cuflash_hf

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=cuflash_hf.register(), dtype=torch.bfloat16)
    # or, for a model already loaded: model.set_attn_implementation(cuflash_hf.register())

register() adds "cuattn" to transformers' AttentionInterface (the attention function below) and to
its AttentionMaskInterface (the mask function below), and returns the name.

What runs where:

- **cuflash** runs every call whose mask it can express: causal or not, no padding, grouped-query
  attention (k/v with fewer heads: used as they are, no repeat_kv), sliding windows (the
  `sliding_window` the model passes: a query sees itself and the sliding_window - 1 keys before it,
  as transformers' sliding masks and its flash-attention integration), dropout (module.attention_dropout
  in training), a KV cache (cuflash aligns masks to the bottom right: a query's diagonal is the last
  key it may see, so decoding and chunked prefill need no mask). Tensors (batch, heads, seq, head_dim)
  are transposed to cuflash's (batch, seq, heads, head_dim) layout as views, without copies;
  autograd runs cuflash's backward.
- a batch padded at the end of its rows (training batches) or at their start (generation's
  prefill), without a cache or before it holds anything, runs on cuflash too: the mask function
  marks sdpa's mask with the rows' real tokens (padded_rows), and the attention function runs the
  rows as one packing of variable-length sequences using only those (attention_varlen's
  seqused_q / seqused_k); padded rows come out 0 (no real token reads them). Padding in the
  middle of a row stays sdpa's.
- generate()'s decoding steps over a left-padded cache (each row's padding at its start, the
  queries real) run on cuflash's KV-cache kernels: the mask function marks sdpa's mask with each
  row's pad (left_padded_cache), and the attention function attends to each row's keys from its
  pad on (attention_with_kvcache's cache_leftpad; the cache read in place through the transposed
  view, no copy). Forward only: with autograd, dropout or sinks such a step stays sdpa's (sinks:
  NotImplementedError, below).
- sequences packed into rows and told apart by position_ids (transformers builds a block-diagonal
  mask for them) and chunked attention's chunks (Llama 4) run on cuflash as well: the mask function
  tests "causal within consecutive blocks of each row" (within the sliding window for a sliding
  mask) against sdpa's mask itself and marks it with the blocks' offsets (packed_offsets).
- **transformers' sdpa**, with a one-time warning saying why, runs calls cuflash's kernels cannot:
  any other attention mask with padding (in the middle of rows, a sliding layer's cache past its
  window), mask overlays
  (e.g. bidirectional image tokens), a custom 4D mask, static caches (their masks are built ahead), and shapes or dtypes
  cuflash does not take (float32, head_dim not a multiple of 8 up to 256, tensors not on a CUDA GPU). A
  fallback gives sdpa's results, so the model stays correct. The choice is made by the mask
  function: it returns no mask (None) exactly when the call's mask is plain causal, sliding-window
  causal or bidirectional with nothing padded, and the query's last position is the last key's
  (bottom-right alignment holds); otherwise it returns sdpa's mask, and the attention function
  hands any mask it gets to sdpa.
- `softcap` (Gemma 2's attention logit soft-capping) runs on cuflash's softcap; a softcapped call
  that would have to fall back (a mask, an unsupported shape) raises instead, since sdpa ignores
  softcap.
- flash-attention-style packed sequences given as `cu_seq_lens_q`/`cu_seq_lens_k` (and
  `max_length_q`/`max_length_k`, else read from the offsets) without a mask run on
  `cuflash.attention_varlen` (batch 1: the packed tokens), masks aligned per sequence.
- `s_aux` (gpt-oss's attention sinks) runs on cuflash's `sinks` (cuflash/sinks.py).
- **NotImplementedError**, naming the option, for what neither cuflash nor sdpa would compute
  correctly: sinks or softcap where cuflash cannot run (above), and packed sequences on a call
  cuflash cannot take.

Neither torch nor transformers is imported until register() or a call.
"""
from __future__ import annotations

import warnings

from ..tiles import head_dim_problem

# Not "cuflash": transformers treats any implementation whose name contains "flash" as a
# flash-attention package (is_flash_attention_requested) and tries to import flash_attn's
# functions for it when building a model (seen with Gemma 2 on transformers 5.x).
NAME = "cuattn"
DTYPES = ("torch.float16", "torch.bfloat16")
# kwargs of flash-attention style packing (transformers' FlashAttentionKwargs)
_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k")

_warned: set = set()
_MASK_CHUNK = 1 << 26  # mask entries packed_offsets reads at once


def register(name: str = NAME) -> str:
    """Register cuflash's attention and mask functions with transformers under `name`; returns `name`
    (pass it as attn_implementation). Idempotent. `name` may not contain "flash" (see NAME)."""
    if not isinstance(name, str) or not name or "flash" in name:
        raise ValueError(f"name must be a non-empty string without 'flash' (transformers would take an "
                         f"implementation named so for the flash-attn package), got {name!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name


# ------------------------------------------------------------------------------------------------- mask

def attention_mask(batch_size, q_length, kv_length, **kwargs):
    """transformers mask function: None where cuflash applies the mask itself (see kernel_masks),
    otherwise the 4D boolean mask transformers' sdpa_mask builds (the attention function then falls
    back to sdpa)."""
    from transformers import masking_utils

    if kernel_masks(masking_utils, q_length, kv_length, kwargs):
        return None
    mask = masking_utils.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, **kwargs)
    if mask is None:
        return None
    # sdpa's mask, marked where cuflash can run it as variable-length sequences over the batch's
    # rows: the attention function does so from the mark (and runs any call it cannot, or a mask a
    # model sliced into a new tensor, on sdpa's mask)
    mark = padded_rows(masking_utils, q_length, kv_length, kwargs)
    if mark is None:
        mark = packed_offsets(masking_utils, q_length, kv_length, kwargs, mask)
    if mark is not None:
        mask._cuflash_rows = mark
    else:  # (or the KV cache's kernels over a left-padded cache, each row's keys from its first real one)
        pads = left_padded_cache(masking_utils, q_length, kv_length, kwargs)
        if pads is not None:
            mask._cuflash_leftpad = pads
    return mask


def kernel_masks(mu, q_length, kv_length, kw: dict) -> bool:
    """Whether the mask transformers asks for is one cuflash's kernels apply from the attention
    call's own arguments (is_causal, sliding_window), so no mask tensor is needed.

    mu: transformers.masking_utils. kw: the mask function's keyword arguments (mask_function,
    attention_mask: the 2D padding mask, q_offset, kv_offset, local_size, allow_is_causal_skip,
    allow_is_bidirectional_skip, config). transformers turns allow_is_causal_skip off whenever it
    adds anything to the causal pattern (packed sequences, overlays, block ids) or uses a static
    cache, so with it on the pattern is the plain causal one or, from
    create_sliding_window_causal_mask (local_size = config.sliding_window), the sliding one; chunked
    attention also passes a local_size (config.attention_chunk_size) and is told apart by it.
    """
    padding = kw.get("attention_mask")
    if padding is not None and not (_host_checkable(mu, padding) and bool(padding.all())):
        return False
    return mask_pattern(mu, q_length, kv_length, kw) is not None


def mask_pattern(mu, q_length, kv_length, kw: dict):
    """kernel_masks' test of the mask's pattern, the padding aside: (causal, window_left) for the
    plain causal pattern (left None), the sliding one (local_size - 1) and the bidirectional one
    (False, None); None for any other."""
    mask_function = kw.get("mask_function", mu.causal_mask_function)
    q_offset, kv_offset = kw.get("q_offset", 0), kw.get("kv_offset", 0)
    if not all(type(x) is int for x in (q_length, kv_length, q_offset, kv_offset)):
        return None  # tensors: compiled static caches, tracing
    if kw.get("allow_is_causal_skip", True) and q_offset + q_length == kv_offset + kv_length:
        if mask_function is mu.causal_mask_function:
            return True, None
        left = _sliding_left(kw)
        if left is not None:
            return True, left
    if kw.get("allow_is_bidirectional_skip", False) and mask_function is mu.bidirectional_mask_function:
        return False, None
    return None


def _sliding_left(kw: dict):
    """local_size - 1 where the mask is a sliding window's (local_size = config.sliding_window, and
    not chunked attention's chunk size), else None."""
    local, config = kw.get("local_size"), kw.get("config")
    if local is not None and local == getattr(config, "sliding_window", None) \
            and local != getattr(config, "attention_chunk_size", None):
        return local - 1
    return None


def _host_checkable(mu, padding) -> bool:
    """Whether a padding mask is a 2D tensor whose values may be read (not traced)."""
    is_tracing = getattr(mu, "is_tracing", None)
    return not (is_tracing is not None and is_tracing(padding)) and getattr(padding, "ndim", 2) == 2


# A mask the mask function marks (its attribute _cuflash_rows) is one cuflash runs as variable-length
# sequences over the flattened (batch x seq) rows: (cu_seqlens over those rows, or None for one span
# per row; the longest sequence; their used lengths or None; the window's left or None; causal).

def padded_rows(mu, q_length, kv_length, kw: dict):
    """The mark of a batch padded at the end of its rows (training batches) or at their start
    (generation's prefill), without a cache, with one of kernel_masks' patterns: each row one
    sequence of its real tokens (seqused_q / seqused_k, cuflash/seqused.py). Right padding: one
    span per row, the real tokens first. Left padding: the spans shifted to each row's first real
    token, [b seq + pad_b, (b + 1) seq + pad_(b+1)), the next row's padding their unused tail
    (and a first, empty sequence over row 0's). None otherwise (padding in the middle, a cache,
    another pattern). Reads the mask once (a sync, as kernel_masks' check)."""
    padding = kw.get("attention_mask")
    if padding is None or not _host_checkable(mu, padding):
        return None
    if kw.get("q_offset", 0) != 0 or kw.get("kv_offset", 0) != 0 or q_length != kv_length \
            or tuple(padding.shape[1:]) != (kv_length,):
        return None
    pattern = mask_pattern(mu, q_length, kv_length, kw)
    if pattern is None:
        return None
    import torch

    real = padding.bool()
    b, n = real.shape
    lengths = real.sum(-1, dtype=torch.int32)
    i = torch.arange(n, device=real.device)[None, :]
    right, left = (((i < lengths[:, None]) == real).all(), ((i >= n - lengths[:, None]) == real).all())
    right, left = torch.stack([right, left]).tolist()
    if right:
        return None, n, lengths, pattern[1], pattern[0]
    if not left:
        return None
    zero = lengths.new_zeros(1)
    starts = torch.arange(b, device=real.device, dtype=torch.int32) * n + (n - lengths)
    cu = torch.cat([zero, starts, zero + b * n])
    return cu, n, torch.cat([zero, lengths]), pattern[1], pattern[0]


def packed_offsets(mu, q_length, kv_length, kw: dict, mask):
    """The mark where sdpa's mask `mask` (batch, 1, seq, seq) is causal attention within
    consecutive blocks of each row, and within a sliding window where the mask is a sliding one
    (_sliding_left): sequences packed into rows and told apart by position_ids, or chunked
    attention's chunks; the blocks' offsets (int32, the mask's device) over the flattened rows. No
    padding and no cache. The hypothesis is tested against the mask itself (one pass over it): a
    mask it does not describe exactly gives None and stays sdpa's. Two syncs."""
    q_offset, kv_offset = kw.get("q_offset", 0), kw.get("kv_offset", 0)
    if kw.get("attention_mask") is not None:
        return None
    if not all(type(x) is int for x in (q_length, kv_length, q_offset, kv_offset)):
        return None
    if q_offset or kv_offset or q_length != kv_length or getattr(mask, "ndim", 0) != 4 \
            or tuple(mask.shape[1:]) != (1, q_length, kv_length) or str(getattr(mask, "dtype", "")) != "torch.bool":
        return None
    is_tracing = getattr(mu, "is_tracing", None)
    if is_tracing is not None and is_tracing(mask):
        return None
    import torch

    left = _sliding_left(kw)
    m = mask[:, 0]
    b, n = m.shape[0], q_length
    i = torch.arange(n, device=m.device)
    # by chunks of rows (at most _MASK_CHUNK entries at once): the mask is seq x seq, and the
    # temporaries of a whole pass would be as large again as it (GBs at 32k tokens)
    rows = max(1, _MASK_CHUNK // max(1, b * n))
    chunks = [slice(r, r + rows) for r in range(0, n, rows)]
    first = torch.cat([torch.where(m[:, c].any(-1), m[:, c].to(torch.uint8).argmax(-1), n) for c in chunks], 1)
    starts = first == i  # a row that sees no earlier key (first: its first visible key) begins a block
    block = torch.cummax(torch.where(starts, i, -1), dim=-1).values  # each row's block's first row
    lo = block if left is None else torch.maximum(block, i - left)
    same = torch.stack([((i >= lo[:, c, None]) & (i <= i[c, None]) == m[:, c]).all() for c in chunks])
    if not bool(same.all()):
        return None
    flat = starts.reshape(-1).nonzero().reshape(-1)
    cu = torch.cat([flat, flat.new_tensor([b * n])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max()), None, left, True


def left_padded_cache(mu, q_length, kv_length, kw: dict):
    """The mark of a decoding step (or a chunk of queries) over a cache whose rows are padded at
    their start (generate()'s batches), with one of kernel_masks' patterns: each row's keys from its
    first real one (attention_with_kvcache's cache_leftpad, cuflash/cache_leftpad.py), the queries
    the row's last q_length positions, all of them real. (pads int32 on the padding's device,
    window_left or None, causal); None otherwise (no cache yet: padded_rows' case; padding in the
    middle or at the end; a query position that is padding; a cache that does not start at
    position 0, as a sliding layer's past its window). Reads the mask once (a sync)."""
    padding = kw.get("attention_mask")
    if padding is None or not _host_checkable(mu, padding):
        return None
    if kw.get("kv_offset", 0) != 0 or not 0 < q_length < kv_length or tuple(padding.shape[1:]) != (kv_length,):
        return None
    pattern = mask_pattern(mu, q_length, kv_length, kw)
    if pattern is None:
        return None
    import torch

    real = padding.bool()
    lengths = real.sum(-1, dtype=torch.int32)
    i = torch.arange(kv_length, device=real.device)[None, :]
    if not bool((((i >= kv_length - lengths[:, None]) == real).all() & (lengths >= q_length).all()).item()):
        return None
    return (kv_length - lengths).to(torch.int32), pattern[1], pattern[0]


# -------------------------------------------------------------------------------------------- attention

def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, sliding_window: int | None = None, softcap: float | None = None,
                      **kwargs):
    """transformers attention function: query (batch, heads, seq_q, head_dim), key and value (batch,
    heads_kv, seq_k, head_dim); returns (attn_output (batch, seq_q, heads, head_dim), None)."""
    softcap = float(softcap or 0.0)  # Gemma 2's attn_logit_softcapping: cuflash's softcap (0: off)
    sinks = kwargs.get("s_aux")  # gpt-oss's attention sinks: cuflash's sinks (one logit per query head)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    packed = [n for n in _VARLEN_KWARGS if kwargs.get(n) is not None]
    rows = _marked_rows(attention_mask, query, key, value, causal, sliding_window) \
        if attention_mask is not None and not packed else None
    if rows is not None:  # a mask the mask function marked: the batch's rows as variable-length sequences
        cu, longest, lengths, window = rows
        extra = {} if sinks is None else {"sinks": sinks}
        out = _cuflash_rows(query, key, value, cu, longest, lengths, causal=causal, softmax_scale=scaling,
                            window_size=window, dropout_p=float(dropout or 0.0), softcap=softcap, **extra)
        return out, None
    padded = _marked_leftpad(attention_mask, query, key, value, causal, sliding_window, dropout, sinks) \
        if attention_mask is not None and not packed else None
    if padded is not None:  # a step over a left-padded cache: the KV cache's kernels from each row's pad
        pads, window = padded
        return _cuflash_leftpad(query, key, value, pads, causal=causal, softmax_scale=scaling, window_size=window,
                                softcap=softcap), None
    if attention_mask is not None and sinks is not None:
        raise NotImplementedError("cuflash attention: attention sinks (s_aux) with an attention mask (padding, "
                                  "packed sequences) would fall back to sdpa, which has no sinks; use "
                                  "attn_implementation='eager' for such batches")
    if attention_mask is not None and softcap:
        raise NotImplementedError(f"cuflash attention: softcap={softcap!r} with an attention mask (padding, packed "
                                  f"sequences) would fall back to sdpa, which ignores softcap; use "
                                  f"attn_implementation='eager' for such batches")
    if attention_mask is not None:
        _warn_once("mask", "cuflash attention: this call has an attention mask (padding, packed sequences, chunked "
                           "attention, a mask overlay or a custom mask), which cuflash's kernels do not take; it runs "
                           "on transformers' sdpa attention")
        return _sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    window = (-1, -1)
    if sliding_window is not None and sliding_window > 0:
        # A bidirectional window comes without a mask only where sdpa_mask skipped it (it covers every
        # key): plain attention, left to sdpa as transformers would run it.
        if not causal:
            _warn_once("bidir-window", "cuflash attention: a bidirectional sliding window without a mask runs on "
                                       "transformers' sdpa attention")
            return _sdpa(module, query, key, value, None, dropout, scaling, is_causal, kwargs)
        window = (int(sliding_window) - 1, 0)
    why = unsupported(query, key, value)
    if packed:  # flash-attention style packing: cuflash's variable-length batches
        if len(packed) != 2:
            raise ValueError("cuflash attention: cu_seq_lens_q and cu_seq_lens_k must be given together")
        if why or query.shape[0] != 1:
            raise NotImplementedError(f"cuflash attention: packed sequences (cu_seq_lens_q/k) on a call cuflash "
                                      f"cannot take ({why or f'batch {query.shape[0]}, packing needs batch 1'}); "
                                      f"use attn_implementation='eager' or pass an attention mask")
        out = _cuflash_varlen(query.transpose(1, 2)[0], key.transpose(1, 2)[0], value.transpose(1, 2)[0],
                              kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], kwargs.get("max_length_q"),
                              kwargs.get("max_length_k"), causal=causal, softmax_scale=scaling, window_size=window,
                              dropout_p=float(dropout or 0.0), softcap=softcap)
        return out[None], None
    if why and sinks is not None:
        raise NotImplementedError(f"cuflash attention: attention sinks (s_aux) on a call cuflash cannot take ({why}) "
                                  f"would fall back to sdpa, which has no sinks; use attn_implementation='eager'")
    if why and softcap:
        raise NotImplementedError(f"cuflash attention: softcap={softcap!r} on a call cuflash cannot take ({why}) would "
                                  f"fall back to sdpa, which ignores softcap; use attn_implementation='eager'")
    if why:
        _warn_once("shape:" + why, f"cuflash attention: {why}; those calls run on transformers' sdpa attention")
        mask, sdpa_causal = sdpa_mask_for(query, key, causal, window)
        return _sdpa(module, query, key, value, mask, dropout, scaling, sdpa_causal, kwargs)
    extra = {} if sinks is None else {"sinks": sinks}
    out = _cuflash(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=causal,
                   softmax_scale=scaling, window_size=window, dropout_p=float(dropout or 0.0), softcap=softcap,
                   **extra)
    return out, None


def unsupported(query, key, value) -> str | None:
    """Why cuflash's kernels cannot take these tensors, or None."""
    if str(query.dtype) not in DTYPES:
        return f"dtype {str(query.dtype).replace('torch.', '')} is not supported by cuflash (float16, bfloat16)"
    if not (query.dtype == key.dtype == value.dtype):
        return "query, key and value differ in dtype"
    if getattr(query.device, "type", None) != "cuda":
        return f"tensors on {query.device} (cuflash runs on CUDA GPUs)"
    d = query.shape[-1]
    if head_dim_problem(d) or key.shape[-1] != d or value.shape[-1] != d:
        return f"head_dim {d} (value {value.shape[-1]}) is not supported by cuflash (a multiple of 8 up to 256)"
    if key.shape[1] == 0 or query.shape[1] % key.shape[1]:
        return f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} key/value heads"
    return None


def sdpa_mask_for(query, key, causal: bool, window: tuple):
    """(attn_mask, is_causal) for sdpa that give cuflash's bottom-right aligned causal/window mask
    (sdpa's own is_causal is top-left aligned): no mask where sdpa's flags say the same (no mask at
    all; causal with seq_q == seq_k; a single query, which sees every key), else a boolean
    (1, 1, seq_q, seq_k) mask."""
    nq, nk = query.shape[-2], key.shape[-2]
    if window == (-1, -1) and (not causal or nq == nk or nq == 1):
        return None, bool(causal)
    import torch

    from ..mask import MaskOptions

    left, right, offset = MaskOptions.of(causal=causal, window_size=window).geometry(nq, nk)
    i = torch.arange(nq, device=query.device)[:, None] + offset
    j = torch.arange(nk, device=query.device)[None, :]
    return ((j >= i - left) & (j <= i + right))[None, None], False


def _cuflash(q, k, v, **options):
    """cuflash on transformers' tensors ((batch, seq, heads, head_dim) views). Decoding-shaped calls
    without autograd (a GQA group's query heads x queries within the decode kernel's tile: cached
    generation) run the KV-cache decode kernel over the whole cache, which reads each cached key
    once per group instead of once per query head; the rest run cuflash.attention."""
    from ..api import attention

    if _decode_shaped(q, k, v, options):
        from ..kvcache import attention_with_kvcache

        return attention_with_kvcache(q, k, v, cache_seqlens=k.shape[1], causal=options["causal"],
                                      softmax_scale=options["softmax_scale"], window_size=options["window_size"],
                                      softcap=options["softcap"])
    return attention(q, k, v, **options)


def _decode_shaped(q, k, v, options) -> bool:
    import torch

    from ..families import DECODE
    from ..kvcache import DECODE_ROWS

    if options.get("dropout_p") or options.get("sinks") is not None:  # (the KV-cache path takes neither)
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    heads, heads_kv = q.shape[2], k.shape[2]
    return heads_kv > 0 and heads // heads_kv * q.shape[1] <= DECODE_ROWS and q.shape[-1] in DECODE.defaults


def _marked_rows(attention_mask, query, key, value, causal: bool, sliding_window):
    """(cu_seqlens, longest, lengths, window) of a mask the mask function marked, for a call cuflash
    can take (its tensors; its causal flag and window the mask's own); else None."""
    mark = getattr(attention_mask, "_cuflash_rows", None)
    if mark is None or unsupported(query, key, value) is not None:
        return None
    cu, longest, lengths, left, mark_causal = mark
    window = (int(sliding_window) - 1, 0) if sliding_window is not None and sliding_window > 0 else (-1, -1)
    if causal != mark_causal or window != ((-1, -1) if left is None else (left, 0)):
        return None  # (the pattern the mask was read with is not this call's)
    return cu, longest, lengths, window


def _marked_leftpad(attention_mask, query, key, value, causal: bool, sliding_window, dropout, sinks):
    """(pads, window) of a mask left_padded_cache marked, for a call the KV cache's path takes (its
    tensors; no dropout, sinks or autograd: that path is forward only; its causal flag and window the
    mask's own); else None."""
    mark = getattr(attention_mask, "_cuflash_leftpad", None)
    if mark is None or dropout or sinks is not None or unsupported(query, key, value) is not None:
        return None
    import torch

    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return None
    pads, left, mark_causal = mark
    window = (int(sliding_window) - 1, 0) if sliding_window is not None and sliding_window > 0 else (-1, -1)
    if causal != mark_causal or window != ((-1, -1) if left is None else (left, 0)):
        return None
    return pads, window


def _cuflash_leftpad(query, key, value, pads, **options):
    """attention_with_kvcache over transformers' (batch, heads, seq, head_dim) cache as it is (views),
    row b's keys from position pads[b] on. Returns (batch, seq_q, heads, head_dim)."""
    from ..kvcache import attention_with_kvcache

    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    return attention_with_kvcache(q, k, v, cache_seqlens=k.shape[1], cache_leftpad=pads, **options)


def _cuflash_rows(query, key, value, cu, longest, lengths, **options):
    """attention_varlen over the rows of transformers' (batch, heads, seq, head_dim) tensors as one
    packing (views where the layout allows), sequences at offsets cu over it (None: one per row),
    `lengths` their used lengths (seqused_q = seqused_k; None: all rows); rows no sequence uses
    come out 0 (no used query reads them). Returns (batch, seq, heads, head_dim)."""
    import torch

    from ..varlen import attention_varlen

    b, n = query.shape[0], query.shape[2]
    if cu is None:
        cu = torch.arange(b + 1, device=query.device, dtype=torch.int32) * n
    q, k, v = (x.transpose(1, 2).reshape(b * n, x.shape[1], x.shape[3]) for x in (query, key, value))
    used = {} if lengths is None else {"seqused_q": lengths, "seqused_k": lengths}
    out = attention_varlen(q, k, v, cu, cu, longest, longest, **used, **options)
    return out.reshape(b, n, query.shape[1], value.shape[-1])


def _cuflash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **options):
    """attention_varlen over transformers' packing (batch 1): q (total_q, heads, head_dim), ... The
    longest sequences, when transformers does not pass them, are read from the offsets (a sync)."""
    from ..varlen import attention_varlen

    if max_q is None:
        max_q = int((cu_q[1:] - cu_q[:-1]).max()) if cu_q.shape[0] > 1 else 0
    if max_k is None:
        max_k = int((cu_k[1:] - cu_k[:-1]).max()) if cu_k.shape[0] > 1 else 0
    return attention_varlen(q, k, v, cu_q, cu_k, int(max_q), int(max_k), **options)


def _sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)
