"""The replay phases' log: a legal event log made by the real core commands (:class:`LogBuilder`),
bulk-loaded into a database with a snapshot near its end (:func:`build_log`). Also used by
``bench.core_instructions``, ``bench.snapshot`` and ``bench.archive``."""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from typing import Any

from bench.coordinator.harness import COLUMNS, NS, catalogue, h, log
from bench.coordinator.synthetic_worker import commit_transition
from coordinator.log.chain import GENESIS, link


class LogBuilder:
    """A legal log made by the real core commands, one simulated request at a time.

    Each request: a 32-block prompt; half of them share a prefix (8–24 blocks) with one of
    the last 8 prompts (read pins), the rest of the blocks are written (write grant, LRU
    eviction once the 512-slot pool is full, commit transitions through the worker
    transition path), then the lease is released. A heartbeat every simulated second (answered
    by the core with no event: heartbeats are soft state, so the log holds none).

    The pool is small (512 slots) so that it is full after a few requests, and the workload is
    then the steady state of a busy worker: every block a grant writes evicts one (the victims
    come from the pool's LRU index). The log is ~92% commit transitions; each grant carries its
    victims, pins and allocations.
    """

    def __init__(self, params: Any, *, pool_slots: int = 512, prompt_blocks: int = 32, seed: int = 3) -> None:
        from coordinator import core
        from shared import messages
        self.core, self.m = core, messages
        self.state = core.LedgerState.empty(params)
        self.rng = random.Random(seed)
        self.pool_slots = pool_slots
        self.prompt_blocks = prompt_blocks
        self.now = self.last_heartbeat = messages.now_ms() - 3_600_000
        self.epoch = 0
        self.seq = 0
        self.next_block = 1
        self.requests = 0
        self.recent: deque[list[str]] = deque(maxlen=8)
        self.worker = "replayw"

    def _apply(self, events: list[Any]) -> list[Any]:
        apply = self.core.apply
        for e in events:
            apply(self.state, e)
        return events

    def start(self) -> list[Any]:
        reply, evs = self.core.register_worker(self.state, self.m.WorkerRegister(
            worker_id=self.worker, namespace=NS, catalogue=catalogue(),
            pool_slots={"compressed": self.pool_slots}), self.now)
        self.epoch = reply.epoch
        return self._apply(evs)

    def request(self) -> list[Any]:
        core, m = self.core, self.m
        out: list[Any] = []
        self.requests += 1
        self.now += 3
        if self.now - self.last_heartbeat >= 1000:
            self.last_heartbeat = self.now
            _, evs = core.heartbeat(self.state, m.Heartbeat(worker_id=self.worker, epoch=self.epoch), self.now)
            out += self._apply(evs)
        n = self.prompt_blocks
        if self.recent and self.rng.random() < 0.5:
            base = self.rng.choice(self.recent)
            k = self.rng.randint(8, 24)
            hashes = base[:k]
        else:
            hashes = []
        while len(hashes) < n:
            hashes.append(h(self.next_block))
            self.next_block += 1
        self.recent.append(hashes)
        lease_id = f"l{self.requests:015x}"
        reply, evs = core.acquire_lease(self.state, m.LeaseAcquire(
            worker_id=self.worker, epoch=self.epoch, request_id=f"q{self.requests}", namespace=NS,
            block_hashes=hashes, write_forms=["compressed"], reuse=True), self.now, lease_id)
        if not isinstance(reply, m.LeaseGrant):
            raise RuntimeError(f"log builder: acquire refused: {reply}")
        out += self._apply(evs)
        self.now += 1
        for i in reply.write.get("compressed", []):
            self.seq += 1
            t = commit_transition(self.epoch, self.seq, hashes, i, lease_id, self.now, self.worker)
            out += self._apply(core.ingest_transition(self.state, t, self.now))
        self.now += 1
        _, evs = core.release_lease(self.state, m.LeaseRelease(worker_id=self.worker, epoch=self.epoch,
                                                               lease_id=lease_id), self.now)
        return out + self._apply(evs)


async def build_log(db_url: str, n: int, tail: int, pool_slots: int = 512) -> dict[str, Any]:
    """Write a ~``n``-event log (and a snapshot ``tail`` events before its end) into ``db_url``;
    the simulated worker has ``pool_slots`` slots."""
    import asyncpg

    from coordinator.core import CoreParams, state_hash, to_snapshot
    from coordinator.core.lifecycle import LIVE
    from coordinator.ledger import to_new_event
    from coordinator.log.migrate import upgrade
    from coordinator.log.postgres import PgSettings, create_engine

    engine = create_engine(PgSettings(url=db_url))
    try:
        await upgrade(engine)
    finally:
        await engine.dispose()
    b = LogBuilder(CoreParams(), pool_slots=pool_slots)
    heads: dict[str, int] = {}
    chain = [GENESIS]   # the log's chain head (coordinator.log.chain), as the coordinator's writer keeps it
    counts: dict[str, int] = {}
    snap: list[Any] = []
    first = b.start()
    pos = 0

    def generate(limit: int) -> list[tuple[Any, ...]]:
        """The next events (whole requests) up to ``limit`` in all, as COPY rows; takes the snapshot."""
        nonlocal first
        rows: list[tuple[Any, ...]] = []
        at = pos
        while at < limit:
            if not snap and at >= n - tail:
                snap.extend((at, state_hash(b.state), to_snapshot(b.state), len(b.state.replicas),
                             sum(r.state in LIVE for r in b.state.replicas.values()), chain[0]))
            for e in first or b.request():
                ne = to_new_event(e)
                v = heads.get(ne.stream_id, 0) + 1
                heads[ne.stream_id] = v
                counts[ne.type] = counts.get(ne.type, 0) + 1
                at += 1
                chain[0] = link(chain[0], at, 1, ne.stream_id, ne.type, ne.source_id, ne.payload)
                rows.append((at, ne.stream_id, v, ne.source_id, ne.type, ne.payload.decode(), 1, chain[0]))
            first = []
        return rows

    conn = await asyncpg.connect(db_url)
    t0 = time.perf_counter()
    try:
        await conn.execute("UPDATE leader SET leader_epoch = 1, holder = 'bench.coordinator log builder'")
        # The core generates the next chunk (in a thread) while the previous one is copied in.
        chunk = 25_000
        copying: asyncio.Task[Any] | None = None
        while pos < n:
            rows = await asyncio.to_thread(generate, min(pos + chunk, n))
            if copying is not None:
                await copying
            pos += len(rows)
            copying = asyncio.create_task(conn.copy_records_to_table("events", records=rows, columns=COLUMNS))
            if pos % 100_000 < chunk or pos >= n:
                log(f"replay: log at {pos:,} events ({pos / (time.perf_counter() - t0):,.0f}/s generated and copied)")
        if copying is not None:
            await copying
        build_s = time.perf_counter() - t0
        await conn.execute("INSERT INTO snapshots (position, state_hash, state, leader_epoch, chain_hash) "
                           "VALUES ($1, $2, $3, 1, $4)", *snap[:3], snap[5])
        await conn.execute("ANALYZE events")
    finally:
        await conn.close()
    return {"events": pos, "state_hash": state_hash(b.state), "snapshot_position": snap[0],
            "snapshot_bytes": len(snap[2]), "snapshot_replicas": snap[3], "snapshot_live_replicas": snap[4],
            "requests": b.requests, "replicas": len(b.state.replicas),
            "build_per_s": pos / build_s, "mix": {k: round(v / pos, 3) for k, v in sorted(counts.items())}}
