"""The runtime parameter structs (kernels_cu/attn/params.cuh) and their NumPy mirror (cuflash/params.py),
on CPU: the generated static_asserts compile with NVRTC (a layout mismatch fails to compile), the
packing, the per-call dropout copy, and problem.py's geometry preconditions."""
from __future__ import annotations


import dataclasses

import numpy as np
import pytest

from cuflash import _compile, families, params, problem
from cuflash.features import Features
from cuflash.mask import MaskOptions

from tests.test_compile import _nvrtc_available

needs_nvrtc = pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not loadable (install nvidia-cuda-nvrtc)")


def _compile_ok(source: str, arch: str = "sm_80") -> tuple[bool, str]:
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, "params_check.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(_compile.nvrtc_options((f"--gpu-architecture={arch}",))))
            return True, ""
        except nvrtc.NVRTCError:
            return False, nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def check_smem_mirror(header: str, traits: str, expected: int) -> None:
    """A tile class's smem_bytes mirror equals its traits' kSmemBytes (`traits`, e.g.
    "cuflash::Sm80BwdTraits<...>", from kernels_cu/`header`), as a static_assert under NVRTC."""
    src = (f'#include "common.cuh"\n#include "{header}"\n'
           f'static_assert({traits}::kSmemBytes == {expected}, "mirror");\n')
    ok, log = _compile_ok(src)
    assert ok, log


def _offsetof_compiles() -> bool:
    """NVRTC 13.5 (CI) takes __builtin_offsetof in a static_assert; NVRTC 13.0 (the H200 image) does
    not know it, so the mirror checks run where it does."""
    probe = "struct S { int a; long long b; };\nstatic_assert(__builtin_offsetof(S, b) == 8, \"\");\n"
    return _nvrtc_available() and _compile_ok(probe + "__global__ void k() {}\n")[0]


needs_offsetof = pytest.mark.skipif(not _offsetof_compiles(), reason="this NVRTC lacks __builtin_offsetof")


def _check_source(asserts: str) -> str:
    return f'#include "attn/params.cuh"\n{asserts}__global__ void k() {{}}\n'


@needs_offsetof
@pytest.mark.parametrize("name", sorted(params.STRUCTS))
def test_mirror_matches_the_cpp_struct(name):
    """Every field's offset and type and the struct's size and alignment, checked by the C++ compiler."""
    asserts = params.static_asserts(name)
    assert asserts.count("__builtin_offsetof") == len(params.STRUCTS[name].names)
    ok, log = _compile_ok(_check_source(asserts))
    assert ok, log


@needs_offsetof
def test_a_wrong_mirror_fails_to_compile(monkeypatch):
    """The check has teeth: swap two fields of different types in the mirror and the asserts fail."""
    fields = [f for f in params.FWD_FIELDS]
    i = [n for n, _ in fields].index("seqlen_q")
    fields[i], fields[i + 1] = fields[i + 1], fields[i]  # (seqlen_q, seqlen_k): same type, wrong offsets
    monkeypatch.setitem(params.STRUCTS, "FwdParams", np.dtype(fields, align=True))
    params.static_asserts.cache_clear()
    try:
        ok, log = _compile_ok(_check_source(params.static_asserts("FwdParams")))
        assert not ok and "FwdParams::seqlen_q" in log
        wrong_type = [(n, "<f4" if n == "heads" else t) for n, t in params.FWD_FIELDS]
        monkeypatch.setitem(params.STRUCTS, "FwdParams", np.dtype(wrong_type, align=True))
        params.static_asserts.cache_clear()
        ok, log = _compile_ok(_check_source(params.static_asserts("FwdParams")))
        assert not ok and "FwdParams::heads" in log
    finally:
        monkeypatch.undo()
        params.static_asserts.cache_clear()


def test_every_shell_carries_the_asserts():
    for fam in families.REGISTRY.values():
        cfg = fam.default(64)
        src = _compile.kernel_source(cfg, Features("bfloat16", 64))
        assert params.static_asserts(fam.params, fields=False) in src
        # every field a scalar parameter, in the mirror's order, gathered into the struct by name
        decl = ", ".join(f"{ctype} {f}_" for f, ctype in params.fields(fam.params))
        assert decl + ") {" in src and f"cuflash::{fam.params} p;" in src
    for name, (_, struct_name) in _compile.AUX_KERNELS.items():
        src, _ = _compile.aux_source(name, "float16", 128)
        assert params.static_asserts(struct_name, fields=False) in src


