"""The Hopper forward's tile orders (kernels_cu/sm90/tile_feed.cuh): a tile's result does not depend on
which CTA runs it, so one CTA per tile (persistent 0), strided persistent CTAs (1) and CTAs that draw
their tiles from a counter (2) must give bitwise the same out and lse, and the counter must be back
at 0 after every launch (the next launch on the stream starts from it)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cuflash import _forward, _forward_sm90, families, stream_scratch, varlen
from cuflash.mask import MaskOptions
from cuflash.testing import backend_unavailable, dtype_of, random_qkv

pytestmark = pytest.mark.gpu


def _need_sm90():
    why = backend_unavailable("sm90")
    if why:
        pytest.skip(why)


def _counters_zero():
    import cupy

    cupy.cuda.runtime.deviceSynchronize()
    given = stream_scratch.handed_out(cupy.cuda.Device().id)
    assert given and all(int(w.get()[0]) == 0 for w in given.values())


def _bits(a):
    import cupy

    return cupy.asnumpy(a).view(np.uint8)


def _fwd(q, k, v, causal, tile):
    import cupy

    out, lse = _forward.forward(q, k, v, mask=MaskOptions.of(causal=causal), config=tile)
    cupy.cuda.get_current_stream().synchronize()
    return _bits(out), _bits(lse)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,b,n,h,hkv", [(128, 2, 1000, 4, 4), (128, 1, 3000, 3, 1), (64, 3, 777, 4, 2),
                                          (128, 1, 64, 1, 1), (64, 4, 2048, 8, 8)])
def test_drawn_and_strided_tiles_give_the_same_bits(d, b, n, h, hkv, causal):
    """Dense calls, ragged lengths, GQA / MQA, a single tile (grid 1), and more tiles than SMs."""
    _need_sm90()
    rng = np.random.default_rng(d + n + h)
    q, k, v = random_qkv(rng, b, n, n, h, d, dtype_of("bfloat16"), heads_kv=hkv)
    base = families.FWD_SM90.defaults[d][0]
    want = _fwd(q, k, v, causal, dataclasses.replace(base, persistent=0))
    for p in (1, 2, 2, 2):  # the drawn order thrice: each launch must find its counter at 0
        got = _fwd(q, k, v, causal, dataclasses.replace(base, persistent=p))
        assert all(np.array_equal(x, y) for x, y in zip(got, want)), f"persistent {p}"
    _counters_zero()


@pytest.mark.parametrize("d,b,nq,nk,h,hkv", [(128, 4, 300, 500, 10, 10), (64, 2, 200, 700, 48, 24),
                                               (128, 9, 500, 500, 8, 8)])
def test_sections_give_the_same_bits(d, b, nq, nk, h, hkv):
    """Causal calls of several sections (attn/tile_order.cuh; the last one partial, GQA's of K/V
    heads): the sectioned order (one CTA per tile, drawn) gives the strided order's bits (one
    section), so it runs every tile exactly once."""
    _need_sm90()
    from tests.test_tile_order_twin import section_heads

    assert section_heads(h // hkv, b * h) < b * h  # more than one section
    rng = np.random.default_rng(nk + h)
    q, k, v = random_qkv(rng, b, nq, nk, h, d, dtype_of("bfloat16"), heads_kv=hkv)
    base = families.FWD_SM90.defaults[d][0]
    want = _fwd(q, k, v, True, dataclasses.replace(base, persistent=1))
    for p in (0, 2, 2):
        got = _fwd(q, k, v, True, dataclasses.replace(base, persistent=p))
        assert all(np.array_equal(x, y) for x, y in zip(got, want)), f"persistent {p}"
    _counters_zero()


def test_a_few_ctas_drawing_many_tiles(monkeypatch):
    """Three CTAs over ~200 tiles: each draws dozens, the last draw's CTA resets the counter."""
    _need_sm90()
    from cuflash import device

    real = device.query
    monkeypatch.setattr(_forward_sm90.device, "query", lambda i=0: dataclasses.replace(real(i), sm_count=3))
    _forward._plans.clear()  # plans of given configs are cached too: none built for the real SM count
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 2, 1500, 1500, 8, 128, dtype_of("float16"))
    base = families.FWD_SM90.defaults[128][0]
    for causal in (False, True):
        want = _fwd(q, k, v, causal, dataclasses.replace(base, persistent=0))
        for _ in range(3):
            got = _fwd(q, k, v, causal, dataclasses.replace(base, persistent=2))
            assert all(np.array_equal(x, y) for x, y in zip(got, want))
    _forward._plans.clear()  # nor left for later calls: their grids are of 3 CTAs
    _counters_zero()


