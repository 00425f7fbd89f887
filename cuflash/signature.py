"""The argument lists of attention's forward and backward, and what is derived from them.

    cuflash::attention_fwd(q, k, v, *FWD_OPTIONS) -> (out, lse)
    cuflash::attention_bwd(dout, q, k, v, out, lse, *BWD_OPTIONS) -> (dq, dk, dv)

Arrays and non-tensor options are listed once, the options as (name, torch schema type[, default
in schema syntax]: options added after the first release carry one, so that calls written for the
older schema still bind); the torch
ops' schema strings, the options autograd hands from the forward op to the backward op, and the
forward op's gradient tuple (None for each option) come from these lists. No imports: the public
entry points (cuflash/api.py) use the array names in messages; cuflash/_torch.py registers the ops.
"""
from __future__ import annotations

FWD_ARRAYS = ("q", "k", "v")
BWD_ARRAYS = ("dout", "q", "k", "v", "out", "lse")

# seed travels as torch's signed 64-bit `int` (cuflash/_torch.py maps [0, 2^64) onto it).
FWD_OPTIONS = (("causal", "bool"), ("softmax_scale", "float?"), ("algorithm", "str"), ("deterministic", "bool"),
               ("dropout_p", "float"), ("seed", "int"), ("backend", "str?", "None"))
# The backward takes the forward's options but the algorithm and the forward's backend (every
# forward has the one backward).
BWD_OPTIONS = tuple(o for o in FWD_OPTIONS if o[0] not in ("algorithm", "backend"))


def schema(tensors: tuple, options: tuple, n_outputs: int) -> str:
    """A torch.library schema (without the op name): tensors first, then the options, all positional."""
    args = [f"Tensor {t}" for t in tensors] + [f"{o[1]} {o[0]}" + (f"={o[2]}" if len(o) > 2 else "") for o in options]
    return f"({', '.join(args)}) -> ({', '.join(['Tensor'] * n_outputs)})"


FWD_SCHEMA = schema(FWD_ARRAYS, FWD_OPTIONS, 2)
BWD_SCHEMA = schema(BWD_ARRAYS, BWD_OPTIONS, 3)

FWD_ARGS = FWD_ARRAYS + tuple(o[0] for o in FWD_OPTIONS)  # the ops' parameters, in order
BWD_ARGS = BWD_ARRAYS + tuple(o[0] for o in BWD_OPTIONS)

_BWD_FROM_FWD = tuple(FWD_ARGS.index(o[0]) for o in BWD_OPTIONS)
# The forward op's gradients beyond dq, dk, dv: none, one per option.
OPTION_GRADS = (None,) * len(FWD_OPTIONS)


def backward_options(fwd_inputs: tuple) -> tuple:
    """The backward op's options, in its order, from the forward op's inputs (autograd's setup_context)."""
    return tuple(fwd_inputs[i] for i in _BWD_FROM_FWD)
