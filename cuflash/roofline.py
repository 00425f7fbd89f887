"""Roofline of the attention forward: cuflash v1 and v2 (and PyTorch SDPA) against this GPU's ceilings.

    python -m cuflash.roofline --out roofline.png [--json PATH] [--seqlens ...] [--causal 0|1|both]
    python -m cuflash.roofline --replot roofline.json --out roofline.png      # no GPU needed

One run measures the GPU's two ceilings -- compute: a large bf16 matmul through CuPy (cuBLAS);
bandwidth: a large device-to-device copy, read + write bytes counted -- and, in the same process,
the forward of cuflash v1 (FlashAttention-1, Algorithm 1: kernels_cu/flash_fwd_v1.cuh) and v2
(FlashAttention-2: kernels_cu/flash_fwd.cuh), plus SDPA's flash and cuDNN backends when torch is
importable (optional, imported lazily). Each kernel is placed at the arithmetic intensity of the
bytes its algorithm must move (the traffic models below) and at the TFLOP/s it achieved, under the
measured roof min(peak, intensity x bandwidth). The JSON report is always written; the picture
needs matplotlib (the `plot` extra).

Everything before "measuring" is plain arithmetic, tested on CPU (tests/test_roofline.py), among
others with the design notes' own example: A100, 312 TFLOP/s over 1.5-2 TB/s, ridge 156-208
FLOP/byte ("about 200").
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

from ._timing import bytes_attention, flops_attention
from ._version import add_version_argument
from .device import cuda_torch

# ----------------------------------------------------------------------------- ceilings


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """A compute and a bandwidth ceiling. TFLOP/s = 1e12 FLOP/s; GB/s = 1e9 bytes/s, reads + writes."""

    peak_tflops: float
    bandwidth_gbps: float
    label: str = ""

    @property
    def ridge(self) -> float:
        """FLOP/byte where the two roofs meet."""
        return ridge_point(self.peak_tflops * 1e12, self.bandwidth_gbps * 1e9)


def ridge_point(peak_flops: float, bandwidth_bytes: float) -> float:
    """Arithmetic intensity (FLOP/byte) at which a kernel stops being memory-bound: pi / beta."""
    if peak_flops <= 0 or bandwidth_bytes <= 0:
        raise ValueError("ceilings must be positive")
    return peak_flops / bandwidth_bytes


def attainable_flops(intensity: float, peak_flops: float, bandwidth_bytes: float) -> float:
    """The roof: min(peak, intensity x bandwidth), in FLOP/s."""
    return min(peak_flops, intensity * bandwidth_bytes)


def bound_side(intensity: float, peak_flops: float, bandwidth_bytes: float) -> str:
    """'memory' left of the ridge, 'compute' at or right of it."""
    return "memory" if intensity < ridge_point(peak_flops, bandwidth_bytes) else "compute"


# The design notes' worked example (FlashAttention v1 study notes): A100, fp16/bf16 tensor cores
# 312 TFLOP/s over HBM at 1.5-2 TB/s (A100 40 GB: 1555 GB/s, 80 GB: 2039 GB/s) -> ridge 156-208
# FLOP/byte, "about 200".
DESIGN_NOTES_A100 = (Ceilings(312, 1500, "A100, notes' 1.5 TB/s"), Ceilings(312, 2000, "A100, notes' 2 TB/s"))

# Vendor figures (dense 16-bit tensor-core FLOP/s, HBM bandwidth), drawn dashed for reference only;
# the analysis uses the measured ceilings. Matched by substring of the device name, first hit wins.
NOMINAL = (
    ("H200", Ceilings(989, 4800, "H200 nominal")),
    ("H100 80GB HBM3", Ceilings(989, 3350, "H100 SXM nominal")),
    ("H100 PCIe", Ceilings(756, 2000, "H100 PCIe nominal")),
    ("A100-SXM4-80GB", Ceilings(312, 2039, "A100 80GB nominal")),
    ("A100-SXM4-40GB", Ceilings(312, 1555, "A100 40GB nominal")),
)


def nominal_ceilings(gpu_name: str) -> Ceilings | None:
    for key, c in NOMINAL:
        if key in gpu_name:
            return c
    return None


# ----------------------------------------------------------------------------- traffic models


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    itemsize: int = 2  # bf16 / fp16

    @property
    def flops(self) -> float:
        """Nominal forward FLOPs, FlashAttention's convention (4 B H Nq Nk D, halved when causal)."""
        return flops_attention(self.batch, self.heads, self.seqlen_q, self.seqlen_k, self.head_dim, self.causal)


