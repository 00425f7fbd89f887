"""The argument lists of attention's forward and backward, and what is derived from them.

    cuflash::attention_fwd(q, k, v, *FWD_OPTIONS) -> (out, lse)
    cuflash::attention_bwd(dout, q, k, v, out, lse, *BWD_OPTIONS) -> (dq, dk, dv)

Arrays and non-tensor options are listed once, the options as (name, torch schema type[, default
in schema syntax]: options added after the first release carry one, and go after those without,
so that positional calls written for the older schema still bind); the torch ops' schema strings,
the options autograd hands from the forward op to the backward op, and the forward op's gradient
tuple (None for each option) come from these lists. The mask options are the fields of
cuflash.mask.MaskOptions, flat (`bool causal`, ...): a field added there is an argument of both
ops here, and `op_options` / `mask_and_options` convert between the record and the flat values.
Imports only cuflash.mask (dataclasses): the public entry points (cuflash/api.py) use the array
names in messages; cuflash/_torch.py registers the ops.
"""
from __future__ import annotations

from .mask import MaskOptions

FWD_ARRAYS = ("q", "k", "v")
BWD_ARRAYS = ("dout", "q", "k", "v", "out", "lse")


MASK_OPTIONS = MaskOptions.schema_options()
MASK_NAMES = tuple(o[0] for o in MASK_OPTIONS)


def _defaults_last(options: tuple) -> tuple:
    """The options in order, those with a schema default (added after the first release) after the
    others: first this module's own (append new ones at the end of the list below), then the mask
    fields' (MaskOptions' field order), so that an op call written for an older schema, with every
    positional argument it knew, still binds. (An option of this module added after a defaulted
    mask field would have to go after it: give _defaults_last an explicit order then.)"""
    group = lambda o: 0 if len(o) == 2 else 1 if o[0] not in MASK_NAMES else 2
    return tuple(sorted(options, key=group))  # stable: each group keeps its order
# seed travels as torch's signed 64-bit `int` (cuflash/_torch.py maps [0, 2^64) onto it).
FWD_OPTIONS = _defaults_last((*MASK_OPTIONS, ("softmax_scale", "float?"), ("algorithm", "str"),
                              ("deterministic", "bool"), ("dropout_p", "float"), ("seed", "int"),
                              ("backend", "str?", "None")))
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


_SCHEMA_DEFAULTS = {"None": None, "True": True, "False": False}


def _python_default(text: str):
    if text in _SCHEMA_DEFAULTS:
        return _SCHEMA_DEFAULTS[text]
    if text.startswith('"'):  # a str default, e.g. "bottom_right" in schema syntax
        return text[1:-1]
    if text.startswith("["):  # an int[] default, e.g. "[-1, -1]": a tuple (hashable, as the record keeps it)
        return tuple(_python_default(x.strip()) for x in text[1:-1].split(",") if x.strip())
    return float(text) if any(c in text for c in ".eE") else int(text)


def op_options(options: tuple, mask: MaskOptions, **others) -> tuple:
    """An op's option values in schema order (FWD_OPTIONS or BWD_OPTIONS): the mask's fields flat,
    the other options by name."""
    return tuple(getattr(mask, o[0]) if o[0] in MASK_NAMES else others[o[0]] for o in options)


def split_options(options: tuple, values: tuple) -> tuple:
    """({mask field: value}, {name: value} of the other options) of an op's option values in
    schema order (FWD_OPTIONS or BWD_OPTIONS). Trailing options with a schema default may be
    missing (the dispatcher drops arguments equal to their default); they take it."""
    if len(values) > len(options):
        raise TypeError(f"expected at most {len(options)} options, got {len(values)}")
    named = {o[0]: (values[i] if i < len(values) else _python_default(o[2])) for i, o in enumerate(options)}
    return {n: named.pop(n) for n in MASK_NAMES}, named


def mask_and_options(options: tuple, values: tuple) -> tuple:
    """(MaskOptions, {name: value} of the other options) of an op's option values (split_options).
    The record is built with MaskOptions' checks: a direct call of the op with a bad mask value
    fails with the public API's message."""
    mask, others = split_options(options, values)
    return MaskOptions.of(**mask), others


def parameters(arrays: tuple, options: tuple) -> list:
    """inspect.Parameter list of an op's Python implementation: the arrays, then the options, with
    their defaults (for `__signature__`: the implementations take the options as *options)."""
    import inspect

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return ([inspect.Parameter(a, kind) for a in arrays]
            + [inspect.Parameter(o[0], kind, **({"default": _python_default(o[2])} if len(o) > 2 else {}))
               for o in options])
