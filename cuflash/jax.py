"""cuflash for JAX: attention usable inside jax.jit and differentiable (jax.custom_vjp).

    import cuflash.jax

    @jax.jit
    def loss(q, k, v):
        return cuflash.jax.attention(q, k, v, causal=True).astype(jnp.float32).sum()

    jax.grad(loss, argnums=(0, 1, 2))(q, k, v)   # cuflash's backward

q: (batch, seqlen_q, heads, head_dim), k and v: (batch, seqlen_k, heads_kv, head_dim), float16 or
bfloat16 on one CUDA GPU, as cuflash.attention (GQA/MQA, causal, window_size, alignment,
softmax_scale, deterministic, backend mean the same). The forward and the backward are
`jax.experimental.buffer_callback`s (cuflash/_jax_ops.py): XLA calls them when the compiled program
reaches them, with its CUDA stream and its device buffers, and cuflash's kernels run on that
stream writing into XLA's buffers, so no host synchronisation and no host round trip are involved
(unlike jax.pure_callback). The forward's lse is the residual the backward uses, with q, k, v and
out (FlashAttention's backward recomputes the probabilities from it).

jax.vmap works: the callbacks are batched with vmap_method="broadcast_all" (an operand without the
mapped axis is broadcast to it) and fold the mapped axes into the batch, one launch per call.

Not supported: dropout (NotImplementedError), forward-mode differentiation (jax.jvp; only reverse
mode, through custom_vjp), several devices in one call (shard_map cuflash.jax.attention per device). Shapes and options are checked when the
function is traced, with cuflash's messages naming the argument.

Memory: cuflash's workspaces (and the backward's gradients before they are copied into XLA's
buffers) come from CuPy's memory pool, outside XLA's. JAX preallocates 75% of the GPU by default;
set XLA_PYTHON_CLIENT_PREALLOCATE=false (or XLA_PYTHON_CLIENT_MEM_FRACTION) before importing jax
so that CuPy has room.

This module imports jax; `import cuflash` does not import it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.buffer_callback import buffer_callback

from . import _jax_ops as ops

__all__ = ["attention"]


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, window_size: tuple = (-1, -1),
              alignment: str = "bottom_right", deterministic: bool = False, dropout_p: float = 0.0,
              backend: str | None = None, return_lse: bool = False, softcap: float = 0.0):
    """Exact softmax attention of jax arrays, jit-compatible and differentiable (reverse mode).

    Arguments as cuflash.attention's (see its docstring); dropout_p must be 0. Returns out (like q),
    or (out, lse) with return_lse=True: lse float32 (batch, heads, seqlen_q), not differentiable
    (its cotangent is dropped: lax.stop_gradient). Gradients flow to q, k and v through cuflash's
    backward (deterministic=True: bitwise reproducible dq).
    """
    opts = ops.options(causal=causal, softmax_scale=softmax_scale, window_size=window_size, alignment=alignment,
                       deterministic=deterministic, dropout_p=dropout_p, backend=backend, softcap=softcap)
    ops.check_forward(q, k, v, opts)
    out, lse = _attention(q, k, v, opts)
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, opts):
    return _forward(q, k, v, opts)


def _attention_fwd(q, k, v, opts):
    out, lse = _forward(q, k, v, opts)
    return (out, lse), (q, k, v, out, lse)


def _attention_bwd(opts, residuals, cotangents):
    dout, _ = cotangents  # lse's cotangent: zero (stop_gradient in attention)
    q, k, v, out, lse = residuals
    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in ops.backward_results(q, k, v)]
    dq, dk, dv = buffer_callback(_backward_callback(opts), shapes, vmap_method="broadcast_all")(
        dout.astype(out.dtype), q, k, v, out, lse)
    return dq, dk, dv


_attention.defvjp(_attention_fwd, _attention_bwd)


def _forward(q, k, v, opts):
    (out_shape, out_dtype), (lse_shape, lse_dtype) = ops.forward_results(q, v)
    shapes = [jax.ShapeDtypeStruct(out_shape, out_dtype), jax.ShapeDtypeStruct(lse_shape, jnp.dtype(lse_dtype))]
    out, lse = buffer_callback(_forward_callback(opts), shapes, vmap_method="broadcast_all")(q, k, v)
    return out, lse


# One callback object per option set: the callback is a parameter of the traced primitive, so a fresh
# partial per call would defeat JAX's caches (eager calls would compile anew each time).
@functools.lru_cache(maxsize=None)
def _forward_callback(opts):
    return functools.partial(ops.forward_callback, opts=opts)


@functools.lru_cache(maxsize=None)
def _backward_callback(opts):
    return functools.partial(ops.backward_callback, opts=opts)
