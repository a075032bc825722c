"""What request states cost in memory: ``CacheState.buffer_bytes`` (one state) and
``live_state_bytes`` (every live one, ``kvl_worker_state_bytes``)."""

from __future__ import annotations

import gc

import torch

import worker.model.dense.model as dm
from bench.model import dense_tiny
from worker.metrics import WorkerMetrics
from worker.model import build_model
from worker.model.recycle import BufferRecycler
from worker.model.state import live_state_bytes


def _dense(recycler=None):
    torch.set_num_threads(1)
    model = dm.build_dense(dense_tiny("llama"), seed=4, dtype=torch.float32)
    model.recycler = recycler
    return model


def test_a_dense_states_bytes_are_its_k_and_v_at_its_capacity():
    model = _dense()
    c = model.cfg
    st = model.new_state(16, 256)
    kv = 2 * c.num_hidden_layers * 256 * c.num_key_value_heads * c.head_dim * 4
    assert kv <= st.buffer_bytes <= kv + 256 // 16   # and its block flags, one byte each


def test_a_state_on_a_longer_kept_buffer_counts_the_whole_buffer():
    model = _dense(BufferRecycler(2**30))
    long = model.new_state(16, 1024)
    long_bytes = long.buffer_bytes
    del long
    gc.collect()
    short = model.new_state(16, 128)        # takes the 1,024-long buffer (worker.model.recycle)
    assert model.recycler.reused == 1
    assert short.buffer_bytes - 128 // 16 == long_bytes - 1024 // 16   # the same K/V; its own block flags


def test_live_state_bytes_follow_states_made_forked_and_collected():
    gc.collect()
    before = live_state_bytes()
    model = build_model(seed=0)             # the hybrid family: windows, entries, rings, halos
    a = model.new_state(16, 256)
    assert a.buffer_bytes > 0 and live_state_bytes() == before + a.buffer_bytes
    b = a.fork()
    assert b.buffer_bytes == a.buffer_bytes and live_state_bytes() == before + 2 * a.buffer_bytes
    metrics = WorkerMetrics()
    metrics.state_bytes.set_function(live_state_bytes)
    assert metrics.registry.get_sample_value("kvl_worker_state_bytes") == before + 2 * a.buffer_bytes
    del a, b
    gc.collect()
    assert live_state_bytes() == before
