"""Features: the compile-time semantics of a call, as one hashable value.

A kernel family compiles one instance per (tile, features). Tiles are what the tuner varies;
features are what the caller asked for (dtype, head_dim, dropout, ...), and each one that changes
the kernel's inner loop, registers or addressing is a separate instantiation. `tag()` names the
variant in kernel names; `perf_class()` groups variants whose best tile is expected to differ,
and keys the tuned tables (tuning every feature combination is impossible, tuning per class is not).

The boolean variant fields (declared with `_variant`) are the kernels' compile-time feature set:
the generated shell passes them, in field order, as ONE template argument,
`cuflash::Variant<dropout, local, softcap, partial_d, seqused_k, varlen, split_kv, paged, alibi, user_mod, block_mask, group_loop, sinks>` (kernels_cu/attn/features.cuh), and asserts that each C++
member holds the value of its field (`cxx_asserts`), so the two lists cannot drift apart. Adding a
feature is: one `_variant` field here, one parameter and member there, and the policy header that
reads it; the shells, kernel names and fingerprints follow.
"""
from __future__ import annotations

import dataclasses
import functools

# dtype name -> (kernel-name tag, the kernel template's BF16 argument)
_DTYPES = {"float16": ("f16", "false"), "bfloat16": ("bf16", "true")}
SUPPORTED_DTYPES = tuple(_DTYPES)
PERF_CLASSES = ("dense", "dropout", "softcap", "alibi")
# A class with no tuned entry for a shape takes its fallback's entry (cuflash/_tuned.py): ALiBi calls
# ran the dense class's tiles before ALiBi had a class (0.93-0.98x of plain at d128 on the H200), so
# a GPU whose table has no ALiBi entries keeps them rather than the untuned heuristic.
PERF_CLASS_FALLBACK = {"alibi": "dense"}


def _variant(tag: str, member: str):
    """A compile-time variant field: off by default; `tag` joins the kernel name when on; `member`
    is the cuflash::Variant member (kernels_cu/attn/features.cuh) that carries it."""
    return dataclasses.field(default=False, metadata={"tag": tag, "cxx": member})