def _q_tiles(s: Shape, block_q: int, block_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, kv_tiles) per Q tile of block_q rows: rows actually present (the last tile may be
    short) and how many K/V tiles of block_k rows the tile sees, 0 when none (bottom-right causal:
    a tile sees K/V tile j iff its last row does, i.e. r0 + block_q - 1 + Nk - Nq >= j*block_k --
    the loop bounds of both kernels)."""
    n_kv = -(-s.seqlen_k // block_k)
    r0 = np.arange(0, s.seqlen_q, block_q, dtype=np.int64)
    rows = np.minimum(block_q, s.seqlen_q - r0)
    if not s.causal:
        return rows, np.full_like(r0, n_kv)
    last_key = r0 + block_q - 1 + (s.seqlen_k - s.seqlen_q)
    seen = np.where(last_key < 0, 0, np.minimum(n_kv, np.maximum(last_key, 0) // block_k + 1))
    return rows, seen


def traffic_floor(s: Shape) -> dict:
    """The ideal (naive) floor: Q, K, V read once, O written once, plus the fp32 lse row."""
    bh = s.batch * s.heads
    q_side = bh * s.seqlen_q * s.head_dim * s.itemsize
    k_side = bh * s.seqlen_k * s.head_dim * s.itemsize
    lse = bh * s.seqlen_q * 4
    total = bytes_attention(s.batch, s.heads, s.seqlen_q, s.seqlen_k, s.head_dim, itemsize=s.itemsize, lse=True)
    out = {"q": q_side, "kv": 2 * k_side, "o_lse": q_side + lse, "workspace": 0}
    assert sum(out.values()) == total
    return {**out, "total": total}


def traffic_v2(s: Shape, block_q: int, block_k: int) -> dict:
    """v2 (FlashAttention-2 forward, one block per Q tile): Q read once; K and V read once per Q tile
    of block_q rows -- for causal only the K/V tiles the Q tile sees; O and lse written once.

    Every K/V re-read is counted as memory traffic, whether L2 or HBM serves it: that is the traffic
    leaving the SMs, an upper bound on HBM bytes (concurrent blocks of one head share K/V in L2, so
    DRAM sees between this and the floor). Q tiles that see no key read nothing.
    """
    rows, seen = _q_tiles(s, block_q, block_k)
    bh = s.batch * s.heads
    row_bytes = s.head_dim * s.itemsize
    kv_rows = np.minimum(s.seqlen_k, seen * block_k)  # rows past Nk are zero-filled, not read
    q = bh * int(rows[seen > 0].sum()) * row_bytes
    kv = bh * 2 * int(kv_rows.sum()) * row_bytes
    o_lse = bh * s.seqlen_q * (row_bytes + 4)
    return {"q": q, "kv": kv, "o_lse": o_lse, "workspace": 0, "total": q + kv + o_lse}


def traffic_v1(s: Shape, block_q: int, block_k: int) -> dict:
    """v1 (FlashAttention-1, Algorithm 1, one block per (batch, head)), as kernels_cu/flash_fwd_v1.cuh
    moves it: K and V read once; Q tile i read once per K/V tile it sees; the fp32 workspace -- O_i
    (head_dim floats per row) and (m_i, l_i) (2 floats per row) -- read and written once per K/V
    tile, except that the first step starts from the initial values without reading and the last
    step writes the 16-bit O and lse instead (Algorithm 1 as printed: one more round trip each);
    O and lse written once.

    All of it is DRAM traffic in practice: each head's workspace is seqlen_q x (head_dim + 2) x 4
    bytes, and batch x heads of them are live at once (134 MB at the brief's shape, over L2).
    """
    rows, seen = _q_tiles(s, block_q, block_k)
    bh = s.batch * s.heads
    row_bytes = s.head_dim * s.itemsize
    kv = bh * 2 * s.seqlen_k * row_bytes
    q = bh * int((rows * seen).sum()) * row_bytes
    ws_row = (s.head_dim + 2) * 4
    round_trips = np.maximum(seen - 1, 0)
    workspace = bh * 2 * int((rows * round_trips).sum()) * ws_row  # read + write
    o_lse = bh * s.seqlen_q * (row_bytes + 4)
    return {"q": q, "kv": kv, "o_lse": o_lse, "workspace": workspace, "total": q + kv + o_lse + workspace}


# Which model each measured kernel is placed with, and why.
V2_SM80 = "v2_sm80"  # the v2 call forced to the mma.sync family, where the automatic one is another
MODELS = {
    "v1": ("v1", "cuflash v1: traffic_v1 with its config's tiles"),
    "v2": ("v2", "cuflash v2, the automatic family (the Hopper one on cc 9.0): traffic_v2 with its config's tiles"),
    V2_SM80: ("v2", ("cuflash v2 forced to the mma.sync family (measured where the automatic family is another): "
                     "traffic_v2 with its config's tiles")),
    "sdpa_flash": ("v2", "SDPA flash (FlashAttention-2): traffic_v2 with --sdpa-flash-tiles (default 128 x 64, "
                         "upstream FA2's forward tile for head_dim 128 outside sm86/89; PyTorch's vendored copy "
                         "may use others), an assumption"),
    "sdpa_cudnn": ("floor", "SDPA cuDNN: internals unknown, placed at the floor"),
}
SDPA_FLASH_TILES = (128, 64)


def traffic(model: str, s: Shape, tiles: tuple[int, int] | None = None) -> dict:
    if model == "floor":
        return traffic_floor(s)
    if tiles is None:
        raise ValueError(f"the {model} traffic model needs (block_q, block_k)")
    return {"v1": traffic_v1, "v2": traffic_v2}[model](s, *tiles)


def place(flops: float, nbytes: float, ms: float | None, ceilings: Ceilings) -> dict:
    """Where one kernel sits: intensity, its roof, the side of the ridge, and (if timed) how close."""
    peak, bw = ceilings.peak_tflops * 1e12, ceilings.bandwidth_gbps * 1e9
    intensity = flops / nbytes
    roof = attainable_flops(intensity, peak, bw)
    out = {
        "bytes": nbytes,
        "intensity": intensity,
        "bound": bound_side(intensity, peak, bw),
        "roof_tflops": roof / 1e12,
        "floor_ms": max(flops / peak, nbytes / bw) * 1e3,  # the roof's time for this work
        "tflops": None,
        "of_roof": None,
        "of_peak": None,
    }
    if ms:
        achieved = flops / (ms * 1e-3)
        out.update(tflops=achieved / 1e12, of_roof=achieved / roof, of_peak=achieved / peak)
    return out


def analyse_case(s: Shape, ceilings: Ceilings, tiles: dict, timings_ms: dict) -> dict:
    """Every kernel of one shape placed under the roof.

    tiles: kernel -> (block_q, block_k) for the kernels placed with a tiled model (v1, v2,
    sdpa_flash); timings_ms: kernel -> median ms or None (not measured). Kernels in `tiles` or
    `timings_ms` are placed; "floor" (the ideal traffic, no timing) always is.
    """
    flops = s.flops
    fl = traffic_floor(s)
    kernels = {"floor": {**place(flops, fl["total"], None, ceilings), "traffic": fl, "model": "floor"}}
    for name in dict.fromkeys([*tiles, *timings_ms]):
        model = MODELS.get(name, ("floor", ""))[0]
        tr = traffic(model, s, tiles.get(name))
        kernels[name] = {**place(flops, tr["total"], timings_ms.get(name), ceilings), "traffic": tr, "model": model,
                         "intensity_floor": flops / fl["total"], "tiles": tiles.get(name)}
    out = {**dataclasses.asdict(s), "flops": flops, "kernels": kernels, "v2_over_v1": None}
    t1, t2 = timings_ms.get("v1"), timings_ms.get("v2")
    if t1 and t2:
        out["v2_over_v1"] = t1 / t2
    return out


# ----------------------------------------------------------------------------- text and JSON

_KERNEL_ORDER = ("v1", "v2", V2_SM80, "sdpa_flash", "sdpa_cudnn")


def format_case(c: dict) -> str:
    head = (f"seqlen {c['seqlen_q']:>6} batch {c['batch']:>3} heads {c['heads']:>3} d {c['head_dim']} "
            f"causal {int(c['causal'])}")
    parts = []
    for name in _KERNEL_ORDER:
        k = c["kernels"].get(name)
        if k is None:
            continue
        tf = "-" if k["tflops"] is None else f"{k['tflops']:.1f}"
        parts.append(f"{name} {tf} TFLOP/s @ {k['intensity']:.0f} FLOP/B ({k['bound']})")
    ratio = "" if c["v2_over_v1"] is None else f"; v2/v1 {c['v2_over_v1']:.2f}x"
    return head + ": " + ", ".join(parts) + ratio


def write_json(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


# ----------------------------------------------------------------------------- plot


class PlotUnavailable(RuntimeError):
    pass


def plot(report: dict, path: str) -> None:
    """Log-log roofline of a report (as written to JSON) into `path`. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailable("matplotlib is not installed, so no picture: pip install 'cuflash[plot]' "
                              "(or pip install matplotlib); the JSON report has every number, and "
                              "`python -m cuflash.roofline --replot REPORT.json --out PNG` draws it later") from e

    meas = Ceilings(**report["ceilings"]["measured"]["roof"])
    nom = report["ceilings"].get("nominal")
    nom = Ceilings(**nom) if nom else None
    points = [(name, k, c) for c in report["cases"] for name, k in c["kernels"].items()
              if name != "floor" and k["tflops"] is not None]
    xs = [k["intensity"] for _, k, _ in points] + [c["kernels"]["floor"]["intensity"] for c in report["cases"]]
    xs += [meas.ridge] + ([nom.ridge] if nom else [])
    x_lo, x_hi = min(xs) / 3, max(xs) * 3
    grid = np.geomspace(x_lo, x_hi, 256)

    fig, ax = plt.subplots(figsize=(9, 6))
    ax.plot(grid, np.minimum(meas.peak_tflops, grid * meas.bandwidth_gbps / 1e3), "k-", lw=2,
            label=f"measured roof: {meas.peak_tflops:.0f} TFLOP/s, {meas.bandwidth_gbps / 1e3:.2f} TB/s "
                  f"(ridge {meas.ridge:.0f} FLOP/B)")
    if nom:
        ax.plot(grid, np.minimum(nom.peak_tflops, grid * nom.bandwidth_gbps / 1e3), color="0.6", ls="--", lw=1,
                label=f"{nom.label}: {nom.peak_tflops:.0f} TFLOP/s, {nom.bandwidth_gbps / 1e3:.2f} TB/s")
    ax.axvline(meas.ridge, color="0.8", lw=0.8, zorder=0)

    colors = {"v1": "tab:red", "v2": "tab:blue", V2_SM80: "tab:cyan", "sdpa_flash": "tab:green", "sdpa_cudnn": "tab:purple"}
    labelled = set()
    brief = report.get("settings", {}).get("highlight_seqlen")
    for name, k, c in points:
        color = colors.get(name, "tab:gray")
        big = c["seqlen_q"] == brief
        ax.plot([k["intensity"]], [k["tflops"]], "o" if big else ".", ms=9 if big else 7, color=color,
                label=None if name in labelled else name, zorder=3)
        labelled.add(name)
        if k.get("intensity_floor") and k["model"] != "floor":
            # the same measurement if L2 served every re-read: from the tile model to the floor
            ax.plot([k["intensity"], k["intensity_floor"]], [k["tflops"]] * 2, ":", color=color, lw=0.8, zorder=2)
        n = c["seqlen_q"]
        ax.annotate((f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)) + (" causal" if c["causal"] else ""),
                    (k["intensity"], k["tflops"]), textcoords="offset points", xytext=(4, 3), fontsize=7, color=color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(x_lo, x_hi)
    ax.set_xlabel("arithmetic intensity (FLOP / byte of the algorithm's memory traffic)")
    ax.set_ylabel("achieved TFLOP/s (4·B·H·N²·D, halved when causal)")
    env = report.get("env", {})
    st = report.get("settings", {})
    ax.set_title(f"{env.get('gpu', 'GPU')}: attention forward, {st.get('dtype', 'bf16')}, head_dim "
                 f"{st.get('head_dim', '?')}, {st.get('heads', '?')} heads, {st.get('tokens', '?')} tokens"
                 f"\nlabels: seqlen; dotted: same point at the ideal-traffic intensity", fontsize=10)
    ax.grid(True, which="both", alpha=0.2)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


# ----------------------------------------------------------------------------- measuring (GPU)




def measure_compute_ceiling(n: int = 8192, reps: int = 20, warmup: int = 5) -> dict:
    """An n x n x n matmul (2 n^3 FLOP) through CuPy's cuBLAS, bf16 (fp16 if bf16 matmul fails)."""
    import cupy
    import ml_dtypes

    from ._timing import time_cuda

    errors = {}
    for name, dt in (("bfloat16", ml_dtypes.bfloat16), ("float16", cupy.float16)):
        try:
            a, b = (cupy.random.standard_normal((n, n), dtype=cupy.float32).astype(dt) for _ in range(2))
            c = cupy.empty((n, n), dtype=dt)
            stats = time_cuda(lambda: cupy.matmul(a, b, out=c), warmup=warmup, reps=reps)
            del a, b, c
            cupy.get_default_memory_pool().free_all_blocks()
            return {**stats, "dtype": name, "n": n, "tflops": 2 * n**3 / stats["median_ms"] / 1e9, "errors": errors}
        except Exception as e:  # a CuPy without bf16 matmul: fp16 has the same tensor-core peak
            errors[name] = f"{type(e).__name__}: {e}"[:300]
    raise RuntimeError(f"no 16-bit matmul ran: {errors}")


def measure_bandwidth_ceiling(nbytes: int = 2 << 30, reps: int = 20, warmup: int = 5) -> dict:
    """A device-to-device copy of `nbytes` (cudaMemcpyAsync); bandwidth counts read + write."""
    import cupy

    from ._timing import time_cuda

    free, _ = cupy.cuda.runtime.memGetInfo()
    nbytes = int(min(nbytes, free // 4)) // 256 * 256
    src = cupy.ones(nbytes // 4, dtype=cupy.uint32)
    dst = cupy.empty_like(src)
    stats = time_cuda(lambda: dst.data.copy_from_device_async(src.data, nbytes), warmup=warmup, reps=reps)
    del src, dst
    cupy.get_default_memory_pool().free_all_blocks()
    return {**stats, "bytes_copied": nbytes, "gbps": 2 * nbytes / stats["median_ms"] / 1e6}


def measure_case(s: Shape, dtype: str, torch=None, reps: int = 10, warmup: int = 3) -> tuple[dict, dict, dict, dict]:
    """(timings_ms, stats, checks, configs) of v1, v2 and the SDPA backends on one shape.

    A backend that fails gets timing None and its error in stats. configs: the kernel config each
    cuflash algorithm runs with here (the one its own selection picks, tuned tables included).
    """
    import contextlib
    import warnings

    import cupy

    from . import _forward, _forward_v1, families, problem
    from .mask import MaskOptions
    from ._timing import time_cuda
    from .bench import Case, make_inputs

    sets = make_inputs(Case(s.head_dim, s.seqlen_q, s.batch, s.heads, s.causal), dtype, torch)
    infos = [problem.describe(x, n) for x, n in zip(sets[0]["cupy"], "qkv")]
    attn = problem.resolve_forward(*infos, MaskOptions.of(causal=s.causal), None)
    # v2 is the automatic family (the Hopper one on cc 9.0), placed with its own tile; where that is
    # not the mma.sync family, the call forced to it (backend="sm80") is measured beside it
    v2_family = families.choose(families.FORWARDS, attn)
    configs = {"v1": families.select(families.FWD_V1, attn), "v2": families.select(v2_family, attn)}
    benches = {
        "v1": (lambda q, k, v: _forward_v1.forward_v1(q, k, v, causal=s.causal), [x["cupy"] for x in sets], "cupy",
               contextlib.nullcontext),
        "v2": (lambda q, k, v: _forward.forward(q, k, v, causal=s.causal), [x["cupy"] for x in sets], "cupy",
               contextlib.nullcontext),
    }
    if v2_family is not families.FWD:
        configs[V2_SM80] = families.select(families.FWD, attn)
        benches[V2_SM80] = (lambda q, k, v: _forward.forward(q, k, v, causal=s.causal, backend="sm80"),
                            [x["cupy"] for x in sets], "cupy", contextlib.nullcontext)
    if torch is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa(q, k, v):  # square seqlens: top-left and bottom-right causal masks coincide
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=s.causal)

        rot = [x["torch_bhnd"] for x in sets]
        benches["sdpa_flash"] = (sdpa, rot, "torch", lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION))
        benches["sdpa_cudnn"] = (sdpa, rot, "torch", lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION))
    timings, stats, checks = {}, {}, {}
    for name, (fn, rot, events, ctx) in benches.items():
        try:
            with warnings.catch_warnings(), ctx():
                warnings.simplefilter("ignore")
                st = time_cuda(fn, warmup=warmup, reps=reps, rotate=rot, events=events)
            timings[name], stats[name] = st["median_ms"], st
        except Exception as e:
            timings[name], stats[name] = None, {"error": f"{type(e).__name__}: {e}"[:300]}
    try:  # the two algorithms must agree (the GPU tests check both against float64)
        q, k, v = sets[0]["cupy"]
        o1, l1 = _forward_v1.forward_v1(q, k, v, causal=s.causal)
        o2, l2 = _forward.forward(q, k, v, causal=s.causal)
        checks["max_abs_diff_out_v1_v2"] = float(cupy.abs(o1.astype(cupy.float32) - o2.astype(cupy.float32)).max())
        fin = cupy.isfinite(l2)
        checks["max_abs_diff_lse_v1_v2"] = float(cupy.abs(l1 - l2)[fin].max()) if bool(fin.any()) else 0.0
    except Exception as e:
        checks["error"] = f"{type(e).__name__}: {e}"[:300]
    del sets, benches
    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()
    return timings, stats, checks, configs


# ----------------------------------------------------------------------------- CLI

BRIEF_SEQLEN = 8192  # the brief's shape: bf16, head_dim 128, seqlen 8192, batch 2, 16 heads


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cuflash.roofline", description=__doc__.splitlines()[0])
    add_version_argument(p)
    p.add_argument("--out", default="roofline.png", help="picture (PNG/SVG/PDF by extension); needs matplotlib")
    p.add_argument("--json", metavar="PATH", default=None, help="report (default: --out with .json)")
    p.add_argument("--replot", metavar="JSON", default=None, help="draw a saved report, measure nothing")
    p.add_argument("--head-dim", type=int, default=128, choices=range(8, 257, 8), metavar="D")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16384, help="batch = max(1, tokens // seqlen)")
    p.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--causal", choices=["0", "1", "both"], default="0")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--no-sdpa", action="store_true", help="do not use torch")
    p.add_argument("--reps", type=int, default=10, help="timed runs per attention measurement (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--matmul-n", type=int, default=8192)
    p.add_argument("--copy-gib", type=float, default=2.0)
    p.add_argument("--sdpa-flash-tiles", type=int, nargs=2, default=list(SDPA_FLASH_TILES), metavar=("BQ", "BK"),
                   help="Q and K/V tile rows assumed for SDPA's flash backend in its traffic model")
    return p.parse_args(argv)


