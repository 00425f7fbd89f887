"""TMA tensor maps for the Hopper forward: what they describe, when they can, and their encoding.

A (batch, seqlen, heads, head_dim) tensor of 16-bit elements with element strides (sb, sn, sh, 1)
is described by a rank-5 map (ThunderKittens' layout; the form was checked on an H200 before the
kernel was written): the 64-column chunks of a row become their own dimension, so that one TMA box of
ROWS rows lands in shared memory as the [chunk][row][64] image the kernel's 128-byte swizzle expects:

    globalDim     (64, seqlen, head_dim // 64, heads, batch)
    globalStrides (sn * 2, 128, sh * 2, sb * 2)          bytes, of dims 1..4
    boxDim        (64, ROWS, head_dim // 64, 1, 1)       ROWS: block_q for q, block_k for k and v
    elementStrides 1, INTERLEAVE_NONE, SWIZZLE_128B, L2_PROMOTION_L2_128B, OOB_FILL_NONE (zeros)

The kernel loads at coordinates {0, row, 0, head, batch} (k and v: the kv head, head // group, of
a GQA/MQA call, whose k and v maps have heads_kv heads); batch and seqlen are separate dimensions,
so rows past a sequence's end are zero-filled, never read from the next batch.

A call whose head dim is below the kernel instance's (Features.partial_d: a head dim between the
instantiated ones, or v's own head dim) takes the rank-4 form, one box per 64-column chunk:

    globalDim     (head_dim, seqlen, heads, batch)
    globalStrides (sn * 2, sh * 2, sb * 2)
    boxDim        (64, ROWS, 1, 1)

loaded at {64 c, row, head, batch} for each chunk c holding a column of the call's: the columns
past head_dim in the last one are out of bounds, which the TMA unit fills with zeros (the kernel
never loads the chunks past it, and zeroes them once).

map_geometry (the tuples) and layout_problem (why a tensor cannot be described) are pure functions;
encode() calls the driver's cuTensorMapEncodeTiled through NVIDIA's `cuda-bindings` package
(imported on first use; the cuda13 / cuda12 extras install it). A map embeds the data pointer, so
it is encoded per call; MapCache keeps the last few per pointer for a launch plan.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

# A CUtensorMap: 128 opaque bytes, passed by value as a size-1 array of one 128-byte element
# (CuPy hands the driver a pointer to a size-1 NumPy array's data; kernels_cu/core/ptx_sm90.cuh,
# cuflash::TmaMap).
MAP_BYTES = 128
MAP_DTYPE = np.dtype([("opaque", "<u8", (16,))])

# CUtensorMapDataType of the 16-bit element types (cuda.h)
DATA_TYPES = {"bfloat16": 9, "float16": 6}
ELEMENT_BYTES = 2
INTERLEAVE_NONE, SWIZZLE_128B, L2_PROMOTION_L2_128B, OOB_FILL_NONE = 0, 3, 2, 0

CHUNK = 64  # elements of one 128-byte swizzle row: the inner box extent
ALIGN = 16  # the global address and every stride: multiples of 16 bytes
MAX_STRIDE = 1 << 40  # strides below 2^40 bytes
MAX_DIM = 1 << 32  # extents at most 2^32
MAX_BOX = 256  # box extents at most 256


@dataclasses.dataclass(frozen=True)
class MapGeometry:
    """cuTensorMapEncodeTiled's arguments for one tensor, but the pointer."""

    data_type: int
    dims: tuple  # 5 extents, innermost first
    strides: tuple  # 4 byte strides, of dims 1..4
    box: tuple  # 5 box extents


def _extents_and_strides(shape: tuple, strides: tuple, itemsize: int) -> tuple:
    """(b, n, h, d) and byte strides (sb, sn, sh) as TMA takes them: a dimension of extent 1 is
    never stepped along, so its stride (which frameworks leave arbitrary) is replaced by that of a
    C-contiguous tensor of this shape."""
    b, n, h, d = shape
    dense = (n * h * d * itemsize, h * d * itemsize, d * itemsize)
    sb, sn, sh = (s if extent > 1 else c for s, extent, c in zip(strides[:3], (b, n, h), dense))
    return (b, n, h, d), (sb, sn, sh)


