"""One description of an attention call (`AttnProblem`) and the one pass that validates its arguments.

    p = resolve_forward(q, k, v, mask, softmax_scale, dropout)          # q, k, v: ArrayInfo
    p = resolve_backward(dout, q, k, v, out, lse, mask, softmax_scale, deterministic, dropout)

`mask` is the call's cuflash.mask.MaskOptions (the public API's mask keywords, checked when the
record was built); resolve_* turn it into the canonical mask geometry of the problem.

The CuPy entry points (on plan build), the torch ops and their fakes all call these, so every rule
and message lives here once. Checks run on `ArrayInfo` records (shape, dtype, strides, pointer,
device), not on arrays, so that every rule is testable without a GPU. Messages name the argument,
what it got and what is expected, in the style of FlashAttention's and PyTorch's own checks.

Dropout's (p, seed) are the exception to "once per plan": they change from call to call without
changing the plan, so `resolve_dropout` runs per call and its result is handed to resolve_*.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from .features import SUPPORTED_DTYPES, Features
from .mask import UNBOUNDED, MaskOptions, check_flag  # noqa: F401  (check_flag, UNBOUNDED: re-exported)
from .tiles import head_dim_problem, kernel_head_dim

# cp.async moves 16 bytes at a time: base pointers and row strides must be 16-byte aligned.
ALIGN_BYTES = 16
LSE_DTYPE = "float32"
# UNBOUNDED (cuflash/mask.py): a window side that reaches every key.
# mask.cuh's integer range: every geometry value is UNBOUNDED or below this in magnitude.
GEOMETRY_LIMIT = 1 << 28


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    shape: tuple
    dtype: str  # numpy-style name, e.g. "bfloat16"
    itemsize: int
    strides: tuple  # in bytes, as NumPy/CuPy report them
    ptr: int
    device: int  # CUDA device ordinal


@dataclasses.dataclass(frozen=True)
class Dropout:
    """Fused dropout of one call: the mask is Philox of `seed` (cuflash/philox.py), p quantised to 1/65536."""

    p: float
    seed: int
    kernel_args: tuple  # (seed, threshold, scale) as the kernels' uint64, uint32, float32 scalars



@dataclasses.dataclass(frozen=True)
class AttnProblem:
    """Everything about a call but its data pointers: shapes, layout, options and the canonical mask.

    Mask: query row i sees key k iff i + offset - window_left <= k <= i + offset + window_right
    (and k < seqlen_k). Bottom-right causal is (UNBOUNDED, 0, seqlen_k - seqlen_q), no mask is
    (UNBOUNDED, UNBOUNDED, seqlen_k - seqlen_q) (MaskOptions.geometry). The compile-time features
    follow the geometry: a bounded left edge selects the `local` kernels; softcap > 0 the
    `softcap` kernels.
    """

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int  # query heads (q, out, dout, lse, dq)
    heads_kv: int  # key/value heads (k, v, dk, dv): heads for MHA, a divisor of it for GQA/MQA
    head_dim: int
    dtype: str
    device: int
    # (batch, seqlen, heads) strides in elements of each given tensor ("q", "k", "v"; the backward
    # adds "dout" and "out"); head_dim's stride is 1
    strides: dict = dataclasses.field(hash=False)
    softmax_scale: float
    window_left: int
    window_right: int
    offset: int
    dropout: Dropout | None = None
    deterministic: bool = False  # the backward's dQ without atomics
    softcap: float = 0.0  # scores s = softmax_scale q.k become softcap * tanh(s / softcap); 0: none
    # per-batch key lengths given as a device array (the KV cache, cuflash/kvcache.py): seqlen_k is
    # then the cache's capacity and `offset` is against it; the kernel moves both per batch
    seqused_k: bool = False
    # variable-length batches (cuflash/varlen.py): q, out (total_q, heads, head_dim) and k, v
    # (total_k, heads_kv, head_dim) packed, batch b's rows given by cu_seqlens on the device;
    # seqlen_q / seqlen_k are then the max_seqlen_q / max_seqlen_k the caller promised (the grid
    # covers them), `offset` the window's alone, and align_end whether each batch's kernel adds its
    # own seqlen_k - seqlen_q (bottom-right alignment)
    varlen: bool = False
    total_q: int = 0
    total_k: int = 0
    align_end: bool = False
    # split-KV decoding (cuflash/kvcache.py): blocks per work tile, each over a slice of the keys,
    # writing fp32 partial results the host merges; 1: the plain forward
    n_splits: int = 1
    # paged KV caches (cuflash/kvcache.py block_table): k and v are pages, their "batch" strides the
    # page strides; seqlen_k is the capacity table_stride * page_size
    paged: bool = False
    page_size: int = 0
    table_stride: int = 0
    # ALiBi (check_alibi_slopes): every score gains -slope |i + offset - j| in softmax units, the
    # slopes a float32 device array (heads,) (alibi_sb 0) or (batch, heads) (alibi_sb = heads)
    alibi: bool = False
    alibi_sb: int = 0
    # attention sinks joined in the kernel's epilogue (with_sinks; kernels_cu/attn/sinks.cuh): a
    # float32 device array (heads,), an input after every other pointer
    sinks: bool = False
    # a user modification (cuflash.ScoreMod, with_score_mod): its snippets (score_mods.ModSource); the
    # aux arrays' pointer table is a per-call input (mod_aux)
    mod: object = None
    # a block mask of the mask snippet (cuflash.BlockMask, with_block_mask): its (batch, heads), 1
    # where it broadcasts; the key-block lists of the plan's tile are per-call inputs
    block_mask: tuple | None = None
    # v's head dim where it differs from q's and k's (MLA: 192 / 128), else 0; out, dout and dv have
    # it (`dv` reads either way). The kernels run the instance of the larger one, masking the columns
    # past each (partial_d)
    head_dim_v: int = 0

    def __post_init__(self):
        check_geometry(self.window_left, self.window_right, self.offset)

    @property
    def group(self) -> int:
        """Query heads per key/value head (GQA/MQA; 1 for MHA): query head h reads k/v head h // group."""
        return self.heads // self.heads_kv if self.heads_kv else 1

    @property
    def dv(self) -> int:
        """v's (and out's, dout's, dv's) head dim."""
        return self.head_dim_v or self.head_dim

    @property
    def features(self) -> Features:
        # head_dim: the instantiated one (of the larger of q's and v's); the call's own (self.head_dim,
        # head_dim_v) reach the kernels in the params struct, and smaller ones select the
        # column-masking instances (partial_d)
        d = kernel_head_dim(max(self.head_dim, self.dv))
        return Features(self.dtype, d, self.dropout is not None, local=self.window_left != UNBOUNDED,
                        softcap=self.softcap > 0, partial_d=self.head_dim != d or self.dv != d,
                        seqused_k=self.seqused_k,
                        varlen=self.varlen, split_kv=self.n_splits > 1, paged=self.paged, alibi=self.alibi,
                        user_mod=self.mod is not None, mod=self.mod, block_mask=self.block_mask is not None,
                        sinks=self.sinks)

    @property
    def empty(self) -> bool:
        """A batch, heads or seqlen of 0: nothing to launch (out 0 and lse -inf where seqlen_k alone is 0).
        Varlen: no query or no key in the whole batch (a single empty sequence is the kernel's)."""
        if self.varlen:
            return 0 in (self.batch, self.heads, self.total_q, self.total_k)
        return 0 in (self.batch, self.heads, self.seqlen_q, self.seqlen_k)

    @property
    def causal(self) -> bool:
        """The mask is causal, either alignment: no left edge, right edge on the diagonal (the tuned tables key on it)."""
        return self.window_left == UNBOUNDED and self.window_right == 0


