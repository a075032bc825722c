"""Bounded streams and bounded amplification (issue 51, items 3 and 4), with a real coordinator,
PostgreSQL and nats-server.

* Junk: a worker floods its own subject with transitions the ledger refuses — 3,000 messages of
  one transition and three of 1,000. Every seq is still recorded (the watermark covers them all,
  so an honest worker's outbox would drop them), but the log holds a handful of
  ``transition.rejected`` rows whose counts sum to 6,000, not 6,000 rows; the audit (the log
  replayed from empty against the live state) stays clean.
* The stream has a byte cap, a message-size cap and, on nats-server ≥ 2.10, a per-worker message
  cap, all "discard new": over a cap the worker's publish fails with an error naming the limit,
  the transitions stay in its outbox, nothing already stored is dropped, and other workers are
  not affected by one worker's cap. A batch over the message-size cap is sent in halves.
* The leader purges what it has acknowledged (its transitions are in the log), so the caps bound
  the backlog rather than history.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import asyncpg
import msgspec
import nats
import pytest

from coordinator.app import COORDINATOR
from shared.config import Config, parse_config
from shared.embedded import EmbeddedNats
from shared.messages import ReplicaState, TransitionBatch, TransitionEvent, encode
from shared.subjects import Subjects
from tests.integration.coordinator_kit import NS, Worker, block, fast_config, running_coordinator
from worker.client import PublishFailed
from worker.client.nats_adapter import NatsCoordinatorClient


def _with(cfg: Config, **nats_keys: Any) -> Config:
    doc = msgspec.to_builtins(cfg)
    return parse_config({**doc, "nats": {**doc["nats"], **nats_keys}})


def junk(w: Worker, seq: int) -> TransitionEvent:
    """A commit of a block the worker never leased: refused ("stale: replica … is absent")."""
    return TransitionEvent(worker_id=w.worker_id, epoch=w.epoch, seq=seq, namespace=NS, block_hash=block(10**6 + seq),
                           parent_hash="0" * 32, token_start=0, token_end=16, form="compressed",
                           location=f"gpu:{w.worker_id}", from_state=ReplicaState.ALLOCATED,
                           to_state=ReplicaState.READY, generation=1, checksum="c", lease_id="l-none")


async def _audit_clean(base: str) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base}/v1/audit", json={"check_workers": False}) as r:
            report = await r.json()
    assert r.status == 200 and report["ok"], report


async def test_junk_transitions_become_a_handful_of_rows_with_their_counts(
        database_url: str, nats_url: str, subjects: Subjects) -> None:
    cfg = fast_config(database_url, nats_url, subjects)
    assert cfg.coordinator.rejection_interval_ms == 1000
    async with running_coordinator(cfg) as (app, base):
        nc = await nats.connect(nats_url)
        db = await asyncpg.connect(database_url)
        try:
            w = Worker(nc, subjects)
            await w.register()
            await w.watch_watermarks()
            js = nc.jetstream(timeout=10)
            # 3,000 messages of one refused transition each, published as fast as the broker takes them
            for lo in range(1, 3001, 250):
                await asyncio.gather(*(js.publish(subjects.events("w1"), encode(junk(w, s)))
                                       for s in range(lo, lo + 250)))
            # and the three messages of 1,000
            for lo in (3001, 4001, 5001):
                batch = TransitionBatch(worker_id="w1", epoch=w.epoch, events=[junk(w, s) for s in range(lo, lo + 1000)])
                await js.publish(subjects.events("w1"), encode(batch))
            await w.wait_watermark(6000, timeout_s=60)
            rows = await db.fetch("SELECT source_id, payload FROM events WHERE type = 'transition.rejected'")
            events = [json.loads(r["payload"]) for r in rows]
            assert len(rows) <= 12, f"{len(rows)} rows for 6,000 refused transitions"
            covered = sorted(s for e in events for s in
                             [e["transition"]["seq"], *(x for lo, hi in e.get("more", []) for x in range(lo, hi + 1))])
            assert covered == list(range(1, 6001))
            assert sum(e["count"] for e in events) == 6000
            assert {e["kind"] for e in events} == {"stale_state"}
            assert all(r["source_id"] == f"w1.{w.epoch}.{e['transition']['seq']}" for r, e in zip(rows, events))
            assert app[COORDINATOR].metrics.events_ingested.labels(result="rejected")._value.get() == 6000
            # what an honest worker relies on: its next transition is judged as usual
            await w.fill([block(1)])
            await _audit_clean(base)
        finally:
            await db.close()
            await nc.drain()


async def test_a_burst_of_refusals_waits_for_one_row_and_audits_stay_clean(
        database_url: str, nats_url: str, subjects: Subjects) -> None:
    """The first refusal of a quiet worker epoch and kind is logged at once; the burst after it is
    held (neither applied nor logged, its messages not acked) and logged as one row when the
    interval ends — an audit in between (the live state replayed from the log) sees no difference."""
    cfg = fast_config(database_url, nats_url, subjects, rejection_interval_ms=1500)
    async with running_coordinator(cfg) as (app, base):
        nc = await nats.connect(nats_url)
        db = await asyncpg.connect(database_url)
        try:
            w = Worker(nc, subjects)
            await w.register()
            await w.watch_watermarks()
            js = nc.jetstream(timeout=10)
            await js.publish(subjects.events("w1"), encode(junk(w, 1)))
            await w.wait_watermark(1)                  # at once: nothing of its kind in the interval
            await asyncio.gather(*(js.publish(subjects.events("w1"), encode(junk(w, s))) for s in range(2, 201)))
            ledger = app[COORDINATOR].ledger
            deadline = asyncio.get_running_loop().time() + 5
            while sum(len(v) for v in ledger.rejections.held.values()) < 199:
                assert asyncio.get_running_loop().time() < deadline, "the burst was not held"
                await asyncio.sleep(0.02)
            assert w.watermark == 1 and ledger.state.committed_seq("w1", w.epoch) == 1
            await _audit_clean(base)                   # held: in neither the live state nor the log
            await w.wait_watermark(200, timeout_s=10)
            rows = await db.fetch("SELECT payload FROM events WHERE type = 'transition.rejected' ORDER BY position")
            assert [(json.loads(r["payload"])["count"], json.loads(r["payload"])["more"]) for r in rows] == \
                [(1, []), (199, [[3, 200]])]
            await _audit_clean(base)
        finally:
            await db.close()
            await nc.drain()


@pytest.fixture(scope="module")
def nats210(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """The pip package's nats-server (≥ 2.10: per-subject discard new), without users."""
    srv = EmbeddedNats(tmp_path_factory.mktemp("nats-bounds")).start()
    yield srv
    srv.stop()


