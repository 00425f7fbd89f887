"""Launch plans on CPU: the kernels' argument lists (the pointers in order, then the pass's parameter
struct as one size-1 raw-bytes NumPy array), the struct's fields, allocations and the launch sequence
of each pass, with CuPy's allocation and the kernels replaced by recorders."""
import contextlib

import numpy as np
import pytest

from cuflash import _backward, _compile, _forward, _forward_v1, families, launch, params, problem
from cuflash.mask import CAUSAL, MaskOptions
from cuflash.tiles import BwdConfig, DqConfig, FwdConfig, V1Config

B, NQ, NK, H, D = 2, 100, 300, 3, 64


class Recorder:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __call__(self, grid, block, args, shared_mem=0):
        self.calls.append((self.name, grid, block, args, shared_mem))


@pytest.fixture
def calls(monkeypatch):
    cupy = pytest.importorskip("cupy")
    rec = []
    monkeypatch.setattr(_compile, "get_kernel", lambda cfg, f, dev: Recorder(type(cfg).__name__, rec))
    monkeypatch.setattr(_compile, "get_aux_kernel", lambda name, f, dev: Recorder(name, rec))
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=None: ("alloc", tuple(shape), np.dtype(dtype).name))
    monkeypatch.setattr(launch, "_capturing", lambda: False)  # no GPU: no capture
    monkeypatch.setattr(cupy.cuda, "Device", lambda d: contextlib.nullcontext())
    return rec


def info(shape, dtype="float16"):
    it = np.dtype(dtype).itemsize
    strides, acc = [], it
    for n in reversed(shape):
        strides.insert(0, acc)
        acc *= n
    return problem.ArrayInfo(shape, dtype, it, tuple(strides), 1 << 20, 0)


def fwd_problem(causal=True, dropout=None):
    return problem.resolve_forward(info((B, NQ, H, D)), info((B, NK, H, D)), info((B, NK, H, D)), MaskOptions.of(causal=causal), 0.5,
                                   dropout)


def struct_arg(args, n_pointers, name):
    """The kernel arguments after the pointers: the struct's fields as numpy scalars of the mirror's
    types, in its order (the generated kernels' scalar parameters), as one record."""
    dt = params.STRUCTS[name]
    tail = args[n_pointers:]
    assert len(tail) == len(dt.names)
    assert all(type(x) is dt.fields[n][0].type for x, n in zip(tail, dt.names)), [type(x) for x in tail]
    return params.unpack(tail, name)


def test_forward_arguments(calls):
    drop = problem.resolve_dropout(0.1, 5)
    plan = _forward._plan(fwd_problem(), FwdConfig(64, 128, 64, 4, 2), np.float16)
    out, lse = plan.run(("q", "k", "v", None, None), drop.kernel_args)
    assert out == ("alloc", (B, NQ, H, D), "float16") and lse == ("alloc", (B, H, NQ), "float32")
    [(name, grid, block, args, smem)] = calls
    assert (name, grid, block, smem) == ("FwdConfig", (1 * H * B,), (128,), FwdConfig(64, 128, 64, 4, 2).smem_bytes)
    assert args[:5] == ("q", "k", "v", out, lse)
    assert args[:5] == tuple(n if n in "qkv" else {"out": out, "lse": lse}[n] for _, n in families.FWD.pointers)
    f = struct_arg(args, 5, "FwdParams")
    assert [int(f[n]) for n in params.FWD.names[:12]] == [NQ * H * D, H * D, D] + [NK * H * D, H * D, D] * 2 + [
        NQ * H * D, H * D, D]
    assert [int(f[n]) for n in ("heads", "seqlen_q", "seqlen_k", "m_blocks")] == [H, NQ, NK, 1]
    assert f["scale_log2"] == np.float32(0.5 * 1.4426950408889634)
    assert (int(f["window_left"]), int(f["window_right"]), int(f["offset"])) == (problem.UNBOUNDED, 0, NK - NQ)
    assert (f["drop_seed"], f["drop_threshold"], f["drop_scale"]) == drop.kernel_args
    # the plan's own struct is untouched by a dropout call, and passed as is without dropout
    assert (plan.params.packed["drop_seed"][0], plan.params.packed["drop_threshold"][0]) == (0, 0)
    assert plan.params.packed["drop_scale"][0] == np.float32(1.0)
    calls.clear()
    plan.run(("q", "k", "v", None, None))
    assert calls[0][3][5:] == plan.params.arg


