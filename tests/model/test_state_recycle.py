"""Kept request-state buffers (``worker.model.recycle``): a state made on a dead state's buffer
computes the bits a fresh one does (its stale rows are never read), a buffer is kept only once no
view of it is alive, forks never share one, and the bound holds."""

from __future__ import annotations

import gc

import torch

import worker.model.dense.model as dm
from bench.model import dense_tiny
from worker.model.recycle import BufferRecycler, size_class


def _model(dtype=torch.float32):
    torch.set_num_threads(1)
    return dm.build_dense(dense_tiny("llama"), seed=4, dtype=dtype)


def _logits(model, tokens, capacity=512):
    st = model.new_state(16, capacity)
    out = [model.prefill(tokens, st, logits="last")]
    for t in (7, 9, 11):
        out.append(model.decode_step(t, st))
    return out, st


def test_a_state_on_a_kept_buffer_computes_a_fresh_states_bits():
    model = _model()
    g = torch.Generator().manual_seed(0)
    first, second = torch.randint(0, 200, (200,), generator=g), torch.randint(0, 200, (90,), generator=g)
    cold, st = _logits(model, second)
    del st
    model.recycler = BufferRecycler(2**30)
    _, st = _logits(model, first)       # fills a buffer with another request's rows
    del st
    assert model.recycler.kept_bytes > 0
    warm, st = _logits(model, second)   # made on that buffer: its stale rows lie past position 93
    assert model.recycler.reused == 1
    assert all(torch.equal(a, b) for a, b in zip(cold, warm))


def test_a_buffer_whose_view_outlives_its_state_is_not_kept():
    model = _model()
    model.recycler = BufferRecycler(2**30)
    st = model.new_state(16, 64)
    view = st.keys(0, 0, 16)[0]
    del st
    gc.collect()
    assert model.recycler.kept_bytes == 0
    del view
    st = model.new_state(16, 64)
    del st
    assert model.recycler.kept_bytes > 0


def test_a_fork_has_buffers_of_its_own_and_both_are_kept_when_they_end():
    model = _model()
    model.recycler = BufferRecycler(2**30)
    st = model.new_state(16, 64)
    model.prefill(torch.arange(20), st)
    child = st.fork()
    assert child._recycler is model.recycler
    assert child._k.data_ptr() != st._k.data_ptr()
    del st, child
    assert len(model.recycler._kept) == 2


def test_the_bound_drops_the_oldest_and_a_zero_bound_keeps_nothing():
    model = _model()
    model.recycler = BufferRecycler(2**30)
    one = 2 * model.new_state(16, 64)._k.nbytes        # a pair as the recycler makes them
    model.recycler = BufferRecycler(int(1.5 * one))
    states = [model.new_state(16, 64) for _ in range(3)]
    del states
    assert model.recycler.kept_bytes <= int(1.5 * one) and len(model.recycler._kept) == 1
    model.recycler = BufferRecycler(0)
    st = model.new_state(16, 64)
    del st
    assert model.recycler.kept_bytes == 0 and model.recycler.reused == 0


def test_new_buffers_have_headroom_for_the_next_turn_of_a_chat():
    assert [size_class(c) for c in (16, 256, 736, 960, 1184)] == [256, 512, 1280, 1536, 1792]
    model = _model()
    model.recycler = BufferRecycler(2**30)
    first = model.new_state(16, 736)
    assert first._k.shape[1] == 1280 and first.capacity == 736
    del first
    second = model.new_state(16, 960)          # the chat's next turn, longer: the same buffer
    assert model.recycler.reused == 1 and second.capacity == 960
    most = model.cfg.max_position_embeddings
    assert model.new_state(16, most)._k.shape[1] == most   # never past the model's positions