def test_two_streams_keep_their_own_counters():
    """Launches queued on two streams at once, alternating: each stream has its own counter, so
    concurrent kernels never share one."""
    _need_sm90()
    import cupy

    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, 4, 2048, 2048, 8, 128, dtype_of("bfloat16"))
    tile = dataclasses.replace(families.FWD_SM90.defaults[128][0], persistent=2)
    want = _fwd(q, k, v, True, dataclasses.replace(tile, persistent=0))
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    outs = []
    for _ in range(4):
        for s in streams:
            with s:
                outs.append(_forward.forward(q, k, v, mask=MaskOptions.of(causal=True), config=tile))
    for s in streams:
        s.synchronize()
    for out, lse in outs:
        assert np.array_equal(_bits(out), want[0]) and np.array_equal(_bits(lse), want[1])
    assert {s.ptr for s in streams} <= {stream for stream, _ in stream_scratch.handed_out(q.device.id)}
    _counters_zero()


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_tiles_past_their_sequence_are_skipped_alike(monkeypatch, causal):
    """A ragged batch (zero-length and one-token sequences included): the producer skips the tiles past
    a sequence's end in both orders; every order gives the same bits."""
    _need_sm90()
    import cupy

    lens = [0, 1, 17, 113, 1000, 129, 0, 2500, 64, 65]
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    total, h, d = sum(lens), 4, 128
    rng = np.random.default_rng(11)
    mk = lambda: cupy.asarray(rng.standard_normal((total, h, d), dtype=np.float32)).astype(dtype_of("bfloat16"))  # noqa: E731
    q, k, v = mk(), mk(), mk()
    real = families.select
    results = {}
    for p in (0, 1, 2, 2):
        monkeypatch.setattr(families, "select", lambda fam, prob, p=p: dataclasses.replace(real(fam, prob), persistent=p)
                            if fam is families.FWD_SM90 else real(fam, prob))
        varlen._plans.clear()
        out, lse = varlen.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=causal, return_lse=True,
                                           backend="sm90")
        cupy.cuda.get_current_stream().synchronize()
        got = (_bits(out), _bits(lse))
        if results:
            assert all(np.array_equal(x, y) for x, y in zip(got, results[0])), f"persistent {p}"
        results.setdefault(p, got)
    varlen._plans.clear()
    _counters_zero()


def test_a_graph_captured_on_a_new_stream_takes_its_word_without_allocating():
    """Warm-up on one stream, capture on another that has no word yet: the capture takes one from the
    device's pool (an allocation would fail the capture), and the replay gives the eager bits."""
    _need_sm90()
    import cupy

    rng = np.random.default_rng(13)
    q, k, v = random_qkv(rng, 2, 1024, 1024, 4, 128, dtype_of("bfloat16"))
    tile = dataclasses.replace(families.FWD_SM90.defaults[128][0], persistent=2)
    want = _fwd(q, k, v, True, tile)
    plan_args = dict(mask=MaskOptions.of(causal=True), config=tile)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        # the strided order first: CuPy's pool keeps the outputs' blocks for this stream, no word taken
        _forward.forward(q, k, v, mask=MaskOptions.of(causal=True), config=dataclasses.replace(tile, persistent=1))
        stream.synchronize()
        assert (stream.ptr, "tile_counter") not in stream_scratch.handed_out(q.device.id)
        stream.begin_capture()
        out, lse = _forward.forward(q, k, v, **plan_args)
        graph = stream.end_capture()
        out.fill(0)
        graph.launch(stream)
        stream.synchronize()
    assert np.array_equal(_bits(out), want[0]) and np.array_equal(_bits(lse), want[1])
    assert (stream.ptr, "tile_counter") in stream_scratch.handed_out(q.device.id)
    _counters_zero()