def test_forward_v1_workspaces_per_call(calls):
    cfg = V1Config(64, 64, 64, 4, 2)
    plan = _forward_v1._plan(fwd_problem(causal=False), cfg, np.float16)
    plan.run(("q", "k", "v", "out", "lse"))
    [(name, grid, _, args, _)] = calls
    rows = B * H * NQ
    assert name == "V1Config" and grid == (B * H,)
    assert args[:7] == ("q", "k", "v", "out", "lse", ("alloc", (rows * D,), "float32"), ("alloc", (rows * 2,), "float32"))
    f = struct_arg(args, len(families.FWD_V1.pointers), "FwdParams")
    assert (int(f["window_left"]), int(f["window_right"]), int(f["offset"])) == (problem.UNBOUNDED,) * 2 + (NK - NQ,)
    assert int(f["m_blocks"]) == -(-NQ // 64)
    assert (f["drop_seed"], f["drop_threshold"], f["drop_scale"]) == (0, 0, np.float32(1.0))


def test_workspaces_of_a_captured_call_are_the_graphs(calls, monkeypatch):
    """Inside a CUDA graph capture a plan's workspaces come from _graph_owned (cudaMallocAsync on the
    capturing stream: the graph's allocation and free nodes), not from CuPy's pool, which would hand
    them to a later array while the graph's replays still write them; outputs the caller did not
    give come from the pool as always (the caller holds them)."""
    owned = []
    monkeypatch.setattr(launch, "_capturing", lambda: True)
    monkeypatch.setattr(launch, "_graph_owned", lambda shape, dtype, zeroed: owned.append((tuple(shape), zeroed))
                        or ("graph", tuple(shape)))
    plan = _forward_v1._plan(fwd_problem(causal=False), V1Config(64, 64, 64, 4, 2), np.float16)
    out, lse = plan.run(("q", "k", "v", None, None))
    [(_, _, _, args, _)] = calls
    rows = B * H * NQ
    assert args[5:7] == (("graph", (rows * D,)), ("graph", (rows * 2,)))
    assert owned == [((rows * D,), False), ((rows * 2,), False)]
    assert out[0] == "alloc" and lse[0] == "alloc"  # the outputs: the caller's to keep
    calls.clear()
    monkeypatch.setattr(launch, "_capturing", lambda: False)
    plan.run(("q", "k", "v", "out", "lse"))
    assert calls[0][3][5][0] == "alloc" and len(owned) == 2  # not capturing: the pool


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_launch_sequence(calls, deterministic):
    arrays = {n: info(s) for n, s in (("dout", (B, NQ, H, D)), ("q", (B, NQ, H, D)), ("k", (B, NK, H, D)),
                                      ("v", (B, NK, H, D)), ("out", (B, NQ, H, D)))}
    lse = info((B, H, NQ), "float32")
    p = problem.resolve_backward(arrays["dout"], arrays["q"], arrays["k"], arrays["v"], arrays["out"], lse, CAUSAL,
                                 None, deterministic)
    dq_cfg = DqConfig(64, 64, 64, 4, 2) if deterministic else None
    drop = problem.resolve_dropout(0.25, 7)
    dq, dk, dv = _backward._plan(p, BwdConfig(64, 64, 64, 4, 2), dq_cfg, np.float16).run(
        ("dout", "q", "k", "v", "out", "lse"), drop.kernel_args)
    pad = 128  # seqlen_q rounded up to _ROW_PAD
    delta = lse2 = ("alloc", (B * H * pad,), "float32")
    dq_acc = np.uint64(0) if deterministic else ("alloc", (B * H * pad * D,), "float32")
    names = [c[0] for c in calls]
    assert names == ["bwd_prep", "BwdConfig", "DqConfig" if deterministic else "bwd_dq_convert"]
    prep, main, post = (c[3] for c in calls)
    n = len(params.BWD.names)
    assert prep[:6] == ("out", "dout", "lse", delta, lse2, dq_acc) and len(prep) == 6 + n
    assert main[:9] == ("q", "k", "v", "dout", lse2, delta, dq_acc, dk, dv) and len(main) == 9 + n
    if deterministic:
        assert post[:7] == ("q", "k", "v", "dout", lse2, delta, dq) and len(post) == 7 + n
    else:
        assert post[:2] == (dq_acc, dq) and len(post) == 2 + n
    # one BwdParams for the pass: every kernel gets the same (per-call, dropout) fields
    assert prep[-n:] == main[-n:] == post[-n:]
    f = struct_arg(main, 9, "BwdParams")
    fresh_q, fresh_k = [NQ * H * D, H * D, D], [NK * H * D, H * D, D]
    strides = {t: [int(f[f"{t}_s{x}"]) for x in "bnh"] for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv")}
    assert strides == {"q": fresh_q, "k": fresh_k, "v": fresh_k, "o": fresh_q, "do": fresh_q, "dq": fresh_q,
                       "dk": fresh_k, "dv": fresh_k}
    assert [int(f[n]) for n in ("heads", "seqlen_q", "seqlen_k", "seqlen_q_pad", "ws_rows", "q_rows")] == [
        H, NQ, NK, pad, B * H * pad, B * H * NQ]
    assert int(f["n_blocks"]) == -(-NK // 64) and int(f["m_blocks"]) == (-(-NQ // 64) if deterministic else 0)
    assert (int(f["window_left"]), int(f["window_right"]), int(f["offset"])) == (problem.UNBOUNDED, 0, NK - NQ)
    assert f["scale"] == np.float32(D ** -0.5) and f["scale_log2"] == np.float32(D ** -0.5 * 1.4426950408889634)
    assert (f["drop_seed"], f["drop_threshold"], f["drop_scale"]) == drop.kernel_args


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("hkv", [1, 3])  # H = 6: group 6 (MQA) and group 2
def test_gqa_backward_reduces_the_expanded_gradients(calls, deterministic, hkv):
    """GQA/MQA: the dK/dV kernel reads k/v with heads_kv heads and writes dK, dV per query head into
    expanded (B, NK, H, D) buffers; bwd_dkdv_reduce, the last launch, sums them into (B, NK, Hkv, D)."""
    h = 6
    q_shape, kv_shape = (B, NQ, h, D), (B, NK, hkv, D)
    p = problem.resolve_backward(info(q_shape), info(q_shape), info(kv_shape), info(kv_shape), info(q_shape),
                                 info((B, h, NQ), "float32"), CAUSAL, None, deterministic)
    assert (p.heads, p.heads_kv, p.group) == (h, hkv, h // hkv)
    dq_cfg = DqConfig(64, 64, 64, 4, 2) if deterministic else None
    dq, dk, dv = _backward._plan(p, BwdConfig(64, 64, 64, 4, 2), dq_cfg, np.float16).run(
        ("dout", "q", "k", "v", "out", "lse"))
    assert dq == ("alloc", q_shape, "float16") and dk == dv == ("alloc", kv_shape, "float16")
    names = [c[0] for c in calls]
    assert names == ["bwd_prep", "BwdConfig", "DqConfig" if deterministic else "bwd_dq_convert", "bwd_dkdv_reduce"]
    main, reduce = calls[1][3], calls[3][3]
    expanded = ("alloc", (B, NK, h, D), "float16")
    assert main[7:9] == (expanded, expanded) and main[7] is not main[8]  # two buffers, not the outputs
    assert reduce[:4] == (main[7], main[8], dk, dv)
    n = len(params.BWD.names)
    assert main[-n:] == reduce[-n:]
    kv_rows = B * NK * hkv
    assert calls[3][1] == (-(-kv_rows * (D // 8) // 256),) and calls[3][2] == (256,)
    f = struct_arg(main, 9, "BwdParams")
    assert (int(f["heads"]), int(f["heads_kv"]), int(f["group"]), int(f["kv_rows"])) == (h, hkv, h // hkv, kv_rows)
    # k, v: their own (heads_kv) strides; dk, dv: those of the expanded buffers the kernel writes
    assert [int(f[f"k_s{x}"]) for x in "bnh"] == [NK * hkv * D, hkv * D, D]
    assert [int(f[f"dk_s{x}"]) for x in "bnh"] == [int(f[f"dv_s{x}"]) for x in "bnh"] == [NK * h * D, h * D, D]
    if deterministic:
        assert calls[2][3][:4] == ("q", "k", "v", "dout")  # the dQ kernel reads the caller's k, v


def test_mha_backward_has_no_reduction(calls):
    """Group 1: no expanded buffer, no extra launch, group 1 and kv_rows 0 in the struct."""
    shape = (B, NQ, H, D)
    kv = (B, NK, H, D)
    p = problem.resolve_backward(info(shape), info(shape), info(kv), info(kv), info(shape), info((B, H, NQ), "float32"),
                                 CAUSAL, None, False)
    _backward._plan(p, BwdConfig(64, 64, 64, 4, 2), None, np.float16).run(("dout", "q", "k", "v", "out", "lse"))
    assert [c[0] for c in calls] == ["bwd_prep", "BwdConfig", "bwd_dq_convert"]
    f = struct_arg(calls[1][3], 9, "BwdParams")
    assert (int(f["heads_kv"]), int(f["group"]), int(f["kv_rows"])) == (H, 1, 0)


@pytest.mark.parametrize("hkv", [1, 3])
def test_gqa_forward_arguments(calls, hkv):
    """The forwards (v2, v1) take k, v with heads_kv heads: their strides, heads_kv and the group in FwdParams."""
    h = 6
    p = problem.resolve_forward(info((B, NQ, h, D)), info((B, NK, hkv, D)), info((B, NK, hkv, D)), CAUSAL, None)
    for plan, n_ptr in ((_forward._plan(p, FwdConfig(64, 128, 64, 4, 2), np.float16), 5),
                        (_forward_v1._plan(p, V1Config(64, 64, 64, 4, 2), np.float16), 7)):
        calls.clear()
        out, lse = plan.run(("q", "k", "v", None, None))
        assert out == ("alloc", (B, NQ, h, D), "float16") and lse == ("alloc", (B, h, NQ), "float32")
        f = struct_arg(calls[0][3], n_ptr, "FwdParams")
        assert (int(f["heads"]), int(f["heads_kv"]), int(f["group"])) == (h, hkv, h // hkv)
        assert [int(f[f"v_s{x}"]) for x in "bnh"] == [NK * hkv * D, hkv * D, D]


# ------------------------------------------------------------------ driver launches (_ArgBuffer)

def _read(addr, n):
    import ctypes

    return ctypes.string_at(int(addr), n)


@pytest.mark.parametrize("lead_maps", [(False,) * 5, (True, True, True, False, False), (False, True, False)])
def test_arg_buffer_points_each_parameter_at_its_bytes(lead_maps):
    """cuLaunchKernel's kernelParams: one pointer per parameter, in order, each at that parameter's
    bytes (pointers 8, TMA maps 128 and 64-byte aligned, then every field of the parameter struct at
    its size), rewritten per run; dropout's fields set for a run and restored after it."""
    from cuflash.launch import MAP_BYTES, _ArgBuffer

    packed = params.pack_fwd(fwd_problem(), 1)
    kp = params.KernelParams(packed)
    buf = _ArgBuffer(lead_maps, kp)
    dt = packed.dtype
    assert len(buf.argv) == len(lead_maps) + len(dt.names)
    tma_map = lambda i: np.frombuffer(bytes(range(i, i + MAP_BYTES)), dtype=[("opaque", "<u8", (16,))]).copy()  # noqa: E731
    values = [tma_map(i) if m else 0x7F0000001000 + 256 * i for i, m in enumerate(lead_maps)]
    for drop in (problem.resolve_dropout(0.1, 7).kernel_args, None):
        buf.fill(values, drop, kp)
        for i, (is_map, v) in enumerate(zip(lead_maps, values)):
            if is_map:
                assert int(buf.argv[i]) % 64 == 0
                assert _read(buf.argv[i], MAP_BYTES) == v.tobytes()
            else:
                assert _read(buf.argv[i], 8) == np.uint64(v).tobytes()
        want = params.unpack(kp.arg if drop is None else kp.with_dropout(drop), "FwdParams")
        for j, name in enumerate(dt.names):
            f = dt.fields[name][0]
            assert _read(buf.argv[len(lead_maps) + j], f.itemsize) == np.asarray(want[name], f).tobytes(), name


def test_pointer_of_leading_arguments():
    from cuflash.launch import NULL, _pointer

    assert _pointer(NULL) == 0 and _pointer(1234) == 1234
    fake = type("A", (), {"data": type("M", (), {"ptr": 99})()})()
    assert _pointer(fake) == 99


def test_run_external_allocates_through_the_caller_and_fills_missing_inputs(calls):
    """Plan.run_external (the torch direct launches): the caller's pointers, out and lse (missing:
    allocated by `empty`, as every workspace), the outputs returned as `empty` made them. The
    caller's pointers come as ints (the torch path) or Ptr; the slots the kernels get are ints."""
    from cuflash.launch import Ptr, address

    plan = _forward._plan(fwd_problem(), FwdConfig(64, 128, 64, 4, 2), np.float16)
    made = []

    def empty(shape, dtype):
        made.append((tuple(shape), np.dtype(dtype).name))
        return f"t{len(made)}", 0x1000 * len(made)

    out, lse = plan.run_external([1, 2, 3], empty, 0)
    assert made == [((B, NQ, H, D), "float16"), ((B, H, NQ), "float32")] and (out, lse) == ("t1", "t2")
    [(_, _, _, args, _)] = calls
    assert list(args[:5]) == [1, 2, 3, 0x1000, 0x2000]
    calls.clear()
    shape, kv = (B, NQ, H, D), (B, NK, H, D)
    p = problem.resolve_backward(info(shape), info(shape), info(kv), info(kv), info(shape), info((B, H, NQ), "float32"),
                                 CAUSAL, None, False)
    plan = _backward._plan(p, BwdConfig(64, 64, 64, 4, 2), None, np.float16)
    made.clear()
    grads = plan.run_external([Ptr(i) for i in range(1, 7)], empty, 0)
    # dq, dk, dv; then the workspaces (delta, lse2, dq_acc) carved from one byte array
    assert grads == ("t1", "t2", "t3") and len(made) == 4 and made[3][1] == "uint8"
    from cuflash._backward import _aux_pointers

    names = _aux_pointers("bwd_prep")
    got = {n: address(a) for n, a in zip(names, calls[0][3]) if n in ("delta", "lse2", "dq_acc")}
    assert sorted(got) == ["delta", "dq_acc", "lse2"]
    assert all((p - 0x4000) in range(0, made[3][0][0], 256) for p in got.values())  # inside the byte array
    assert len(set(got.values())) == 3
    assert [c[0] for c in calls] == ["bwd_prep", "BwdConfig", "bwd_dq_convert"]


def test_zeroed_buffers_are_zeroed_on_either_path(calls, monkeypatch):
    """A Buffer(zeroed=True) (the sm90 deterministic backward's turn counters): cupy.zeros on run(),
    a memset of its bytes on the caller's stream after `empty` on run_external(); others uninitialised."""
    cupy = pytest.importorskip("cupy")
    from cuflash import launch
    from cuflash.launch import Buffer, Launch, Plan, Ptr

    made, sets = [], []
    monkeypatch.setattr(cupy, "zeros", lambda shape, dtype=None: ("zeros", tuple(shape), np.dtype(dtype).name))
    monkeypatch.setattr(launch, "_memset_zero", lambda ptr, n, stream: sets.append((ptr, n, stream)))
    plan = Plan(0, ("x",), (Buffer("sem", (10,), np.int32, zeroed=True), Buffer("ws", (4,))),
                (Launch(Recorder("k", calls), (1,), (32,), 0, pointers=("x", "sem", "ws")),), ("ws",),
                np.zeros(1, params.STRUCTS["BwdParams"]))
    plan.run(("x",))
    args = calls[-1][3]
    assert args[1] == ("zeros", (10,), "int32") and args[2] == ("alloc", (4,), "float32")

    def empty(shape, dtype):
        made.append((tuple(shape), np.dtype(dtype).name))
        return f"t{len(made)}", 0x1000 * len(made)

    plan.run_external([Ptr(0x10)], empty, 7)
    # the output from `empty`; the zeroed workspace from the one byte array of workspaces, zeroed
    assert made == [((4,), "float32"), ((256,), "uint8")] and sets == [(0x2000, 256, 7)]
    assert [launch.address(a) for a in calls[-1][3][:3]] == [0x10, 0x2000, 0x1000]


def test_workspaces_share_one_allocation_zeroed_ones_first():
    """launch._arena_layout: 256-byte offsets, the zeroed workspaces first under one memset."""
    from cuflash.launch import _arena_layout

    places, nbytes, zeroed = _arena_layout([(3, (5,), np.float32, False), (4, (100,), np.int32, True),
                                            (6, (300,), np.float16, True), (7, (1,), np.uint8, False)])
    assert places == ((4, 0), (6, 512), (3, 1280), (7, 1536)) and nbytes == 1792 and zeroed == 1280
    assert _arena_layout([]) == ((), 0, 0)


def test_driver_launch_passes_what_the_kernel_call_passed(calls, monkeypatch):
    """The driver path of Plan.run end to end on the CPU: with cuLaunchKernel replaced by a reader of
    its kernelParams, every launch of a forward and a dropout backward plan gets the grid, block,
    shared memory, stream and, through the pointer array, the same argument values (pointers of
    the slots, the parameter struct's fields, dropout's per run) as the kernel call of the CPU
    recorders."""
    import ctypes

    import cupy

    from cuflash import launch
    from cuflash.launch import Ptr

    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: Ptr(0x5EED))
    monkeypatch.setattr(launch, "_ensure_context", lambda device: None)
    allocated = []
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=None: allocated.append(0) or Ptr(0xA0000 + len(allocated)))
    monkeypatch.setattr(launch, "_capturing", lambda: False)  # no GPU: no capture
    launched = []

    def fake_launch(func, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        launched.append(((func, (gx, gy, gz), (bx, by, bz), smem, stream, extra), argv))

    monkeypatch.setattr(launch, "_launch_kernel", fake_launch)
    drop = problem.resolve_dropout(0.25, 7)
    shape, kv = (B, NQ, H, D), (B, NK, H, D)
    pb = problem.resolve_backward(info(shape), info(shape), info(kv), info(kv), info(shape), info((B, H, NQ), "float32"),
                                  CAUSAL, None, False, drop)
    plans = [(_forward._plan(fwd_problem(), FwdConfig(64, 128, 64, 4, 2), np.float16), 5, params.FWD),
             (_backward._plan(pb, BwdConfig(64, 64, 64, 4, 2), None, np.float16), 6, params.BWD)]
    for plan, n_in, struct in plans:
        args = [Ptr(0x10000 * (i + 1)) for i in range(n_in)]
        calls.clear()
        allocated.clear()
        plan.run(tuple(args), drop.kernel_args)  # the recorders' kernel calls
        want = list(calls)
        plan._launches = tuple((*ln[:5], True) for ln in plan._launches)  # as if CuPy's kernels
        for j, ln in enumerate(plan._launches):
            ln[0].ptr = 0xF00 + j
        launched.clear()
        allocated.clear()  # the same allocations, so the same pointers, as the recorded run
        plan.run(tuple(args), drop.kernel_args)
        assert len(launched) == len(want)
        for j, ((func, grid, block, smem, stream, extra), argv), (_, wgrid, wblock, wargs, wsmem) in \
                zip(range(len(want)), launched, want):
            assert (func, stream, extra, smem) == (0xF00 + j, 0x5EED, 0, wsmem)
            assert grid == (*wgrid, *(1,) * (3 - len(wgrid))) and block == (*wblock, *(1,) * (3 - len(wblock)))
            n_lead = len(wargs) - len(struct.names)
            ptrs = np.frombuffer(ctypes.string_at(argv, 8 * len(wargs)), np.uint64)
            for i, a in enumerate(wargs[:n_lead]):
                got = int(np.frombuffer(ctypes.string_at(int(ptrs[i]), 8), np.uint64)[0])
                assert got == launch._pointer(a), (j, i)
            for i, name in enumerate(struct.names):
                f = struct.fields[name][0]
                got = np.frombuffer(ctypes.string_at(int(ptrs[n_lead + i]), f.itemsize), f)[0]
                assert got == wargs[n_lead + i], (j, name)


def test_run_external_driver_launch_writes_the_int_pointers(calls, monkeypatch):
    """run_external's slots are ints (the caller's pointers, the allocations, the arena's offsets):
    cuLaunchKernel's kernelParams carry exactly the recorders' pointers, run after run (the
    packed runs of _ArgBuffer rewritten each time), with the grid and block padded to three."""
    import ctypes

    monkeypatch.setattr(launch, "_ensure_context", lambda device: None)
    monkeypatch.setattr(launch, "_memset_zero", lambda *a: None)
    launched = []
    monkeypatch.setattr(launch, "_launch_kernel", lambda func, *rest: launched.append((func, rest)))
    shape, kv = (B, NQ, H, D), (B, NK, H, D)
    pb = problem.resolve_backward(info(shape), info(shape), info(kv), info(kv), info(shape), info((B, H, NQ), "float32"),
                                  CAUSAL, None, False)
    plan = _backward._plan(pb, BwdConfig(64, 64, 64, 4, 2), None, np.float16)
    for base in (0x10000, 0x50000):
        made = []

        def empty(shape, dtype):
            made.append(0)
            return f"t{len(made)}", base + 0x100000 * len(made)

        ins = [base + 0x1000 * (i + 1) for i in range(6)]
        calls.clear()
        plan.run_external(ins, empty, 0x5EED)  # the recorders
        want = list(calls)
        saved = plan._launches
        plan._launches = tuple((*ln[:5], True) for ln in saved)
        for j, ln in enumerate(plan._launches):
            ln[0].ptr = 0xF00 + j
        launched.clear()
        made.clear()
        plan.run_external(ins, empty, 0x5EED)
        plan._launches = saved
        assert len(launched) == len(want) == 3
        for (func, rest), (_, grid, block, args, smem) in zip(launched, want):
            assert rest[:6] == (*grid, *(1,) * (3 - len(grid)), *block, *(1,) * (3 - len(block)))
            assert rest[6:8] == (smem, 0x5EED)
            lead = [int(a) for a in args[:len(args) - len(params.BWD.names)]]  # the pointers, NULL as 0
            argv = np.frombuffer(ctypes.string_at(rest[8], 8 * len(lead)), np.uint64)
            got = [int(np.frombuffer(ctypes.string_at(int(a), 8), np.uint64)[0]) for a in argv]
            assert got == lead and any(x >= 0x100000 for x in lead), func


def test_cupy_raw_kernels_take_the_driver_launch():
    """What RawModule.get_function returns (a cupy.RawKernel in CuPy 14) is launched through the
    driver: on the H200 a check of cupy.cuda.function.Function alone sent every plan down CuPy's
    per-call path. Building a RawKernel compiles nothing, so this runs without a GPU."""
    import cupy

    from cuflash.launch import _is_cupy_function

    kernel = cupy.RawKernel('extern "C" __global__ void f() {}', "f")
    assert _is_cupy_function(kernel)
    assert not _is_cupy_function(lambda *a, **k: None)


def test_split_decode_plan_ends_with_its_combine(calls, monkeypatch):
    """A split-KV decode plan with more (K/V head, batch) tiles than a stream's scratch words is one
    plan of two launches: the decode kernel writes fp32 partial results into the plan's o_acc /
    lse_acc (its merge pointers null), the combine (with its own five int32 sizes instead of the
    parameter struct) merges them into out and lse, which the plan returns."""
    import dataclasses

    from cuflash import kvcache, stream_scratch
    from cuflash.launch import NULL

    monkeypatch.setattr(stream_scratch, "POOL_WORDS", 3)  # 4 tiles: no room for the in-kernel merge's counters
    monkeypatch.setattr(kvcache, "_combine_kernel", lambda name: Recorder(f"combine_{name}", calls))
    qs, kvs = (2, 1, 8, 128), (2, 4096, 2, 128)
    p = problem.resolve_forward(info(qs, "bfloat16"), info(kvs, "bfloat16"), info(kvs, "bfloat16"), MaskOptions.of(),
                                None)
    p = dataclasses.replace(p, seqused_k=True, n_splits=4)
    plan = kvcache.plan_decode(p, families.DECODE.default(128), np.float16)
    out, lse = plan.run(("q", "k", "v", None, None, "lens"))
    assert [c[0] for c in calls] == ["DecodeConfig", "combine_float16"]
    o_acc, lse_acc = ("alloc", (4, 2, 1, 8, 128), "float32"), ("alloc", (4, 2, 8, 1), "float32")
    assert calls[0][3][:6] == ("q", "k", "v", o_acc, lse_acc, "lens") and calls[0][3][6:9] == (NULL,) * 3
    _, grid, block, args, smem = calls[1]
    assert args[:4] == (o_acc, lse_acc, out, lse) and smem == 0
    assert out == ("alloc", qs, "float16") and lse == ("alloc", (2, 8, 1), "float32")
    assert args[4:] == (4, 2, 1, 8, 128) and all(type(a) is np.int32 for a in args[4:])
    assert grid == (-(-2 * 8 * 32 // block[0]),)


def test_split_decode_plan_merges_in_its_one_launch(calls, monkeypatch):
    """Otherwise the decode kernel merges (sm80/decode.cuh merge_splits): one launch, which takes
    out, lse and one counter per (K/V head, batch) of the current stream's scratch words."""
    import dataclasses

    import types

    import cupy

    from cuflash import kvcache, stream_scratch

    got = []
    monkeypatch.setattr(stream_scratch, "reserve", lambda dev: None)
    monkeypatch.setattr(stream_scratch, "words", lambda dev, stream, name, n: got.append((name, n)) or ("words", n))
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: types.SimpleNamespace(ptr=7))
    qs, kvs = (2, 1, 8, 128), (2, 4096, 2, 128)
    p = problem.resolve_forward(info(qs, "bfloat16"), info(kvs, "bfloat16"), info(kvs, "bfloat16"), MaskOptions.of(),
                                None)
    p = dataclasses.replace(p, seqused_k=True, n_splits=4)
    out, lse = kvcache.plan_decode(p, families.DECODE.default(128), np.float16).run(("q", "k", "v", None, None, "lens"))
    assert [c[0] for c in calls] == ["DecodeConfig"]
    o_acc, lse_acc = ("alloc", (4, 2, 1, 8, 128), "float32"), ("alloc", (4, 2, 8, 1), "float32")
    assert calls[0][3][:9] == ("q", "k", "v", o_acc, lse_acc, "lens", out, lse, ("words", 4))
    assert got == [("split_counters_4", 4)]
    assert out == ("alloc", qs, "float16") and lse == ("alloc", (2, 8, 1), "float32")


def test_own_scalars_are_packed_at_their_c_offsets():
    """Launch.params (a helper kernel's own scalars) go to the driver as C lays out the parameters:
    after the pointers, each scalar at its natural alignment, the buffer padded to whole words."""
    import ctypes

    from cuflash.launch import OwnParams, _ArgBuffer

    scalars = (np.int32(3), np.int64(-5), np.int32(7), np.float32(0.5), np.int32(9))
    buf = _ArgBuffer((False, False), OwnParams(scalars))
    buf.fill([0x1234, 0x5678], None, None)
    ptrs = np.frombuffer(ctypes.string_at(buf.argv_ptr, 8 * 7), np.uint64)
    lead = [int(np.frombuffer(ctypes.string_at(int(a), 8), np.uint64)[0]) for a in ptrs[:2]]
    assert lead == [0x1234, 0x5678]
    got = [np.frombuffer(ctypes.string_at(int(a), x.itemsize), x.dtype)[0] for a, x in zip(ptrs[2:], scalars)]
    assert got == list(scalars) and all(int(a) % x.itemsize == 0 for a, x in zip(ptrs[2:], scalars))


def test_a_tma_map_is_copied_when_another_comes():
    """_ArgBuffer copies a leading TMA map only when the argument is another map than the last run's
    (maps are encoded once per pointer and not changed after), and always holds the current one."""
    from cuflash.launch import MAP_BYTES, OwnParams, _ArgBuffer

    buf = _ArgBuffer((True, False), OwnParams((np.int32(1),)))
    off = buf.lead[0][1]
    a, b = np.frombuffer(b"\x11" * MAP_BYTES, np.dtype((np.void, MAP_BYTES))).copy(), \
        np.frombuffer(b"\x22" * MAP_BYTES, np.dtype((np.void, MAP_BYTES))).copy()
    for m, byte in ((a, 0x11), (a, 0x11), (b, 0x22), (a, 0x11)):
        buf.fill([m, 7], None, None)
        assert (buf.view[off:off + MAP_BYTES] == byte).all() and buf.maps[0] is m
