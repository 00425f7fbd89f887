"""Benchmark cuflash against PyTorch SDPA (FlashAttention and cuDNN backends).

    python -m cuflash.bench [--head-dims 64 128] [--seqlens ...] [--causal both] [--quick]

The case list, table and JSON logic are plain functions that run without a GPU (and are tested
in CI); everything that touches the GPU lives in the "measuring" section. torch is optional and
imported lazily: without it only cuflash is measured.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import re
import sys
import warnings
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Callable, NamedTuple

from .device import cuda_device_count as _cuda_device_count
from .device import cuda_torch
from ._timing import bytes_attention, flops_attention, time_cuda
from ._version import add_version_argument

BACKENDS = ("cuflash", "sdpa_flash", "sdpa_cudnn")
# measured beside them where the automatic choice is not the mma.sync family (a Hopper GPU picks the
# sm90 forward): the same call forced to backend="sm80", so both families show in one run
SM80 = "cuflash_sm80"
# Max |cuflash - reference| above which a case is flagged: about two ulps at |x| ~ 4-8, the
# largest outputs random-normal inputs produce (causal row 0 is v[0] itself).
MISMATCH_TOL = {"bf16": 1 / 16, "fp16": 1 / 128}


# ----------------------------------------------------------------------------- cases and CLI


@dataclass(frozen=True)
class Case:
    head_dim: int
    seqlen: int
    batch: int
    heads: int
    causal: bool
    heads_kv: int = 0  # key/value heads (GQA/MQA: fewer than heads, dividing them); 0: heads (MHA)

    @property
    def kv_heads(self) -> int:
        return self.heads_kv or self.heads


def build_cases(head_dims, seqlens, tokens, hidden, causal_modes, gqa: int = 1) -> list[Case]:
    """Keep the work per case constant-ish: batch = tokens // seqlen, heads = hidden // head_dim;
    with gqa > 1, heads // gqa key/value heads (grouped-query attention; 0 recorded for MHA).

    A seqlen longer than ``tokens`` still gets one sequence (batch 1) rather than none.
    """
    cases = []
    for d in head_dims:
        heads = max(1, hidden // d)
        if heads % gqa:
            raise ValueError(f"--gqa {gqa} does not divide the {heads} heads of head_dim {d} (hidden {hidden})")
        cases += [Case(d, n, max(1, tokens // n), heads, c, heads // gqa if gqa > 1 else 0)
                  for n in seqlens for c in causal_modes]
    return cases


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cuflash.bench", description=__doc__.splitlines()[0])
    add_version_argument(p)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], choices=range(8, 257, 8), metavar="D",
                   help="multiples of 8 from 8 to 256 (default 64 128)")
    p.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--tokens", type=int, default=16384, help="batch = tokens // seqlen")
    p.add_argument("--hidden", type=int, default=2048, help="heads = hidden // head_dim")
    p.add_argument("--causal", choices=["0", "1", "both"], default="both")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="output file (default: bench-<gpu>-<date>.json in the current directory)")
    p.add_argument("--no-sdpa", action="store_true", help="do not use torch, measure cuflash only")
    p.add_argument("--reps", type=int, default=50, help="timed runs per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--warmup-ms", type=float, default=300.0,
                   help="after --warmup calls, keep each backend busy this long before timing it, so every "
                        "backend is timed at the clock the GPU holds under sustained load (0: calls only)")
    p.add_argument("--rounds", type=int, default=3,
                   help="the backends take turns this many times per case, each round its warm-up and --reps "
                        "timed runs; each backend's figure is the median of its rounds' medians (1: one pass each)")
    p.add_argument("--passes", nargs="+", choices=sorted(PASS_BENCHES), default=["fwd", "bwd"])
    p.add_argument("--quick", action="store_true", help="only seqlen 2048 and 8192")
    p.add_argument("--gqa", type=int, default=1, metavar="G",
                   help="query heads per key/value head (grouped-query attention; SDPA runs with enable_gqa); "
                        "1: multi-head attention. E.g. --head-dims 128 --hidden 4096 --gqa 4: Llama-3-8B's 32/8 heads")
    p.add_argument("--overhead", action="store_true",
                   help="instead: per-call time at a launch-bound shape (batch 1, 128 tokens, 2 heads, "
                        "head_dim 64), CuPy and torch paths against SDPA, eager and CUDA-graph replays")
    args = p.parse_args(argv)
    if args.quick:
        args.seqlens = [2048, 8192]
    return args


def causal_modes(arg: str) -> list[bool]:
    return {"0": [False], "1": [True], "both": [False, True]}[arg]


def cases_from_args(args) -> list[Case]:
    return build_cases(args.head_dims, args.seqlens, args.tokens, args.hidden, causal_modes(args.causal), args.gqa)


# ----------------------------------------------------------------------------- records


def new_record(case: Case, dtype: str, passes=("fwd",)) -> dict:
    """Per-case result: timings[pass][backend] is a stats dict, or None (reason in errors)."""
    itemsize = 2  # bf16 and fp16
    n = case.seqlen
    dims = (case.batch, case.heads, n, n, case.head_dim)
    return {
        **asdict(case),
        "dtype": dtype,
        "flops": {p: flops_attention(*dims, case.causal, p) for p in passes},
        "bytes": {p: bytes_attention(*dims, itemsize=itemsize, pass_=p) for p in passes},
        "timings": {},
        "errors": {},
        "max_abs_diff": None,
        "checked_against": None,
    }


def add_timing(rec: dict, pass_: str, backend: str, stats: dict | None, error: str | None = None):
    """Store ``stats`` (from time_cuda) with throughput added, or None and the reason."""
    if stats is not None:
        ms = stats["median_ms"]
        stats = {**stats, "tflops": rec["flops"][pass_] / ms / 1e9, "gbps": rec["bytes"][pass_] / ms / 1e6}
    rec["timings"].setdefault(pass_, {})[backend] = stats
    if error is not None:
        rec["errors"].setdefault(pass_, {})[backend] = error


def _tflops(rec, pass_, backend):
    stats = rec["timings"].get(pass_, {}).get(backend)
    return None if stats is None else stats["tflops"]


_COLUMNS = [("hdim", 4), ("seqlen", 6), ("batch", 5), ("heads", 5), ("causal", 6), ("pass", 4),
            ("cuflash", 8), ("flash", 8), ("cudnn", 8), ("cf/flash", 8), ("cf/cudnn", 8), ("sm80", 8), ("sm80/cd", 8)]


def format_header() -> str:
    return "\n".join([
        "TFLOP/s of cuflash, SDPA-flash and SDPA-cuDNN; cf/x = cuflash throughput / x's; "
        "sm80: cuflash forced to the mma.sync family (where the default is another), sm80/cd its ratio to cuDNN",
        "  ".join(f"{name:>{w}}" for name, w in _COLUMNS),
        "  ".join("-" * w for _, w in _COLUMNS),
    ])


def format_rows(rec: dict) -> list[str]:
    """One line per pass measured; '-' for a backend that was not run or failed."""
    rows = []
    for pass_ in rec["timings"]:
        cf, fl, cd = (_tflops(rec, pass_, b) for b in BACKENDS)
        s8 = _tflops(rec, pass_, SM80)
        heads = f"{rec['heads']}/{rec['heads_kv']}" if rec.get("heads_kv") else rec["heads"]  # q/kv heads: GQA
        cells = [rec["head_dim"], rec["seqlen"], rec["batch"], heads,
                 "yes" if rec["causal"] else "no", pass_,
                 cf, fl, cd,
                 None if cf is None or fl is None else cf / fl,
                 None if cf is None or cd is None else cf / cd,
                 s8, None if s8 is None or cd is None else s8 / cd]
        rows.append("  ".join(_cell(v, w, ratio=i in (9, 10, 12)) for i, (v, (_, w)) in enumerate(zip(cells, _COLUMNS))))
    return rows


def _cell(v, width, ratio=False) -> str:
    if v is None:
        return f"{'-':>{width}}"
    if isinstance(v, float):
        return f"{v:>{width}.2f}" if ratio else f"{v:>{width}.1f}"
    return f"{v:>{width}}"


def format_table(records: list[dict]) -> str:
    return "\n".join([format_header()] + [row for rec in records for row in format_rows(rec)])


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (for file names)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def default_json_path(gpu_name: str, when: datetime) -> str:
    return f"bench-{gpu_slug(gpu_name)}-{when:%Y%m%d}.json"


def write_json(path, env: dict, settings: dict, records: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"env": env, "settings": settings, "cases": records}, f, indent=2)
        f.write("\n")


# ----------------------------------------------------------------------------- measuring (GPU)




def env_info(torch=None) -> dict:
    import cupy

    import cuflash

    rt = cupy.cuda.runtime
    dev = cupy.cuda.Device()
    props = rt.getDeviceProperties(dev.id)
    name = props["name"]
    return {
        "gpu": name.decode() if isinstance(name, bytes) else name,
        "sm_count": props["multiProcessorCount"],
        "compute_capability": dev.compute_capability,
        "driver_version": rt.driverGetVersion(),
        "runtime_version": rt.runtimeGetVersion(),
        "cuflash_version": getattr(cuflash, "__version__", None),
        "cupy_version": cupy.__version__,
        "torch_version": torch.__version__ if torch is not None else None,
        "python_version": platform.python_version(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


class Bench(NamedTuple):
    fn: Callable
    rotate: list  # argument tuples, cycled through by time_cuda
    events: str  # "cupy" or "torch": whose current stream the work runs on
    context: Callable = contextlib.nullcontext  # entered once around all runs (keeps it out of the loop)


def _cupy_dtype(dtype: str):
    import ml_dtypes
    import numpy as np

    return np.dtype(ml_dtypes.bfloat16 if dtype == "bf16" else np.float16)


def _torch_to_cupy(t, cp_dtype):
    import cupy
    import torch

    try:
        return cupy.from_dlpack(t)  # zero-copy view
    except Exception:  # a CuPy without bf16 DLPack: share the bits as int16 and reinterpret them
        return cupy.from_dlpack(t.view(torch.int16)).view(cp_dtype)


def make_inputs(case: Case, dtype: str, torch=None, n_sets: int = 3) -> list[dict]:
    """``n_sets`` random-normal (q, k, v) sets in (B, N, H, D), never zeros (zeros would hide
    wrong results in the check, and draw less power than real data). With torch, the tensors are torch's and cuflash gets CuPy views
    of the same memory, so every backend reads identical inputs."""
    import cupy

    shape = (case.batch, case.seqlen, case.heads, case.head_dim)
    kv_shape = (case.batch, case.seqlen, case.kv_heads, case.head_dim)
    shapes = (shape, kv_shape, kv_shape)
    cp_dtype = _cupy_dtype(dtype)
    sets = []
    for _ in range(n_sets):
        if torch is not None:
            t_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
            qkv = [torch.randn(s, device="cuda", dtype=t_dtype) for s in shapes]
            sets.append({"cupy": tuple(_torch_to_cupy(t, cp_dtype) for t in qkv),
                         "torch_bhnd": tuple(t.transpose(1, 2) for t in qkv)})  # SDPA wants (B, H, N, D)
        else:
            sets.append({"cupy": tuple(cupy.random.standard_normal(s, dtype=cupy.float32).astype(cp_dtype)
                                       for s in shapes)})
    if torch is not None:
        torch.cuda.synchronize()  # inputs were written on torch's stream; cuflash runs on CuPy's
    return sets


def _fwd_benches(case: Case, sets: list[dict], torch) -> dict[str, Bench]:
    import cuflash

    def cf(q, k, v):
        return cuflash.attention(q, k, v, causal=case.causal)

    benches = {"cuflash": Bench(cf, [s["cupy"] for s in sets], "cupy")}
    from . import device

    if device.query(0).cc == (9, 0):  # the default is the sm90 family: show the sm80 one beside it

        def cf_sm80(q, k, v):
            return cuflash.attention(q, k, v, causal=case.causal, backend="sm80")

        benches[SM80] = Bench(cf_sm80, [s["cupy"] for s in sets], "cupy")
    if torch is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        gqa = {"enable_gqa": True} if case.kv_heads != case.heads else {}

        def sdpa(q, k, v):  # square seqlens: top-left and bottom-right causal masks coincide
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.causal, **gqa)

        rot = [s["torch_bhnd"] for s in sets]
        benches["sdpa_flash"] = Bench(sdpa, rot, "torch", lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION))
        benches["sdpa_cudnn"] = Bench(sdpa, rot, "torch", lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION))
    return benches


def _bwd_benches(case: Case, sets: list[dict], torch) -> dict[str, Bench]:
    """Backward only: the forward's results (and SDPA's autograd graphs) are built before timing."""
    import cupy

    from . import _backward, _forward

    cf_rot = []
    for s in sets:
        q, k, v = s["cupy"]
        out, lse = _forward.forward(q, k, v, causal=case.causal)
        dout = cupy.random.standard_normal(q.shape, dtype=cupy.float32).astype(q.dtype)
        cf_rot.append((dout, q, k, v, out, lse))

    def cf(dout, q, k, v, out, lse):
        return _backward.backward(dout, q, k, v, out, lse, causal=case.causal)

    benches = {"cuflash": Bench(cf, cf_rot, "cupy")}
    if torch is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        gqa = {"enable_gqa": True} if case.kv_heads != case.heads else {}

        def graphs(backend):
            rot = []
            with sdpa_kernel(backend):
                for s in sets:
                    q, k, v = (t.detach().requires_grad_() for t in s["torch_bhnd"])
                    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.causal, **gqa)
                    rot.append((out, torch.randn_like(out), q, k, v))
            return rot

        def sdpa_bwd(out, dout, q, k, v):
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    benches[name] = Bench(sdpa_bwd, graphs(backend), "torch")
            except Exception as e:  # the backend cannot run this case: measure_case records why
                benches[name] = Bench(_raiser(e), [()], "torch")
    return benches


def _raiser(e: Exception):
    def fn(*_):
        raise e
    return fn


# pass name -> builder of {backend: Bench}; flops, bytes, table rows and JSON handle any pass.
PASS_BENCHES = {"fwd": _fwd_benches, "bwd": _bwd_benches}


def _check_fwd(rec: dict, benches: dict[str, Bench], torch) -> None:
    """Max |cuflash - SDPA| on the first input set, against flash (or cuDNN if flash failed)."""
    import cupy

    ok = rec["timings"].get("fwd", {})
    ref = next((b for b in ("sdpa_flash", "sdpa_cudnn") if ok.get(b) is not None), None)
    if ref is None or ok.get("cuflash") is None:
        return
    out = benches["cuflash"].fn(*benches["cuflash"].rotate[0])
    with benches[ref].context():
        o_ref = benches[ref].fn(*benches[ref].rotate[0])
    # fp32 and contiguous before DLPack: no dependence on bf16 DLPack support.
    o_ref = o_ref.transpose(1, 2).float().contiguous()
    torch.cuda.synchronize()
    diff = cupy.abs(out.astype(cupy.float32) - cupy.from_dlpack(o_ref)).max()
    rec["max_abs_diff"] = float(diff)
    rec["checked_against"] = ref


def _short_error(e: Exception) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"[:300]


def merge_rounds(per_round: list[dict]) -> dict:
    """One backend's stats over alternating rounds (time_cuda dicts, one a round): the median of the
    rounds' medians, the rounds' own medians kept beside it (their spread is the run's drift)."""
    import numpy as np

    medians = [r["median_ms"] for r in per_round]
    return {"median_ms": float(np.median(medians)),
            "p20_ms": float(np.median([r["p20_ms"] for r in per_round])),
            "p80_ms": float(np.median([r["p80_ms"] for r in per_round])),
            "n": sum(r["n"] for r in per_round), "round_ms": medians}


def measure_case(case: Case, *, dtype: str, torch=None, passes=("fwd",), reps=50, warmup=10,
                 warmup_ms: float = 0.0, rounds: int = 1) -> dict:
    """Time every backend for every pass of one case; a backend that raises is recorded as None.

    An untimed round first warms every backend up (calls, then warmup_ms of load). With rounds > 1
    the backends take turns, round after round, round r starting from backend r (each round:
    warmup_ms of load, then `reps` timed runs per backend), and each gets the median of its rounds'
    medians: the GPU's clock drifts
    within a run by a few per cent (more on short kernels), and timing one backend after the other
    charged that drift to whichever came later, which moved a short cell's ratio 5-8% between runs."""
    import cupy

    rec = new_record(case, dtype, passes)
    sets = make_inputs(case, dtype, torch)
    benches = {}
    for pass_ in passes:
        benches = PASS_BENCHES[pass_](case, sets, torch)
        per_round: dict[str, list] = {name: [] for name in benches}
        failed: dict[str, str] = {}
        # round -1, untimed: every backend's warm-up (first calls, compiles, warmup_ms of load), so
        # that the timed rounds all run at the power state of sustained load. The H200 draws ~130 W
        # after a case's setup and reaches its 700 W cap about a second into the load; its clock then
        # dips (1485 MHz against 1700-1725 settled, NVML SW power cap, scripts/bench_round_clocks.py)
        # and whichever backend ran then (ours: first in round 2) measured up to 1.28x slower.
        # The timed rounds rotate who goes first (round r from backend r), so a transient that is
        # still settling as the timed rounds begin does not always fall on the same backend.
        names = list(benches)
        for r in range(-1, max(1, int(rounds))):
            shift = max(r, 0) % len(names)
            for name in names[shift:] + names[:shift]:
                b = benches[name]
                if name in failed:
                    continue
                try:
                    # SDPA warns at length when a forced backend cannot run; the exception says why.
                    with warnings.catch_warnings(), b.context():
                        warnings.simplefilter("ignore")
                        st = time_cuda(b.fn, warmup=warmup if r < 0 else 0, reps=reps if r >= 0 else 1,
                                       rotate=b.rotate, events=b.events, warmup_ms=warmup_ms)
                    if r >= 0:
                        per_round[name].append(st)
                except Exception as e:
                    failed[name] = _short_error(e)
        for name in benches:
            if name in failed:
                add_timing(rec, pass_, name, None, failed[name])
            else:
                add_timing(rec, pass_, name, per_round[name][0] if len(per_round[name]) == 1
                           else merge_rounds(per_round[name]))
        if pass_ == "fwd" and torch is not None:
            try:
                _check_fwd(rec, benches, torch)
            except Exception as e:
                rec["errors"].setdefault("fwd", {})["check"] = _short_error(e)
    # Free this case's inputs before the next one allocates its own.
    del sets, benches
    cupy.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.empty_cache()
    return rec


# ----------------------------------------------------------------------------- main


def json_path_problem(path) -> str | None:
    """Why results could not be written to `path` (checked before anything is measured), or None."""
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{path} is a directory"
    if not os.path.isdir(folder):
        return f"no folder {folder}"
    if not os.access(folder, os.W_OK):
        return f"cannot write in {folder}"
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    why = args.json and json_path_problem(args.json)
    if why:
        print(f"cuflash.bench: --json: {why}", file=sys.stderr)
        return 2
    n_gpus, why = _cuda_device_count()
    if n_gpus == 0:
        print(f"cuflash.bench: no CUDA GPU found ({why}); nothing to benchmark.", file=sys.stderr)
        return 2

    torch = None if args.no_sdpa else cuda_torch()
    env = env_info(torch)
    path = args.json or default_json_path(env["gpu"], datetime.now(timezone.utc))
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    if args.overhead:
        from . import bench_overhead

        rows = bench_overhead.measure(torch, args.dtype)
        print(f"{env['gpu']}, {args.dtype}")
        print(bench_overhead.format_table(rows))
        write_json(path, env, settings | {"shape": bench_overhead.SHAPE}, rows)
        print(f"results written to {path}")
        return 0
    cases = cases_from_args(args)
    print(f"{env['gpu']} ({env['sm_count']} SMs), {args.dtype}, {len(cases)} cases"
          + ("" if torch is not None else ", SDPA not measured (torch with CUDA unavailable or --no-sdpa)"))
    print(format_header(), flush=True)

    records = []
    for case in cases:
        rec = measure_case(case, dtype=args.dtype, torch=torch, passes=tuple(args.passes), reps=args.reps,
                           warmup=args.warmup, warmup_ms=args.warmup_ms, rounds=args.rounds)
        records.append(rec)
        for row in format_rows(rec):
            print(row, flush=True)
        if rec["max_abs_diff"] is not None and rec["max_abs_diff"] > MISMATCH_TOL[args.dtype]:
            print(f"  WARNING: max |cuflash - {rec['checked_against']}| = {rec['max_abs_diff']:.3g}"
                  f" > {MISMATCH_TOL[args.dtype]:.3g}", flush=True)
        for pass_, errs in rec["errors"].items():
            for backend, msg in errs.items():
                print(f"  {backend} {pass_}: {msg}", flush=True)
        write_json(path, env, settings, records)  # after every case: a crash keeps what was measured
    print(f"results written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
