"""The public entry points and their dispatch: CuPy fast path, torch custom ops, other DLPack arrays.

cuflash/__init__.py re-exports `attention` and `attention_backward`; their docstrings are the
user documentation.
"""
from __future__ import annotations

from .mask import MaskOptions
from .signature import BWD_ARRAYS

# Filled by the first call with CuPy arrays, so that later CuPy calls cost three `is` tests on top
# of the forward itself (its plan cache keeps the rest of the host overhead flat).
_ndarray = None  # cupy.ndarray
_fwd = None  # cuflash._forward.forward
_tmod = None  # the cuflash._torch module (registers the torch ops), once a torch tensor was seen
_ttensor = None  # torch.Tensor, set with _tmod: plain torch tensors skip _attention's checks as CuPy's do


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False,
              algorithm: str = "v2", deterministic: bool = False, dropout_p: float = 0.0, seed: int | None = None,
              backend: str | None = None, window_size: tuple = (-1, -1), alignment: str = "bottom_right",
              softcap: float | None = 0.0, sinks=None, alibi_slopes=None, score_mod=None, block_mask=None):
    """Exact softmax attention, FlashAttention algorithm, never materialising the N x N matrix.

    q: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim); float16 or
    bfloat16, on one CUDA device, contiguous in the last dimension (other strides are free, e.g.
    slices of a packed qkv array; used without copies). head_dim: any multiple of 8 from 8 to 256
    (32, 64, 96, 128, 192 and 256 have their own kernels; others run the next one's, which reads and
    writes only the call's columns, still in place); the default softmax_scale is 1/sqrt(head_dim)
    of the call. v's head dim may differ from q's and k's (MLA: 192 / 128); out (and the
    backward's dout and dv) then have v's, on the v2 mma.sync kernels (the Hopper ones hand such
    calls to them; algorithm "v1" and the KV cache refuse them). heads_kv is heads
    (multi-head attention) or a divisor of it: grouped-query attention (GQA; MQA with heads_kv 1),
    where query head h attends with k/v head h // (heads // heads_kv), on every kernel (both
    algorithms, both backends) and in the backward. Accepted arrays:

    - CuPy arrays (bf16 as ml_dtypes.bfloat16): results are CuPy arrays; runs on CuPy's current
      stream.
    - torch.Tensor: runs as the custom op `torch.ops.cuflash.attention_fwd` on torch's current
      stream (no sync); differentiable when q, k or v require grad (the backward is
      `cuflash::attention_bwd`); works under torch.compile. Results are torch tensors.
    - jax.Array (eager; under jax.jit use cuflash.jax.attention) and other DLPack arrays on a CUDA
      device: converted zero-copy, results handed back as jax arrays (CuPy arrays for other
      producers); the call synchronises CuPy's current stream before returning (see
      cuflash/_interop.py for why).

    causal: mask aligned to the bottom-right when seqlen_q != seqlen_k (FlashAttention >= 2.1);
        rows that see no key give 0 (and lse -inf).
    window_size: (left, right) sliding window, FlashAttention's: query row i sees keys j with
        i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; -1 = no limit on that
        side (the default, (-1, -1), is no window). With causal=True the right side is at most 0
        (Mistral-style local causal attention: window_size=(w, 0) or (w, -1) with causal).
    alignment: where row i's diagonal sits when seqlen_q != seqlen_k, for causal and the window:
        "bottom_right" (key i + seqlen_k - seqlen_q; FlashAttention >= 2.1, the default) or "top_left"
        (key i; PyTorch SDPA's is_causal).
    softmax_scale: defaults to 1/sqrt(head_dim).
    softcap: c > 0 caps the scores, Gemma 2 style (FlashAttention >= 2.6's softcap): each score
        s = softmax_scale * q.k becomes c * tanh(s / c) before the mask and the softmax (lse is that
        of the capped scores); 0 or None (the default): no cap. Forward and backward, every kernel.
    alibi_slopes: ALiBi (BLOOM, MPT; FlashAttention's alibi_slopes): a float32 array (heads,) or
        (batch, heads) of q's framework and device; each score (after softcap) gains
        -slope * |i + seqlen_k - seqlen_q - j| (|i - j| with alignment="top_left"), causal or not.
        Forward and backward on every v2 kernel (both backends); algorithm "v2" only. Torch tensors: differentiable in
        q, k, v (not the slopes) through an autograd.Function, eager only (not torch.compile yet).
    score_mod: a cuflash.ScoreMod: your own score and/or mask modification as CUDA C++ snippets
        compiled into the kernel (FlexAttention's score_mod / mask_mod over (score, b, h, q_idx,
        kv_idx), with auxiliary arrays; cuflash/score_mods.py says how to write one). The score
        snippet sees softmax_scale * q.k and replaces softcap; the built-in mask and ALiBi apply
        after it. Forward and backward on every v2 kernel (both backends; the backward of a score
        snippet needs its `grad` snippet), torch autograd included (eager, not torch.compile);
        algorithm "v2" only. A snippet that does not compile raises cuflash.ScoreModError naming
        its line.
    block_mask: a cuflash.BlockMask of score_mod's mask snippet (score_mod.block_mask(batch, heads,
        seqlen_q, seqlen_k), made once per mask and shape): the key blocks the mask empties are not
        visited, the result the same bits (cuflash/block_mask.py). Forward and backward
        (attention_backward(block_mask=), torch autograd) on every v2 kernel.
    return_lse: also return the natural-log log-sum-exp per row, float32 (batch, heads, seqlen_q).
        With torch autograd, lse is not differentiable.
    algorithm: "v2" (FlashAttention-2 loop order, the default) or "v1" (FlashAttention-1). The
        backward is the same for both.
    deterministic: for torch autograd, run the backward deterministically (bitwise reproducible dq).
    dropout_p, seed: dropout on the attention probabilities, fused in the kernel (both algorithms):
        a counter-based Philox mask of `seed` (an int in [0, 2^64)), so the same seed gives the same
        mask and the backward regenerates it instead of storing it (pass the same dropout_p and seed
        to attention_backward; torch autograd does it for you, and draws a seed from torch's CPU
        generator when none is given). p is quantised to 1/65536; kept values are scaled by
        1/(1 - p). lse is that of the undropped scores.
    backend: which forward kernel runs (the backward picks its own: on a cc 9.0 GPU the Hopper
        dK/dV kernel at head_dim 64, 128 and 256 where it can run, else mma.sync; CUFLASH_BACKEND applies to
        both). None (the
        default): on a compute capability 9.0 GPU (H100, H200) the Hopper kernel ("sm90": TMA,
        wgmma, warp-specialised) whenever it can take the call (fp16/bf16, head_dim 64/128/192/256, q, k, v
        describable by TMA: positive strides, which cuflash's layout rules nearly always give;
        NVIDIA's cuda-bindings package installed), else the mma.sync kernel ("sm80", any GPU of
        compute capability >= 8.0). "sm80" or "sm90" forces one; forcing "sm90" where it cannot run
        raises ValueError saying why, before any launch. The environment variable CUFLASH_BACKEND
        (sm80, sm90 or auto) sets the default for calls with backend=None; it is read when a call
        signature's launch plan is built (once per shape, not per call). algorithm="v1" has only
        the sm80 kernel (backend="sm90" raises; CUFLASH_BACKEND does not apply).

    sinks: attention sinks (gpt-oss; transformers' s_aux): a float array of one logit per query
        head, of q's framework and device. Each row's softmax then includes one more column with
        that logit and no value, so out is scaled down by the mass the sink takes and lse includes
        it (cuflash/sinks.py). The v2 kernels join the sink in their epilogue; v1's results are
        rescaled after the kernel by one fused pass. Differentiable on torch
        tensors, sinks included; for CuPy arrays, attention_backward with the out and lse returned
        here gives dq, dk, dv, and cuflash.sinks.grad(dout, out, lse, sinks) the sinks' gradient.

    Raises TypeError/ValueError naming the argument before any launch on bad input.
    """
    mask = MaskOptions.of(causal=causal, window_size=window_size, alignment=alignment, softcap=softcap)  # checked
    t = type(q)
    if alibi_slopes is not None or score_mod is not None or block_mask is not None:
        return _attention_alibi(q, k, v, mask, softmax_scale, return_lse, algorithm, deterministic, dropout_p, seed,
                                backend, sinks, alibi_slopes, score_mod, block_mask)
    if sinks is not None:
        return _attention_sinks(q, k, v, mask, softmax_scale, return_lse, algorithm, deterministic, dropout_p, seed,
                                backend, sinks)
    if (t is _ndarray and type(k) is t and type(v) is t and algorithm == "v2"
            and (deterministic is False or deterministic is True)):
        out, lse = _fwd(q, k, v, mask=mask, softmax_scale=softmax_scale, dropout_p=dropout_p, seed=seed,
                        backend=backend)
        return (out, lse) if return_lse else out
    if (t is _ttensor and type(k) is t and type(v) is t and algorithm == "v2" and backend is None
            and (deterministic is False or deterministic is True) and _tmod is not None):  # _attention's checks
        return _tmod.attention(q, k, v, mask, softmax_scale, return_lse, algorithm, deterministic, dropout_p, seed,
                               backend)
    return _attention(q, k, v, mask, softmax_scale, return_lse, algorithm, deterministic, dropout_p, seed, backend)


