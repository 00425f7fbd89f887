"""User score and mask modifications: CUDA C++ snippets compiled into the attention kernels.

    mod = cuflash.ScoreMod(score="score + bias[h * 4096 + kv_idx]", aux={"bias": bias})
    mod = cuflash.ScoreMod(mask="kv_idx <= q_idx && q_idx - kv_idx < 256")            # a band
    mod = cuflash.ScoreMod(score="30.f * tanhf(score / 30.f)")                          # softcap
    out = cuflash.attention(q, k, v, score_mod=mod)

A snippet is an expression or a function body (with `return`) over

    score_mod:  float score, int b, int h, int q_idx, int kv_idx   -> float (softmax units)
    mask_mod:   int b, int h, int q_idx, int kv_idx                 -> bool (false: masked out)
    grad:       float score, int b, int h, int q_idx, int kv_idx   -> d score_mod / d score (backward)

plus each auxiliary array by its name (`aux`: float32 as `const float*`, int32 as `const int*`,
contiguous, on the call's device; the snippet indexes them itself). `score` is the scaled score
softmax_scale * q.k (after softcap); `b` the batch, `h` the query head, `q_idx` and `kv_idx` the
query's and key's positions in their sequences (FlexAttention's convention). The built-in mask
(causal, window) and ALiBi apply after the modification. q_idx and kv_idx stay inside the
sequences (a kernel's padding positions are clamped to the last one and dropped after), so a
snippet may index aux arrays by position.

The snippets are part of the kernel (`ModSource`): their hash joins the kernel's name and the
compile cache's key, so each distinct snippet compiles once per tile, and a compile error names the
snippet and its own line (ScoreModError). The aux arrays are per call (a device pointer table).
"""
from __future__ import annotations

import dataclasses
import hashlib
import re

# the names the snippet's function already binds (its parameters) and cuflash's own
_RESERVED = {"score", "b", "h", "q_idx", "kv_idx", "cuflash_aux", "cuflash"}
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_CTYPES = {"float32": "float", "int32": "int"}
MAX_AUX = 8


class ScoreModError(ValueError):
    """A snippet that does not compile: the compiler's messages, with the snippet's own line numbers."""


@dataclasses.dataclass(frozen=True)
class ModSource:
    """The compile-time part of a ScoreMod: the snippets and the aux arrays' names and C types."""
    score: str | None = None
    mask: str | None = None
    aux: tuple = ()  # ((name, ctype), ...) in the pointer table's order
    grad: str | None = None  # d score_mod / d score, for the backward

    def digest(self) -> str:
        h = hashlib.sha256(repr((self.score, self.mask, self.aux) + ((self.grad,) if self.grad else ())).encode())
        return h.hexdigest()[:12]

    def cxx(self) -> str:
        """The specialisation cuflash::UserModDefs<true> (kernels_cu/attn/score_mod.cuh) that the
        generated shell places after the kernel headers: one static function per snippet, the aux
        arrays bound by name from the pointer table, `#line` so errors cite the snippet's lines."""
        binds = "".join(f"        [[maybe_unused]] const {ct}* __restrict__ {name} = "
                        f"static_cast<const {ct}*>(cuflash_aux[{i}]);\n" for i, (name, ct) in enumerate(self.aux))
        aux_arg = "[[maybe_unused]] const void* const* __restrict__ cuflash_aux"

        def fn(ret, name, params, body, which):
            if body is None:
                return ""
            return (f"    __device__ __forceinline__ static {ret} {name}({params}, {aux_arg}) {{\n{binds}"
                    f'#line 1 "{which}"\n{_as_body(body)}\n    }}\n')

        return ("namespace cuflash {\n"
                "template <> struct UserModDefs<true> {\n"
                f"    static constexpr bool kScore = {'true' if self.score else 'false'};\n"
                f"    static constexpr bool kMask = {'true' if self.mask else 'false'};\n"
                + fn("float", "score", "float score, int b, int h, int q_idx, int kv_idx", self.score, "score_mod")
                + fn("bool", "mask", "int b, int h, int q_idx, int kv_idx", self.mask, "mask_mod")
                + fn("float", "grad", "float score, int b, int h, int q_idx, int kv_idx", self.grad, "score_grad")
                + ("" if self.score else "    __device__ __forceinline__ static float score(float s, int, int, int, int, "
                   "const void* const*) { return s; }\n")
                + ("" if self.mask else "    __device__ __forceinline__ static bool mask(int, int, int, int, "
                   "const void* const*) { return true; }\n")
                + ("" if self.grad else "    __device__ __forceinline__ static float grad(float, int, int, int, int, "
                   "const void* const*) { return 1.f; }\n")
                + "};\n}  // namespace cuflash\n")


def _as_body(snippet: str) -> str:
    """An expression becomes `return (expr);`; a body (it has a `return` or a `;`) stays as written."""
    text = snippet.strip()
    if re.search(r"\breturn\b", text) or ";" in text.rstrip(";") or text.startswith("{"):
        return text
    return f"return ({text.rstrip(';')});"