def describe(x, name: str) -> ArrayInfo:
    """ArrayInfo for a CuPy array; TypeError naming `name` for anything else."""
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - cupy is a hard requirement at run time
        raise ImportError("cuflash needs CuPy: pip install 'cuflash[cuda13]' (or [cuda12])") from e
    if not isinstance(x, cupy.ndarray):
        kind = f"{type(x).__module__}.{type(x).__name__}"
        raise TypeError(f"{name} must be a CuPy array on a CUDA device, got {kind}")
    return ArrayInfo(tuple(x.shape), x.dtype.name, x.dtype.itemsize, tuple(x.strides), x.data.ptr, x.device.id)


# ----------------------------------------------------------------------------------- options

def check_softmax_scale(softmax_scale) -> float | None:
    """A positive finite float, or None (the default, 1/sqrt(head_dim), is resolved with the arrays)."""
    if softmax_scale is None:
        return None
    if isinstance(softmax_scale, (bool, np.bool_, str, bytes)):  # float() would take True and "0.1"
        raise TypeError(f"softmax_scale must be a positive finite float or None, got {softmax_scale!r}")
    try:
        scale = float(softmax_scale)
    except (TypeError, ValueError):
        raise TypeError(f"softmax_scale must be a positive finite float or None, got {softmax_scale!r}") from None
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite float or None, got {softmax_scale!r}")
    return scale


