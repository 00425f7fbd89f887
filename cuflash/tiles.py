"""Tile configs: the tunable compile-time constants of one kernel instance, one class per family.

A tile is a frozen dataclass whose fields, in order, are the kernel template's integer arguments
(head_dim first): <D, BR, BC, WARPS, STAGES> for the mma.sync kernels (Sm80Tile), <D, BC,
CONSUMERS, STAGES, PINGPONG, OVERLAP> for the Hopper forward (Sm90FwdConfig). The tuner searches
the fields after head_dim, so a family with other axes declares other fields and nothing in the
tuner changes.
Each class mirrors its kernel's shared-memory formula and static_asserts (smem_bytes,
structural_problem). Which tiles exist and which one runs by default is the family's business
(cuflash/families/).
"""
from __future__ import annotations

import dataclasses

# The head dims the sm80 kernels are instantiated for (the Hopper families take a subset:
# SM90_HEAD_DIMS). A call may have any multiple of 8 in [8, 256]: it runs the instance of the next
# instantiated head dim (kernel_head_dim), which masks the columns past the call's (Features.partial_d).
SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
SM90_HEAD_DIMS = (64, 128, 192, 256)  # the Hopper forward
SM90_BWD_HEAD_DIMS = (64, 128, 256)  # the Hopper backward (256: the split-head-dim tile, Sm90BwdConfig)
HEAD_DIM_STEP, MAX_HEAD_DIM = 8, 256
# The decode kernel's split heuristic (cuflash/kvcache.py decode_splits): key blocks per split at
# least, by default and at most (a DecodeConfig's host-only min_split_blocks, which the tuner
# searches; an explicit num_splits may give fewer)
DECODE_MIN_SPLIT_BLOCKS, DECODE_MAX_MIN_SPLIT_BLOCKS = 4, 64


def head_dim_problem(head_dim: int) -> str | None:
    """Why a call's head dim cannot run, or None: a multiple of 8 (16-byte rows) from 8 to 256."""
    if head_dim % HEAD_DIM_STEP or not HEAD_DIM_STEP <= head_dim <= MAX_HEAD_DIM:
        return (f"head_dim must be a multiple of {HEAD_DIM_STEP} between {HEAD_DIM_STEP} and {MAX_HEAD_DIM}, "
                f"got {head_dim}")
    return None


def kernel_head_dim(head_dim: int) -> int:
    """The instantiated head dim a call of `head_dim` (valid per head_dim_problem) runs with: the
    smallest of SUPPORTED_HEAD_DIMS at least as large."""
    return next(d for d in SUPPORTED_HEAD_DIMS if d >= head_dim)


def smem_row_bytes(head_dim: int) -> int:
    """Bytes of one tile row in shared memory (kernels_cu/core/swizzle.cuh, SmemRow::kBytes): rows of
    a multiple of 8 16-byte chunks are XOR-swizzled and packed, others padded by one chunk."""
    chunks = head_dim // 8
    return 16 * (chunks if chunks % 8 == 0 else chunks + 1)


def _axis(tag: str, doc: str):
    """A tile field: `tag` is its short name in kernel names (br128), `doc` what it means."""
    return dataclasses.field(metadata={"tag": tag, "doc": doc})


def _host_axis(tag: str, doc: str, default: int):
    """A searched tile field the host alone reads (how a call is launched, not what is compiled): not a
    template argument and not in the kernel's name, so the tiles that differ only in it share one
    compiled instance. Last in its class, with a default (the heuristic's value)."""
    return dataclasses.field(default=default, metadata={"tag": tag, "doc": doc, "host": True})