class ScoreMod:
    """A user modification of the attention scores and/or mask (see the module's docstring).

    score: CUDA C++ for the modified score, or None; mask: CUDA C++ for whether the key is visible,
    or None (one of them is needed); grad: CUDA C++ for d score_mod / d score over the same
    arguments, which the backward needs with a score snippet (a mask-only modification has no
    derivative to give); aux: {name: array} of float32 / int32 contiguous arrays (CuPy,
    or any DLPack array, used zero-copy), at most 8, named as C identifiers."""

    def __init__(self, score: str | None = None, *, mask: str | None = None, grad: str | None = None,
                 aux: dict | None = None):
        for what, snip in (("score", score), ("mask", mask), ("grad", grad)):
            if snip is not None and (not isinstance(snip, str) or not snip.strip()):
                raise ValueError(f"{what} must be a non-empty string of CUDA C++, got {snip!r}")
        if score is None and mask is None:
            raise ValueError("a ScoreMod needs a score snippet, a mask snippet or both")
        if grad is not None and score is None:
            raise ValueError("grad is the derivative of the score snippet: give score too")
        aux = dict(aux or {})
        if len(aux) > MAX_AUX:
            raise ValueError(f"aux takes at most {MAX_AUX} arrays, got {len(aux)}")
        arrays, decl = [], []
        for name, arr in aux.items():
            if not isinstance(name, str) or not _IDENT.match(name) or name in _RESERVED or name.startswith("__"):
                raise ValueError(f"aux name {name!r} must be a C identifier other than "
                                 f"{', '.join(sorted(_RESERVED))}")
            arr = _as_cupy(arr, name)
            ct = _CTYPES.get(arr.dtype.name)
            if ct is None:
                raise ValueError(f"aux array {name!r} must be float32 or int32, got {arr.dtype.name}")
            if not arr.flags.c_contiguous:
                raise ValueError(f"aux array {name!r} must be C-contiguous")
            arrays.append(arr)
            decl.append((name, ct))
        self.source = ModSource(score=score, mask=mask, aux=tuple(decl), grad=grad)
        self.aux = tuple(arrays)
        self._tables = {}

    def __repr__(self) -> str:
        parts = [f"score={self.source.score!r}"] if self.source.score else []
        parts += [f"mask={self.source.mask!r}"] if self.source.mask else []
        parts += [f"grad={self.source.grad!r}"] if self.source.grad else []
        parts += [f"aux={[n for n, _ in self.source.aux]}"] if self.source.aux else []
        return f"ScoreMod({', '.join(parts)})"

    def block_mask(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device: int | None = None):
        """A cuflash.BlockMask of this modification's mask snippet for calls of this shape (batch and
        heads: the call's, or 1 where the snippet reads neither b nor h): the key blocks the mask
        empties are then skipped (cuflash/block_mask.py). The aux arrays are read now."""
        from . import block_mask

        return block_mask.build(self, batch, heads, seqlen_q, seqlen_k, device)

    def check_device(self, device: int) -> None:
        for (name, _), arr in zip(self.source.aux, self.aux):
            if arr.device.id != device:
                raise ValueError(f"aux array {name!r} is on device {arr.device.id}, the call's arrays on {device}")

    def pointer_table(self, device: int):
        """The aux arrays' addresses as a uint64 device array on `device` (the kernels' mod_aux), made once."""
        table = self._tables.get(device)
        if table is None:
            import cupy
            import numpy as np

            self.check_device(device)
            with cupy.cuda.Device(device):
                ptrs = np.array([a.data.ptr for a in self.aux] or [0], dtype=np.uint64)
                table = cupy.asarray(ptrs)
            self._tables[device] = table
        return table


def _as_cupy(arr, name: str):
    import cupy

    if isinstance(arr, cupy.ndarray):
        return arr
    if hasattr(arr, "__dlpack__"):
        return cupy.from_dlpack(arr)
    raise TypeError(f"aux array {name!r} must be a CuPy array or support DLPack, got {type(arr).__name__}")


def compile_error(log: str, source: ModSource) -> ScoreModError | None:
    """The compiler's messages about the snippets (lines `score_mod(N): ...`), with each snippet line
    they cite, or None when the log blames no snippet."""
    hits = [l for l in log.splitlines() if re.match(r"\s*(score_mod|mask_mod|score_grad)\(\d+\)", l)]
    if not hits:
        return None
    texts = {"score_mod": source.score or "", "mask_mod": source.mask or "", "score_grad": source.grad or ""}
    out = []
    for l in hits:
        m = re.match(r"\s*(score_mod|mask_mod|score_grad)\((\d+)\)", l)
        out.append(l.strip())
        lines = _as_body(texts[m.group(1)]).splitlines()
        n = int(m.group(2))
        if 1 <= n <= len(lines):
            out.append(f"    {m.group(1)} line {n}: {lines[n - 1].strip()}")
    return ScoreModError("the ScoreMod snippet does not compile:\n" + "\n".join(out))