def _attention(q, k, v, mask, softmax_scale, return_lse, algorithm, deterministic, dropout_p, seed, backend=None):
    from . import families, problem

    problem.check_algorithm(algorithm)
    deterministic = problem.check_flag(deterministic, "deterministic")
    families.check_backend(backend)
    tm = _tmod
    if tm is not None and isinstance(q, tm.Tensor):
        return tm.attention(q, k, v, mask, softmax_scale, return_lse, algorithm, deterministic, dropout_p, seed,
                            backend)

    from . import _interop

    fw, dev = _interop.common_framework((q, k, v), ("q", "k", "v"))
    if fw == _interop.TORCH:
        return _load_torch().attention(q, k, v, mask, softmax_scale, return_lse, algorithm, deterministic,
                                       dropout_p, seed, backend)
    fwd = forward_fn(algorithm)
    if fw == _interop.CUPY:
        out, lse = fwd(q, k, v, mask=mask, softmax_scale=softmax_scale, dropout_p=dropout_p, seed=seed,
                       backend=backend)
    else:
        out, lse = _interop.run(lambda *a: fwd(*a, mask=mask, softmax_scale=softmax_scale, dropout_p=dropout_p,
                                               seed=seed, backend=backend), (q, k, v), fw, dev, ("q", "k", "v"))
    return (out, lse) if return_lse else out


