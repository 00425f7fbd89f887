"""NumPy twin of kernels_cu/core/convert.cuh's exp2_fma (2^x on the FMA pipe, for a share of the
softmax's exps): the same float32 operations in the same order (each FMA one rounding: the float64
product of two float32 is exact), the coefficients read from the header. CPU only.

  * relative error <= 4e-6 over x in [-126, 0] (the softmax's arguments: S c - m c <= 0), far under
    a 16-bit P's half ulp (2^-9 bf16, 2^-11 fp16), so P rounds as MUFU.EX2's would almost always;
  * exactly 0 below -126 and at -inf (masked scores), as ex2.approx.ftz gives;
  * exactly 1 at 0 within the polynomial's error (the row maximum's own P).
"""
import pathlib
import re

import numpy as np

HEADER = pathlib.Path(__file__).resolve().parent.parent / "kernels_cu" / "core" / "convert.cuh"
F32 = np.float32


def _coefficients():
    body = HEADER.read_text().split("float exp2_fma(float x) {", 1)[1].split("\n}\n", 1)[0]
    first = re.search(r"__fmaf_rn\(f, ([0-9.]+)f, ([0-9.]+)f\)", body)
    rest = re.findall(r"__fmaf_rn\(p, f, ([0-9.]+)f\)", body)
    assert first and len(rest) == 3, "exp2_fma's Horner steps changed: update the twin"
    return [F32(first.group(1)), F32(first.group(2))] + [F32(c) for c in rest]


def _fma(a, b, c):
    return (a.astype(np.float64) * b.astype(np.float64) + c).astype(F32)


def exp2_fma(x):
    c = _coefficients()
    x = np.asarray(x, dtype=F32)
    xc = np.maximum(x, F32(-127.0))
    t = (xc + F32(12582912.0)).astype(F32)
    f = (xc - (t - F32(12582912.0)).astype(F32)).astype(F32)
    p = _fma(f, np.full_like(f, c[0]), c[1])
    for k in c[2:]:
        p = _fma(p, f, k)
    y = (p.view(np.int32) + (t.view(np.int32) << np.int32(23))).view(F32)
    return np.where(xc < F32(-126.0), F32(0.0), y)


def test_relative_error_over_the_softmax_range():
    x = np.linspace(-126, 0, 4_000_001, dtype=np.float64).astype(F32)
    x = np.concatenate([x, -np.geomspace(1e-8, 126, 200_001).astype(F32)])
    ref = np.exp2(x.astype(np.float64))
    rel = np.abs(exp2_fma(x).astype(np.float64) - ref) / ref
    assert rel.max() <= 4e-6, float(rel.max())


def test_masked_scores_give_zero_and_zero_gives_one():
    assert (exp2_fma(np.array([-np.inf, -1e30, -200.0, -126.5, -127.0], F32)) == 0).all()
    assert abs(float(exp2_fma(np.array([0.0], F32))[0]) - 1.0) <= 2e-6


def test_the_fma_share_variant_compiles(tmp_path):
    """gpu_run.sh exp2fma edits sm90/traits.cuh's two shares (sed on `kExp2FmaPlain = 0;` and
    `kExp2FmaSoftcap = 0;`): the anchors are there, and the softcap forward built with 10 of 16
    exps on the FMA pipe compiles for sm_90a without spills."""
    import shutil

    import pytest

    pytest.importorskip("cupy")
    from cupy_backends.cuda.libs import nvrtc

    from cuflash import _compile, families
    from cuflash.features import Features

    kdir = tmp_path / "kernels_cu"
    shutil.copytree(_compile.kernel_dir(), kdir)
    traits = kdir / "sm90" / "traits.cuh"
    text = traits.read_text()
    assert text.count("kExp2FmaPlain = 0;") == 1 and text.count("kExp2FmaSoftcap = 0;") == 1
    traits.write_text(text.replace("kExp2FmaSoftcap = 0;", "kExp2FmaSoftcap = 10;"))
    f = Features("bfloat16", 128, softcap=True)
    src = _compile.kernel_source(families.FWD_SM90.default(128, features=f), f)
    prog = nvrtc.createProgram(src, "variant.cu", [], [])
    nvrtc.compileProgram(prog, ["--std=c++17", "--use_fast_math", f"-I{kdir}", "--gpu-architecture=sm_90a",
                                "-Xptxas", "-v"])
    log = nvrtc.getProgramLog(prog)
    assert " 0 bytes spill stores" in log, log[-1500:]
