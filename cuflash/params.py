"""The kernels' runtime parameter structs (kernels_cu/attn/params.cuh), mirrored as NumPy dtypes.

One struct per pass; the device code takes it as one value after the data pointers:

    FwdParams   flash_fwd (v2) and flash_fwd_v1                    FWD, pack_fwd(problem, m_blocks)
    BwdParams   bwd_prep, flash_bwd_dkdv, flash_bwd_dq, bwd_dq_convert   BWD, pack_bwd(problem, ...)

A launch plan packs its struct ONCE and passes it to every launch (cuflash/launch.py) as the
struct's fields, numpy scalars of the mirror's types in the mirror's order (`KernelParams.arg`):
the generated extern "C" kernels (cuflash/_compile.py) declare exactly these scalar parameters
and gather them into the struct. Not the struct by value as one aggregate parameter (CuPy can pass
a size-1 NumPy array so): with an aggregate parameter ptxas holds the fields in registers for the
whole kernel (up to +32 registers and new spills on today's tiles), where scalar parameters stay
constant-bank operands.

Dropout's (seed, threshold, scale) change per call without changing the plan: with dropout on,
`KernelParams.with_dropout` returns the fields with those three replaced; with dropout off the
plan's tuple is passed as is.

The mirror is checked by the compiler: `static_asserts(name)` is C++ asserting sizeof, alignof and
the offset and type of EVERY field, which the CPU tests compile; the generated shells
(cuflash/_compile.py) carry its size/alignment part at every compile.
"""
from __future__ import annotations

import functools

import numpy as np

from .problem import UNBOUNDED, AttnProblem

LOG2E = 1.4426950408889634  # the kernels use exp2: scores are scaled by softmax_scale * log2(e) (softcap * log2(e) with softcap)

_I64, _U64, _I32, _U32, _F32 = "<i8", "<u8", "<i4", "<u4", "<f4"
# NumPy field type -> the C++ type params.cuh declares it with
C_TYPES = {_I64: "long long", _U64: "unsigned long long", _I32: "int", _U32: "unsigned int", _F32: "float"}


def _strides(*tensors) -> list:
    return [(f"{t}_s{d}", _I64) for t in tensors for d in "bnh"]


# The dropout trio: contiguous, replaced per call (see KernelParams.with_dropout).
DROPOUT_FIELDS = [("drop_seed", _U64), ("drop_threshold", _U32), ("drop_scale", _F32)]
GEOMETRY_FIELDS = [("window_left", _I32), ("window_right", _I32), ("offset", _I32)]

FWD_FIELDS = [
    *_strides("q", "k", "v", "o"),
    *DROPOUT_FIELDS,
    ("heads", _I32), ("seqlen_q", _I32), ("seqlen_k", _I32), ("m_blocks", _I32),
    *GEOMETRY_FIELDS,
    ("scale_log2", _F32),
    ("tiles", _I32),  # work tiles: m_blocks * heads * batch (a persistent grid strides over them)
    ("heads_kv", _I32), ("group", _I32),  # GQA/MQA: k/v heads, heads // heads_kv (query head h reads h // group)
    ("softcap_scale", _F32),  # softcap: softmax_scale / softcap, the raw score's factor in the tanh (0: off)
    ("head_dim", _I32),  # the call's head dim (an instance of a larger D masks the columns past it)
    ("align_end", _I32),  # varlen: 1 adds each batch's seqlen_k - seqlen_q to offset (bottom-right); 0 otherwise
    ("n_splits", _I32), ("split_blocks", _I32),  # split-KV: blocks per work tile, key blocks per split
    ("page_size", _I32), ("table_stride", _I32),  # paged KV caches: rows per page, block_table entries per batch
    # ALiBi: the slope's factor to the kernel's score units (1 / softmax_scale; 1 / softcap with
    # softcap), and alibi_slopes' batch stride in elements (0: one slope per head; heads: per batch)
    ("alibi_scale", _F32), ("alibi_sb", _I32),
    # a block mask's key-block lists (cuflash/block_mask.py): the (batch, head) strides of a list row
    # in rows of m_blocks lists (0 where the mask broadcasts), and the entries per list
    ("bm_sb", _I32), ("bm_sh", _I32), ("bm_nb", _I32),
    ("head_dim_v", _I32),  # v's and out's head dim (other than head_dim only in partial_d instances)
    # the decode kernel: added to seqused_k[b] before it clips the length into [0, seqlen_k] (n_new
    # where seqused_k holds the cache's lengths before the append; kernels_cu/sm80/decode.cuh)
    ("seqused_add", _I32),
    ("reserved0", _I32),  # pads the struct to its 8-byte alignment (no implicit padding)
]