class Tile:
    """What every tile class shares. A subclass is a frozen dataclass whose fields, in order, are its
    template's integer arguments (head_dim first) and says what they mean for its kernel: threads,
    smem_bytes (the dynamic shared memory a launch asks for), structural_problem, label."""

    @classmethod
    def axes(cls) -> tuple:
        """The searched fields: every field but head_dim, in template order."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "head_dim")

    def tag(self) -> str:
        """The tile's part of a kernel name: d128_br128_bc128_w8_s3 (its compiled fields)."""
        return "_".join(f"{f.metadata['tag']}{getattr(self, f.name)}" for f in dataclasses.fields(self)
                        if not f.metadata.get("host"))

    def template_args(self) -> tuple:
        """The template's integer arguments, in field order (host-only fields left out)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self) if not f.metadata.get("host"))

    def launch_bounds(self) -> str:
        """The generated kernel's launch bounds (cuflash/_compile.py)."""
        return f"__launch_bounds__({self.threads})"

    @property
    def threads(self) -> int:
        raise NotImplementedError

    @property
    def smem_bytes(self) -> int:
        raise NotImplementedError

    def structural_problem(self) -> str | None:
        """Why this tile can never compile (mirrors the kernel's static_asserts), or None."""
        raise NotImplementedError

    def fits(self, smem_optin_bytes: int) -> bool:
        return self.structural_problem() is None and self.smem_bytes <= smem_optin_bytes


@dataclasses.dataclass(frozen=True, order=True)
class Sm80Tile(Tile):
    """The tile of the mma.sync kernels: <D, BR, BC, WARPS, STAGES>.

    Subclasses say what the tiles mean for their kernel (smem_bytes, structural_problem).
    """

    head_dim: int = _axis("d", "head dimension (not searched: it is the problem's)")
    block_q: int = _axis("br", "query rows per tile (BR)")
    block_k: int = _axis("bc", "key rows per tile (BC)")
    warps: int = _axis("w", "warps per thread block")
    stages: int = _axis("s", "depth of the kernel's cp.async ring")

    @property
    def threads(self) -> int:
        return self.warps * 32

    def label(self) -> str:
        """Short human label of the searched fields: 128x128 w8 s3."""
        return f"{self.block_q}x{self.block_k} w{self.warps} s{self.stages}"

    def _common_problem(self) -> str | None:
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            return f"head_dim {self.head_dim} not in {SUPPORTED_HEAD_DIMS}"
        if self.stages < 2:
            return "stages must be >= 2 (the single-barrier pipeline)"
        return None


def _rows_problem(tile) -> str | None:
    """The forward-style rule: warps split block_q rows, K/V tiles of block_k rows (v2, v1)."""
    if problem := tile._common_problem():
        return problem
    if tile.block_q % (16 * tile.warps):
        return f"block_q {tile.block_q} is not a multiple of 16*warps ({16 * tile.warps})"
    if tile.block_k % 16:
        return f"block_k {tile.block_k} is not a multiple of 16"
    return None  # any tile copies (sm80/tile_copy.cuh has a general form besides the fast one)


@dataclasses.dataclass(frozen=True, order=True)
class FwdConfig(Sm80Tile):
    """Tile of the v2 forward kernel (kernels_cu/flash_fwd.cuh).

    block_q: query rows per thread block, block_q / warps per warp; block_k: key rows per K/V
    tile; stages: depth of the cp.async K/V ring.
    """

    @property
    def smem_bytes(self) -> int:
        # Q tile + STAGES x (K tile + V tile) (mirrors Sm80FwdTraits::kSmemBytes).
        return smem_row_bytes(self.head_dim) * (self.block_q + 2 * self.stages * self.block_k)

    def structural_problem(self) -> str | None:
        return _rows_problem(self)


