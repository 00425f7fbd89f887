"""MaskOptions: the mask arguments of one call as one record, from the public API to resolve_*.

    mask = MaskOptions.of(causal=True)            # the public API's keywords, checked
    mask.geometry(seqlen_q, seqlen_k)             # (window_left, window_right, offset)

The record carries every option that decides a score before the softmax: which keys a row sees
(causal, window_size, alignment) and the score modifier that runs before the mask (softcap). The
modifier rides here, not in a record of its own, because it needs exactly the same plumbing
(public keyword, torch schema argument, plan key, resolve_*) and nothing else.

The public entry points (cuflash/api.py) build the record once from their keywords and hand it on:
the CuPy forwards and backward take it whole (and put it in their plan keys), the torch ops carry
its fields as flat schema arguments (cuflash/signature.py derives them from the fields below), and
cuflash/problem.py's resolve_* turn it into the canonical mask the kernels take: query row i sees
key k iff i + offset - window_left <= k <= i + offset + window_right (kernels_cu/attn/mask.cuh).

A new mask argument (a window size, top-left alignment, ...) is one field here (its default, torch
schema type and check), one keyword of `of`, and its term in `geometry`; the plumbing between the
API and resolve_* follows. Only the dataclasses module is imported: cuflash/signature.py reads the
fields when cuflash is imported.
"""
from __future__ import annotations

import dataclasses

# A window side that reaches every key: larger than any seqlen, small enough that i + offset +/- it
# stays in a 32-bit int. The kernels use the same value (kernels_cu/attn/mask.cuh, kUnbounded).
UNBOUNDED = 1 << 30