BWD_FIELDS = [
    *_strides("q", "k", "v", "o", "do", "dq", "dk", "dv"),
    ("ws_rows", _I64), ("q_rows", _I64),
    ("kv_rows", _I64),  # batch * seqlen_k * heads_kv: the rows bwd_dkdv_reduce writes (0: MHA, no reduction)
    *DROPOUT_FIELDS,
    ("heads", _I32), ("seqlen_q", _I32), ("seqlen_k", _I32), ("seqlen_q_pad", _I32),
    ("n_blocks", _I32), ("m_blocks", _I32),
    *GEOMETRY_FIELDS,
    ("scale_log2", _F32), ("scale", _F32),
    ("heads_kv", _I32), ("group", _I32),  # GQA/MQA, as FwdParams'
    ("softcap_scale", _F32),  # as FwdParams'
    ("head_dim", _I32),  # as FwdParams'
    ("align_end", _I32),  # as FwdParams'
    ("alibi_scale", _F32), ("alibi_sb", _I32),  # as FwdParams'
    # a block mask's lists: FwdParams' strides; entries per list of the dQ kernel (key blocks of its
    # tile) and of the dK/dV kernel (query blocks of its tile: the transposed lists)
    ("bm_sb", _I32), ("bm_sh", _I32), ("bm_nb", _I32), ("bm_mb", _I32),
    ("head_dim_v", _I32),  # as FwdParams' (v, out, dout, dv)
    ("batch", _I32),  # the batch; varlen: the sequences (the row-wise kernels' grid z strides over them)
    # the sm90 deterministic backward's order (kernels_cu/sm90/bwd.cuh, DQ_BULK 3): 1 lets each CTA
    # rotate its key block's walk over its query blocks (the grid in the atomic mode's order; every
    # head's key blocks fit on the GPU at once), 0 keeps the turn staircase's order and grid
    # (cuflash/_backward.py, det_rotation)
    ("det_rotate", _I32),
    ("head_chunk", _I32),  # the sm90 group loop's CTA order under a causal mask (pack_bwd)
]

# The sm90 group loop's CTA chunks under a causal mask (pack_bwd's head_chunk): how many (batch, K/V
# head)s share the heaviest-first order. None: gqa_causal_chunk's L2 rule; batch x heads_kv or more:
# the whole grid.
GQA_CAUSAL_HEAD_CHUNK: int | None = None
# What one chunk's (batch, K/V head)s may keep of the tensors every key block re-reads (their groups'
# Q and dO): FlashAttention-3's L2 "sections" (sized for its forward's K / V) carried over.
GQA_L2_SECTION_BYTES = 32 << 20