@dataclasses.dataclass(frozen=True, order=True)
class BwdConfig(Sm80Tile):
    """Tile of the backward main kernel (kernels_cu/flash_bwd.cuh, flash_bwd_dkdv).

    One thread block owns block_k keys (16 per warp) and keeps their dK, dV in registers while it
    walks the query tiles of block_q rows through a cp.async ring of `stages` Q / dO slots.
    """

    @property
    def column_splits(self) -> int:
        """Thread blocks per key tile, each owning head_dim / column_splits columns of dK, dV and dQ
        (Sm80BwdTraits::kColSplits: past d=128 one warp's dK and dV would not fit in registers)."""
        return 2 if self.head_dim > 128 else 1

    @property
    def ds_buffers(self) -> int:
        """dS^T buffers (Sm80BwdTraits::kDsBuffers): two, but one in the 2-warp tiles (the ~99 KB
        fallbacks of d192 and d256), which pay a barrier per query tile for the 2.5 KB."""
        return 1 if self.warps == 2 else 2

    @property
    def smem_bytes(self) -> int:
        # K, V tiles + STAGES x (Q, dO tiles) + ds_buffers x dS^T tile (16-bit)
        # + STAGES x (lse, delta) rows (fp32)  (mirrors Sm80BwdTraits::kSmemBytes)
        d, br, bc, s = self.head_dim, self.block_q, self.block_k, self.stages
        return smem_row_bytes(d) * (2 * bc + 2 * s * br) + self.ds_buffers * bc * smem_row_bytes(br) + 2 * s * br * 4

    def structural_problem(self) -> str | None:
        if problem := self._common_problem():
            return problem
        if self.block_k != 16 * self.warps:
            return f"block_k must be 16*warps ({16 * self.warps}), got {self.block_k}"
        if self.block_q % 32:
            return f"block_q {self.block_q} is not a multiple of 32"
        wm = min(self.warps, self.block_q // 16)  # dQ = dS K split over warps: wm x wn
        wn = self.warps // wm
        cols = self.head_dim // self.column_splits
        if self.warps % wm or cols % wn or (cols // wn) % 16:
            return f"dQ tile {self.block_q}x{cols} does not split over {self.warps} warps"
        return None


@dataclasses.dataclass(frozen=True, order=True)
class DqConfig(Sm80Tile):
    """Tile of the deterministic dQ kernel (kernels_cu/flash_bwd.cuh, flash_bwd_dq).

    Laid out like the forward: warps own query rows (16 each), K/V tiles of block_k rows stream
    through a cp.async ring of `stages` slots.
    """

    @property
    def smem_bytes(self) -> int:
        # Q, dO tiles + STAGES x (K, V tiles) (mirrors Sm80DqTraits::kSmemBytes)
        return smem_row_bytes(self.head_dim) * (2 * self.block_q + 2 * self.stages * self.block_k)

    def structural_problem(self) -> str | None:
        if problem := self._common_problem():
            return problem
        if self.block_q != 16 * self.warps:
            return f"block_q must be 16*warps ({16 * self.warps}), got {self.block_q}"
        if self.block_k % 16:
            return f"block_k {self.block_k} is not a multiple of 16"
        return None


@dataclasses.dataclass(frozen=True, order=True)
class V1Config(Sm80Tile):
    """Tile of the v1 forward kernel (kernels_cu/flash_fwd_v1.cuh).

    FlashAttention-1's Algorithm 1: one thread block per (batch, head); K/V tiles of block_k rows
    in the outer loop (single-buffered in shared memory), Q tiles of block_q rows in the inner
    loop through a cp.async ring of `stages` slots; O, m, l in an fp32 workspace in device memory.
    """

    @property
    def smem_bytes(self) -> int:
        # K tile + V tile + STAGES Q tiles (mirrors Sm80FwdV1Traits::kSmemBytes)
        return smem_row_bytes(self.head_dim) * (2 * self.block_k + self.stages * self.block_q)

    def structural_problem(self) -> str | None:
        return _rows_problem(self)


# ------------------------------------------------------------------------------------- Hopper

SM90_CONSUMER_ROWS = 64  # query rows per consumer warpgroup: wgmma's M
SM90_MAX_BOX_ROWS = 256  # a TMA box has at most 256 rows (cuTensorMapEncodeTiled's boxDim limit)
# The kernel rounds its dynamic shared memory base up to 1024 B (the 128B-swizzle TMA images need
# it), and its mbarriers are static __shared__: one spare KiB for each (tiles.Sm90FwdConfig.smem_bytes).
SM90_SMEM_SLACK = 1024 + 1024


@dataclasses.dataclass(frozen=True, order=True)
class Sm90FwdConfig(Tile):
    """Tile of the Hopper forward kernel (kernels_cu/flash_fwd_sm90.cuh, sm_90a: TMA, wgmma, setmaxnreg).

    <D, BC, CONSUMERS, STAGES, PINGPONG, OVERLAP>: one producer warpgroup issues the TMA loads of Q
    and of a ring of `stages` K/V tiles of block_k rows; `consumers` warpgroups of 64 query rows each
    (block_q = 64 * consumers) run S = Q K^T and O += P V on wgmma. pingpong: the consumer
    warpgroups take turns issuing their GEMMs, so one's softmax overlaps another's GEMMs (needs two
    consumers and overlap); overlap: each consumer issues the next tile's Q K^T before the current
    tile's softmax (intra-warpgroup overlap). Mirrors kernels_cu/sm90/traits.cuh (Sm90FwdTraits)
    and the static_asserts of kernels_cu/sm90/fwd.cuh.
    """

    head_dim: int = _axis("d", "head dimension (not searched: it is the problem's)")
    block_k: int = _axis("bc", "key rows per K/V tile (BC, wgmma N of S = Q K^T)")
    consumers: int = _axis("c", "consumer warpgroups, 64 query rows each (block_q = 64 * consumers)")
    stages: int = _axis("s", "depth of the TMA K/V ring")
    pingpong: int = _axis("pp", "1: consumer warpgroups take turns issuing their GEMMs")
    overlap: int = _axis("ov", "1: the next tile's Q K^T is issued before the current tile's softmax")
    q_stages: int = _axis("q", "Q buffers: 2 loads the next work tile's Q while this one computes")
    # host-only (not a template argument): the kernel strides over its work tiles with any grid
    persistent: int = _axis("p", "0: one CTA per work tile; a persistent grid of one CTA per SM whose CTAs take every "
                                 "gridDim-th tile (1) or draw their next tile from a counter (2: greedy)")

    @property
    def block_q(self) -> int:
        return SM90_CONSUMER_ROWS * self.consumers

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)  # the producer warpgroup and the consumers

    def launch_bounds(self) -> str:
        # min blocks 1: ptxas must leave the register file to setmaxnreg's split
        return f"__launch_bounds__({self.threads}, 1)"

    def template_args(self) -> tuple:
        """<D, BC, CONSUMERS, STAGES, PINGPONG, OVERLAP, QSTAGES>: `persistent` only sizes the grid."""
        return dataclasses.astuple(self)[:-1]

    def label(self) -> str:
        """Short human label of the searched fields: 128x128 c2 s2 pp1 ov1."""
        return (f"{self.block_q}x{self.block_k} c{self.consumers} s{self.stages} "
                f"pp{self.pingpong} ov{self.overlap} q{self.q_stages} p{self.persistent}")

    @property
    def smem_bytes(self) -> int:
        # Q tile + STAGES x (K tile + V tile), 16-bit elements (Sm90FwdTraits::kSmemBytes counts the
        # first KiB of slack, for the 1024-B alignment of the base), + a KiB for the static barriers
        return 2 * self.head_dim * (self.q_stages * self.block_q + 2 * self.stages * self.block_k) + SM90_SMEM_SLACK

    def structural_problem(self) -> str | None:
        if self.head_dim not in SM90_HEAD_DIMS:
            return f"head_dim {self.head_dim} not in {SM90_HEAD_DIMS}"
        if self.consumers not in (1, 2, 3):
            return f"consumers must be 1, 2 or 3 (block_q = 64 * consumers <= 192), got {self.consumers}"
        if self.block_k % 16 or not 64 <= self.block_k <= SM90_MAX_BOX_ROWS:
            return f"block_k must be a multiple of 16 in [64, {SM90_MAX_BOX_ROWS}] (TMA box, wgmma N), got {self.block_k}"
        if self.stages not in (2, 3, 4):
            return f"stages must be 2, 3 or 4, got {self.stages}"
        if self.q_stages not in (1, 2):
            return f"q_stages must be 1 or 2, got {self.q_stages}"
        if self.pingpong not in (0, 1) or self.overlap not in (0, 1):
            return f"pingpong and overlap are 0 or 1, got {self.pingpong}, {self.overlap}"
        if self.persistent not in (0, 1, 2):
            return f"persistent must be 0 (a CTA per tile), 1 (strided) or 2 (drawn), got {self.persistent}"
        if self.pingpong and (self.consumers < 2 or not self.overlap):
            return "pingpong needs at least 2 consumer warpgroups and the overlapped loop (overlap 1)"
        return None


@dataclasses.dataclass(frozen=True, order=True)
class Sm90BwdConfig(Tile):
    """Tile of the Hopper backward's dK/dV kernel (kernels_cu/flash_bwd_sm90.cuh, sm_90a).

    <D, BR, CONSUMERS, STAGES, DQ_BULK, OVERLAP>: one producer warpgroup loads K and V of 64 * consumers keys once and
    streams Q and dO in blocks of block_q rows through a `stages`-deep TMA ring; each consumer
    warpgroup owns 64 of the keys (its dK and dV stay in registers). Mirrors
    kernels_cu/sm90/bwd_traits.cuh (Sm90BwdTraits), whose first version takes block_q 64 and two
    consumers only.
    """

    head_dim: int = _axis("d", "head dimension (not searched: it is the problem's)")
    block_q: int = _axis("br", "query rows per Q/dO block (BR, wgmma N of S^T and dP^T)")
    consumers: int = _axis("c", "consumer warpgroups, 64 keys each (block_k = 64 * consumers)")
    stages: int = _axis("s", "depth of the TMA Q/dO ring")
    dq_bulk: int = _axis("dqb", "0: dQ added by atomics; 1: staged in smem and added by a store warp, a bulk "
                               "reduction per row; 2: staged in fragment order, one bulk reduction per block; "
                               "3: as 2 in key-block order by the store warp (the deterministic mode's twin of a "
                               "tile, not searched); 4: as 2, the reductions issued by the store warp")
    overlap: int = _axis("ov", "1: a block's element-wise work under its GEMMs (dP^T under exp(S^T), dV under the "
                               "dS^T barrier, dQ's store under dK); 0: each GEMM waited on before the work after it")

    @property
    def split_d(self) -> bool:
        """Sm90BwdTraits::kSplitD: above head_dim 128 both consumers share 64 keys and split the head dim."""
        return self.head_dim > 128

    @property
    def block_k(self) -> int:
        return SM90_CONSUMER_ROWS * (1 if self.split_d else self.consumers)

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)

    def launch_bounds(self) -> str:
        return f"__launch_bounds__({self.threads}, 1)"  # setmaxnreg needs the cap

    def label(self) -> str:
        return f"{self.block_q}x{self.block_k} c{self.consumers} s{self.stages} dqb{self.dq_bulk} ov{self.overlap}"

    @property
    def smem_bytes(self) -> int:
        # K and V, stages x (Q + dO), two dS^T images (Sm90BwdTraits::kSmemBytes counts the first KiB
        # of slack, for the 1024-B alignment of the base) + a KiB for the static barriers
        d = self.head_dim
        # Sm90BwdTraits::kDqSetBytes: padded rows (1) or fragment order (2, 3, 4)
        # (none in the split tile: its dq_bulk 4 stages dQ over the block's own Q and dO images, kDqInStage)
        dq_set = (d // 64) * 64 * ((64 * 4 + 16) if self.dq_bulk == 1 else 64 * 4) if self.dq_bulk and not self.split_d else 0
        stats = 2 * self.stages * self.block_q * 4  # lse2 and delta per stage (kStatBytes)
        p_image = 2 * self.block_k * self.block_q if self.split_d else 0  # kPBytes: the P^T image
        rest = (2 * 2 * self.block_k * d + 2 * self.stages * 2 * self.block_q * d + 2 * 2 * self.block_k * self.block_q
                + p_image + stats + SM90_SMEM_SLACK)
        # kDqSets: the deterministic mode (3) takes a second staging set where it fits in 227 KiB
        # with a KiB to spare beyond this request (the static barriers)
        sets = 2 if self.dq_bulk == 3 and rest + 2 * dq_set + 1024 <= 227 * 1024 else 1
        return rest + sets * dq_set

    def structural_problem(self) -> str | None:
        if self.head_dim not in SM90_BWD_HEAD_DIMS:
            return f"head_dim {self.head_dim} not in {SM90_BWD_HEAD_DIMS}"
        if self.block_q != 64:
            return f"block_q must be 64 (the dS^T image is one 64-query chunk), got {self.block_q}"
        if self.consumers != 2:
            return f"consumers must be 2, got {self.consumers}"
        if self.stages not in (2, 3, 4):
            return f"stages must be 2, 3 or 4, got {self.stages}"
        if self.dq_bulk not in (0, 1, 2, 3, 4):
            return f"dq_bulk must be 0 to 4, got {self.dq_bulk}"
        if self.overlap not in (0, 1):
            return f"overlap must be 0 or 1, got {self.overlap}"
        if self.split_d and (self.dq_bulk not in (0, 4) or (self.overlap, self.stages) != (0, 2)):
            return (f"head_dim {self.head_dim} (the split-head-dim tile) takes dq_bulk 0 or 4, overlap 0 and 2 stages, "
                    f"got dq_bulk {self.dq_bulk}, overlap {self.overlap}, stages {self.stages}")
        return None


@dataclasses.dataclass(frozen=True, order=True)
class DecodeConfig(Tile):
    """Tile of the decode kernel (kernels_cu/flash_decode.cuh, Sm80DecodeTraits): <D, WARPS, STAGES>.

    One block serves one (K/V head, batch, split): the query heads of the K/V head's group times
    the queries in one m16 tile (at most 16 rows), K/V tiles of 16 keys per key slice through a
    `stages`-deep cp.async ring. Above head_dim 128 two warps share each key slice, one half of
    O's columns each (col_splits), so warps must be even there.
    """

    head_dim: int = _axis("d", "head dimension (not searched: it is the problem's)")
    warps: int = _axis("w", "warps per block, 16 keys of each K/V tile each")
    stages: int = _axis("s", "depth of the cp.async K/V ring")
    # host-only: how far num_splits=0 splits a (K/V head, batch)'s keys (cuflash/kvcache.py decode_splits)
    min_split_blocks: int = _host_axis("mb", "key blocks per split at least, when the call leaves the split count "
                                             "to cuflash (num_splits=0)", DECODE_MIN_SPLIT_BLOCKS)

    ROWS = 16  # packed query rows per block (group * seqlen_q at most this)

    @property
    def col_splits(self) -> int:
        """Warps per key slice, each with D / col_splits of O's columns (Sm80DecodeTraits::kColSplits)."""
        return 2 if self.head_dim > 128 else 1

    @property
    def block_k(self) -> int:
        return 16 * self.warps // self.col_splits

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def label(self) -> str:
        return f"{self.block_k} keys w{self.warps} s{self.stages} mb{self.min_split_blocks}"

    @property
    def smem_bytes(self) -> int:
        # Q (16 rows) + the ring, or the warps' fp32 O staging where larger (Sm80DecodeTraits::kSmemBytes)
        row = smem_row_bytes(self.head_dim)
        ring = 2 * self.stages * self.block_k * row
        return self.ROWS * row + max(ring, self.warps // self.col_splits * self.ROWS * self.head_dim * 4)

    def structural_problem(self) -> str | None:
        if self.head_dim % 16 or not 16 <= self.head_dim <= MAX_HEAD_DIM:
            return f"head_dim must be a multiple of 16 in [16, {MAX_HEAD_DIM}], got {self.head_dim}"
        if not 1 <= self.warps <= 8 or self.warps % self.col_splits:
            return f"warps must be 1 to 8{' and even above head_dim 128' if self.col_splits > 1 else ''}, got {self.warps}"
        if self.stages < 2:
            return "stages must be >= 2 (the single-barrier pipeline)"
        if not 1 <= self.min_split_blocks <= DECODE_MAX_MIN_SPLIT_BLOCKS:
            return f"min_split_blocks must be 1 to {DECODE_MAX_MIN_SPLIT_BLOCKS}, got {self.min_split_blocks}"
        return None
