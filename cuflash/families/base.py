"""KernelFamily: everything cuflash knows about one kernel, in one object.

identity   name, pass, backend (the name a caller forces it by), the GPUs it runs on (min_cc,
           max_cc) and the NVRTC target it is built for, the header and device template the
           generated shell instantiates, the kernel's pointer parameters and parameter struct, its
           tile class;
selection  supports(features), space(head_dim), default(head_dim, smem, features),
           can_implement(tile, props, features), accumulator_registers(tile), register_cap(tile,
           props), cannot_run(problem, props) (whether it can serve a call at all);
execution  plan(problem, tile, dtype): the launch plan of a call (cuflash/launch.py);
           run(tile, inputs, causal, features) for the tuner, which outputs must be bitwise
           deterministic, and whether a causal mask changes what is tuned.

The library (selection, compiler), the tuner and the tests iterate the registry
(cuflash/families/__init__.py); nobody branches on a family's name.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from ..features import SUPPORTED_DTYPES, Features

MAX_REGS_PER_THREAD = 255
REG_ALLOC_UNIT = 8  # registers are allocated per thread in multiples of 8 (256 per warp)
DEFAULT_SMEM_OPTIN = 227 * 1024  # an H100/H200 block's opt-in shared memory

# C declarations of the kernels' pointer parameters (KernelFamily.pointers)
IN = "const cuflash::elem_t* __restrict__"  # a 16-bit input tensor
OUT = "cuflash::elem_t* __restrict__"  # a 16-bit output tensor
F32_IN = "const float* __restrict__"
F32 = "float* __restrict__"
I32_IN = "const int* __restrict__"  # per-batch lengths (seqused_k)
F32_WS = "float*"  # a workspace the kernel reads back (v1's O, m, l): not __restrict__
I32_WS = "int*"  # flags other blocks of the grid write and read (the deterministic sm90 backward's turns)
AUX_TABLE = "const void* const* __restrict__"  # a user modification's aux arrays (cuflash/score_mods.py)


def register_cap(threads: int, props) -> int:
    """Most registers per thread ptxas can give a block of `threads` threads (launch bounds)."""
    per_thread = props.register_budget // threads
    return min(MAX_REGS_PER_THREAD, per_thread // REG_ALLOC_UNIT * REG_ALLOC_UNIT)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)  # keywords only: fields grouped by topic
class KernelFamily:
    # --- identity
    name: str  # in kernel names and tuned-table keys: cuflash_<name>_...
    description: str
    what: str  # in messages: "no <what> config for head_dim ..."
    pass_: str  # "forward" | "backward" | "decode" (one token against a KV cache): which inputs the tuner prepares
    tile_cls: type
    header: str  # under kernels_cu/
    template: str  # device template, <BF16, *tile.template_args(), Variant> (Features.cxx())
    # the kernel's parameters: its data pointers ((C declaration, name), in order; the names are
    # the launch plan's array slots), then the pass's parameter struct (attn/params.cuh, mirrored in
    # cuflash/params.py), whose fields the generated kernel takes as scalar parameters
    pointers: tuple
    params: str
    min_cc: tuple
    min_cc_why: str
    arch_specific: bool  # built for sm_90a-style targets (props.arch_specific) rather than CuPy's sm_XY
    # the newest compute capability it runs on (None: any from min_cc on); sm_90a code runs on 9.0 only
    max_cc: tuple | None = None
    max_cc_why: str = ""
    # the name `cuflash.attention(backend=...)` and CUFLASH_BACKEND force it by, among the families
    # that serve one pass and algorithm (families.FORWARDS)
    backend: str = "sm80"
    # head dims at which the automatic choice (families.choose with no backend) may take this
    # family, where it was measured faster than the next candidate; None: every head dim it supports
    auto_head_dims: frozenset | None = None
    # --- selection
    domain: Callable  # head_dim -> the tiles the kernel's template admits, in search order (before fitting)
    defaults: Mapping[int, tuple]  # head_dim -> heuristic tiles, in order of preference; the first that fits wins
    accumulator_registers: Callable  # tile -> fp32 registers per thread its live accumulators need
    # (tile, props) -> registers per thread those accumulators may take; None: ptxas' cap for a
    # block of tile.threads threads (register_cap). A warp-specialised kernel that moves registers
    # to its compute warps with setmaxnreg gives its own.
    register_limit: Callable | None = None
    # problem -> why this family cannot serve a call that its features allow (e.g. a tensor layout
    # its TMA descriptors cannot describe, a missing Python package), or None. Decided once per plan.
    call_problem: Callable | None = None
    # perf class, variant name ("local", "softcap") or "+"-joined variant names ("dropout+softcap":
    # the instance with all of them) -> tiles whose instantiation spills registers (ptxas, sm_80
    # and sm_90a); tests/test_compile_dropout.py and tests/test_softcap.py keep this data honest
    spilling: Mapping[str, frozenset] = dataclasses.field(default_factory=dict)
    # perf class -> head_dim -> tiles preferred to `defaults` for that class while nothing tuned
    # applies (a class whose best tile was measured to differ from its head dim's default)
    class_defaults: Mapping[str, Mapping[int, tuple]] = dataclasses.field(default_factory=dict)
    # tile -> the tile a variable-length call runs instead of the one chosen for dense calls (their tuned
    # tile unless it spills with varlen): a rule measured on ragged batches, e.g. the sm90 forward's
    # drawn order; None: that tile
    varlen_tile: Callable | None = None
    # tile -> the tile a causal call runs when nothing tuned applies (the heuristic default's
    # variant measured to suit a causal mask's uneven tiles); None: the default as it is
    causal_tile: Callable | None = None
    # (tile, problem, device props) -> the tile a paged-KV call runs when nothing tuned applies (the
    # default's variant measured to read scattered pages better); None: the default as it is
    paged_tile: Callable | None = None
    # tiles of `defaults` that only a device where no other default fits may pick (the 2-warp d192 /
    # d256 backward of ~99 KB GPUs: slow, and spilling a little, they must not win elsewhere)
    last_resort: frozenset = frozenset()
    # --- execution
    # (problem, tile, dtype) -> launch.Plan of one call (the passes' plan builders); None: the pass
    # builds its plan itself (the backward)
    plan: Callable | None = None
    # (problem, tile) -> (slot names, bind) for a kernel whose leading arguments are computed per
    # call from the plan's slots (TMA maps embed data pointers): the backward's main kernel on sm90
    main_args: Callable | None = None
    takes_dropout: bool = True  # False: no dropout instantiation exists (supports() says so)
    takes_partial_d: bool = True  # False: no column-masking instance (a call's head dim must be instantiated)
    takes_seqused_k: bool = False  # True: per-batch key length instances (a seqused_k pointer; the KV cache)
    needs_seqused_k: bool = False  # True: only per-batch key length instances exist (the decode kernel)
    # the pointer the seqused_k instances take after `pointers` (kernel_source adds it)
    seqused_k_pointer: tuple = (I32_IN, "seqused_k")
    takes_varlen: bool = False  # True: variable-length instances (cu_seqlens_q/k pointers; cuflash/varlen.py)
    takes_split_kv: bool = False  # True: split-KV instances (fp32 partial results; cuflash/kvcache.py)
    takes_paged: bool = False  # True: paged KV cache instances (a block_table pointer after seqused_k)
    paged_pointer: tuple = (I32_IN, "block_table")
    varlen_pointers: tuple = ((I32_IN, "cu_seqlens_q"), (I32_IN, "cu_seqlens_k"))
    takes_alibi: bool = False  # True: ALiBi instances (an alibi_slopes pointer after all the others)
    alibi_pointer: tuple = (F32_IN, "alibi_slopes")
    takes_user_mod: bool = False  # True: user score/mask modification instances (cuflash.ScoreMod)
    mod_pointer: tuple = (AUX_TABLE, "mod_aux")  # the ScoreMod's aux pointer table, after alibi_slopes
    takes_block_mask: bool = False  # True: block-mask instances (cuflash.BlockMask's key-block lists)
    takes_group_loop: bool = False  # True: GQA instances that sum dK / dV over a group in the kernel (sm90 backward)
    block_mask_pointers: tuple = ((I32_IN, "bm_counts"), (I32_IN, "bm_index"))  # after mod_aux
    # True: attention-sink instances (the sinks' logits joined in the epilogue: attn/sinks.cuh), a
    # float32 sinks pointer (one per query head) after the block mask's lists
    takes_sinks: bool = False
    sinks_pointer: tuple = (F32_IN, "sinks")
    # the split-KV instances' in-kernel merge (the decode kernel: the last split block of a tile merges
    # the tile's partial results into merged_out / merged_lse; split_counters: zeroed per-stream words,
    # null for the host's combine launch instead), after every other pointer; () for no such merge
    split_merge_pointers: tuple = ()
    # True: the device template takes every optional pointer the family has (seqused_k, block_table,
    # cu_seqlens_q / _k, alibi_slopes, mod_aux, bm_counts / bm_index, sinks, in that order), and the shell passes nullptr for those the
    # instance's features do not take; False: the template has one overload per pointer set
    nullable_pointers: bool = False
    # the tuner:
    run: Callable | None = None  # (tile, inputs: dict, causal, features, props) -> tuple of outputs
    deterministic_outputs: tuple = ()  # indices of run()'s outputs that must be bitwise reproducible
    tuned_by_default: bool = True  # tuned by `python -m cuflash.tune` unless --kernels says otherwise
    # False: a causal mask does not change the kernel's cost (the decode kernel's one query row per
    # head): tuned without it, and causal calls take those entries (tuning_store's key has causal False)
    causal_matters: bool = True

    def __repr__(self) -> str:
        return f"<KernelFamily {self.name}>"

    # --- identity
    def nvrtc_arch(self, props) -> str:
        return props.arch_specific if self.arch_specific else props.arch

    # --- selection
    def supports(self, features: Features) -> bool:
        # the head dims the family is instantiated for are the keys of its defaults
        return (features.dtype in SUPPORTED_DTYPES and features.head_dim in self.defaults
                and (self.takes_dropout or not features.dropout)
                and (self.takes_partial_d or not features.partial_d)
                and (self.takes_seqused_k or not features.seqused_k)
                and (features.seqused_k or not self.needs_seqused_k)
                and (self.takes_varlen or not features.varlen)
                and (self.takes_split_kv or not features.split_kv)
                and (self.takes_paged or not features.paged)
                and (self.takes_alibi or not features.alibi)
                and (self.takes_user_mod or not features.user_mod)
                and (self.takes_block_mask or not features.block_mask)
                and (self.takes_group_loop or not features.group_loop)
                and (self.takes_sinks or not features.sinks)
                and not (features.sinks and features.split_kv))  # a split's partial softmax has no sink

    def space(self, head_dim: int, smem_optin_bytes: int = DEFAULT_SMEM_OPTIN) -> list:
        """Every tile for `head_dim` that is structurally valid and fits in shared memory, in domain order
        (none for a head dim the family is not instantiated for: not a key of its defaults)."""
        if head_dim not in self.defaults:
            return []
        return [t for t in self.domain(head_dim) if t.fits(smem_optin_bytes)]

    def avoids(self, tile, features: Features | None) -> bool:
        """Whether `tile` spills for these features: its perf class's set, or the set of a variant (or
        a "+"-joined combination of variants) the call has, e.g. "local" for windowed calls,
        "softcap", "dropout+softcap": such a call tunes with its class but its instance carries the
        variants' code."""
        if features is None:
            return False
        if tile in self.spilling.get(features.perf_class(), ()):
            return True
        on = {v.name for v in Features.variant_fields() if getattr(features, v.name)}
        return any(tile in tiles and set(key.split("+")) <= on for key, tiles in self.spilling.items())

    def default(self, head_dim: int, smem_optin_bytes: int = DEFAULT_SMEM_OPTIN, features: Features | None = None):
        """The heuristic tile: the first default (the class's own first: class_defaults) that fits the
        device and does not spill for `features`; where every fitting one spills, the first fitting
        one (a slower kernel beats none: the d192 / d256 backward on ~99 KB GPUs)."""
        first = () if features is None else self.class_defaults.get(features.perf_class(), {}).get(head_dim, ())
        fitting = self.fitting_defaults(head_dim, smem_optin_bytes, first)
        for t in fitting:
            if not self.avoids(t, features):
                return t
        if fitting:
            return fitting[0]
        raise RuntimeError(f"no {self.what} config for head_dim {head_dim} fits in {smem_optin_bytes} bytes "
                           f"of shared memory")

    def untuned(self, head_dim: int, smem_optin_bytes: int = DEFAULT_SMEM_OPTIN, features: Features | None = None,
                causal: bool = False):
        """The tile a call runs where nothing tuned applies: the heuristic default, in the family's
        causal variant for a causal call (causal_tile). The tuner's baseline, so that its speedups and
        its promise that a winner is never slower than the untuned call hold for causal shapes too."""
        tile = self.default(head_dim, smem_optin_bytes, features)
        return self.causal_tile(tile) if causal and self.causal_tile is not None else tile

    def fitting_defaults(self, head_dim: int, smem_optin_bytes: int, first: tuple = ()) -> list:
        """`first`, then the head dim's defaults, that fit the device; the last resorts only where
        nothing else fits."""
        fitting = [t for t in (*first, *self.defaults[head_dim]) if t.fits(smem_optin_bytes)]
        usual = [t for t in fitting if t not in self.last_resort]
        return usual or fitting

    def selectable(self) -> list:
        """Tiles the package may pick at run time without tuning (the CPU compile tests cover these)."""
        return sorted({t for table in (self.defaults, *self.class_defaults.values()) for cands in table.values()
                       for t in cands})

    def device_problem(self, props) -> str | None:
        """Why no tile of this family runs on a device with these properties (its compute capability), or None."""
        if tuple(props.cc) < self.min_cc:
            return f"compute capability {props.cc_str} < {self.min_cc[0]}.{self.min_cc[1]} ({self.min_cc_why})"
        if self.max_cc is not None and tuple(props.cc) > self.max_cc:
            return f"compute capability {props.cc_str} > {self.max_cc[0]}.{self.max_cc[1]} ({self.max_cc_why})"
        return None

    def register_cap(self, tile, props) -> int:
        """Registers per thread the tile's accumulators may take on this device."""
        if self.register_limit is not None:
            return self.register_limit(tile, props)
        return register_cap(tile.threads, props)

    def cannot_run(self, problem, props) -> str | None:
        """Why this family cannot serve `problem` (an AttnProblem) on a device with `props`, or None:
        the device, the call's features, the family's own conditions (call_problem), and whether any
        of its default tiles fits the device."""
        why = self.device_problem(props)
        if why:
            return why
        f = problem.features
        if not self.supports(f):
            if f.partial_d and getattr(problem, "dv", problem.head_dim) != problem.head_dim:
                return (f"{self.what} kernels do not support a value head dim other than q's "
                        f"(v {problem.dv}, q and k {problem.head_dim})")
            return f"{self.what} kernels do not support {self._unsupported_part(f, problem.head_dim)}"
        if self.call_problem is not None:
            why = self.call_problem(problem)
            if why:
                return why
        try:
            self.default(f.head_dim, props.smem_optin, f)
        except (RuntimeError, KeyError) as e:
            return str(e) if isinstance(e, RuntimeError) else f"no {self.what} config for head_dim {problem.head_dim}"
        return None

    def _unsupported_part(self, f: Features, call_head_dim: int | None = None) -> str:
        """The part of the call's features this family lacks: a variant (dropout, a sliding window) when
        the plain instantiation would serve, else the dtype and head_dim."""
        plain = dataclasses.replace(f, **{v.name: False for v in Features.variant_fields()})
        if self.supports(plain):
            lacking = [v.name for v in Features.variant_fields()
                       if getattr(f, v.name) and not self.supports(dataclasses.replace(plain, **{v.name: True}))]
            names = {"dropout": "dropout", "local": "sliding windows (window_size)", "softcap": "softcap",
                     "seqused_k": "per-batch key lengths (the KV cache)",
                     "varlen": "variable-length batches (cu_seqlens)",
                     "split_kv": "split-KV decoding (num_splits)",
                     "paged": "paged KV caches (block_table)",
                     "alibi": "ALiBi (alibi_slopes)",
                     "user_mod": "user score/mask modifications (score_mod)",
                     "block_mask": "block masks (block_mask)",
                     "sinks": "attention sinks in the kernel (sinks)",
                     "partial_d": f"head_dim other than {', '.join(map(str, sorted(self.defaults)))}"}
            return " or ".join(names.get(n, n) for n in lacking) or "this combination of features"
        run_as = f" (on the kernels of head dim {f.head_dim})" if call_head_dim not in (None, f.head_dim) else ""
        return f"{f.dtype} with head_dim {call_head_dim or f.head_dim}{run_as}"

    def can_implement(self, tile, props, features: Features | None = None) -> str | None:
        """Why `tile` cannot run on a device with these properties (decided without compiling), or None."""
        if not isinstance(tile, self.tile_cls):
            return f"a {self.name} config must be a {self.tile_cls.__name__}, got {type(tile).__name__}"
        why = self.device_problem(props)
        if why:
            return why
        why = tile.structural_problem() or self.launch_limits_problem(tile, props)
        if why:
            return why
        need, cap = self.accumulator_registers(tile), self.register_cap(tile, props)
        if need > cap:
            return f"accumulators alone need {need} registers per thread > {cap} available (would spill)"
        if self.avoids(tile, features):
            return f"its {features.perf_class()} instantiation spills registers"
        return None

    @staticmethod
    def launch_limits_problem(tile, props) -> str | None:
        """Why the device cannot launch `tile` at all (its threads or shared memory), or None."""
        if tile.threads > props.max_threads_per_block:
            return f"{tile.threads} threads > {props.max_threads_per_block} per block"
        if tile.smem_bytes > props.smem_optin:
            return f"shared memory {tile.smem_bytes} B > opt-in limit {props.smem_optin} B"
        return None

    def check_explicit(self, tile, features: Features) -> None:
        """Raise if a caller-given tile cannot serve `features`: the wrong family's tile (TypeError)
        or another head_dim (ValueError). Selection never produces either; the tuner and tests can."""
        if not isinstance(tile, self.tile_cls):
            raise TypeError(f"config must be a {self.tile_cls.__name__}, got {type(tile).__name__}")
        if tile.head_dim != features.head_dim:
            raise ValueError(f"config {tile} is for head_dim {tile.head_dim}, the problem has {features.head_dim}")

    def tile_from_dict(self, d: dict):
        """A tile from its JSON fields; ValueError if the fields are wrong."""
        names = [f.name for f in dataclasses.fields(self.tile_cls)]
        if not isinstance(d, dict) or set(d) != set(names) or not all(type(d[n]) is int for n in names):
            raise ValueError(f"not a {self.name} config: {d!r}")
        return self.tile_cls(**d)