def gqa_causal_chunk(p) -> int:
    """The group loop's causal chunk: as many (batch, K/V head)s as keep their groups' Q and dO
    within GQA_L2_SECTION_BYTES, at least one. GQA 32 / 8, d128, N8192, batch 2 (16 MB a K/V head:
    chunks of 2), causal backward, loop / our MHA's TFLOP/s on an H100: the whole grid 0.853 / 0.87,
    chunk 1 0.950 / 0.965, 2 0.957 / 0.99, 4 0.925 / 0.94, 8 0.911 / 0.928 (2026-12-05, two
    sessions): one chunk of the whole grid puts every head's Q and dO in flight past L2. The H200
    read the whole grid at 1.025 and chunk 1 at 0.967 (2026-12-04); chunk 2 there not yet measured."""
    per_head = 2 * p.group * p.seqlen_q * p.head_dim * 2  # Q and dO, 2-byte elements
    return max(1, GQA_L2_SECTION_BYTES // max(per_head, 1))

FWD = np.dtype(FWD_FIELDS, align=True)
BWD = np.dtype(BWD_FIELDS, align=True)
STRUCTS = {"FwdParams": FWD, "BwdParams": BWD}  # C++ name (namespace cuflash) -> mirror


def contiguous_strides(seqlen: int, heads: int, head_dim: int) -> tuple:
    """(batch, seqlen, heads) strides in elements of a fresh C-contiguous (batch, seqlen, heads, head_dim) array."""
    return seqlen * heads * head_dim, heads * head_dim, head_dim


def _set_strides(a, tensor: str, strides) -> None:
    for d, s in zip("bnh", strides):
        a[f"{tensor}_s{d}"] = s


def _set_common(a, p: AttnProblem) -> None:
    if p.window_left != UNBOUNDED and not p.features.local:  # kernels_cu/attn/mask.cuh, MaskGeometry::of
        raise NotImplementedError(f"a bounded left window edge (window_left = {p.window_left}) needs the kernels "
                                  f"built with Features.local; these features are {p.features}")
    a["heads"], a["seqlen_q"], a["seqlen_k"] = p.heads, p.seqlen_q, p.seqlen_k
    a["heads_kv"], a["group"] = p.heads_kv, p.group
    a["head_dim"], a["head_dim_v"] = p.head_dim, p.dv
    a["window_left"], a["window_right"], a["offset"] = p.window_left, p.window_right, p.offset
    if p.softcap:  # score = c tanh(S softcap_scale), softmax over it: exp2 units c log2(e) (attn/score_mod.cuh)
        a["scale_log2"] = np.float32(p.softcap * LOG2E)
        a["softcap_scale"] = np.float32(p.softmax_scale / p.softcap)
    elif _user_score(p):  # the snippet takes softmax_scale S and returns softmax units (attn/score_mod.cuh UserMod)
        a["scale_log2"] = np.float32(LOG2E)
        a["softcap_scale"] = np.float32(p.softmax_scale)
    else:
        a["scale_log2"] = np.float32(p.softmax_scale * LOG2E)
        a["softcap_scale"] = 0.0
    # no dropout: what the DROPOUT=false instantiations would ignore anyway
    a["drop_seed"], a["drop_threshold"], a["drop_scale"] = 0, 0, np.float32(1.0)


def _user_score(p: AttnProblem) -> bool:
    """Whether a user modification rewrites the scores (a mask-only one keeps the kernel's units)."""
    return getattr(p, "mod", None) is not None and p.mod.score is not None


def _set_alibi(a, p: AttnProblem) -> None:
    if p.alibi:  # a bias b in softmax units is b / softmax_scale on S, b / softcap on softcap's t, b
        # itself on a user score snippet's result
        a["alibi_scale"] = np.float32(1.0 / (p.softcap if p.softcap else 1.0 if _user_score(p) else p.softmax_scale))
        a["alibi_sb"] = p.alibi_sb


def _set_block_mask(a, p: AttnProblem) -> None:
    if getattr(p, "block_mask", None) is not None:  # the lists' row strides (entries per row: the plan's tiles)
        bm_batch, bm_heads = p.block_mask
        a["bm_sb"], a["bm_sh"] = (bm_heads if bm_batch > 1 else 0), (1 if bm_heads > 1 else 0)


def pack_fwd(p: AttnProblem, m_blocks: int) -> np.ndarray:
    """FwdParams of a forward plan: q, k, v strides from the problem, o's of a fresh (C-contiguous)
    output; m_blocks = ceil(seqlen_q / block_q) of the launched tile."""
    a = np.zeros(1, FWD)
    for t in ("q", "k", "v"):
        _set_strides(a, t, p.strides[t])
    _set_strides(a, "o", contiguous_strides(p.seqlen_q, p.heads, p.dv))
    _set_common(a, p)
    a["m_blocks"], a["tiles"] = m_blocks, m_blocks * p.heads * p.batch
    a["n_splits"], a["split_blocks"] = 1, 0  # split-KV plans set theirs (cuflash/kvcache.py)
    a["page_size"], a["table_stride"] = p.page_size, p.table_stride  # paged KV caches (0 otherwise)
    _set_alibi(a, p)
    _set_block_mask(a, p)
    if p.varlen:  # packed rows: the kernel finds each batch's by cu_seqlens (kernels_cu/attn/mask.cuh, SeqSpan)
        _set_strides(a, "o", (0, p.heads * p.dv, p.dv))
        a["seqlen_q"], a["seqlen_k"], a["align_end"] = p.total_q, p.total_k, int(p.align_end)
    return a


def pack_bwd(p: AttnProblem, seqlen_q_pad: int, n_blocks: int, m_blocks: int = 0, group_loop: bool = False) -> np.ndarray:
    """BwdParams of a backward plan: q, k, v, out, dout strides from the problem, dq, dk, dv's of
    fresh (C-contiguous) gradients; lse2 / delta / dq_acc rows padded to seqlen_q_pad; n_blocks
    key blocks of the dK/dV tile, m_blocks query blocks of the dQ tile (0: no dQ kernel).

    GQA/MQA (p.group > 1): dk_s*/dv_s* are those of the expanded (batch, seqlen_k, heads,
    head_dim) buffers the dK/dV kernels write per query head, and kv_rows = batch * seqlen_k *
    heads_kv the rows bwd_dkdv_reduce sums them into (0 with group 1: no reduction). `group_loop`
    (the Hopper dK/dV kernel's kGroupLoop, cuflash/_backward.py group_loop): the kernel writes dk, dv
    themselves, (batch, seqlen_k, heads_kv, head_dim), and nothing is reduced (kv_rows 0)."""
    a = np.zeros(1, BWD)
    for t, name in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "out"), ("do", "dout")):
        _set_strides(a, t, p.strides[name])
    _set_strides(a, "dq", contiguous_strides(p.seqlen_q, p.heads, p.head_dim))
    kv_heads = p.heads_kv if group_loop else p.heads  # dk / dv's heads as the dK/dV kernel writes them
    reduced = p.group > 1 and not group_loop
    _set_strides(a, "dk", contiguous_strides(p.seqlen_k, kv_heads, p.head_dim))
    _set_strides(a, "dv", contiguous_strides(p.seqlen_k, kv_heads, p.dv))  # v's head dim
    rows = p.batch * p.heads
    a["ws_rows"], a["q_rows"] = rows * seqlen_q_pad, rows * p.seqlen_q
    a["kv_rows"] = p.batch * p.seqlen_k * p.heads_kv if reduced else 0
    _set_common(a, p)
    a["seqlen_q_pad"], a["n_blocks"], a["m_blocks"] = seqlen_q_pad, n_blocks, m_blocks
    a["batch"] = p.batch
    # the group loop's CTAs take `group` query heads' work each: under a causal mask they go in chunks
    # of (batch, K/V head)s, every head's key block 0 of a chunk first (kernels_cu/sm90/bwd.cuh)
    chunk = GQA_CAUSAL_HEAD_CHUNK or gqa_causal_chunk(p)
    a["head_chunk"] = min(chunk, p.batch * p.heads_kv) if group_loop and p.causal else 0
    a["scale"] = np.float32(p.softmax_scale)
    _set_alibi(a, p)
    _set_block_mask(a, p)
    if p.varlen:  # packed rows (cuflash/_backward.py _plan_varlen; kernels_cu/attn/mask.cuh SeqSpan)
        _set_strides(a, "dq", (0, p.heads * p.head_dim, p.head_dim))
        _set_strides(a, "dk", (0, kv_heads * p.head_dim, p.head_dim))
        _set_strides(a, "dv", (0, kv_heads * p.dv, p.dv))
        a["ws_rows"], a["q_rows"] = p.heads * seqlen_q_pad, 0
        a["kv_rows"] = p.total_k * p.heads_kv if reduced else 0
        a["seqlen_q"], a["seqlen_k"], a["align_end"] = p.total_q, p.total_k, int(p.align_end)
    return a


