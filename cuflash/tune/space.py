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

The domains are the families' own (cuflash/families/); which of them exist
on a GPU follows only from its recorded properties, never from its name.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from .. import families
from ..device import DeviceProps
from ..families import REG_ALLOC_UNIT, KernelFamily

_UNLIMITED = 1 << 40


def family(kernel: str) -> KernelFamily:
    """The family named `kernel` (the CLI's and the tables' name for it)."""
    return families.get(kernel)


def default_kernels() -> tuple:
    """What `python -m cuflash.tune` tunes unless told otherwise."""
    return tuple(name for name, f in families.REGISTRY.items() if f.tuned_by_default)


def static_problem(cfg, props: DeviceProps, features=None) -> str | None:
    """Why `cfg` cannot run on a device with these properties, decided without compiling, or None."""
    return families.of(cfg).can_implement(cfg, props, features)


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


def build_space(fam: KernelFamily, head_dim: int, props: DeviceProps, features=None) -> Space:
    """Every tile of `fam` for `head_dim`, split into static candidates and pruned (with reasons)."""
    candidates, pruned = [], {}
    for cfg in fam.space(head_dim, _UNLIMITED):
        why = fam.can_implement(cfg, props, features)
        if why:
            pruned[cfg] = why
        else:
            candidates.append(cfg)
    try:
        # no default on a device the family does not run on (the sm90 forward off cc 9.0)
        default = None if fam.device_problem(props) else fam.default(head_dim, props.smem_optin, features)
    except (RuntimeError, KeyError):
        default = None
    if default is not None and default not in candidates and default not in pruned:
        # a default outside the searched domain (the 2-warp last resorts of the d192 / d256
        # backward, for ~99 KB GPUs where no searched tile fits): the space's one candidate
        candidates.append(default)
    return Space(fam.name, head_dim, props, candidates, pruned, default)


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def config_label(cfg) -> str:
    return cfg.label()


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


def offline_check(features, props: DeviceProps, allow_local_bytes: int = 0) -> Callable:
    """check(cfg) by an offline NVRTC compile of the (cfg, features) instance for the device's arch
    as its family targets it (no GPU needed)."""
    from .. import _compile

    def check(cfg):
        try:
            rep = _compile.compile_report(_compile.kernel_source(cfg, features), families.of(cfg).nvrtc_arch(props))
        except Exception as e:  # noqa: BLE001 - any compile failure prunes the config
            return f"NVRTC compile failed: {str(e).strip().splitlines()[0][:200]}"
        return resource_problem(cfg, rep, props, allow_local_bytes)

    return check