def shapes_from_args(args) -> list[Shape]:
    modes = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    itemsize = 2
    return [Shape(max(1, args.tokens // n), args.heads, n, n, args.head_dim, c, itemsize)
            for n in args.seqlens for c in modes]


def _json_path(args) -> str:
    return args.json or (os.path.splitext(args.out)[0] + ".json")


def _try_plot(report: dict, path: str) -> bool:
    try:
        plot(report, path)
    except PlotUnavailable as e:
        print(f"cuflash.roofline: {e}", file=sys.stderr)
        return False
    except OSError as e:
        print(f"cuflash.roofline: cannot write the picture {path}: {e}", file=sys.stderr)
        return False
    print(f"picture written to {path}")
    return True


def read_report(path: str) -> tuple[dict | None, str]:
    """A saved report (--replot), or (None, why not): missing, unreadable, not JSON, not a report."""
    from ._jsonfile import load

    report, why = load(path)
    if report is None:
        return None, why
    try:
        Ceilings(**report["ceilings"]["measured"]["roof"])
        if not isinstance(report["cases"], list):
            raise TypeError("cases is not a list")
        for c in report["cases"]:
            c["kernels"]["floor"]["intensity"]
    except (KeyError, TypeError, IndexError) as e:
        return None, (f"{path} is not a roofline report written by python -m cuflash.roofline "
                      f"(missing or malformed: {e})")
    return report, ""


def _gpu_count() -> tuple[int, str]:
    from .device import cuda_device_count

    return cuda_device_count()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        report, why = read_report(args.replot)
        if report is None:
            print(f"cuflash.roofline: --replot: {why}", file=sys.stderr)
            return 2
        return 0 if _try_plot(report, args.out) else 3

    n_gpus, why = _gpu_count()
    if n_gpus == 0:
        print(f"cuflash.roofline: no CUDA GPU found ({why}); nothing to measure "
              "(--replot REPORT.json draws a saved report without one).", file=sys.stderr)
        return 2

    from .bench import env_info

    torch = None if args.no_sdpa else cuda_torch()
    env = env_info(torch)

    print(f"{env['gpu']} ({env['sm_count']} SMs): measuring ceilings ...", flush=True)
    mm = measure_compute_ceiling(args.matmul_n)
    cp = measure_bandwidth_ceiling(int(args.copy_gib * 2**30))
    meas = Ceilings(mm["tflops"], cp["gbps"], "measured")
    nom = nominal_ceilings(env["gpu"])
    print(f"  compute {meas.peak_tflops:.0f} TFLOP/s ({mm['dtype']} matmul {mm['n']}^3), bandwidth "
          f"{meas.bandwidth_gbps:.0f} GB/s (copy, read + write): ridge {meas.ridge:.0f} FLOP/byte", flush=True)

    settings = {k: v for k, v in vars(args).items() if k not in ("json", "replot")}
    settings["highlight_seqlen"] = BRIEF_SEQLEN
    report = {
        "env": env,
        "settings": settings,
        "ceilings": {
            "measured": {"roof": dataclasses.asdict(meas), "ridge": meas.ridge, "matmul": mm, "copy": cp},
            "nominal": dataclasses.asdict(nom) if nom else None,
        },
        "models": {
            "traffic": {name: " ".join(fn.__doc__.split())
                        for name, fn in (("floor", traffic_floor), ("v1", traffic_v1), ("v2", traffic_v2))},
            "placement": {k: v[1] for k, v in MODELS.items()},
        },
        "cases": [],
    }
    path = _json_path(args)
    for s in shapes_from_args(args):
        timings, stats, checks, configs = measure_case(s, args.dtype, torch, args.reps, args.warmup)
        tiles = {name: (cfg.block_q, cfg.block_k) for name, cfg in configs.items()}
        if "sdpa_flash" in timings:
            tiles["sdpa_flash"] = tuple(args.sdpa_flash_tiles)
        case = analyse_case(s, meas, tiles, timings)
        for name, st in stats.items():
            case["kernels"][name]["timing"] = st
        for name, cfg in configs.items():
            case["kernels"][name]["config"] = repr(cfg)
        case["checks"] = checks
        report["cases"].append(case)
        print("  " + format_case(case), flush=True)
        if "error" in checks or checks.get("max_abs_diff_out_v1_v2", 0) > 0.1:
            print(f"  WARNING: v1/v2 check: {checks}", flush=True)
        write_json(path, report)  # after every case: a crash keeps what was measured
    print(f"report written to {path}")
    _try_plot(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