class KernelParams:
    """A packed struct as the kernels take it: its fields as numpy scalars, in order (the generated
    kernels' scalar parameters): `arg` (the plan's, passed as is) or `with_dropout(...)` (dropout's
    three fields replaced, per call)."""

    __slots__ = ("packed", "arg", "_drop_at")

    def __init__(self, packed: np.ndarray):
        if packed.shape != (1,) or packed.dtype not in STRUCTS.values():
            raise TypeError(f"not a packed parameter struct: {packed.dtype} {packed.shape}")
        self.packed = packed  # the structured view (tests, debugging)
        record = packed[0]
        self.arg = tuple(record[f] for f in packed.dtype.names)  # numpy scalars of the fields' types
        self._drop_at = packed.dtype.names.index("drop_seed")

    def with_dropout(self, kernel_args) -> tuple:
        """`arg` with (drop_seed, drop_threshold, drop_scale) = kernel_args (problem.Dropout.kernel_args)."""
        i = self._drop_at
        return (*self.arg[:i], *kernel_args, *self.arg[i + 3:])


def unpack(scalars: tuple, name: str) -> np.void:
    """The kernel arguments of cuflash::<name> (its fields, in order) as one record (tests, debugging)."""
    a = np.zeros(1, STRUCTS[name])
    for f, x in zip(a.dtype.names, scalars, strict=True):
        a[f] = x
    return a[0]


