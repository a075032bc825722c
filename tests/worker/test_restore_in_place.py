"""A validated hit read where the pool holds it (``cache.restore_in_place``): the dense state's
prefix table points at the pool's slots, each slot is pinned while the state reads it
(``worker.cache.pools.FormPool.pin``), and what a freed pinned slot held is never handed out
until the reader lets go — so a request reads the bytes it validated, bit for bit, whatever
the cache does meanwhile (evictions, a new epoch clearing every slot, new blocks filling it)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import worker.model.dense.model as dm
from bench.model import dense_tiny
from shared.ids import ROOT_HASH
from worker.cache.planner import BlockMeta
from worker.cache.pools import FormPool, PoolExhausted
from worker.cache.store import CacheStore
from worker.model.dense.state import KV
from worker.model.state import BlockPayload

BS = 16


def _pool(slots: int = 3) -> FormPool:
    model = _model()
    return FormPool(model.declare_forms(BS).forms[0], slots, torch.device("cpu"))


def test_a_pinned_slot_that_is_freed_is_not_handed_out_until_its_last_reader_lets_go():
    pool = _pool(2)
    slot, gen = pool.allocate("a" * 32)
    assert pool.hold(slot, gen + 1) is None                 # another generation: nothing held
    first = pool.hold(slot, gen)
    second = first.share()                                  # a fork reads it too
    pool.free(slot)                                         # evicted, fenced or cleared meanwhile
    assert pool.lookup("a" * 32) is None                    # no lookup finds it again at once
    other, _ = pool.allocate("b" * 32)
    assert other != slot
    with pytest.raises(PoolExhausted, match="still read by running requests"):
        pool.allocate("c" * 32)
    first.release()
    first.release()                                         # once only
    with pytest.raises(PoolExhausted):
        pool.allocate("c" * 32)
    second.release()
    assert pool.allocate("c" * 32)[0] == slot                # back with its last reader
    assert pool.pinned_slots == 0


def test_holds_from_two_threads_leave_the_free_list_whole():
    pool = _pool(64)
    slots = [pool.allocate(f"{i:032x}") for i in range(64)]
    holds = [pool.hold(s, g) for s, g in slots]
    done = threading.Event()

    def release():
        for h in holds:
            h.release()
        done.set()

    t = threading.Thread(target=release)
    t.start()
    for s, _ in slots:
        pool.free(s)
    t.join()
    assert done.is_set() and pool.pinned_slots == 0 and pool.used == 0


def _model(dtype=torch.float32):
    torch.set_num_threads(1)
    return dm.build_dense(dense_tiny("llama"), seed=4, dtype=dtype)


def _meta(model, hashes, i, payload_checksum="") -> BlockMeta:
    spec = model.declare_forms(BS).forms[0]
    return BlockMeta(namespace="ns", tenant="t", block_hash=hashes[i], parent_hash=hashes[i - 1] if i else ROOT_HASH,
                     token_start=i * BS, token_end=(i + 1) * BS, form=KV, spec_digest=spec.spec_digest,
                     checksum=payload_checksum, generation=0)


def _run(model, state, tokens):
    out = [model.prefill(tokens, state, logits="last")]
    for t in (7, 9, 11):
        out.append(model.decode_step(t, state))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_state_reading_pinned_slots_keeps_its_bits_while_the_cache_recycles_everything(dtype):
    model = _model(dtype)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 200, (5 * BS,), generator=g)
    hashes = [f"{i:032x}" for i in range(4)]
    # the first 4 blocks of the prompt, computed cold and put in a store of 6 slots
    cold = model.new_state(BS, 256)
    model.prefill(prompt[:4 * BS], cold, logits="last")
    catalogue = model.declare_forms(BS)
    store = CacheStore(catalogue, {KV: 6}, torch.device("cpu"))
    for i in range(4):
        store.install(_meta(model, hashes, i), cold.export_block(i)[KV])
    seen = store.observe_in_place(KV, hashes)
    layout = model.form_layouts(BS)[KV]
    blocks = [BlockPayload({KV: data.view(layout.dtype).reshape(layout.shape)}, {KV: layout.spec})
              for _, data, _ in seen]
    reads = [read for _, _, read in seen]

    want_state = model.new_state(BS, 256)
    want_state.restore(blocks, 4)                                   # copied (no hold)
    assert want_state.cached_in_place == 0

    state = model.new_state(BS, 256)
    assert state.reads_in_place
    state.restore(blocks, 4, hold=lambda i, form: store.hold(reads[i]))
    assert state.cached_in_place == 4 and store.pinned_slots() == 4
    twin = state.fork()                                             # a fork holds each slot once more

    # the cache moves on: a new epoch frees every slot, new blocks fill every free one with other bytes
    assert store.clear() == 4
    for i in range(2):
        store.install(_meta(model, [f"f{j:031x}" for j in range(2)], i),
                      torch.full((catalogue.forms[0].bytes_per_block,), 0x7F, dtype=torch.uint8))
    with pytest.raises(PoolExhausted):
        store.install(_meta(model, ["e" * 32], 0), torch.zeros(catalogue.forms[0].bytes_per_block, dtype=torch.uint8))

    rest = prompt[4 * BS:]
    want = _run(model, want_state, rest)
    got = _run(model, state, rest)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(torch.equal(a, b) for a, b in zip(want, _run(model, twin, rest)))
    del state
    gc.collect()
    assert store.pinned_slots() == 4                               # the fork still reads them
    twin.reset()
    assert store.pinned_slots() == 0
    store.install(_meta(model, ["e" * 32], 0), torch.zeros(catalogue.forms[0].bytes_per_block, dtype=torch.uint8))


def test_a_slot_taken_again_before_the_hold_is_copied_not_read_in_place():
    model = _model()
    prompt = torch.randint(0, 200, (2 * BS,), generator=torch.Generator().manual_seed(5))
    cold = model.new_state(BS, 128)
    model.prefill(prompt, cold, logits="last")
    catalogue = model.declare_forms(BS)
    store = CacheStore(catalogue, {KV: 2}, torch.device("cpu"))
    store.install(_meta(model, ["a" * 32], 0), cold.export_block(0)[KV])
    (_, data, read), = store.observe_in_place(KV, ["a" * 32])
    layout = model.form_layouts(BS)[KV]
    store.clear()                                                   # freed after validation, before the hold
    state = model.new_state(BS, 128)
    state.restore([BlockPayload({KV: data.view(layout.dtype).reshape(layout.shape)}, {KV: layout.spec})], 1,
                  hold=lambda i, form: store.hold(read))
    assert state.cached_in_place == 0 and store.pinned_slots() == 0


@pytest.mark.parametrize("kept_bytes,how,in_place", [(0, "auto", True), (2**30, "auto", False),
                                                     (2**30, "always", True), (0, "never", False)])
async def test_auto_reads_in_place_into_new_buffers_and_copies_into_kept_ones(tmp_path, kept_bytes, how, in_place):
    """``cache.restore_in_place``: ``auto`` reads a hit in place when the state's buffers are new
    (a copy would fault their pages in) and copies into buffers an ended request left (resident);
    the output is the same bits either way."""
    from tests.twin import InProcessCoordinator
    from tests.worker.conftest import config
    from worker.engine import Engine

    model = _model()
    toks = torch.randint(0, 200, (4 * BS + 3,), generator=torch.Generator().manual_seed(2)).tolist()
    cold = Engine(_model(), config(tmp_path / "cold"), None)      # the same weights, a recycler of its own
    engine = Engine(model, config(tmp_path, **{"cache.restore_in_place": how, "worker.kept_state_bytes": kept_bytes}),
                    InProcessCoordinator())
    await engine.start()
    try:
        await engine.generate(toks, max_tokens=2)
        warm = await engine.generate(toks[:3 * BS] + [5, 6, 7], max_tokens=2)
        assert warm.cached_tokens == 3 * BS
        want = await cold.generate(toks[:3 * BS] + [5, 6, 7], max_tokens=2)
        assert warm.tokens == want.tokens and torch.equal(warm.logits, want.logits)
        m = engine.metrics
        got = {h: m.value("kvl_worker_restored_blocks_total", {"how": h}) for h in ("in_place", "copied")}
        assert got["in_place" if in_place else "copied"] == 3, got
        assert m.value("kvl_worker_pinned_slots") == 0
    finally:
        await engine.stop()
        await cold.stop()