@dataclasses.dataclass(frozen=True)
class Features:
    dtype: str  # "float16" | "bfloat16"
    head_dim: int
    # fused Philox dropout: its own instantiation, so plain kernels carry no Philox code
    dropout: bool = _variant("_drop", "kDropout")
    # the mask has a bounded LEFT window edge (sliding window): only these instances read
    # window_left and run the left-edge block-range and mask code (attn/mask.cuh, block_range.cuh)
    local: bool = _variant("_local", "kLocal")
    # softcapped scores (c tanh(scale S / c)): a tanh per score element on every tile and the
    # tanh's derivative in the backward (kernels_cu/attn/score_mod.cuh)
    softcap: bool = _variant("_softcap", "kSoftcap")
    # the call's head dim is less than head_dim, the instantiated one (cuflash.tiles.kernel_head_dim):
    # loads zero-fill the columns past it and stores skip them (params.head_dim holds it)
    partial_d: bool = _variant("_pd", "kPartialD")
    # per-batch key lengths (the KV cache, cuflash/kvcache.py): the kernel takes a seqused_k device
    # array after its data pointers and attends batch b to its first seqused_k[b] keys, the mask
    # bottom-right aligned to them (MaskGeometry::for_batch); only the sm80 v2 forward has it
    seqused_k: bool = _variant("_kvlen", "kSeqUsedK")
    # variable-length batches (cuflash/varlen.py): packed q/k/v, the kernel takes cu_seqlens_q and
    # cu_seqlens_k after its other pointers (kernels_cu/attn/mask.cuh SeqSpan); sm80 v2 forward only
    varlen: bool = _variant("_varlen", "kVarlen")
    # split-KV decoding (cuflash/kvcache.py num_splits): blocks share a work tile's key blocks and
    # write fp32 partial results the host merges; only the sm80 v2 forward has it
    split_kv: bool = _variant("_split", "kSplitKV")
    # paged KV caches (cuflash/kvcache.py block_table): k and v are pages (num_pages, page_size,
    # heads_kv, head_dim) and batch b's key row r lives in page block_table[b][r / page_size]; the
    # kernel takes block_table after seqused_k; only the decode kernel has it
    paged: bool = _variant("_paged", "kPaged")
    # ALiBi (BLOOM, MPT; FlashAttention's alibi_slopes): every score gains -slope_h |q + offset - k|
    # (the mask's alignment), slopes per head or per (batch, head) read from an alibi_slopes pointer
    # after the kernel's others (kernels_cu/attn/score_mod.cuh AlibiBias); the v2 forwards and
    # backwards (sm80, sm90)
    alibi: bool = _variant("_alibi", "kAlibi")
    # a user score / mask modification (cuflash.ScoreMod): CUDA C++ snippets compiled into the kernel
    # (kernels_cu/attn/score_mod.cuh UserMod), auxiliary arrays through a pointer table after every
    # other pointer; `mod` holds the snippets (cuflash.score_mods.ModSource), whose hash joins the tag
    user_mod: bool = _variant("_mod", "kUserMod")
    mod: object = None  # ModSource when user_mod (compared and hashed: each snippet is its own kernel)
    # a block mask for a mask snippet (cuflash.BlockMask): per query block, the key blocks the snippet
    # leaves non-empty; the kernel takes the lists after mod_aux and visits only those
    # (kernels_cu/attn/block_mask.cuh); every v2 kernel (forwards, dK/dV, dQ)
    block_mask: bool = _variant("_bm", "kBlockMask")
    # GQA/MQA in the Hopper dK/dV kernel: a CTA per (key block, K/V head) loops over the group's query
    # heads and sums dK, dV over them in registers (kernels_cu/sm90/bwd.cuh kGroupLoop) instead of
    # writing them per query head for bwd_dkdv_reduce; only the sm90 backward has it
    group_loop: bool = _variant("_grp", "kGroupLoop")
    # learnable attention sinks (cuflash/sinks.py): one logit per query head joins every row's softmax
    # in the epilogue (kernels_cu/attn/sinks.cuh), from a sinks pointer after every other pointer;
    # the v2 forwards (sm80 without split-KV, sm90). It keeps the call's perf class: a few
    # instructions per row, none per score
    sinks: bool = _variant("_sink", "kSinks")

    @classmethod
    @functools.cache
    def variant_fields(cls) -> tuple:
        """The compile-time variant fields, in the order of cuflash::Variant's template parameters."""
        return tuple(f for f in dataclasses.fields(cls) if "cxx" in f.metadata)

    @property
    def dtype_tag(self) -> str:
        return _DTYPES[self.dtype][0]

    @property
    def bf16(self) -> str:
        """The template's BF16 argument (C++ bool literal)."""
        return _DTYPES[self.dtype][1]

    def tag(self) -> str:
        """The variant's suffix in kernel names: "" for the plain kernel, then "_drop", "_local", ...
        (a user modification: "_mod" and its snippets' hash)."""
        tag = "".join(f.metadata["tag"] for f in self.variant_fields() if getattr(self, f.name))
        return tag + self.mod.digest() if self.user_mod and self.mod is not None else tag

    def cxx(self) -> str:
        """The kernels' feature-set template argument, e.g. cuflash::Variant<true, false, false, false, false, false, false, false, false, false>."""
        return f"cuflash::Variant<{', '.join(_cxx_bool(getattr(self, f.name)) for f in self.variant_fields())}>"

    def cxx_asserts(self) -> str:
        """A C++ static_assert that each member of cxx() holds its field's value (the mirror check)."""
        checks = " && ".join(f"{self.cxx()}::{f.metadata['cxx']} == {_cxx_bool(getattr(self, f.name))}"
                             for f in self.variant_fields())
        names = ", ".join(f"{f.name} -> {f.metadata['cxx']}" for f in self.variant_fields())
        return f'static_assert({checks}, "cuflash::Variant differs from cuflash/features.py ({names})");\n'

    def perf_class(self) -> str:
        """The tuning class: features that move the optimum get their own tuned tables (a bounded
        left edge only removes work from the masked ends, so `local` keeps its class).
        `softcap` has its own class (without dropout, whose class it keeps): its MUFU.TANH beside
        every score's ex2 makes the softmax, not the tensor cores, the sm90 forward's critical
        path, and the best tile moves: on the H200 (2026-12-01, perf-notes) dense's tuned d128
        tile (block_k 192, ping-pong) runs softcap at 0.75x of plain where the 128-key tile
        without ping-pong runs it at 0.82x. `partial_d` keeps its class: it runs the tiles of its
        instantiated head dim. `alibi` (without dropout or softcap, whose classes it keeps) has its
        own class too: its bias costs an FFMA per score, which at d64 moved the sm90 forward off
        its class's pace (0.84-0.89x of plain on the dense tile, 2026-12-01), and the bias's form
        depends on the tile (kernels_cu/sm90/fwd.cuh kAlibiSplit), so its best tile may be another;
        a GPU without ALiBi entries takes the dense ones (PERF_CLASS_FALLBACK)."""
        return "dropout" if self.dropout else "softcap" if self.softcap else "alibi" if self.alibi else "dense"

    @classmethod
    def of_class(cls, dtype: str, head_dim: int, perf_class: str) -> "Features":
        """The features a perf class is tuned with (the tuner's problems, a tuned entry's spills)."""
        if perf_class not in PERF_CLASSES:
            raise ValueError(f"unknown perf class {perf_class!r} (one of {', '.join(PERF_CLASSES)})")
        return cls(dtype, head_dim, dropout=perf_class == "dropout", softcap=perf_class == "softcap",
                   alibi=perf_class == "alibi")


def _cxx_bool(x: bool) -> str:
    return "true" if x else "false"