def _attention_alibi(q, k, v, mask, softmax_scale, return_lse, algorithm, deterministic, dropout_p, seed, backend,
                     sinks, alibi_slopes, score_mod=None, block_mask=None):
    """attention(..., alibi_slopes=... and/or score_mod=...): the v2 forward with the slopes as one
    more array (CuPy, or any DLPack framework; torch through an autograd.Function) and the
    ScoreMod's snippets; sinks rescale its results."""
    from . import _interop, families, problem
    from . import sinks as sinks_mod

    what = "alibi_slopes" if score_mod is None else "score_mod"
    if problem.check_algorithm(algorithm) != "v2":
        raise ValueError(f"{what}: the v1 algorithm has no {'ALiBi' if score_mod is None else 'score_mod'} kernels; "
                         "use algorithm='v2'")
    problem.check_flag(deterministic, "deterministic")
    families.check_backend(backend)
    if sinks is not None:
        if len(getattr(q, "shape", ())) != 4:
            raise ValueError(f"q must be (batch, seqlen_q, heads, head_dim), got shape {tuple(getattr(q, 'shape', ()))}")
        sinks_mod.check(sinks, q.shape[2], q)
    arrays, names = (q, k, v), ("q", "k", "v")
    if alibi_slopes is not None:
        arrays, names = (*arrays, alibi_slopes), (*names, "alibi_slopes")
    fw, dev = _interop.common_framework(arrays, names)
    if score_mod is not None:
        from .score_mods import ScoreMod

        if not isinstance(score_mod, ScoreMod):
            raise TypeError(f"score_mod must be a cuflash.ScoreMod, got {type(score_mod).__name__}")
    if block_mask is not None and score_mod is None:
        raise ValueError("block_mask needs the score_mod whose mask snippet it was made from")
    if fw == _interop.TORCH:  # an autograd.Function (differentiable in q, k, v and sinks), eager only
        return _load_torch().attention_sinks(q, k, v, sinks, mask, softmax_scale, return_lse, algorithm,
                                             deterministic, dropout_p, seed, backend, alibi_slopes, score_mod,
                                             block_mask)
    fwd = forward_fn("v2")
    n_main = len(arrays)

    def body(*a):  # the v2 forward: sinks joined in its kernel (cuflash._forward.run_forward)
        slopes = a[3] if alibi_slopes is not None else None
        return fwd(a[0], a[1], a[2], mask=mask, softmax_scale=softmax_scale, dropout_p=dropout_p, seed=seed,
                   backend=backend, alibi_slopes=slopes, score_mod=score_mod, block_mask=block_mask,
                   sinks=sinks_mod.for_kernel(a[n_main]) if len(a) > n_main else None)

    extra = () if sinks is None else (sinks,)
    if fw == _interop.CUPY:
        out, lse = body(*arrays, *extra)
    else:
        out, lse = _interop.run(body, (*arrays, *extra), fw, dev, (*names, *(("sinks",) if extra else ())))
    return (out, lse) if return_lse else out