@functools.lru_cache(maxsize=None)
def fields(name: str) -> tuple:
    """((field, C type), ...) of cuflash::<name>, in order: the generated kernels' scalar parameters."""
    dt = STRUCTS[name]
    return tuple((f, C_TYPES[dt.fields[f][0].str]) for f in dt.names)


@functools.lru_cache(maxsize=None)
def static_asserts(name: str, fields: bool = True) -> str:
    """C++ static_asserts that cuflash::<name> has the mirror's layout: sizeof and alignof, and with
    `fields` per field its offset and type (NVRTC has no <cstddef>: __builtin_offsetof).

    The generated shells carry the size/alignment checks only: NVRTC 13.0 (CUDA 13.0 installs, the
    H200 machine) does not know __builtin_offsetof; NVRTC 13.5 does. The per-field checks run in
    the CPU tests (tests/test_params.py), which compile them with the NVRTC of the test extra."""
    dt = STRUCTS[name]
    cpp = f"cuflash::{name}"
    lines = [f'static_assert(sizeof({cpp}) == {dt.itemsize} && alignof({cpp}) == {dt.alignment}, '
             f'"{name}: size/alignment differ from cuflash/params.py");']
    for field in dt.names if fields else ():
        ftype, off = dt.fields[field][:2]
        ctype = C_TYPES[ftype.str]
        lines.append(f"static_assert(__builtin_offsetof({cpp}, {field}) == {off} && "
                     f"cuflash::same_type<decltype({cpp}::{field}), {ctype}>::value, "
                     f'"{name}::{field}: offset or type differs from cuflash/params.py ({off}, {ctype})");')
    return "\n".join(lines) + "\n"


def _check_mirror() -> None:
    """Every byte of each struct is a named field (so the C++ side cannot hide a field in padding),
    fields in order, 8-byte fields first, the dropout trio contiguous."""
    for name, dt in STRUCTS.items():
        end = 0
        for field in dt.names:
            ftype, off = dt.fields[field][:2]
            assert off == end, f"{name}.{field}: implicit padding before it (offset {off}, expected {end})"
            end = off + ftype.itemsize
        assert end == dt.itemsize and dt.itemsize % 8 == 0 and dt.alignment == 8, name
        seed = dt.fields["drop_seed"][1]
        assert (dt.fields["drop_threshold"][1], dt.fields["drop_scale"][1]) == (seed + 8, seed + 12), name


_check_mirror()