def test_layout_has_no_implicit_padding():
    for name, dt in params.STRUCTS.items():
        assert dt.isalignedstruct and dt.alignment == 8 and dt.itemsize % 8 == 0
        assert sum(dt.fields[n][0].itemsize for n in dt.names) == dt.itemsize, name
        # 8-byte fields first
        sizes = [dt.fields[n][0].itemsize for n in dt.names]
        assert sizes == sorted(sizes, reverse=True), name
    assert (params.FWD.itemsize, params.BWD.itemsize) == (216, 336)
    # GQA/MQA (issue 12): new 4-byte fields at the end; BwdParams' kv_rows with the other 8-byte
    # fields; softcap's scale (issue 13) and the call's head dim (issue 12); v's head dim took
    # FwdParams' tail padding and joined BwdParams' end with a new one (appended: every earlier
    # field's kernel parameter keeps its offset); that padding became the batch (issue 14: the
    # varlen row-wise kernels stride over sequences past the grid's z); the sm90 deterministic
    # backward's order flag after it (issue 11); the decode kernel's length addend and its padding
    # word at FwdParams' end (issue 17)
    assert params.FWD.names[-18:] == ("tiles", "heads_kv", "group", "softcap_scale", "head_dim", "align_end", "n_splits",
                                     "split_blocks", "page_size", "table_stride", "alibi_scale", "alibi_sb",
                                     "bm_sb", "bm_sh", "bm_nb", "head_dim_v", "seqused_add", "reserved0")
    assert params.BWD.names[-15:] == ("heads_kv", "group", "softcap_scale", "head_dim", "align_end", "alibi_scale",
                                     "alibi_sb", "bm_sb", "bm_sh", "bm_nb", "bm_mb", "head_dim_v", "batch", "det_rotate",
                                     "head_chunk")
    assert params.BWD.names[params.BWD.names.index("q_rows") + 1] == "kv_rows"


def _problem(causal=True, nq=100, nk=300, hkv=3):
    def info(shape):
        it = 2
        strides, acc = [], it
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
        return problem.ArrayInfo(shape, "float16", it, tuple(strides), 1 << 20, 0)

    return problem.resolve_forward(info((2, nq, 3 * 2 if hkv != 3 else 3, 64)), info((2, nk, hkv, 64)),
                                   info((2, nk, hkv, 64)), MaskOptions.of(causal=causal), None)


def test_with_dropout_patches_only_the_dropout_fields():
    kp = params.KernelParams(params.pack_fwd(_problem(), 2))
    drop = problem.resolve_dropout(0.3, 2**64 - 1)
    arg = kp.with_dropout(drop.kernel_args)
    assert len(arg) == len(kp.arg) == len(params.FWD.names)
    got, base = params.unpack(arg, "FwdParams"), kp.packed[0]
    for n in params.FWD.names:
        want = dict(zip(("drop_seed", "drop_threshold", "drop_scale"), drop.kernel_args)).get(n, base[n])
        assert got[n] == want, n
    assert params.unpack(kp.arg, "FwdParams").tobytes() == kp.packed.tobytes()  # the plan's fields are untouched


def test_pack_geometry_and_scales():
    p = _problem(causal=False, nq=300, nk=100)
    f = params.pack_fwd(p, 5)[0]
    assert (int(f["window_left"]), int(f["window_right"]), int(f["offset"])) == (problem.UNBOUNDED,) * 2 + (-200,)
    assert f["scale_log2"] == np.float32(p.softmax_scale * params.LOG2E)


def test_geometry_preconditions():
    U = problem.UNBOUNDED
    for ok in ((U, 0, 5), (U, U, -(2**28 - 1)), (3, -3, 0), (0, 0, 2**28 - 1)):
        problem.check_geometry(*ok)
    for bad in ((U, 0, 2**28), (U, 0, U), (2**28, 0, 0), (U + 1, 0, 0), (-(2**28), U, 0)):
        with pytest.raises(ValueError, match="range"):
            problem.check_geometry(*bad)
    with pytest.raises(ValueError, match="empty attention window"):
        problem.check_geometry(2, -3, 0)
    # enforced on every AttnProblem, including replace()
    import dataclasses

    with pytest.raises(ValueError, match="offset"):
        dataclasses.replace(_problem(), offset=2**28)


@pytest.mark.parametrize("hkv", [3, 2, 1])  # MHA (3 heads), GQA 6/2, MQA 6/1
def test_pack_gqa_fields(hkv):
    """heads_kv and the group in both structs; k, v strides of their own (heads_kv) shape; the
    backward's dk/dv strides are those of the expanded (per query head) buffers with GQA, and
    kv_rows the reduction's rows (0 for MHA: no reduction)."""
    p = _problem(hkv=hkv)
    h = p.heads
    f = params.pack_fwd(p, 2)[0]
    assert (int(f["heads"]), int(f["heads_kv"]), int(f["group"])) == (h, hkv, h // hkv)
    assert [int(f[f"k_s{x}"]) for x in "bnh"] == [300 * hkv * 64, hkv * 64, 64]
    assert int(f["tiles"]) == 2 * h * 2 and float(f["softcap_scale"]) == 0.0 and int(f["head_dim"]) == p.head_dim
    g = params.pack_bwd(dataclasses.replace(p, strides={**p.strides, "out": p.strides["q"], "dout": p.strides["q"]}),
                        128, 3)[0]
    assert (int(g["heads"]), int(g["heads_kv"]), int(g["group"])) == (h, hkv, h // hkv)
    assert int(g["kv_rows"]) == (0 if hkv == h else 2 * 300 * hkv)
    assert [int(g[f"dk_s{x}"]) for x in "bnh"] == [300 * h * 64, h * 64, 64]
    assert [int(g[f"v_s{x}"]) for x in "bnh"] == [300 * hkv * 64, hkv * 64, 64]