def _attention_sinks(q, k, v, mask, softmax_scale, return_lse, algorithm, deterministic, dropout_p, seed, backend,
                     sinks):
    """attention(..., sinks=...): the kernels' (out, lse), rescaled by cuflash/sinks.py; torch
    through its own autograd.Function (the sinks' gradient included)."""
    from . import _interop, families, problem
    from . import sinks as sinks_mod

    v1 = problem.check_algorithm(algorithm) == "v1"
    deterministic = problem.check_flag(deterministic, "deterministic")
    families.check_backend(backend)
    if len(getattr(q, "shape", ())) != 4:
        raise ValueError(f"q must be (batch, seqlen_q, heads, head_dim), got shape {tuple(getattr(q, 'shape', ()))}")
    sinks_mod.check(sinks, q.shape[2], q)
    fw, dev = _interop.common_framework((q, k, v), ("q", "k", "v"))
    if fw == _interop.TORCH:
        return _load_torch().attention_sinks(q, k, v, sinks, mask, softmax_scale, return_lse, algorithm,
                                             deterministic, dropout_p, seed, backend)
    fwd = forward_fn(algorithm)

    def body(q, k, v, sinks):  # v2: the sinks joined in the kernel (cuflash._forward.run_forward); v1: after it
        if v1:
            return sinks_mod.apply(*fwd(q, k, v, mask=mask, softmax_scale=softmax_scale, dropout_p=dropout_p,
                                        seed=seed, backend=backend), sinks)
        return fwd(q, k, v, mask=mask, softmax_scale=softmax_scale, dropout_p=dropout_p, seed=seed, backend=backend,
                   sinks=sinks_mod.for_kernel(sinks))

    if fw == _interop.CUPY:
        out, lse = body(q, k, v, sinks)
    else:
        out, lse = _interop.run(body, (q, k, v, sinks), fw, dev, ("q", "k", "v", "sinks"))
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, causal: bool = False, softmax_scale: float | None = None,
                       deterministic: bool = False, dropout_p: float = 0.0, seed: int | None = None,
                       window_size: tuple = (-1, -1), alignment: str = "bottom_right", softcap: float | None = 0.0,
                       alibi_slopes=None, score_mod=None, block_mask=None):
    """Gradients (dq, dk, dv) of attention(q, k, v) for the output gradient `dout`.

    `out` and `lse` are the forward's outputs (attention(..., return_lse=True)) for the same q, k, v,
    causal, window_size, alignment, softcap and softmax_scale. dout and out: q's shape and dtype, contiguous in the last dimension;
    lse: float32 (batch, heads, seqlen_q), contiguous. dq, dk, dv have the shapes and dtype of q, k, v.
    GQA/MQA (k, v with heads_kv heads dividing q's): dk and dv have heads_kv heads, each the sum of
    the gradients through its group of query heads (computed per query head, then summed in fp32).
    deterministic: bitwise reproducible dq (no floating-point atomics), at some speed cost.
    dropout_p, seed: those the forward used (the mask is regenerated from the seed).
    alibi_slopes, score_mod: the forward's (a score snippet needs its grad snippet here).
    block_mask: the forward's cuflash.BlockMask (the empty blocks skipped here too; the sm80 kernels).

    Accepts the same frameworks as `attention`, results in the caller's framework (torch: through
    the op `torch.ops.cuflash.attention_bwd`, which is not itself differentiable). Raises
    TypeError/ValueError naming the argument before any launch on bad input.
    """
    mask = MaskOptions.of(causal=causal, window_size=window_size, alignment=alignment, softcap=softcap)
    args = (dout, q, k, v, out, lse)
    t = type(q)
    if (alibi_slopes is None and score_mod is None and block_mask is None and t is _ndarray
            and all(type(a) is t for a in args)
            and (deterministic is False or deterministic is True)):
        from ._backward import backward

        return backward(*args, mask=mask, softmax_scale=softmax_scale, deterministic=deterministic,
                        dropout_p=dropout_p, seed=seed)
    return _attention_backward(args, mask, softmax_scale, deterministic, dropout_p, seed, alibi_slopes, score_mod,
                               block_mask)