def map_geometry(shape: tuple, strides: tuple, dtype: str, rows: int, partial: bool = False) -> MapGeometry:
    """The map of a (batch, seqlen, heads, head_dim) tensor with byte `strides` (as NumPy/CuPy give
    them, 4 entries, the last the element size) whose TMA boxes are `rows` rows of one head: all its
    64-column chunks in one box, or (`partial`: a column-masking instance) the rank-4 form of one
    chunk per box (module docstring)."""
    (b, n, h, d), (sb, sn, sh) = _extents_and_strides(shape, strides, ELEMENT_BYTES)
    if partial:
        return MapGeometry(DATA_TYPES[dtype], (d, n, h, b), (sn, sh, sb), (CHUNK, rows, 1, 1))
    return MapGeometry(DATA_TYPES[dtype], (CHUNK, n, d // CHUNK, h, b), (sn, CHUNK * ELEMENT_BYTES, sh, sb),
                       (CHUNK, rows, d // CHUNK, 1, 1))


def layout_problem(shape: tuple, strides: tuple, dtype: str, itemsize: int, name: str = "tensor",
                   ptr: int | None = None, partial: bool = False) -> str | None:
    """Why no tensor map of map_geometry's form (`partial`: its rank-4 form) can describe this
    tensor, or None. `strides` in bytes (4 entries); `ptr` (the data pointer) checked when given."""
    if dtype not in DATA_TYPES or itemsize != ELEMENT_BYTES:
        return f"{name} has dtype {dtype}; TMA maps here are for float16 and bfloat16"
    if len(shape) != 4 or len(strides) != 4:
        return f"{name} must be (batch, seqlen, heads, head_dim), got shape {shape}"
    b, n, h, d = shape
    if d % (8 if partial else CHUNK):  # (a row of the rank-4 form: whole 16-byte units)
        return f"{name}'s head_dim {d} is not a multiple of {8 if partial else CHUNK}"
    if d > 1 and strides[3] != itemsize:
        return f"{name} is not contiguous in head_dim (strides {strides} bytes)"
    if ptr is not None and ptr % ALIGN:
        return f"{name}'s data pointer is not {ALIGN}-byte aligned"
    if any(x > MAX_DIM for x in shape):
        return f"{name}'s shape {shape} has an extent above 2^32"
    _, eff = _extents_and_strides(shape, strides, itemsize)
    for dim, s in zip(("batch", "seqlen", "heads"), eff):
        if s <= 0:
            return (f"{name}'s {dim} stride is {s} bytes; TMA needs positive strides "
                    f"(a broadcast or reversed view: copy it, or run the sm80 backend)")
        if s % ALIGN:
            return f"{name}'s {dim} stride ({s} bytes) is not a multiple of {ALIGN} bytes"
        if s >= MAX_STRIDE:
            return f"{name}'s {dim} stride ({s} bytes) is not below 2^40"
    return None


def tensor_layout(p, name: str) -> tuple:
    """(shape, byte strides) of tensor `name` ("q", "k", "v", and a backward problem's "out",
    "dout") of an AttnProblem (whose strides are in elements). k and v have heads_kv heads (GQA/MQA:
    the kernels load k/v head h // group for query head h)."""
    kv = name in ("k", "v")
    n = p.seqlen_k if kv else p.seqlen_q  # q, out, dout have the queries' rows
    batch = p.batch
    if getattr(p, "varlen", False):  # packed (total, heads, head_dim): one batch of all the rows
        n, batch = (p.total_k if kv else p.total_q), 1
    # v, out and dout have v's head dim (the value head dim, when it is not q's)
    d = p.dv if name in ("v", "out", "dout") else p.head_dim
    shape = (batch, n, p.heads_kv if kv else p.heads, d)
    return shape, (*(s * ELEMENT_BYTES for s in p.strides[name]), ELEMENT_BYTES)


@functools.lru_cache(maxsize=1)
def bindings_problem() -> str | None:
    """Why cuda-bindings cannot be used here (not installed), or None. Asked once per process."""
    try:
        _driver()
    except ImportError as e:
        return str(e)
    return None


def tensors_problem(p, names=("q", "k", "v")) -> str | None:
    """Why TMA maps of map_geometry's form cannot describe this call's tensors `names` (of an
    AttnProblem), or None. The problem's own checks already hold (16-byte aligned pointers and
    strides, contiguous head_dim); this adds what TMA needs beyond them."""
    partial = p.features.partial_d  # (a column-masking instance: the rank-4 maps)
    for name in names:
        shape, strides = tensor_layout(p, name)
        why = layout_problem(shape, strides, p.dtype, ELEMENT_BYTES, name, partial=partial)
        if why:
            return why
    return None


def call_problem(p) -> str | None:
    """Why the Hopper forward cannot take this call through TMA maps (tensors_problem, then the
    cuda-bindings package), or None."""
    return tensors_problem(p) or bindings_problem()


# ----------------------------------------------------------------------------------- encoding

@functools.lru_cache(maxsize=1)
def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise ImportError("the sm90 (Hopper) forward encodes TMA descriptors with NVIDIA's cuda-bindings "
                          "package, which is not installed: pip install 'cuda-bindings>=13' (CUDA 13; "
                          "'cuda-bindings>=12.8,<13' for CUDA 12), or install cuflash[cuda13] / "
                          "cuflash[cuda12]") from e
    return driver


def encode(g: MapGeometry, ptr: int) -> np.ndarray:
    """The tensor map of geometry `g` at device address `ptr`: a size-1 MAP_DTYPE array, ready to
    pass to a kernel as a `const __grid_constant__ cuflash::TmaMap` parameter."""
    import ctypes

    cu = _driver()
    err, tmap = cu.cuTensorMapEncodeTiled(
        cu.CUtensorMapDataType(g.data_type), len(g.dims), ptr,
        [cu.cuuint64_t(x) for x in g.dims], [cu.cuuint64_t(x) for x in g.strides],
        [cu.cuuint32_t(x) for x in g.box], [cu.cuuint32_t(1)] * len(g.dims),
        cu.CUtensorMapInterleave(INTERLEAVE_NONE), cu.CUtensorMapSwizzle(SWIZZLE_128B),
        cu.CUtensorMapL2promotion(L2_PROMOTION_L2_128B), cu.CUtensorMapFloatOOBfill(OOB_FILL_NONE))
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err!r}) for address {ptr:#x}, dims {g.dims}, "
                           f"strides {g.strides}, box {g.box}")
    return np.frombuffer(ctypes.string_at(int(tmap.getPtr()), MAP_BYTES), dtype=MAP_DTYPE).copy()


class MapCache:
    """The encoded maps of one tensor geometry by data pointer: the last `size` pointers (a plan's
    calls usually cycle through a few buffers). get(ptr) costs one dict hit when the pointer is known."""

    __slots__ = ("geometry", "_maps", "_size", "_encode")

    def __init__(self, geometry: MapGeometry, size: int = 8, encoder=None):
        self.geometry = geometry
        self._maps: dict = {}
        self._size = size
        self._encode = encoder or encode

    def get(self, ptr: int) -> np.ndarray:
        m = self._maps.get(ptr)
        if m is None:
            if len(self._maps) >= self._size:
                del self._maps[next(iter(self._maps))]  # the oldest
            m = self._maps[ptr] = self._encode(self.geometry, ptr)
        return m

    def __len__(self) -> int:
        return len(self._maps)