def check_algorithm(algorithm) -> str:
    if algorithm != "v2" and algorithm != "v1":
        raise ValueError(f"algorithm must be 'v1' or 'v2', got {algorithm!r}")
    return algorithm


def resolve_dropout(dropout_p, seed) -> Dropout | None:
    """The call's dropout, or None when nothing is dropped (p == 0, or p below the 1/65536 quantum).

    Raises TypeError/ValueError naming the argument (dropout_p in [0, 1); seed required when
    dropout_p > 0, an int in [0, 2^64)). Runs per call: the no-dropout case costs two compares.
    """
    if seed is None and (dropout_p == 0.0 or dropout_p is None):  # the common case, no import
        if dropout_p is None:
            raise TypeError("dropout_p must be a float in [0, 1), got None")
        return None
    from .philox import check_dropout, dropout_scale, dropout_threshold

    check_dropout(dropout_p, seed)
    p = float(dropout_p)
    threshold = dropout_threshold(p)
    if threshold == 0:
        return None
    return Dropout(p, int(seed), (np.uint64(int(seed)), np.uint32(threshold), np.float32(dropout_scale(p))))


# ------------------------------------------------------------------------------------ arrays

def _check_layout(a: ArrayInfo, name: str) -> None:
    if len(a.shape) != 4:
        raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, heads, head_dim), got shape {a.shape}")
    if a.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {a.dtype}; supported dtypes are float16 and bfloat16")
    if why := head_dim_problem(a.shape[-1]):  # before the alignment checks, which it would trip
        raise ValueError(f"{name}: {why}")
    if 0 in a.shape:  # no element is read or written (CuPy gives empty arrays zero strides)
        return
    if a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
        raise ValueError(
            f"{name} must be contiguous in its last dimension (head_dim), got strides {a.strides} bytes; "
            f"call .copy() or ascontiguousarray first")
    if a.ptr % ALIGN_BYTES:
        raise ValueError(f"{name}'s data pointer is not {ALIGN_BYTES}-byte aligned (offset view?); copy it first")
    for dim, s in zip(("batch", "seqlen", "heads"), a.strides[:3]):
        if s % ALIGN_BYTES:
            raise ValueError(
                f"{name}'s {dim} stride ({s} bytes) is not a multiple of {ALIGN_BYTES} bytes; copy it first")


