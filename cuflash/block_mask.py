"""Block masks for mask snippets: the key blocks a cuflash.ScoreMod's mask leaves empty are skipped.

    mod = cuflash.ScoreMod(mask="doc[q_idx] == doc[kv_idx]", aux={"doc": doc_ids})
    bm = mod.block_mask(batch=1, heads=1, seqlen_q=n, seqlen_k=n)      # once per mask and shape
    out = cuflash.attention(q, k, v, score_mod=mod, block_mask=bm)    # every layer, every step

A mask snippet is evaluated per score and every key block is visited, so a mask that empties most
blocks (documents, a band, a sparse pattern) costs as much as full attention. A BlockMask is
FlexAttention's BlockMask made explicitly: one pass of the snippet over every (query, key) pair,
kept as one bit per 16 x 16 cell (set: some pair of the cell is kept); from the cells, per tile
shape the kernels use, the ordered list of non-empty key blocks of each query block (made on first
use and kept). The kernels then visit only the listed blocks inside the built-in mask's range; the
forwards skip the mask snippet on blocks whose every pair it keeps ("full" blocks: a second bit per
cell), and apply it elsewhere, so the output is the same, bit for bit, as without the block mask on the
same tile (the automatic tile may differ: a snippet runs on the first tile whose instance does not
spill, and the block-mask instance holds a few more registers).

The mask is a snapshot: the aux arrays' contents are read when the BlockMask is made. Make a new
one when they change (the call cannot tell: the arrays' addresses stay). `batch=1` or `heads=1`
when the snippet reads neither `b` nor `h`: it is evaluated at b = 0 / h = 0 and serves every batch
/ head. Cost: one snippet call per (query, key) pair and batch x heads of the mask, once; memory
(seqlen_q / 16) x (seqlen_k / 16) bits per (batch, head) of the mask, plus the lists.

Every v2 kernel takes block masks: both forwards, the sm80 dK/dV and dQ kernels and the Hopper
backward; not v1, variable-length batches or the KV cache.
"""
from __future__ import annotations

import threading

from . import _compile
from .launch import GRID_YZ_MAX  # the passes' y / z grid limit: they stride over the pairs past it
from .score_mods import ModSource, ScoreModError, compile_error

CELL = 16  # positions per cell side (attn/block_mask.cuh kMaskCell); tiles are multiples of it
FULL_BLOCK = 1 << 30  # a list entry's flag: the mask keeps every pair of the block (kFullBlock)
_lock = threading.Lock()
_cells_kernels: dict = {}  # (ModSource, device) -> the cells pass compiled with the snippets
_lists_kernels: dict = {}  # device -> the lists pass

_LISTS_SRC = r'''
#include "attn/block_mask.cuh"
extern "C" __global__ void cuflash_block_mask_lists(const unsigned* bits, const unsigned* full, int* counts, int* index,
                                                    int qcells, int kcells, int kwords, int rb, int cb, int m_blocks,
                                                    int n_blocks, int bh_count) {
    cuflash::block_mask_lists<false>(bits, full, counts, index, qcells, kcells, kwords, rb, cb, m_blocks, n_blocks,
                                     bh_count);
}
extern "C" __global__ void cuflash_block_mask_lists_t(const unsigned* bits, const unsigned* full, int* counts,
                                                      int* index, int qcells, int kcells, int kwords, int rb, int cb,
                                                      int m_blocks, int n_blocks, int bh_count) {
    cuflash::block_mask_lists<true>(bits, full, counts, index, qcells, kcells, kwords, rb, cb, m_blocks, n_blocks,
                                    bh_count);
}
'''


def _cells_source(source: ModSource) -> str:
    return ('#include "attn/score_mod.cuh"\n#include "attn/block_mask.cuh"\n' + source.cxx() +
            'extern "C" __global__ void cuflash_block_mask_cells(unsigned* bits, unsigned* full, const void* const* aux,\n'
            '        int heads, int seqlen_q, int seqlen_k, int qcells, int kcells, int kwords, int bh_count) {\n'
            '    cuflash::block_mask_cells<cuflash::UserModDefs<true>>(bits, full, aux, heads, seqlen_q, seqlen_k, qcells,\n'
            '                                                          kcells, kwords, bh_count);\n'
            '}\n')


def _kernel(cache: dict, key, source: str, name: str, device: int, mod: ModSource | None = None):
    fn = cache.get(key)
    if fn is None:
        import cupy

        with _lock, cupy.cuda.Device(device):
            try:
                fn = cupy.RawModule(code=source, options=_compile.nvrtc_options(), backend="nvrtc").get_function(name)
            except Exception as e:
                err = compile_error(str(e), mod) if mod is not None else None
                if err is not None:
                    raise err from None
                raise
            cache[key] = fn
    return fn


