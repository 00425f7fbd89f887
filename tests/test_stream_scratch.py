"""cuflash/stream_scratch.py without a GPU: a fake CuPy whose zeros are NumPy arrays."""
from __future__ import annotations

import contextlib
import sys
import types

import numpy as np
import pytest

from cuflash import stream_scratch


@pytest.fixture
def fake(monkeypatch):
    state = types.SimpleNamespace(capturing=False, zeros=0, syncs=0)

    def zeros(n, dtype=None):
        state.zeros += 1
        return np.zeros(n, dtype)

    stream = types.SimpleNamespace(is_capturing=lambda: state.capturing,
                                   synchronize=lambda: setattr(state, "syncs", state.syncs + 1))
    cupy = types.SimpleNamespace(zeros=zeros, cuda=types.SimpleNamespace(Device=lambda d: contextlib.nullcontext(),
                                                                         get_current_stream=lambda: stream))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(stream_scratch, "_pools", {})
    return state


def test_one_word_per_stream_from_one_pool(fake):
    stream_scratch.reserve(0)
    stream_scratch.reserve(0)
    assert fake.zeros == 1 and fake.syncs == 1  # made once, zeroed before any kernel reads it
    a, b = stream_scratch.words(0, 0x10, "c"), stream_scratch.words(0, 0x20, "c")
    assert a is stream_scratch.words(0, 0x10, "c") and a.base is b.base and a.shape == b.shape == (1,)
    a[0] = 5
    assert b[0] == 0  # distinct words
    assert stream_scratch.words(0, 0x10, "other") is not a
    assert set(stream_scratch.handed_out(0)) == {(0x10, "c"), (0x20, "c"), (0x10, "other")}
    assert stream_scratch.handed_out(1) == {}


def test_a_capture_takes_words_without_allocating_but_cannot_grow(fake):
    stream_scratch.reserve(0)
    fake.capturing = True
    for s in range(stream_scratch.POOL_WORDS):
        stream_scratch.words(0, s, "c")
    assert fake.zeros == 1
    with pytest.raises(RuntimeError, match="before capturing"):
        stream_scratch.words(0, 10**6, "c")
    fake.capturing = False
    w = stream_scratch.words(0, 10**6, "c")  # a second pool
    assert fake.zeros == 2 and w[0] == 0
    with pytest.raises(ValueError, match="1 to"):
        stream_scratch.words(0, 1, "big", stream_scratch.POOL_WORDS + 1)