def _element_strides(a: ArrayInfo) -> tuple:
    return tuple(s // a.itemsize for s in a.strides[:3])


def check_geometry(window_left: int, window_right: int, offset: int) -> None:
    """The preconditions kernels_cu/attn/mask.cuh states for a MaskGeometry, which the kernels take
    as is from their parameter struct: each value UNBOUNDED or of magnitude < 2^28 (so that every
    index expression stays in a 32-bit int), and a non-empty window (left + right >= 0).
    Bottom-right causal and no mask satisfy them whenever |seqlen_k - seqlen_q| < 2^28."""
    for name, v in (("window_left", window_left), ("window_right", window_right), ("offset", offset)):
        if not (v == UNBOUNDED and name != "offset" or -GEOMETRY_LIMIT < v < GEOMETRY_LIMIT):
            raise ValueError(f"mask geometry out of the kernels' range: {name} = {v} (must be UNBOUNDED = 2^30 or of "
                             f"magnitude < 2^28; offset = seqlen_k - seqlen_q for a bottom-right mask)")
    if window_left + window_right < 0:
        raise ValueError(f"empty attention window: window_left + window_right = {window_left} + {window_right} < 0")


def resolve_forward(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, mask: MaskOptions, softmax_scale,
                    dropout: Dropout | None = None) -> AttnProblem:
    """The forward's problem; raises TypeError/ValueError naming the first bad argument.

    q is (batch, seqlen_q, heads, head_dim), k (batch, seqlen_k, heads_kv, head_dim) and v
    (batch, seqlen_k, heads_kv, head_dim_v) with heads_kv dividing heads (MHA: equal; GQA: fewer;
    MQA: 1); v's head dim may differ from q's and k's (MLA: 192 / 128), out then has v's.

    `mask` is the call's MaskOptions, `dropout` resolve_dropout's result for the call.
    """
    if type(mask) is not MaskOptions:
        raise TypeError(f"mask must be a cuflash.mask.MaskOptions (e.g. MaskOptions.of(causal=True)), got {mask!r}")
    for a, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_layout(a, name)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got devices {q.device}, {k.device}, {v.device}")
    b, nq, h, d = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same (batch, seqlen, heads), got shapes {k.shape} and {v.shape}")
    bk, nk, hk, dk = k.shape
    if bk != b:
        raise ValueError(f"batch size differs: q has {b}, k and v have {bk}")
    if (h % hk if hk else h):
        raise ValueError(f"number of heads: q has {h}, k and v have {hk}; q's heads must be a multiple of k and v's "
                         f"(grouped-query attention: heads_kv divides heads)")
    if dk != d:
        raise ValueError(f"head_dim differs: q has {d}, k has {dk} (v's may differ from both)")
    if why := head_dim_problem(d):
        raise ValueError(why)
    dv = v.shape[3]
    scale = check_softmax_scale(softmax_scale)
    left, right, offset = mask.geometry(nq, nk)
    return AttnProblem(
        batch=b, seqlen_q=nq, seqlen_k=nk, heads=h, heads_kv=hk, head_dim=d, dtype=q.dtype, device=q.device,
        strides={"q": _element_strides(q), "k": _element_strides(k), "v": _element_strides(v)},
        softmax_scale=1.0 / math.sqrt(d) if scale is None else scale,
        window_left=left, window_right=right, offset=offset, dropout=dropout, softcap=mask.softcap,
        head_dim_v=0 if dv == d else dv)


def check_alibi_slopes(slopes: ArrayInfo, batch: int, heads: int, device: int) -> int:
    """alibi_slopes' batch stride in elements (0 for (heads,), heads for (batch, heads)) after checking
    it: float32, C-contiguous, 4-byte aligned, on q's device (FlashAttention's alibi_slopes)."""
    if slopes.dtype != "float32":
        raise TypeError(f"alibi_slopes must be float32 (one slope per head, or per batch and head), got {slopes.dtype}")
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape (heads,) = ({heads},) or (batch, heads) = ({batch}, {heads}), "
                         f"got shape {tuple(slopes.shape)}")
    contiguous = (4,) if len(slopes.shape) == 1 else (heads * 4, 4)
    if any(n > 1 and st != c for n, st, c in zip(slopes.shape, slopes.strides, contiguous)):
        raise ValueError(f"alibi_slopes must be C-contiguous (strides {contiguous} bytes), got strides {slopes.strides}")
    if slopes.ptr % 4:
        raise ValueError("alibi_slopes' data pointer is not 4-byte aligned; copy it first")
    if slopes.device != device:
        raise ValueError(f"alibi_slopes must be on q's device {device}, got device {slopes.device}")
    return heads if len(slopes.shape) == 2 else 0


def with_sinks(p: AttnProblem, sinks: ArrayInfo | None) -> AttnProblem:
    """`p` with the sinks joined in the kernel (cuflash/sinks.py's check has passed: (heads,)), or `p`
    itself without; the kernels read them as float32, one per query head, 4-byte aligned on q's device."""
    if sinks is None:
        return p
    if sinks.dtype != "float32" or tuple(sinks.shape) != (p.heads,) or (p.heads > 1 and sinks.strides != (4,)):
        raise ValueError(f"the kernels' sinks must be float32 of shape ({p.heads},), contiguous; got {sinks.dtype} "
                         f"{tuple(sinks.shape)} strides {sinks.strides}")
    if sinks.ptr % 4 or sinks.device != p.device:
        raise ValueError(f"sinks must be 4-byte aligned on q's device {p.device}")
    return dataclasses.replace(p, sinks=True)


def with_alibi(p: AttnProblem, slopes: ArrayInfo | None) -> AttnProblem:
    """`p` with ALiBi of these slopes (checked), or `p` itself without."""
    if slopes is None:
        return p
    return dataclasses.replace(p, alibi=True, alibi_sb=check_alibi_slopes(slopes, p.batch, p.heads, p.device))