class BlockMask:
    """The non-empty blocks of a mask snippet for one shape (module docstring). Made by
    cuflash.ScoreMod.block_mask; passed to cuflash.attention(..., score_mod=, block_mask=)."""

    def __init__(self, source: ModSource, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device: int,
                 bits, full_bits=None):
        self.source = source
        self.batch, self.heads, self.seqlen_q, self.seqlen_k, self.device = batch, heads, seqlen_q, seqlen_k, device
        # uint32 (batch * heads, query cells, key-cell words), attn/block_mask.cuh: the cells with a
        # kept pair, and those whose every pair is kept
        self.cells, self.full_cells = bits, full_bits
        self._lists: dict = {}

    def __repr__(self) -> str:
        return (f"BlockMask(batch={self.batch}, heads={self.heads}, seqlen_q={self.seqlen_q}, "
                f"seqlen_k={self.seqlen_k}, device={self.device})")

    @property
    def layout(self) -> tuple:
        """(batch, heads): the mask's own, 1 where it broadcasts (the kernels' list strides)."""
        return self.batch, self.heads

    def density(self) -> float:
        """The fraction of 16 x 16 cells with a kept pair (1: the mask skips nothing; a host sync)."""
        import cupy

        qc, kc = -(-self.seqlen_q // CELL), -(-self.seqlen_k // CELL)
        if qc * kc == 0:
            return 0.0
        set_bits = int(cupy.unpackbits(self.cells.view(cupy.uint8)).sum())
        return set_bits / (qc * kc * self.batch * self.heads)

    def lists(self, block_q: int, block_k: int, transposed: bool = False):
        """(counts, index) for tiles of block_q x block_k: counts int32 (batch * heads, m_blocks),
        index int32 (batch * heads, m_blocks, n_blocks), row (bh, i) the ascending key blocks of
        query block i with a kept pair, each | FULL_BLOCK where every pair of the block is kept
        (attn/block_mask.cuh); `transposed` (the dK/dV kernels):
        (batch * heads, n_blocks) and (batch * heads, n_blocks, m_blocks), per key block its query
        blocks. Made on first use, then kept."""
        key = (block_q, block_k, transposed)
        got = self._lists.get(key)
        if got is None:
            if block_q % CELL or block_k % CELL:
                raise ValueError(f"a block mask serves tiles whose sides are multiples of {CELL}, "
                                 f"got {block_q} x {block_k}")
            import cupy

            qc, kc = -(-self.seqlen_q // CELL), -(-self.seqlen_k // CELL)
            mb, nb = -(-self.seqlen_q // block_q), -(-self.seqlen_k // block_k)
            bh = self.batch * self.heads
            name = "cuflash_block_mask_lists_t" if transposed else "cuflash_block_mask_lists"
            fn = _kernel(_lists_kernels, (self.device, transposed), _LISTS_SRC, name, self.device)
            outer, inner = (nb, mb) if transposed else (mb, nb)
            with cupy.cuda.Device(self.device):
                counts = cupy.zeros((bh, max(outer, 1)), dtype=cupy.int32)
                index = cupy.zeros((bh, max(outer, 1), max(inner, 1)), dtype=cupy.int32)
                if mb and nb:  # (y strides over the (batch, head) pairs: there may be more than 65,535)
                    fn((outer, min(bh, GRID_YZ_MAX)), (32,),
                       (self.cells, self.full_cells, counts, index, cupy.int32(qc), cupy.int32(kc),
                        cupy.int32(self.cells.shape[2]), cupy.int32(block_q // CELL), cupy.int32(block_k // CELL),
                        cupy.int32(mb), cupy.int32(nb), cupy.int32(bh)))
            got = self._lists[key] = (counts, index)
        return got

    def check_call(self, source: ModSource, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                   device: int) -> None:
        """Raise (naming block_mask) unless this mask serves a call with these snippets and shape."""
        if source != self.source:
            raise ValueError("block_mask was made by another ScoreMod than the call's score_mod "
                             "(make it with score_mod.block_mask(...))")
        if (self.seqlen_q, self.seqlen_k) != (seqlen_q, seqlen_k):
            raise ValueError(f"block_mask is for seqlen_q={self.seqlen_q}, seqlen_k={self.seqlen_k}; the call has "
                             f"seqlen_q={seqlen_q}, seqlen_k={seqlen_k}")
        if self.batch not in (1, batch) or self.heads not in (1, heads):
            raise ValueError(f"block_mask has batch={self.batch}, heads={self.heads}; the call has batch={batch}, "
                             f"heads={heads} (the mask's must be 1 or the call's)")
        if self.device != device:
            raise ValueError(f"block_mask is on device {self.device}, the call's arrays on {device}")


def build(mod, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device: int | None = None) -> BlockMask:
    """ScoreMod.block_mask's body: the cells pass of `mod`'s mask snippet (on the aux arrays' device,
    or `device`, or the current one)."""
    import cupy

    if mod.source.mask is None:
        raise ValueError("a block mask needs a mask snippet: ScoreMod(mask=...) (a score snippet empties no block)")
    for name, v in (("batch", batch), ("heads", heads), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name in ("batch", "heads") else 0):
            raise ValueError(f"{name} must be an int >= {1 if name in ('batch', 'heads') else 0}, got {v!r}")
    qc, kc = -(-seqlen_q // CELL), -(-seqlen_k // CELL)
    kw = -(-kc // 32)
    if kw > GRID_YZ_MAX:  # the cells pass's grid y (its x, the query cells, goes to 2^31 - 1)
        raise ValueError(f"seqlen_k of a block mask must be at most {GRID_YZ_MAX * 32 * CELL}, got {seqlen_k}")
    if device is None:
        device = mod.aux[0].device.id if mod.aux else cupy.cuda.Device().id
    mod.check_device(device)
    fn = _kernel(_cells_kernels, (mod.source, device), _cells_source(mod.source), "cuflash_block_mask_cells",
                 device, mod.source)
    with cupy.cuda.Device(device):
        bits = cupy.zeros((batch * heads, qc, max(kw, 1)), dtype=cupy.uint32)
        full = cupy.zeros_like(bits)
        if qc and kw:
            # z strides over the (batch, head) pairs: there may be more than 65,535
            fn((qc, kw, min(batch * heads, GRID_YZ_MAX)), (32,),
               (bits, full, mod.pointer_table(device), cupy.int32(heads), cupy.int32(seqlen_q), cupy.int32(seqlen_k),
                cupy.int32(qc), cupy.int32(kc), cupy.int32(kw), cupy.int32(batch * heads)))
    return BlockMask(mod.source, batch, heads, seqlen_q, seqlen_k, device, bits, full)


__all__ = ["BlockMask", "ScoreModError", "build"]