async def _client(url: str, subjects: Subjects) -> NatsCoordinatorClient:
    c = NatsCoordinatorClient(url, subjects, timeout_s=2.0)
    await c.connect()
    return c


async def test_a_worker_over_its_cap_gets_an_error_and_loses_nothing(
        nats210: EmbeddedNats, database_url: str, subjects: Subjects) -> None:
    cfg = _with(fast_config(database_url, nats210.url, subjects), stream_max_msgs_per_worker=5,
                stream_purge_interval_s=0)
    async with running_coordinator(cfg) as (app, base):
        client, other = await _client(nats210.url, subjects), await _client(nats210.url, subjects)
        try:
            service = app[COORDINATOR].service
            info = await service.js.stream_info(subjects.stream_name)
            assert (info.config.max_msgs_per_subject, info.config.discard_new_per_subject) == (5, True)
            assert (info.config.max_bytes, info.config.max_msg_size) == (1 << 30, 1 << 20)
            assert getattr(info.config.discard, "value", info.config.discard) == "new"
            w, w2 = Worker(client.nc, subjects, worker_id="w1"), Worker(other.nc, subjects, worker_id="w2")
            for x in (w, w2):
                await x.register()
                await x.watch_watermarks()
            hashes = [block(i) for i in range(1, 9)]
            grant = await w.acquire(hashes)
            commits = [w.commit(hashes, i, grant.lease_id) for i in range(8)]
            for t in commits[:5]:
                await client.publish(t)
            await w.wait_watermark(5)
            # the sixth message: over w1's cap (acknowledged messages stay until a purge)
            with pytest.raises(PublishFailed, match="maximum messages per subject exceeded"):
                await client.publish(commits[5])
            # w2 is not held to w1's cap
            await w2.fill([block(100)])
            # a purge of what is acknowledged makes room; the refused transition goes through
            assert await service.purge_acknowledged() == 7     # w1's five and w2's one were acknowledged
            for t in commits[5:]:
                await client.publish(t)
            await w.wait_watermark(8)
            info = await service.js.stream_info(subjects.stream_name)
            assert info.state.first_seq == 7     # nothing was discarded: only purged after its ack
            assert app[COORDINATOR].metrics.stream_purged._value.get() == 6
            await _audit_clean(base)
        finally:
            await client.close()
            await other.close()