def _attention_backward(args, mask, softmax_scale, deterministic, dropout_p, seed, alibi_slopes=None, score_mod=None,
                        block_mask=None):
    from . import _interop, problem

    deterministic = problem.check_flag(deterministic, "deterministic")
    names = BWD_ARRAYS
    if alibi_slopes is not None:
        args, names = (*args, alibi_slopes), (*BWD_ARRAYS, "alibi_slopes")
    tm = _tmod
    torch_args = tm is not None and isinstance(args[1], tm.Tensor)
    fw, dev = (_interop.TORCH, None) if torch_args else _interop.common_framework(args, names)
    if fw == _interop.TORCH:
        return _load_torch().attention_backward(*args[:6], mask, softmax_scale, deterministic, dropout_p, seed,
                                                alibi_slopes, score_mod, block_mask)
    from ._backward import backward

    def run(*a):
        return backward(*a[:6], mask=mask, softmax_scale=softmax_scale, deterministic=deterministic,
                        dropout_p=dropout_p, seed=seed, alibi_slopes=a[6] if len(a) > 6 else None, score_mod=score_mod,
                        block_mask=block_mask)

    if fw == _interop.CUPY:
        _remember_cupy()
        return run(*args)
    return _interop.run(run, args, fw, dev, names)


def forward_fn(algorithm):
    """The CuPy forward of `algorithm` ("v1" or "v2"; anything else raises the argument's error)."""
    from . import problem

    if problem.check_algorithm(algorithm) == "v1":
        from ._forward_v1 import forward_v1

        return forward_v1
    _remember_cupy()
    from . import _forward

    return _forward.forward  # the module attribute, so a patched forward (tests/gpu/test_torch_gpu.py) runs


def _remember_cupy():
    global _ndarray, _fwd
    if _fwd is None:
        import cupy

        from ._forward import forward

        _ndarray, _fwd = cupy.ndarray, forward


def _load_torch():
    global _tmod, _ttensor
    if _tmod is None:
        from . import _torch as tm

        _tmod, _ttensor = tm, tm.Tensor
    return _tmod
