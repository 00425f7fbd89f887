"""kernels_cu/core/wgmma_sm90.cuh is generated: it must be exactly scripts/gen_wgmma.py's output."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _gen():
    spec = importlib.util.spec_from_file_location("gen_wgmma", ROOT / "scripts" / "gen_wgmma.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_checked_in_headers_are_the_generators_output():
    gen = _gen()
    for name, text in (("wgmma_sm90.cuh", gen.render()), ("wgmma_sm90_mn.cuh", gen.render_mn())):
        assert (ROOT / "kernels_cu" / "core" / name).read_text() == text, \
            f"kernels_cu/core/{name} is stale: run python scripts/gen_wgmma.py"


def test_every_n_a_tile_may_use_is_generated():
    gen = _gen()
    # block_k (S = Q K^T) and head_dim (O += P V) are multiples of 16 in [64, 256]
    assert set(gen.N_VALUES) == set(range(64, 257, 16))
    text, mn = gen.render(), gen.render_mn()
    for n in gen.N_VALUES:
        for ty in ("bf16", "f16"):
            assert f"m64n{n}k16.f32.{ty}.{ty}" in text and f"m64n{n}k16.f32.{ty}.{ty}" in mn
    assert "p, 1, 1, 1, 1;" in mn and "p, 1, 1, 0, 1;" in mn and "p, 1, 1, 1, 1;" not in text
