"""Fixtures for the worker engine tests: the tiny model, configs, prompts, engines on the twin.

The tiny model is overhead-bound; one intra-op thread keeps it fast and steady on a shared
machine. Prompts are short (a few blocks) so the suite stays in seconds.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from shared.config import Config, parse_config
from tests.twin import InProcessCoordinator
from worker.engine import Engine
from worker.model import build_model

torch.set_num_threads(1)

BS = 16


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def config(tmp_path: Any = None, **over: Any) -> Config:
    """A small engine config; ``over`` maps dotted keys (``cache.chunk_blocks``) to values."""
    doc: dict[str, Any] = {
        "cache": {"chunk_blocks": 1, "host_tier_bytes": 4 * 2**20,
                  "offload_dir": str(tmp_path / "offload") if tmp_path is not None else ""},
        "worker": {"worker_id": "w1", "pool_bytes": 4 * 2**20, "outbox_resend_ms": 200},
        "coordinator": {"heartbeat_interval_ms": 100},
        "state_dir": str(tmp_path / "state") if tmp_path is not None else ".kvl-state",
    }
    for dotted, value in over.items():
        cur = doc
        *path, last = dotted.split(".")
        for p in path:
            cur = cur.setdefault(p, {})
        cur[last] = value
    return parse_config(doc)


@pytest.fixture(scope="session")
def model():
    return build_model(seed=0)


@pytest.fixture
def make_engine(model, tmp_path):
    """``async with make_engine(twin, **over) as engine``: a started engine, stopped afterwards."""

    @contextlib.asynccontextmanager
    async def make(twin: InProcessCoordinator | None, worker_id: str = "w1", **over: Any) -> AsyncIterator[Engine]:
        cfg = config(tmp_path, **{"worker.worker_id": worker_id, **over})
        engine = Engine(model, cfg, twin)
        await engine.start()
        try:
            yield engine
        finally:
            await engine.stop()

    return make


@pytest.fixture
async def reference(model, tmp_path):
    """``reference(**over)``: a cache-disabled engine, the cold run a warm result must equal bit for bit.

    Give it the same ``cache.chunk_blocks`` as the engine under test: the prefill schedule is
    part of what "cold" means.
    """
    made: list[Engine] = []

    def make(**over: Any) -> Engine:
        made.append(Engine(model, config(tmp_path, **over), None))
        return made[-1]

    yield make
    for e in made:
        await e.stop()


def core_accepts_lru_offload() -> bool:
    """Does the coordinator core accept an offload whose source replica was EVICTED by LRU?

    The worker copies an LRU victim to the host tier *after* the grant that evicted it (the
    grant is the first it hears of the eviction), so the offload's source is EVICTED(lru)
    by then. Tests that need that rule are expected to fail until the core has it.
    """
    from coordinator.core import LedgerState, acquire_lease, apply, ingest_transition, register_worker
    from shared.forms import FormCatalogue, FormScope, FormSpec
    from shared.messages import LeaseAcquire, ReplicaState, TransitionEvent, WorkerRegister

    ns, h1, h2 = "ab" * 16, "1" * 32, "2" * 32
    cat = FormCatalogue(model_id="m", block_size=4, forms=(
        FormSpec(name="compressed", scope=FormScope.FULL_HISTORY, bytes_per_block=8, dtype="float32"),))
    s = LedgerState.empty()

    def run(out):
        reply, events = out if isinstance(out, tuple) else (None, out)
        for e in events:
            apply(s, e)
        return reply, events

    run(register_worker(s, WorkerRegister(worker_id="w", namespace=ns, catalogue=cat,
                                          pool_slots={"compressed": 1}), 1))
    run(acquire_lease(s, LeaseAcquire(worker_id="w", epoch=1, namespace=ns, block_hashes=[h1],
                                      write_forms=["compressed"]), 2, "L1"))

    def t(seq, h, loc, frm, to, gen, lease=""):
        return TransitionEvent(worker_id="w", epoch=1, seq=seq, namespace=ns, block_hash=h, parent_hash="0" * 32,
                               form="compressed", location=loc, from_state=frm, to_state=to, generation=gen,
                               checksum="c" * 32, lease_id=lease, block_size=4)

    run(ingest_transition(s, t(1, h1, "gpu:w", ReplicaState.ALLOCATED, ReplicaState.READY, 1, "L1"), 3))
    from coordinator.core import release_lease
    from shared.messages import LeaseRelease
    run(release_lease(s, LeaseRelease(worker_id="w", epoch=1, lease_id="L1"), 4))
    run(acquire_lease(s, LeaseAcquire(worker_id="w", epoch=1, namespace=ns, block_hashes=[h2],
                                      write_forms=["compressed"]), 5, "L2"))
    _, events = run(ingest_transition(s, t(2, h1, "host:w", None, ReplicaState.READY, 0), 6))
    return type(events[0]).__name__ == "TransitionApplied"
