"""Facts about the CUDA devices, asked once per process: is there a GPU, and what are its limits.

One record (`DeviceProps`) serves the library (config selection, tuned-table lookup) and the tuner
(search spaces), read from CuPy or from recorded JSON, so the space for a GPU that is not at hand
can be built from its recorded properties (shipped_props(): tests/fixtures/devices/*.json, installed
as cuflash/devices/). Everything a kernel config is judged by comes from here (shared memory a
block may opt into, registers per block and per SM, threads per block, compute capability); the
identity fields (name, compute capability, SM count, driver and NVRTC versions) are part of every
tuning-table key.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib


# The oldest GPUs cuflash runs on: every kernel uses mma.sync on bf16 and cp.async (sm_80, Ampere).
MIN_CC = (8, 0)


class UnsupportedDeviceError(RuntimeError):
    """The GPU is older than cuflash supports (compute capability below MIN_CC), or this process's
    NVRTC cannot build kernels for it (compiler_reason)."""


@dataclasses.dataclass(frozen=True)
class DeviceProps:
    name: str
    cc: tuple  # (major, minor)
    sm_count: int
    smem_optin: int  # sharedMemPerBlockOptin: dynamic + static shared memory one block may use
    smem_per_sm: int
    regs_per_block: int
    regs_per_sm: int
    max_threads_per_block: int
    max_threads_per_sm: int
    l2_bytes: int = 0
    total_mem: int = 0
    driver_version: int | None = None  # cudaDriverGetVersion, e.g. 13000
    runtime_version: int | None = None
    nvrtc_version: tuple | None = None  # (major, minor)

    @property
    def arch(self) -> str:
        """NVRTC target of the binaries CuPy builds for this GPU (CuPy uses sm_XY, never sm_XYa)."""
        return f"sm_{self.cc[0]}{self.cc[1]}"

    @property
    def arch_specific(self) -> str:
        """NVRTC target with this GPU's architecture-specific instructions: sm_90a on cc 9.0 (wgmma,
        setmaxnreg need it), the plain target elsewhere. For families that opt into such code."""
        return f"{self.arch}a" if self.cc == (9, 0) else self.arch

    @property
    def cc_str(self) -> str:
        return f"{self.cc[0]}.{self.cc[1]}"

    @property
    def register_budget(self) -> int:
        """Registers one block may hold: the smaller of the per-block and per-SM limits."""
        return min(self.regs_per_block, self.regs_per_sm)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["cc"] = list(self.cc)
        if self.nvrtc_version is not None:
            d["nvrtc_version"] = list(self.nvrtc_version)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceProps":
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["cc"] = tuple(kw["cc"])
        if kw.get("nvrtc_version") is not None:
            kw["nvrtc_version"] = tuple(kw["nvrtc_version"])
        return cls(**kw)

    @classmethod
    def from_json(cls, path) -> "DeviceProps":
        return cls.from_dict(json.loads(pathlib.Path(path).read_text()))


class CudaUnavailableError(RuntimeError):
    """CUDA cannot be used here: no NVIDIA driver, a driver older than CuPy's CUDA, no device."""


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def explain_cuda_error(e: BaseException) -> str:
    """A failure of CuPy's first CUDA call in a user's words. CuPy reports a missing driver as
    "driver version is insufficient" (the runtime reads the absent driver's version as 0); this says
    which of the two it is, and what to do."""
    try:
        import cupy

        rt = cupy.cuda.runtime
        driver, runtime = int(rt.driverGetVersion()), int(rt.runtimeGetVersion())
    except Exception:  # noqa: BLE001 - no CuPy, or not even the versions: CuPy's own words
        return f"{type(e).__name__}: {e}"
    if driver == 0:
        return ("no NVIDIA driver found: the CUDA driver library (libcuda) is not installed or not visible here, "
                "and cuflash's kernels need an NVIDIA GPU with its driver")
    if driver < runtime and getattr(e, "status", None) == 35:  # cudaErrorInsufficientDriver
        return (f"the NVIDIA driver supports CUDA up to {_cuda_version(driver)}, but this CuPy is built for CUDA "
                f"{_cuda_version(runtime)}: update the driver, or install the CuPy build for it "
                f"(pip install 'cuflash[cuda12]' for a CUDA 12 driver)")
    return f"{type(e).__name__}: {e}"


def cuda_device_count() -> tuple[int, str]:
    """(number of CUDA devices, why none) -- any CuPy/driver failure counts as no GPU."""
    try:
        import cupy
    except ImportError as e:
        return 0, f"CuPy is not installed ({e}): pip install 'cuflash[cuda13]' (or [cuda12])"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
        return n, "" if n else "getDeviceCount() returned 0"
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError (no driver, insufficient driver, ...)
        return 0, explain_cuda_error(e)


def shipped_props_dir() -> pathlib.Path | None:
    """Recorded properties of real GPUs (sm_80, sm_86, sm_89, sm_90, sm_100, sm_120): cuflash/devices as installed,
    tests/fixtures/devices in a checkout (the same files; pyproject.toml ships one as the other)."""
    pkg = pathlib.Path(__file__).resolve().parent
    for d in (pkg / "devices", pkg.parent / "tests" / "fixtures" / "devices"):
        if d.is_dir():
            return d
    return None