def check_flag(value, name: str) -> bool:
    """A bool option (0 and 1 are accepted as bools, and NumPy's bool and integer scalars)."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:  # without importing NumPy here
        value = value.item()
    if not isinstance(value, (bool, int)) or value not in (0, 1, True, False):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def check_window(value, name: str) -> tuple:
    """A (left, right) window: ints >= -1 each, -1 meaning no limit on that side (FlashAttention's
    window_size). Sides past UNBOUNDED are no limit too (they see every key anyway)."""
    try:
        pair = tuple(value)
    except TypeError:
        raise TypeError(f"{name} must be a pair (left, right) of ints, got {value!r}") from None
    if len(pair) != 2:
        raise ValueError(f"{name} must be a pair (left, right), got {len(pair)} values: {value!r}")
    out = []
    for side, x in zip(("left", "right"), pair):
        if type(x).__module__ == "numpy" and getattr(x, "ndim", None) == 0:
            x = x.item()
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name}: the {side} side must be an int, got {x!r}")
        if x < -1:
            raise ValueError(f"{name}: the {side} side must be >= 0, or -1 for no limit, got {x}")
        out.append(-1 if x >= UNBOUNDED else x)
    return tuple(out)


def check_softcap(value, name: str) -> float:
    """Softcap c (Gemma 2, FlashAttention >= 2.6): 0 or None for none, else a finite float > 0."""
    if value is None:
        return 0.0
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float (> 0, or 0 / None for no softcap), got {value!r}")
    c = float(value)
    if c == 0.0:
        return 0.0
    if not (c > 0.0 and c != float("inf")):  # also NaN
        raise ValueError(f"{name} must be a finite float > 0 (or 0 / None for no softcap), got {value!r}")
    return c


ALIGNMENTS = ("bottom_right", "top_left")


def check_alignment(value, name: str) -> str:
    """Where the causal diagonal and the window sit when seqlen_q != seqlen_k."""
    if value not in ALIGNMENTS:
        raise ValueError(f"{name} must be 'bottom_right' (FlashAttention >= 2.1) or 'top_left' (PyTorch SDPA's "
                         f"is_causal), got {value!r}")
    return value


def _option(default, schema_type: str, check, schema_default: str | None = None):
    """A field of MaskOptions: the public keyword of the same name, its default, its torch schema
    type, and `check(value, name)`, which returns the normalised value or raises TypeError /
    ValueError naming the argument. A field added after the ops' first release gives its default
    in schema syntax (`schema_default`): it then goes after the options of the first release, so
    that positional calls written for the older schema still bind (cuflash/signature.py)."""
    meta = {"schema": schema_type, "check": check}
    if schema_default is not None:
        meta["schema_default"] = schema_default
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class MaskOptions:
    """Which keys each query row may see, as the caller said it (the keywords of cuflash.attention).

    Construction checks and normalises every field (errors name the argument). Compared and
    hashed by value; `key` (the values as a tuple) is what the CuPy entry points' plan keys hold.
    """

    # bottom-right aligned causal mask (FlashAttention >= 2.1): row i sees keys k <= i + seqlen_k - seqlen_q
    causal: bool = _option(False, "bool", check_flag)
    # sliding window (FlashAttention's window_size): row i sees keys k with
    # i + offset - left <= k <= i + offset + right (offset = seqlen_k - seqlen_q), -1 = no limit;
    # with causal the right side is at most 0
    window_size: tuple = _option((-1, -1), "int[]", check_window, schema_default="[-1, -1]")
    # where query row i's diagonal is: key i + seqlen_k - seqlen_q (bottom_right, FlashAttention
    # >= 2.1, the default) or key i (top_left, PyTorch SDPA's is_causal); the window is centred on it
    alignment: str = _option("bottom_right", "str", check_alignment, schema_default='"bottom_right"')
    # softcap c > 0 (0: none): the scores s = softmax_scale q.k become c tanh(s / c) before the mask
    # and the softmax (Gemma 2; FlashAttention >= 2.6's softcap); kernels_cu/attn/score_mod.cuh
    softcap: float = _option(0.0, "float", check_softcap, schema_default="0.0")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](getattr(self, f.name), f.name))
        # The fields' values as a plain tuple, for the plan keys: a tuple hashes in C, where the
        # dataclass's own __hash__ is a Python call that builds one (~90 ns per plan lookup).
        object.__setattr__(self, "key", dataclasses.astuple(self))

    @classmethod
    def of(cls, causal=False, window_size=(-1, -1), alignment="bottom_right", softcap=0.0) -> MaskOptions:
        """The record of the public API's mask keywords, checked. The two bottom-right masks without
        a window or softcap are built once (NO_MASK, CAUSAL): the common call allocates nothing."""
        if (alignment == "bottom_right" and (window_size == (-1, -1) or window_size == [-1, -1])
                and (softcap is None or (type(softcap) in (float, int) and softcap == 0))):
            if causal is False:
                return NO_MASK
            if causal is True:
                return CAUSAL
            return cls(causal=causal)
        return cls(causal=causal, window_size=window_size, alignment=alignment, softcap=softcap)

    @classmethod
    def given(cls, mask, keywords: dict) -> MaskOptions:
        """The mask of an internal entry point (cuflash/_forward.py, _backward.py) that takes either
        the record (`mask=`, what the public API hands on) or the public keywords (`causal=...`,
        as tests, the tuner and scripts write it), not both; neither is no mask."""
        if keywords:
            if mask is not None:
                raise TypeError(f"pass the mask as mask= or as its keywords, not both (got mask= and "
                                f"{', '.join(keywords)})")
            unknown = [k for k in keywords if k not in FIELD_NAMES]
            if unknown:
                raise TypeError(f"unexpected keyword argument {unknown[0]!r} (mask options: {', '.join(FIELD_NAMES)})")
            return cls.of(**keywords)
        if mask is None:
            return NO_MASK
        if type(mask) is not cls:
            raise TypeError(f"mask must be a cuflash.mask.MaskOptions, got {type(mask).__name__}")
        return mask

    def geometry(self, seqlen_q: int, seqlen_k: int) -> tuple:
        """(window_left, window_right, offset), the canonical form the kernels take: bottom-right
        causal is (UNBOUNDED, 0, seqlen_k - seqlen_q), no mask (UNBOUNDED, UNBOUNDED, seqlen_k - seqlen_q),
        a window (left, right) its sides (UNBOUNDED for -1), the right one at most 0 with causal;
        top_left alignment puts the offset at 0."""
        left, right = (UNBOUNDED if w < 0 else w for w in self.window_size)
        if self.causal:
            right = min(right, 0)
        return left, right, (seqlen_k - seqlen_q if self.alignment == "bottom_right" else 0)

    @classmethod
    def schema_options(cls) -> tuple:
        """The fields as the torch ops' options: (name, schema type[, schema default]), in field order."""
        return tuple((f.name, f.metadata["schema"], *((f.metadata["schema_default"],)
                                                      if "schema_default" in f.metadata else ()))
                     for f in dataclasses.fields(cls))


FIELD_NAMES = tuple(f.name for f in dataclasses.fields(MaskOptions))
NO_MASK = MaskOptions()
CAUSAL = MaskOptions(causal=True)