async def test_the_byte_cap_refuses_new_messages_never_drops_old_ones(
        database_url: str, nats_url: str, subjects: Subjects) -> None:
    cfg = _with(fast_config(database_url, nats_url, subjects), stream_max_bytes=16 * 1024, stream_purge_interval_s=0)
    async with running_coordinator(cfg) as (app, _):
        client = await _client(nats_url, subjects)
        try:
            w = Worker(client.nc, subjects, worker_id="w1")
            await w.register()
            await w.watch_watermarks()
            hashes = [block(i) for i in range(1, 61)]
            grant = await w.acquire(hashes)
            sent = 0
            ids = [client.msg_id(f"w1.{w.epoch}.{s}") for s in range(1, 61)]
            with pytest.raises(PublishFailed, match="maximum bytes exceeded"):
                for i in range(60):
                    await client.publish(w.commit(hashes, i, grant.lease_id, seq=i + 1))
                    sent += 1
            assert 5 < sent < 60
            # the refused message's id may have been seen on the bus without being stored: from now
            # on the client's ids are new ones (worker/client/nats_adapter.py), so none seen can pre-empt it
            assert all(client.msg_id(f"w1.{w.epoch}.{s}") != ids[s - 1] for s in range(1, 61))
            await w.wait_watermark(sent)
            info = await app[COORDINATOR].service.js.stream_info(subjects.stream_name)
            assert (info.state.first_seq, info.state.messages) == (1, sent)
            # the leader's purge of what it acknowledged frees the stream; the refused one goes through
            await app[COORDINATOR].service.purge_acknowledged()
            await client.publish(w.commit(hashes, sent, grant.lease_id, seq=sent + 1))
            await w.wait_watermark(sent + 1)
        finally:
            await client.close()


async def test_a_batch_over_the_message_size_cap_is_sent_in_halves(
        database_url: str, nats_url: str, subjects: Subjects) -> None:
    cfg = _with(fast_config(database_url, nats_url, subjects), stream_max_msg_bytes=4096)
    async with running_coordinator(cfg):
        client = await _client(nats_url, subjects)
        try:
            w = Worker(client.nc, subjects, worker_id="w1")
            await w.register()
            await w.watch_watermarks()
            hashes = [block(i) for i in range(1, 41)]
            grant = await w.acquire(hashes)
            batch = TransitionBatch(worker_id="w1", epoch=w.epoch,
                                    events=[w.commit(hashes, i, grant.lease_id) for i in range(40)])
            assert len(encode(batch)) > 4096
            await client.publish_batch(batch)
            await w.wait_watermark(40)
        finally:
            await client.close()


async def test_the_leader_purges_what_it_has_logged(database_url: str, nats_url: str, subjects: Subjects) -> None:
    cfg = _with(fast_config(database_url, nats_url, subjects), stream_purge_interval_s=1)
    async with running_coordinator(cfg) as (app, _):
        client = await _client(nats_url, subjects)
        try:
            w = Worker(client.nc, subjects, worker_id="w1")
            await w.register()
            await w.watch_watermarks()
            await w.fill([block(i) for i in range(1, 11)])
            js = app[COORDINATOR].service.js
            deadline = asyncio.get_running_loop().time() + 10
            while (await js.stream_info(subjects.stream_name)).state.messages:
                assert asyncio.get_running_loop().time() < deadline, "acknowledged messages not purged in 10 s"
                await asyncio.sleep(0.2)
            assert app[COORDINATOR].metrics.stream_purged._value.get() == 10
        finally:
            await client.close()