def shipped_props() -> dict:
    """name (file stem, e.g. "l4", "a100-80gb") -> path of the recorded properties shipped with cuflash."""
    d = shipped_props_dir()
    return {p.stem: p for p in sorted(d.glob("*.json"))} if d is not None else {}


def cuda_torch():
    """torch if importable and it sees a CUDA device, else None (torch is optional: the benchmarks
    compare against it when it is there)."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _str(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple | None:
    try:
        from cupy.cuda import nvrtc

        return tuple(nvrtc.getVersion())
    except Exception:  # noqa: BLE001 - no NVRTC: nothing can compile, but the key must still build
        return None


@functools.lru_cache(maxsize=None)
def nvrtc_targets() -> tuple | None:
    """The real architectures this process's NVRTC builds for, as numbers (80, 86, ..., 90, 100, 120),
    or None where it cannot say (no NVRTC, or one without nvrtcGetSupportedArchs)."""
    try:
        from cupy.cuda import nvrtc

        return tuple(sorted(int(a) for a in nvrtc.getSupportedArchs()))
    except Exception:  # noqa: BLE001 - unknown: no check (the compile then says what it says)
        return None


def compiler_reason(props: DeviceProps, device_id: int | None = None) -> str | None:
    """Why this process's NVRTC cannot build kernels for a GPU with these properties (its target,
    e.g. sm_120, not among NVRTC's: a Blackwell GPU with an NVRTC older than CUDA 12.8), or None.
    Asked before the first compile: CuPy would otherwise build for the newest target its NVRTC
    knows, and that binary does not load on a GPU of a later architecture (or NVRTC rejects the
    target), neither of which says what to install."""
    targets = nvrtc_targets()
    cc = 10 * props.cc[0] + props.cc[1]
    if targets is None or cc in targets:
        return None
    which = "this GPU" if device_id is None else f"CUDA device {device_id}"
    v = nvrtc_version()
    version = "" if v is None else f" {v[0]}.{v[1]}"
    return (f"cuflash builds its kernels at run time with NVRTC, and this process's NVRTC{version} cannot build "
            f"for {which}, {props.name} (compute capability {props.cc_str}, target sm_{cc}): its targets end "
            f"at sm_{targets[-1]}. Install an NVRTC that knows sm_{cc} (pip install -U nvidia-cuda-nvrtc for "
            f"CUDA 13, or nvidia-cuda-nvrtc-cu12 for CUDA 12) and a driver that supports the GPU")


@functools.lru_cache(maxsize=None)
def query(device_id: int = 0) -> DeviceProps:
    """The properties of CUDA device `device_id`, asked once per process."""
    import cupy

    rt = cupy.cuda.runtime
    try:
        p = rt.getDeviceProperties(device_id)
    except rt.CUDARuntimeError as e:
        raise CudaUnavailableError(f"cuflash cannot use CUDA device {device_id}: {explain_cuda_error(e)}") from e
    return DeviceProps(
        name=_str(p["name"]),
        cc=(int(p["major"]), int(p["minor"])),
        sm_count=int(p["multiProcessorCount"]),
        smem_optin=int(p["sharedMemPerBlockOptin"]),
        smem_per_sm=int(p["sharedMemPerMultiprocessor"]),
        regs_per_block=int(p["regsPerBlock"]),
        regs_per_sm=int(p["regsPerMultiprocessor"]),
        max_threads_per_block=int(p["maxThreadsPerBlock"]),
        max_threads_per_sm=int(p["maxThreadsPerMultiProcessor"]),
        l2_bytes=int(p.get("l2CacheSize", 0)),
        total_mem=int(p.get("totalGlobalMem", 0)),
        driver_version=int(rt.driverGetVersion()),
        runtime_version=int(rt.runtimeGetVersion()),
        nvrtc_version=nvrtc_version(),
    )


def unsupported_reason(props: DeviceProps, device_id: int | None = None) -> str | None:
    """Why cuflash cannot run on a GPU with these properties (compute capability below MIN_CC), or None."""
    if tuple(props.cc) >= MIN_CC:
        return None
    which = "this GPU" if device_id is None else f"CUDA device {device_id}"
    return (f"cuflash needs an NVIDIA GPU of compute capability {MIN_CC[0]}.{MIN_CC[1]} or newer (Ampere or "
            f"later: A100, A10, RTX 30xx, L4, RTX 40xx, H100, ...; its kernels use mma.sync on bf16 and "
            f"cp.async), but {which} is {props.name} with compute capability {props.cc_str}")


def check_supported(props: DeviceProps, device_id: int | None = None) -> DeviceProps:
    """props, or UnsupportedDeviceError naming the GPU, its compute capability and the minimum."""
    why = unsupported_reason(props, device_id)
    if why:
        raise UnsupportedDeviceError(why)
    return props


def supported(device_id: int = 0) -> DeviceProps:
    """query(device_id), or UnsupportedDeviceError for a GPU cuflash cannot run on (too old, or no
    NVRTC target for it here). Every entry point asks this before it selects a kernel or compiles
    one (families.choose/select, _compile)."""
    props = check_supported(query(device_id), device_id)
    why = compiler_reason(props, device_id)
    if why:
        raise UnsupportedDeviceError(why)
    return props
