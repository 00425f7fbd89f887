"""Why our backward's host path costs more on autograd's device thread than on the calling thread
(issue 18; scripts/overhead_parts.py found 538 us per fwd+bwd with the device thread, 177 without,
and 212 with both host paths stubbed). At the overhead shape (batch 1, 128 tokens, 2 heads, d64,
bf16): the step split at our backward's entry and exit (main thread's call -> entry, the body,
exit -> the call's return), per thread setting, then a cProfile of the body on whichever thread
runs it. Each figure the median over 400 back-to-back steps."""
import cProfile
import io
import pstats
import statistics
import threading
import time

import torch

import cuflash
from cuflash import _torch as T
from cuflash import launch

q, k, v, do = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
real_bwd = T._bwd_eager
marks: list = []
prof = None


def timed_bwd(*a, **kw):
    t_in = time.perf_counter_ns()
    fresh = not getattr(launch._tls, "devices", None)  # the thread-local context check had to run again
    if prof is not None:
        prof.enable()
    r = real_bwd(*a, **kw)
    if prof is not None:
        prof.disable()
    marks.append((t_in, time.perf_counter_ns(), threading.get_ident(), fresh))
    return r


def step():
    t0 = time.perf_counter_ns()
    torch.autograd.grad(cuflash.attention(qg, kg, vg), (qg, kg, vg), do)
    return t0, time.perf_counter_ns()


def measure(label, n=400):
    for _ in range(30):
        step()
    torch.cuda.synchronize()
    marks.clear()
    spans = [step() for _ in range(n)]
    torch.cuda.synchronize()
    pre = [(m[0] - s[0]) / 1e3 for m, s in zip(marks, spans)]
    body = [(m[1] - m[0]) / 1e3 for m in marks]
    post = [(s[1] - m[1]) / 1e3 for m, s in zip(marks, spans)]
    whole = [(s[1] - s[0]) / 1e3 for s in spans]
    threads = {m[2] for m in marks}
    fresh = sum(m[3] for m in marks)
    main = threading.get_ident() in threads
    print(f"{label:<28} step {statistics.median(whole):7.1f}  call->bwd {statistics.median(pre):7.1f}  "
          f"bwd body {statistics.median(body):7.1f}  bwd->return {statistics.median(post):7.1f} us  "
          f"(p90 step {sorted(whole)[int(0.9 * n)]:7.1f}; threads {len(threads)}, main {main}, "
          f"context check re-run {fresh}/{n})", flush=True)


T._bwd_eager = timed_bwd
for rnd in range(2):
    measure(f"device thread, round {rnd}")
    with torch.autograd.set_multithreading_enabled(False):
        measure(f"calling thread, round {rnd}")

for label, multi in (("device thread", True), ("calling thread", False)):
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(multi):
        measure(f"{label}, profiled", n=300)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    print(f"===== the backward body on the {label} (300 steps), by own time")
    print("\n".join(s.getvalue().splitlines()[4:34]))
    prof = None
T._bwd_eager = real_bwd
