"""Running configs on the GPU for the tuner: inputs, correctness against the default, timing, and
the worker process that keeps a bad config from taking the tuner down with it.

`Bench` (one problem shape on one GPU) runs in a child process (`Worker`, multiprocessing spawn).
The parent sends one request at a time and knows which config each request is about; if the child
dies, hangs past a deadline, or finds its CUDA context unusable after an error (the canary after
every failed request), the parent records that config as "crashed", starts a fresh child and goes
on. So no config can crash the tuner or leave it with a poisoned CUDA context.

Everything that is not GPU work (tolerances, comparisons, shapes) is a plain function, tested on CPU.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time

from .. import families, tuning_store
from ..features import Features
from .search import Outcome

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "bfloat16": "bfloat16", "float16": "float16"}
DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16"}
# Max |config - default| allowed, relative to max |default|: 4 ulps of the largest value for the
# 16-bit outputs (configs differ only in summation order), fp32 lse to 1e-4 of its largest value.
RTOL = {"bfloat16": 2.0**-6, "float16": 2.0**-9, "float32": 1e-4}
# Each perf class's call options while tuning: dropout at this rate and seed (the mask's cost depends
# on neither), softcap at Gemma 2's cap (every cap costs the same), ALiBi with one slope per head
# (class_options: an array of the shape's heads; every slope costs the same).
CLASS_OPTIONS = {"dense": {}, "dropout": {"dropout_p": 0.1, "seed": 20261130}, "softcap": {"softcap": 30.0},
                 "alibi": {}}


def class_options(perf_class: str, heads: int) -> dict:
    """The call options a perf class is tuned with, on the GPU (ALiBi's slopes: BLOOM's geometric
    2^(-8 i / heads), float32 on the current device)."""
    opts = dict(CLASS_OPTIONS[perf_class])
    if perf_class == "alibi":
        import cupy

        opts["alibi_slopes"] = cupy.asarray(2.0 ** (-8.0 * cupy.arange(1, heads + 1) / heads), dtype=cupy.float32)
    return opts


@dataclasses.dataclass(frozen=True)
class Shape:
    """One tuning problem: the kernel family, its compile-time keys and a representative workload."""

    kernel: str  # a family name (cuflash/families/)
    dtype: str  # "bfloat16" | "float16"
    head_dim: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    perf_class: str = "dense"  # Features.perf_class(): "dense" | "dropout" | "softcap" | "alibi"

    @property
    def bucket(self) -> int:
        return tuning_store.seqlen_bucket(self.seqlen, self.seqlen)

    @property
    def features(self) -> Features:
        return Features.of_class(self.dtype, self.head_dim, self.perf_class)

    @property
    def label(self) -> str:
        variant = "" if self.perf_class == "dense" else f" {self.perf_class}"
        return (f"{self.kernel} {DTYPE_SHORT.get(self.dtype, self.dtype)} d{self.head_dim} "
                f"{'causal' if self.causal else 'full'} n{self.seqlen}{variant}")


def make_shape(kernel, dtype, head_dim, causal, seqlen, tokens=16384, hidden=2048, perf_class="dense") -> Shape:
    """batch = tokens // seqlen, heads = hidden // head_dim (as cuflash.bench), at least 1 each."""
    return Shape(kernel, DTYPES[dtype], int(head_dim), bool(causal), int(seqlen),
                 max(1, tokens // seqlen), max(1, hidden // head_dim), perf_class)


def _xp(a):
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    import numpy

    return numpy


def compare(ref, out, deterministic_again=None) -> tuple[bool, float, str]:
    """(ok, max_abs_diff, reason): `out` (tuple of arrays) against `ref`, element-wise.

    Where ref is finite, out must be finite and within RTOL[dtype] * max|ref| (at least one ulp of
    1.0 in that dtype); where ref is +-inf (the lse of a row that sees no key), out must be the same.
    `deterministic_again`, if given, is a second run's output: it must equal `out` bitwise.
    """
    worst = 0.0
    for i, (r, o) in enumerate(zip(ref, out)):
        xp = _xp(r)
        if tuple(r.shape) != tuple(o.shape) or r.dtype != o.dtype:
            return False, math.inf, f"output {i}: shape/dtype {o.shape} {o.dtype} != {r.shape} {r.dtype}"
        rf, of = r.astype(xp.float32), o.astype(xp.float32)
        fin = xp.isfinite(rf)
        if bool((~fin & (rf != of)).any()):
            return False, math.inf, f"output {i}: non-finite values differ from the default's"
        if bool((fin & ~xp.isfinite(of)).any()):
            return False, math.inf, f"output {i}: NaN/inf where the default is finite (unwritten or overflow)"
        if not bool(fin.any()):
            continue
        diff = float(xp.abs(xp.where(fin, of, 0) - xp.where(fin, rf, 0)).max())
        scale = float(xp.abs(xp.where(fin, rf, 0)).max())
        rtol = RTOL.get(str(r.dtype), 2.0**-6)
        allowed = rtol * max(scale, 1.0)
        worst = max(worst, diff)
        if diff > allowed:
            return False, worst, f"output {i}: max |diff| {diff:.3g} > {allowed:.3g}"
    if deterministic_again is not None:
        for i, (a, b) in deterministic_again:
            xp = _xp(a)
            if not bool((a.view(xp.uint8) == b.view(xp.uint8)).all()):
                return False, worst, f"output {i} differs bitwise between two runs (race?)"
    return True, worst, ""


def _short(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"[:300]


# ----------------------------------------------------------------------------- on the GPU

class Bench:
    """Inputs, the default config's reference output, and timing for one Shape on one device."""

    def __init__(self, shape: Shape, device: int = 0, n_sets: int = 3, seed: int = 0):
        import cupy

        from .. import device as _device

        self.shape, self.device = shape, device
        self.props = _device.query(device)
        self.family = families.get(shape.kernel)
        self.default = self.family.default(shape.head_dim, self.props.smem_optin, shape.features)
        with cupy.cuda.Device(device):
            self.sets = [self._make_set(seed + i) for i in range(n_sets)]
            self.reference = self._run(self.default, self.sets[0])
            cupy.cuda.Device().synchronize()

    # --- inputs and one run; what a run does is the family's (KernelFamily.run)
    def _make_set(self, seed):
        import cupy
        import ml_dtypes
        import numpy as np

        s = self.shape
        dt = np.dtype(ml_dtypes.bfloat16) if s.dtype == "bfloat16" else np.dtype(np.float16)
        rs = cupy.random.RandomState(seed)
        mk = lambda: rs.standard_normal((s.batch, s.seqlen, s.heads, s.head_dim), dtype=cupy.float32).astype(dt)
        q, k, v = mk(), mk(), mk()
        d = {"q": q, "k": k, "v": v, "options": class_options(s.perf_class, s.heads)}
        if self.family.pass_ == "backward":
            from .. import _forward

            d["out"], d["lse"] = _forward.forward(q, k, v, causal=s.causal, **d["options"])
            d["dout"] = mk()
        return d

    def _run(self, cfg, d, poison=False):
        s = self.shape
        out = lse = None
        if poison and self.family.pass_ == "forward":  # outputs given, pre-filled with NaN
            import cupy

            out = cupy.full(d["q"].shape, cupy.nan, dtype=cupy.float32).astype(d["q"].dtype)
            lse = cupy.full((s.batch, s.heads, s.seqlen), cupy.nan, dtype=cupy.float32)
        elif poison:  # the backward allocates its outputs: make the pool hand out NaN-filled memory
            self._poison_pool()
        return self.family.run(cfg, d, s.causal, s.features, self.props, out=out, lse=lse)

    def _poison_pool(self):
        """Fill and free buffers shaped like the outputs, so that outputs the next call allocates
        from CuPy's pool start as NaN: an element a config forgets to write is then caught."""
        import cupy

        bufs = [cupy.full(r.shape, cupy.nan, dtype=cupy.float32).astype(r.dtype) if r.dtype.kind == "f"
                else cupy.empty_like(r) for r in self.reference]
        bufs += [cupy.full(r.shape, cupy.nan, dtype=cupy.float32) for r in self.reference]  # fp32 scratch sizes
        del bufs

    # --- requests
    def check(self, cfg, features, allow_local_bytes=0) -> str | None:
        return check_on_device(cfg, features, self.device, allow_local_bytes)

    def trial(self, cfg, warmup=5, reps=20, verify=True, warmup_ms=0.0) -> Outcome:
        """Verify `cfg` against the default's output (twice: races), then time it (after `warmup`
        calls and `warmup_ms` of device time: time_cuda's)."""
        import cupy

        from .._timing import time_cuda

        info = {}
        try:
            with cupy.cuda.Device(self.device):
                if verify:
                    a = self._run(cfg, self.sets[0], poison=True)
                    b = self._run(cfg, self.sets[0], poison=True)
                    det = [(i, (a[i], b[i])) for i in self.family.deterministic_outputs]
                    ok, diff, why = compare(self.reference, a, det)
                    info["max_abs_diff"] = diff
                    del a, b, det
                    if not ok:
                        return Outcome("wrong", None, why, info)
                sets = self.sets
                t = time_cuda(lambda i: self._run(cfg, sets[i]), warmup=warmup, reps=reps,
                              rotate=[(i,) for i in range(len(sets))], warmup_ms=warmup_ms)
        except Exception as e:  # noqa: BLE001 - launch failures etc.; the worker checks the context after
            return Outcome("failed", None, _short(e), info)
        info.update(p20_ms=t["p20_ms"], p80_ms=t["p80_ms"], reps=t["n"])
        return Outcome("ok", t["median_ms"], "", info)


def check_on_device(cfg, features, device, allow_local_bytes=0) -> str | None:
    """Compile and load the (cfg, features) instance (NVRTC, as cuflash will at run time) and judge
    its resources."""
    from .. import _compile
    from .. import device as _device
    from . import space

    props = _device.query(device)
    why = space.static_problem(cfg, props, features)
    if why:
        return why
    try:
        fn = _compile.get_kernel(cfg, features, device)
    except Exception as e:  # noqa: BLE001 - compile error, smem opt-in refused, ...
        return f"compile/load failed: {_short(e)}"
    return space.resource_problem(cfg, space.kernel_resources(fn), props, allow_local_bytes)


def context_ok(device) -> bool:
    """The canary: can this process still run work on the device?"""
    try:
        import cupy

        with cupy.cuda.Device(device):
            cupy.cuda.runtime.deviceSynchronize()
            return int((cupy.arange(4) + 1).sum()) == 10
    except Exception:  # noqa: BLE001
        return False


def _inject(kind: str, device: int):
    """Failures on purpose, for the GPU tests of the worker (R11)."""
    if kind == "exit":
        os._exit(9)
    if kind == "hang":
        time.sleep(3600)
    if kind == "illegal_address":
        import cupy

        k = cupy.RawKernel(r'extern "C" __global__ void cuflash_poison(float* p) { p[threadIdx.x] = 1.f; }',
                           "cuflash_poison")
        with cupy.cuda.Device(device):
            import numpy as np

            k((1,), (32,), (np.uint64(0),))  # a store through a null pointer: a sticky error
            cupy.cuda.runtime.deviceSynchronize()
        return "no error?"
    raise ValueError(kind)


class _Local:
    """The requests of the worker protocol, served in this process (no isolation)."""

    def __init__(self, device):
        self.device = device
        self.bench = None

    def handle(self, op, args):
        if op == "setup":
            self.bench = None
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()
            self.bench = Bench(*args, device=self.device)
            return {"default": self.bench.default}
        if op == "check":
            cfg, features, allow_local_bytes = args
            return check_on_device(cfg, features, self.device, allow_local_bytes)
        if op == "trial":
            if self.bench is None:
                raise RuntimeError("trial before setup")
            return self.bench.trial(*args)
        if op == "inject":
            return _inject(args[0], self.device)
        if op == "ping":
            return "pong"
        raise ValueError(f"unknown request {op!r}")


def _worker_main(conn, device):  # pragma: no cover - runs in the child process
    local = _Local(device)
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            return
        if op == "quit":
            conn.send(("ok", None))
            return
        try:
            res = ("ok", local.handle(op, args))
        except Exception as e:  # noqa: BLE001
            res = ("error", _short(e))
        failed = (res[0] == "error" or (op == "check" and res[1] is not None)
                  or (isinstance(res[1], Outcome) and res[1].status != "ok"))
        if failed and not context_ok(device):
            why = res[1].reason if isinstance(res[1], Outcome) else res[1]
            conn.send(("poisoned", f"CUDA context unusable after: {why}"))
            os._exit(3)
        conn.send(res)


class Worker:
    """Serves setup / check / trial requests, in a child process (isolated=True) or in this one.

    call() returns (status, payload): ("ok", result), ("error", message) for an ordinary Python
    error, or ("crashed", message) when the child died, hung or lost its CUDA context (it is then
    replaced on the next call, and the current shape set up again).
    """

    def __init__(self, device: int = 0, isolated: bool = True, timeout_s: float = 600.0):
        self.device, self.isolated, self.timeout_s = device, isolated, timeout_s
        self.proc = self.conn = None
        self.local = None if isolated else _Local(device)
        self.setup_args = None
        self.ready = False
        self.restarts = 0

    # --- process management
    def _start(self):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, self.device), daemon=True,
                                name="cuflash-tune-worker")
        self.proc.start()
        child.close()
        self.ready = False

    def _kill(self):
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(10)
            self.conn.close()
        self.proc = self.conn = None
        self.ready = False
        self.restarts += 1

    def close(self):
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(("quit", ()))
                if self.conn.poll(10):
                    self.conn.recv()
            except (OSError, EOFError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
        self.proc = self.conn = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- requests
    def _raw(self, op, args, timeout_s):
        if not self.isolated:
            try:
                return "ok", self.local.handle(op, args)
            except Exception as e:  # noqa: BLE001
                return "error", _short(e)
        if self.proc is None or not self.proc.is_alive():
            if self.proc is not None:
                self._kill()
            self._start()
        try:
            self.conn.send((op, args))
            if not self.conn.poll(timeout_s):
                self._kill()
                return "crashed", f"no answer within {timeout_s:.0f} s (hung); worker killed"
            status, payload = self.conn.recv()
        except (EOFError, OSError, ConnectionError):
            self.proc.join(10)
            code = self.proc.exitcode
            self._kill()
            return "crashed", f"worker process died (exit code {code})"
        if status == "poisoned":
            self._kill()
            return "crashed", payload
        return status, payload

    def setup(self, shape: Shape):
        self.setup_args = (shape,)
        self.ready = False
        status, payload = self._raw("setup", self.setup_args, self.timeout_s)
        self.ready = status == "ok"
        return status, payload

    def call(self, op, *args, timeout_s=None):
        if op == "trial" and not self.ready:
            if self.setup_args is None:
                return "error", "trial before setup"
            status, payload = self.setup(*self.setup_args)
            if status != "ok":
                return status, f"setting up the shape again failed: {payload}"
        return self._raw(op, args, timeout_s or self.timeout_s)

    def check(self, cfg, features, allow_local_bytes=0) -> str | None:
        status, payload = self.call("check", cfg, features, allow_local_bytes)
        if status == "ok":
            return payload
        return f"check {status}: {payload}"

    def trial(self, cfg, warmup=5, reps=20, verify=True, warmup_ms=0.0) -> Outcome:
        status, payload = self.call("trial", cfg, warmup, reps, verify, warmup_ms)
        if status == "ok":
            return payload
        return Outcome("crashed" if status == "crashed" else "failed", None, str(payload))
