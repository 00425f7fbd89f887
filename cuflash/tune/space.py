"""Search spaces per kernel, derived from the device's properties, and the pruning rules.

A config is pruned before it is ever timed, in two stages:

1. statically (no compile): structurally invalid; more threads than a block may have; more shared
   memory than the block may opt into; or accumulators that alone need more registers per thread
   than the block can give (a sure spill: ptxas caps registers at
   min(255, registers per block / threads), and the fp32 accumulator tiles of the kernel are live at
   once, so that count is a lower bound of what the kernel needs);
2. after an NVRTC compile, from the compiled kernel's resources: registers x threads over the
   device's register budget, any local memory (register spills or a stack frame), static plus
   dynamic shared memory over the opt-in limit, or a kernel the driver would not launch with this
   many threads.

The domains (Br, Bc, warps, stages) are the kernels' own (cuflash._configs); which of them exist
on a GPU follows only from its recorded properties, never from its name.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from .. import _configs
from .device import DeviceProps

MIN_CC = (8, 0)  # mma.sync m16n8k16 with bf16, ldmatrix, cp.async
MAX_REGS_PER_THREAD = 255
REG_ALLOC_UNIT = 8  # registers are allocated per thread in multiples of 8 (256 per warp)


def _fwd_acc(c) -> int:  # O (block_q x d) + S (block_q x block_k), fp32, spread over the block's threads
    return (c.block_q * c.head_dim + c.block_q * c.block_k) // c.threads


def _bwd_acc(c) -> int:  # dK + dV (block_k x d each) + S^T (block_k x block_q), fp32
    return (2 * c.block_k * c.head_dim + c.block_k * c.block_q) // c.threads


def _dq_acc(c) -> int:  # dQ (block_q x d) + S (block_q x block_k), fp32
    return (c.block_q * c.head_dim + c.block_q * c.block_k) // c.threads


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    name: str
    config_cls: type
    space_fn: Callable  # (head_dim, smem_optin_bytes) -> [config]: the kernel's structurally valid domain
    default_fn: Callable  # (head_dim, smem_optin_bytes) -> config (the heuristic)
    accumulator_registers: Callable  # config -> fp32 registers per thread its accumulators need
    api_module: str  # the module that runs it (None of the tuner's business if it is missing)
    description: str


KERNELS = {
    "fwd": KernelSpec("fwd", _configs.FwdConfig, _configs.fwd_space, _configs.default_fwd_config, _fwd_acc,
                      "cuflash._forward", "forward (out, lse)"),
    "bwd": KernelSpec("bwd", _configs.BwdConfig, _configs.bwd_space, _configs.default_bwd_config, _bwd_acc,
                      "cuflash._backward", "backward dK/dV kernel (dQ by atomics)"),
    "bwd_dq": KernelSpec("bwd_dq", _configs.DqConfig, _configs.dq_space, _configs.default_dq_config, _dq_acc,
                         "cuflash._backward", "deterministic backward's dQ kernel"),
    "fwd_v1": KernelSpec("fwd_v1", _configs.V1Config, _configs.v1_space, _configs.default_v1_config, _fwd_acc,
                         "cuflash._forward_v1", "forward, v1 algorithm (FlashAttention-1)"),
}
DEFAULT_KERNELS = ("fwd", "bwd", "bwd_dq")  # what `python -m cuflash.tune` tunes unless told otherwise

_UNLIMITED = 1 << 40


def spec(kernel: str) -> KernelSpec:
    try:
        return KERNELS[kernel]
    except KeyError:
        raise ValueError(f"unknown kernel {kernel!r}; known: {', '.join(KERNELS)}") from None


def register_cap(threads: int, props: DeviceProps) -> int:
    """Most registers per thread ptxas can give a block of `threads` threads (launch bounds)."""
    per_thread = props.register_budget // threads
    return min(MAX_REGS_PER_THREAD, per_thread // REG_ALLOC_UNIT * REG_ALLOC_UNIT)


def static_problem(cfg, props: DeviceProps) -> str | None:
    """Why `cfg` cannot run on a device with these properties, decided without compiling, or None."""
    if tuple(props.cc) < MIN_CC:
        return f"compute capability {props.cc_str} < {MIN_CC[0]}.{MIN_CC[1]} (needs mma.sync bf16 and cp.async)"
    why = cfg.structural_problem()
    if why:
        return why
    if cfg.threads > props.max_threads_per_block:
        return f"{cfg.threads} threads > {props.max_threads_per_block} per block"
    if cfg.smem_bytes > props.smem_optin:
        return f"shared memory {cfg.smem_bytes} B > opt-in limit {props.smem_optin} B"
    need = KERNELS[cfg.KERNEL].accumulator_registers(cfg) if cfg.KERNEL in KERNELS else 0
    cap = register_cap(cfg.threads, props)
    if need > cap:
        return f"accumulators alone need {need} registers per thread > {cap} available (would spill)"
    return None


@dataclasses.dataclass
class Space:
    kernel: str
    head_dim: int
    props: DeviceProps
    candidates: list  # pass the static checks, in the kernel's domain order
    pruned: dict  # config -> reason (static)
    default: object  # the heuristic default for this device, or None when no config fits

    @property
    def size(self) -> int:
        return len(self.candidates) + len(self.pruned)


def build_space(kernel: str, head_dim: int, props: DeviceProps) -> Space:
    """Every config of `kernel` for `head_dim`, split into static candidates and pruned (with reasons)."""
    s = spec(kernel)
    candidates, pruned = [], {}
    for cfg in s.space_fn(head_dim, _UNLIMITED):
        why = static_problem(cfg, props)
        if why:
            pruned[cfg] = why
        else:
            candidates.append(cfg)
    try:
        default = s.default_fn(head_dim, props.smem_optin)
    except (RuntimeError, KeyError):
        default = None
    return Space(kernel, head_dim, props, candidates, pruned, default)


def config_from_dict(kernel: str, d: dict):
    """A config of `kernel` from its JSON fields; ValueError if the fields are wrong."""
    cls = spec(kernel).config_cls
    names = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(d, dict) or set(d) != set(names) or not all(type(d[n]) is int for n in names):
        raise ValueError(f"not a {kernel} config: {d!r}")
    return cls(**d)


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def config_label(cfg) -> str:
    return f"{cfg.block_q}x{cfg.block_k} w{cfg.warps} s{cfg.stages}"


# ----------------------------------------------------------------------------- after the compile

def normalize_resources(rep: dict) -> dict:
    """One shape for ptxas' offline report (cuflash._compile.compile_report) and a loaded kernel's
    attributes (kernel_resources): registers, local_bytes, smem_static_bytes, max_threads_per_block."""
    if "local_bytes" in rep:
        return rep
    return {
        "registers": int(rep.get("registers", 0)),
        # the stack frame holds the spill slots; a spill without a frame is still local memory
        "local_bytes": max(int(rep.get("stack_bytes", 0)), int(rep.get("spill_stores", 0))),
        "smem_static_bytes": int(rep.get("smem_static_bytes", 0)),
        "max_threads_per_block": None,
    }


def kernel_resources(fn) -> dict:
    """Resources of a loaded cupy.RawKernel (what the driver will actually launch)."""
    return {
        "registers": int(fn.num_regs),
        "local_bytes": int(fn.local_size_bytes),
        "smem_static_bytes": int(fn.shared_size_bytes),
        "max_threads_per_block": int(fn.max_threads_per_block),
    }


def resource_problem(cfg, resources: dict, props: DeviceProps, allow_local_bytes: int = 0) -> str | None:
    """Why a compiled `cfg` should not be timed, from its resources, or None."""
    r = normalize_resources(resources)
    regs = r["registers"]
    alloc = -(-regs // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    if alloc * cfg.threads > props.register_budget:
        return f"{regs} registers x {cfg.threads} threads > {props.register_budget} registers per block"
    if r["local_bytes"] > allow_local_bytes:
        return f"{r['local_bytes']} B of local memory per thread (register spills / stack frame)"
    if r["smem_static_bytes"] + cfg.smem_bytes > props.smem_optin:
        return (f"shared memory {r['smem_static_bytes']} static + {cfg.smem_bytes} dynamic B"
                f" > opt-in limit {props.smem_optin} B")
    mt = r.get("max_threads_per_block")
    if mt is not None and mt < cfg.threads:
        return f"driver allows {mt} threads per block for this kernel, config needs {cfg.threads}"
    return None


def offline_check(dtype: str, props: DeviceProps, allow_local_bytes: int = 0) -> Callable:
    """check(cfg) by an offline NVRTC compile for the device's arch (no GPU needed)."""
    from .. import _compile

    def check(cfg):
        try:
            rep = _compile.compile_report(_compile.kernel_source(cfg, dtype), props.arch)
        except Exception as e:  # noqa: BLE001 - any compile failure prunes the config
            return f"NVRTC compile failed: {str(e).strip().splitlines()[0][:200]}"
        return resource_problem(cfg, rep, props, allow_local_bytes)

    return check