def with_score_mod(p: AttnProblem, score_mod) -> AttnProblem:
    """`p` with a user modification (a cuflash.ScoreMod, checked against the call), or `p` itself
    without. Its score snippet replaces softcap (write the cap in the snippet), so not both."""
    if score_mod is None:
        return p
    from .score_mods import ScoreMod

    if not isinstance(score_mod, ScoreMod):
        raise TypeError(f"score_mod must be a cuflash.ScoreMod, got {type(score_mod).__name__}")
    if score_mod.source.score is not None and p.softcap:
        raise ValueError("softcap with a score_mod that has a score snippet: write the cap in the snippet "
                         "(score_mod's score is softmax_scale * q.k)")
    score_mod.check_device(p.device)
    return dataclasses.replace(p, mod=score_mod.source)


def with_block_mask(p: AttnProblem, block_mask, score_mod) -> AttnProblem:
    """`p` with a block mask (a cuflash.BlockMask of score_mod's mask snippet, checked against the
    call), or `p` itself without."""
    if block_mask is None:
        return p
    from .block_mask import BlockMask  # (p may be None: the argument checks alone)

    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a cuflash.BlockMask (score_mod.block_mask(...)), got "
                        f"{type(block_mask).__name__}")
    if score_mod is None:
        raise ValueError("block_mask needs the score_mod whose mask snippet it was made from")
    if p.varlen or p.seqused_k or p.n_splits > 1:
        raise NotImplementedError("block_mask with variable-length batches or the KV cache")
    block_mask.check_call(score_mod.source, p.batch, p.heads, p.seqlen_q, p.seqlen_k, p.device)
    return dataclasses.replace(p, block_mask=block_mask.layout)


def resolve_backward(dout: ArrayInfo, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, out: ArrayInfo, lse: ArrayInfo,
                     mask: MaskOptions, softmax_scale, deterministic=False,
                     dropout: Dropout | None = None) -> AttnProblem:
    """The backward's problem; raises TypeError/ValueError naming the first bad argument.

    q, k, v, mask and softmax_scale follow resolve_forward (k and v may have fewer heads than q,
    dividing them: GQA/MQA; dk and dv then have k's heads). `out` (the forward's output) and `dout`
    (the gradient of the loss with respect to it) must have q's shape, dtype and device, and the
    layout rules of q (contiguous last dimension, 16-byte aligned pointer and strides); their head
    dim is v's where v's differs from q's. `lse` is the
    forward's float32 (batch, heads, seqlen_q) log-sum-exp, C-contiguous, on q's device.
    """
    p = resolve_forward(q, k, v, mask, softmax_scale, dropout)
    for a, name in ((out, "out"), (dout, "dout")):
        if a.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {a.dtype}")
        want_shape = (*q.shape[:3], p.dv)
        if a.shape != want_shape:
            what = "q's shape" if p.dv == p.head_dim else "q's shape with v's head dim"
            raise ValueError(f"{name} must have {what} {want_shape}, got shape {a.shape}")
        _check_layout(a, name)
        if a.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got device {a.device}")
    want = (p.batch, p.heads, p.seqlen_q)
    if lse.dtype != LSE_DTYPE:
        raise TypeError(f"lse must be float32 (the forward's log-sum-exp), got dtype {lse.dtype}")
    if tuple(lse.shape) != want:
        raise ValueError(f"lse must have shape (batch, heads, seqlen_q) = {want}, got shape {lse.shape}")
    contiguous = (p.heads * p.seqlen_q * lse.itemsize, p.seqlen_q * lse.itemsize, lse.itemsize)
    if 0 not in lse.shape and any(n > 1 and s != c for n, s, c in zip(lse.shape, lse.strides, contiguous)):
        raise ValueError(f"lse must be C-contiguous (strides {contiguous} bytes), got strides {lse.strides}; "
                         f"pass the lse the forward returned, or a contiguous copy of it")
    if lse.ptr % lse.itemsize:
        raise ValueError(f"lse's data pointer is not {lse.itemsize}-byte aligned; copy it first")
    if lse.device != q.device:
        raise ValueError(f"lse must be on q's device {q.device}, got device {lse.device}")
    return dataclasses.replace(
        p, strides={**p.strides, "dout": _element_strides(dout), "out": _element_strides(out)},
        deterministic=check_flag(deterministic, "deterministic"))
