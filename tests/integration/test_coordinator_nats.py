"""The coordinator over real NATS and PostgreSQL, in this process: leases, transitions,
watermarks, redelivery, malformed input, restart by snapshot + replay."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import asyncpg
import msgspec
import nats
import pytest
from nats.js.api import AckPolicy, RetentionPolicy, StorageType
from structlog.testing import capture_logs

from coordinator.core import LedgerState, apply, decode_event, replay, resume, state_hash
from coordinator.app import COORDINATOR
from coordinator.nats_service import CONSUMER_NAME
from shared.messages import (
    Control, ControlAck, ErrorCode, ErrorReply, HeartbeatReply, LeaseGrant, LeaseReleased, LeaseRenewed, RegisterReply,
    ResumeReply, TransitionBatch, decode, encode,
)
from shared.subjects import Subjects
from shared.hashing import replica_digest
from shared.messages import WorkerResume
from tests.integration.coordinator_kit import CATALOGUE, NS, Worker, block, fast_config, running_coordinator
from worker.client.nats_adapter import NatsCoordinatorClient


async def _audit_clean(base: str) -> None:
    """The coordinator's audit of the log (workers not asked) finds nothing."""
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base}/v1/audit", json={"check_workers": False}) as r:
            report = await r.json()
    assert r.status == 200 and report["ok"], report


async def _folded(db: asyncpg.Connection) -> LedgerState:
    """The log as it stands, folded by the core."""
    return replay(decode_event(r["payload"]) for r in await db.fetch("SELECT payload FROM events ORDER BY position"))


async def test_lease_round_trip_is_answered_only_after_its_event_is_durable(
        database_url: str, nats_url: str, subjects: Subjects) -> None:
    cfg = fast_config(database_url, nats_url, subjects)
    async with running_coordinator(cfg):
        nc = await nats.connect(nats_url)
        db = await asyncpg.connect(database_url)
        try:
            w = Worker(nc, subjects)
            reg = await w.register()
            assert isinstance(reg, RegisterReply) and reg.epoch == 1 and reg.heartbeat_interval_ms == 200
            assert await db.fetchval("SELECT count(*) FROM events WHERE type = 'worker.registered'") == 1

            hb = await w.heartbeat()
            assert isinstance(hb, HeartbeatReply) and hb.committed_seq == 0

            hashes = [block(i) for i in range(3)]
            grant = await w.acquire(hashes)
            assert isinstance(grant, LeaseGrant)
            assert grant.usable_blocks == 0 and grant.write == {"compressed": [0, 1, 2]}
            # the grant, which allocates its writes itself, was in the log before the reply was sent
            stored = await db.fetch("SELECT type, payload::jsonb->'allocated' AS allocated FROM events "
                                    "WHERE stream_id = $1", f"lease:{grant.lease_id}")
            assert [(r["type"], r["allocated"]) for r in stored] == [("lease.granted", "true")]
            keys = [(bh, "compressed", "gpu:w1") for bh in hashes]
            assert {k: v.state.value for k, v in (await _folded(db)).replicas.items()} == dict.fromkeys(keys, "ALLOCATED")

            renewed = await w.renew(grant.lease_id)
            assert isinstance(renewed, LeaseRenewed) and renewed.lease_id == grant.lease_id
            released = await w.release(grant.lease_id)
            assert isinstance(released, LeaseReleased)
            # unfilled writes were aborted by the release (no event of their own)
            assert {k: v.state.value for k, v in (await _folded(db)).replicas.items()} == dict.fromkeys(keys, "EVICTED")
            assert await db.fetchval("SELECT count(*) FROM events WHERE type = 'replica.evicted'") == 0

            # group commit through the service: concurrent requests share transactions
            beats = await asyncio.gather(*[w.heartbeat() for _ in range(100)])
            assert all(isinstance(b, HeartbeatReply) for b in beats)
            transactions = await db.fetchval(
                "SELECT count(DISTINCT xmin::text) FROM events WHERE type = 'worker.heartbeat'")
            assert transactions < 50, f"100 concurrent heartbeats took {transactions} transactions"

            unknown = await w.renew(grant.lease_id)
            assert isinstance(unknown, ErrorReply) and unknown.code == ErrorCode.NOT_FOUND
            w.epoch = 99
            fenced = await w.heartbeat()
            assert isinstance(fenced, ErrorReply) and fenced.code == ErrorCode.FENCED
        finally:
            await db.close()
            await nc.drain()


async def test_transitions_are_acked_after_commit_watermarked_and_redelivery_absorbed(
        database_url: str, nats_url: str, subjects: Subjects) -> None:
    cfg = fast_config(database_url, nats_url, subjects)
    async with running_coordinator(cfg) as (app, base):
        nc = await nats.connect(nats_url)
        db = await asyncpg.connect(database_url)
        try:
            # the stream and consumer as stated: file storage, limits retention, configured
            # max age and duplicate window; explicit acks, unlimited redelivery
            js = nc.jetstream()
            stream = (await js.stream_info(subjects.stream_name)).config
            assert (stream.storage, stream.retention) == (StorageType.FILE, RetentionPolicy.LIMITS)
            assert (stream.max_age, stream.duplicate_window) == (cfg.nats.stream_max_age_s, cfg.nats.duplicate_window_s)
            consumer = (await js.consumer_info(subjects.stream_name, CONSUMER_NAME)).config
            assert (consumer.ack_policy, consumer.max_deliver) == (AckPolicy.EXPLICIT, -1)

            w = Worker(nc, subjects)
            await w.register()
            await w.watch_watermarks()
            hashes = [block(i) for i in range(20)]
            grant = await w.acquire(hashes)
            commits = [w.commit(hashes, i, grant.lease_id) for i in range(20)]
            for t in commits:
                await w.publish(t)
            await w.wait_watermark(20)
            # the watermark says durable: every one is in the log, exactly once
            rows = await db.fetch("SELECT source_id, type FROM events WHERE source_id IS NOT NULL ORDER BY position")
            assert [r["source_id"] for r in rows] == [t.source_id for t in commits]
            assert {r["type"] for r in rows} == {"transition.applied"}

            # redelivery: the broker drops a repeated Nats-Msg-Id; a fresh msg id reaches the
            # coordinator, which must absorb it (no second row, no state change)
            ledger = app[COORDINATOR].ledger
            duplicates = app[COORDINATOR].metrics.events_ingested.labels(result="duplicate")
            before = state_hash(ledger.state), ledger.position
            ack = await w.publish(commits[3])
            assert ack.duplicate
            await w.publish(commits[3], msg_id="redelivered-after-dedup-window")
            await w.publish(commits[4], msg_id="redelivered-2")
            await _until(lambda: duplicates._value.get() >= 2)
            assert (state_hash(ledger.state), ledger.position) == before
            assert await db.fetchval("SELECT count(*) FROM events WHERE source_id = $1", commits[3].source_id) == 1
            hb = await w.heartbeat()
            assert isinstance(hb, HeartbeatReply) and hb.committed_seq == 20

            # an illegal transition is recorded as rejected (and watermarked), never applied
            bad = w.commit(hashes, 0, grant.lease_id)  # block 0 is READY already
            await w.publish(bad)
            await w.wait_watermark(21)
            row = await db.fetchrow("SELECT type, stream_id FROM events WHERE source_id = $1", bad.source_id)
            assert (row["type"], row["stream_id"]) == ("transition.rejected", "worker:w1")

            await _audit_clean(base)
        finally:
            await db.close()
            await nc.drain()


async def test_a_workers_batch_of_transitions_is_judged_in_order_acked_once_and_deduplicated(
        database_url: str, nats_url: str, subjects: Subjects) -> None:
    # commit_batch_max 8: a 25-transition batch is decided in pieces, which must keep the order
    cfg = fast_config(database_url, nats_url, subjects, commit_batch_max=8)
    async with running_coordinator(cfg) as (app, base):
        nc = await nats.connect(nats_url)
        db = await asyncpg.connect(database_url)
        try:
            js = nc.jetstream()
            metrics = app[COORDINATOR].metrics
            w = Worker(nc, subjects)
            await w.register()
            await w.watch_watermarks()
            hashes = [block(i) for i in range(40)]
            grant = await w.acquire(hashes)
            commits = [w.commit(hashes, i, grant.lease_id) for i in range(40)]
            bad = w.commit(hashes, 0, grant.lease_id)  # block 0 is READY by then: rejected, in its place
            first = TransitionBatch(worker_id="w1", epoch=w.epoch, events=commits[:25])
            second = TransitionBatch(worker_id="w1", epoch=w.epoch, events=commits[25:] + [bad])
            for b in (first, second):
                await js.publish(subjects.events("w1"), encode(b), headers={"Nats-Msg-Id": b.source_id})
            await w.wait_watermark(41)
            rows = await db.fetch("SELECT source_id, type FROM events WHERE source_id IS NOT NULL ORDER BY position")
            assert [r["source_id"] for r in rows] == [t.source_id for t in commits + [bad]]
            assert [r["type"] for r in rows] == ["transition.applied"] * 40 + ["transition.rejected"]
            assert metrics.transition_messages._sum.get() == 41        # two messages, 41 transitions

            # the same batch again (a resend whose broker ack was lost, past the dedup window):
            # 25 duplicates, nothing changes, the message is acked (not redelivered forever)
            ledger = app[COORDINATOR].ledger
            duplicates = metrics.events_ingested.labels(result="duplicate")
            before = state_hash(ledger.state), ledger.position
            await js.publish(subjects.events("w1"), encode(first), headers={"Nats-Msg-Id": "again"})
            await _until(lambda: duplicates._value.get() >= 25)
            assert (state_hash(ledger.state), ledger.position) == before
            for _ in range(100):
                if (await js.consumer_info(subjects.stream_name, CONSUMER_NAME)).num_ack_pending == 0:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the repeated batch was never acked")

            # a batch is one identity's: on another worker's subject it is refused whole, and a
            # batch that carries another worker's transition does not decode
            forbidden = metrics.forbidden.labels(op="transition")
            malformed = metrics.malformed.labels(kind="transition")
            more = [w.commit(hashes, i, grant.lease_id, seq=100 + i) for i in range(2)]
            await js.publish(subjects.events("w2"), encode(TransitionBatch(worker_id="w1", epoch=w.epoch,
                                                                             events=more)))
            mixed = encode(TransitionBatch(worker_id="w1", epoch=w.epoch, events=more)).replace(
                b'"worker_id":"w1","epoch":%d,"seq":101' % w.epoch, b'"worker_id":"w2","epoch":%d,"seq":101' % w.epoch)
            assert mixed.count(b'"worker_id":"w2"') == 1
            await js.publish(subjects.events("w1"), mixed)
            await _until(lambda: forbidden._value.get() >= 1 and malformed._value.get() >= 1)
            assert ledger.position == before[1]
        finally:
            await db.close()
            await nc.drain()


async def test_the_watermark_names_a_refused_copy_to_the_host_tier(
        database_url: str, nats_url: str, subjects: Subjects) -> None:
    """Over real NATS and PostgreSQL: w1 copies two committed blocks to its host tier, one of them
    naming a checksum the ledger does not know; the watermark that covers both names the refused
    one (the worker drops those bytes), and only that one."""
    cfg = fast_config(database_url, nats_url, subjects)
    async with running_coordinator(cfg) as (app, base):
        nc = await nats.connect(nats_url)
        try:
            w1 = Worker(nc, subjects, "w1")
            await w1.register()
            await w1.watch_watermarks()
            hashes = [block(i) for i in range(2)]
            grant = await w1.fill(hashes)
            await w1.release(grant.lease_id)
            seqs = []
            for i, checksum in enumerate(("c0", "not-the-committed-one")):
                t = w1.commit(hashes, i, grant.lease_id)
                await w1.publish(msgspec.structs.replace(t, from_state=None, location="host:w1", lease_id="",
                                                         checksum=checksum, generation=0))
                seqs.append(t.seq)
            await w1.wait_watermark(w1.seq)
            assert w1.refused == [seqs[1]]
        finally:
            await nc.drain()


async def test_the_watermark_names_a_gpu_commit_refused_after_its_lease_ended(
        database_url: str, nats_url: str, subjects: Subjects) -> None:
    """Over real NATS and PostgreSQL: w1 commits one of a lease's two writes, releases the lease
    (a release after the worker's settle wait, the log out of reach meanwhile: the NATS-cluster
    drill) and then publishes the other commit: the release aborted that write, the commit is
    refused as stale, and the watermark names it (the worker frees the slot it filled), and only it."""
    cfg = fast_config(database_url, nats_url, subjects)
    async with running_coordinator(cfg) as (app, base):
        nc = await nats.connect(nats_url)
        try:
            w1 = Worker(nc, subjects, "w1")
            await w1.register()
            await w1.watch_watermarks()
            hashes = [block(i) for i in range(2)]
            grant = await w1.acquire(hashes)
            kept = w1.commit(hashes, 0, grant.lease_id)
            await w1.publish(kept)
            await w1.wait_watermark(kept.seq)
            await w1.release(grant.lease_id)
            late = w1.commit(hashes, 1, grant.lease_id)
            await w1.publish(late)
            await w1.wait_watermark(late.seq)
            assert w1.refused == [late.seq]
        finally:
            await nc.drain()


async def test_a_worker_that_disowns_its_replicas_takes_its_disk_copies_out_of_reuse(
        database_url: str, nats_url: str, subjects: Subjects) -> None:
    """Over real NATS and PostgreSQL: w1 copies its blocks to the shared disk and w2 reloads two
    of them into its GPU pool; w1 registers again disowning what it computed (its fused forwards
    differed): its copies and w2's reloads (the same bytes) are INVALID in the log, w2 is told to
    drop each reloaded block, its next lease reads nothing of them, the audit is clean."""
    cfg = fast_config(database_url, nats_url, subjects)
    async with running_coordinator(cfg) as (app, base):
        nc = await nats.connect(nats_url)
        db = await asyncpg.connect(database_url)
        try:
            w1, w2 = Worker(nc, subjects, "w1"), Worker(nc, subjects, "w2")
            for w in (w1, w2):
                await w.register()
                await w.watch_watermarks()
            told: list[str] = []

            async def on_control(msg: Any) -> None:
                told.extend(b.block_hash for b in decode(msg.data, expect=Control).blocks)
                await msg.respond(encode(ControlAck(worker_id="w2", affected=1)))
            await nc.subscribe(subjects.control("w2"), cb=on_control)
            hashes = [block(i) for i in range(3)]
            grant = await w1.fill(hashes)
            await w1.release(grant.lease_id)
            for i, bh in enumerate(hashes):
                t = w1.commit(hashes, i, grant.lease_id)
                await w1.publish(msgspec.structs.replace(t, from_state=None, location="disk", lease_id=""))
            await w1.wait_watermark(w1.seq)
            reload = await w2.acquire(hashes[:2])
            assert isinstance(reload, LeaseGrant) and {r.location for r in reload.read} == {"disk"}
            assert reload.write == {"compressed": [0, 1]}
            for i in range(2):                  # the same bytes (checksum) now in w2's GPU pool
                await w2.publish(w2.commit(hashes, i, reload.lease_id))
            await w2.wait_watermark(w2.seq)
            await w2.release(reload.lease_id)

            reply = await w1.register(disown_replicas=True)
            assert isinstance(reply, RegisterReply) and reply.epoch == 2 and reply.disowned == 5
            row = await db.fetchrow("SELECT payload::jsonb AS p FROM events WHERE type = 'invalidated'")
            assert sorted(tuple(k) for k in msgspec.json.decode(row["p"])["affected"]) == sorted(
                [(bh, "compressed", "disk") for bh in hashes] + [(bh, "compressed", "gpu:w2") for bh in hashes[:2]])
            await _until(lambda: len(told) >= 2)
            assert sorted(told) == sorted(hashes[:2])
            again = await w2.acquire(hashes, write=False)
            assert isinstance(again, ErrorReply) or not again.read, again
            await _audit_clean(base)
        finally:
            await db.close()
            await nc.drain()


async def test_a_burst_is_decided_in_bounded_passes_in_the_order_it_arrived(
        database_url: str, nats_url: str, subjects: Subjects) -> None:
    """100 acquires sent at once, decided 8 to a pass (``decide_pass_max``): each pass is submitted
    as soon as it is decided, so the first commits apart from the rest, and the log holds the
    grants in the order the requests were sent."""
    cfg = fast_config(database_url, nats_url, subjects, commit_batch_ms=0, decide_pass_max=8)
    async with running_coordinator(cfg) as (app, base):
        nc = await nats.connect(nats_url)
        db = await asyncpg.connect(database_url)
        ledger = app[COORDINATOR].ledger
        passes: list[int] = []
        execute_all = ledger.execute_all

        async def counted(decisions: Any) -> Any:
            passes.append(len(decisions))
            return await execute_all(decisions)
        try:
            w = Worker(nc, subjects)
            await w.register()
            ledger.execute_all = counted
            grants = await asyncio.gather(*[w.acquire([block(i)]) for i in range(100)])
            assert all(isinstance(g, LeaseGrant) and g.write == {"compressed": [0]} for g in grants)
            assert sum(passes) == 100 and max(passes) <= 8
            rows = await db.fetch("SELECT payload::jsonb->'block_hashes'->>0 AS first, xmin::text AS tx FROM events "
                                  "WHERE type = 'lease.granted' ORDER BY position")
            assert [r["first"] for r in rows] == [block(i) for i in range(100)]
            assert len({r["tx"] for r in rows}) >= 2
            await _audit_clean(base)
        finally:
            await db.close()
            await nc.drain()


async def test_a_batch_larger_than_a_nats_message_goes_out_in_ordered_parts(
        database_url: str, nats_url: str, subjects: Subjects) -> None:
    cfg = fast_config(database_url, nats_url, subjects)
    async with running_coordinator(cfg) as (app, base):
        nc = await nats.connect(nats_url)
        client = NatsCoordinatorClient(nats_url, subjects)
        await client.connect()
        try:
            w = Worker(nc, subjects)
            await w.register()
            await w.watch_watermarks()
            hashes = [block(i) for i in range(24)]
            grant = await w.acquire(hashes)
            # ~60 kB of reason each: ~1.4 MB in all, over the server's max_payload (1 MB by default)
            long = "r" * (nc.max_payload // 16)
            commits = [msgspec.structs.replace(w.commit(hashes, i, grant.lease_id), reason=long) for i in range(24)]
            await client.publish_batch(TransitionBatch(worker_id="w1", epoch=w.epoch, events=commits))
            await w.wait_watermark(24)
            db = await asyncpg.connect(database_url)
            try:
                rows = await db.fetch("SELECT source_id FROM events WHERE source_id IS NOT NULL ORDER BY position")
            finally:
                await db.close()
            assert [r["source_id"] for r in rows] == [t.source_id for t in commits]
            assert app[COORDINATOR].metrics.transition_messages._sum.get() == 24
            assert 2 <= sum(b.get() for b in app[COORDINATOR].metrics.transition_messages._buckets) <= 4
        finally:
            await client.close()
            await nc.drain()


async def test_malformed_requests_get_an_error_reply_and_a_warning_without_content(
        database_url: str, nats_url: str, subjects: Subjects) -> None:
    cfg = fast_config(database_url, nats_url, subjects)
    secret = "prompt text that must never reach a log"
    async with running_coordinator(cfg):
        nc = await nats.connect(nats_url)
        try:
            bad = [
                (subjects.request("acquire", "w"), b"\x00\xff not json"),
                (subjects.request("acquire", "w"), b'{"type": "worker.heartbeat", "v": 1, "worker_id": "w", "epoch": 1}'),
                (subjects.request("register", "w"), b'{"type": "worker.register", "v": 1, "worker_id": 7}'),
                (subjects.request("renew", "w"), ('{"type": "%s", "v": 1}' % secret).encode()),
                (subjects.request("heartbeat", "w"), b'{"type": "worker.heartbeat", "v": 999, "worker_id": "w", "epoch": 1}'),
                (subjects.request("release", "w"), b""),
                (subjects.request("heartbeat", "w"), b"[1, 2, 3]"),
            ]
            with capture_logs() as logs:
                for subject, data in bad:
                    reply = decode((await nc.request(subject, data, timeout=5)).data)
                    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.INVALID, (subject, reply)
            warnings = [e for e in logs if e["event"] == "malformed_request"]
            assert len(warnings) == len(bad)
            assert all(e["log_level"] == "warning" for e in warnings)
            assert secret not in repr(logs)
            assert {e["error_kind"] for e in warnings} >= {"not_json_object", "wrong_type", "invalid_fields",
                                                          "unknown_type", "bad_version"}
            # a malformed transition on the stream is terminated, logged, and does not stop the consumer
            js = nc.jetstream()
            await js.publish(subjects.events("w1"), secret.encode())
            w = Worker(nc, subjects)
            assert isinstance(await w.register(), RegisterReply)  # still alive and answering
        finally:
            await nc.drain()


async def test_restart_from_snapshot_and_tail_reproduces_the_state(
        database_url: str, nats_url: str, subjects: Subjects) -> None:
    cfg = fast_config(database_url, nats_url, subjects, snapshot_every_events=8)
    nc = await nats.connect(nats_url)
    try:
        async with running_coordinator(cfg) as (app, base):
            w = Worker(nc, subjects)
            await w.register()
            for n in range(4):
                hashes = [block(100 * n + i) for i in range(4)]
                grant = await w.acquire(hashes)
                for i in range(4):
                    await w.publish(w.commit(hashes, i, grant.lease_id))
            await _until(lambda: app[COORDINATOR].ledger.state.committed_seq("w1", 1) == 16)
            # 22 events so far with snapshot_every_events=8: periodic snapshots were taken
            await _until(lambda: app[COORDINATOR].metrics.snapshots._value.get() >= 2)
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{base}/v1/snapshot") as r:
                    snap = await r.json()
                assert r.status == 200 and snap["position"] > 0
            grant = await w.acquire([block(900)])  # a tail after the snapshot
            before = app[COORDINATOR].ledger
            position_before = before.position
        async with running_coordinator(cfg) as (app, base):
            ledger = app[COORDINATOR].ledger
            assert ledger.last_replay["snapshot_position"] == snap["position"]
            assert ledger.last_replay["position"] == position_before
            assert ledger.last_replay["events"] == position_before - snap["position"]
            # restart = the state before + the takeover's decisions (CoordinatorResumed, every live
            # epoch suspended), exactly
            for e in resume(before.state, ledger.state.resumed_at_ms):
                apply(before.state, e)
            assert state_hash(ledger.state) == state_hash(before.state)
            assert grant.lease_id in ledger.state.leases
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{base}/v1/audit", json={"check_workers": False}) as r:
                    from_empty = await r.json()
                async with http.post(f"{base}/v1/audit", json={"check_workers": False,
                                                               "replay_from": "snapshot"}) as r:
                    from_snapshot = await r.json()
            assert from_empty["ok"] and from_empty["replayed_events"] == ledger.position, from_empty
            assert from_snapshot["ok"] and from_snapshot["snapshot_position"] == snap["position"], from_snapshot
            assert from_empty["replay_hash"] == from_snapshot["replay_hash"] == state_hash(ledger.state)
    finally:
        await nc.drain()


async def test_a_silent_worker_is_suspended_then_declared_lost_by_periodic_expiry(
        database_url: str, nats_url: str, subjects: Subjects) -> None:
    # 600 ms of silence suspends; 600 ms more without a resume fences
    cfg = fast_config(database_url, nats_url, subjects, missed_heartbeats=3, lease_ttl_ms=500, resume_grace_ms=600)
    async with running_coordinator(cfg) as (app, base):
        nc = await nats.connect(nats_url)
        try:
            w = Worker(nc, subjects)
            await w.register()
            grant = await w.acquire([block(1), block(2)])
            assert isinstance(grant, LeaseGrant)
            ledger = app[COORDINATOR].ledger
            await _until(lambda: ledger.state.workers["w1"].suspended, timeout_s=5)
            assert ledger.state.workers["w1"].alive
            suspended = await w.heartbeat()
            assert isinstance(suspended, ErrorReply) and suspended.code == ErrorCode.SUSPENDED
            await _until(lambda: not ledger.state.workers["w1"].alive, timeout_s=5)
            assert grant.lease_id not in ledger.state.leases
            fenced = await w.heartbeat()
            assert isinstance(fenced, ErrorReply) and fenced.code == ErrorCode.FENCED
            refused = await w.resume()
            assert isinstance(refused, ErrorReply) and refused.code == ErrorCode.FENCED
            again = await w.register()
            assert again.epoch == 2
            kinds = [e["type"] for e in await _events(base) if e["stream_id"] == "worker:w1"]
            assert kinds == ["worker.registered", "worker.suspended", "worker.lost", "worker.registered"], kinds
        finally:
            await nc.drain()


async def test_heartbeats_are_soft_state_and_a_resumed_worker_keeps_its_cache(
        database_url: str, nats_url: str, subjects: Subjects) -> None:
    cfg = fast_config(database_url, nats_url, subjects)
    nc = await nats.connect(nats_url)
    try:
        async with running_coordinator(cfg) as (app, base):
            w = Worker(nc, subjects)
            await w.register()
            await w.watch_watermarks()
            hashes = [block(i) for i in range(3)]
            grant = await w.fill(hashes)                            # committed, acknowledged
            ledger = app[COORDINATOR].ledger
            assert ledger.state.committed_seq("w1", 1) == 3
            await w.release(grant.lease_id)
            head = ledger.position
            for _ in range(20):
                assert isinstance(await w.heartbeat(), HeartbeatReply)
            assert ledger.position == head                          # no event per heartbeat
        async with running_coordinator(cfg) as (app, base):         # a restart: w1 suspended
            ledger = app[COORDINATOR].ledger
            assert ledger.state.workers["w1"].suspended
            hb = await w.heartbeat()
            assert isinstance(hb, ErrorReply) and hb.code == ErrorCode.SUSPENDED
            reply = await w.resume()
            assert isinstance(reply, ResumeReply) and reply.kept == 3 and reply.drop == b"" and reply.epoch == 1, (
                reply, [(k, r.state, r.generation, r.checksum) for k, r in ledger.state.replicas.items()])
            again = await w.acquire(hashes + [block(7)])
            assert isinstance(again, LeaseGrant) and again.usable_blocks == 3
    finally:
        await nc.drain()


async def _events(base: str) -> list[dict]:  # type: ignore[type-arg]
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/v1/events", params={"limit": "500"}) as r:
            return (await r.json())["events"]  # type: ignore[no-any-return]


async def _until(cond, timeout_s: float = 10) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVL_ADMIN_TOKEN", raising=False)



async def test_a_large_inventory_resumes_in_parts(database_url: str, nats_url: str, subjects: Subjects) -> None:
    """The worker's NATS client splits an inventory larger than one message into ordered parts;
    the coordinator decides on the last; parts out of order are refused."""
    cfg = fast_config(database_url, nats_url, subjects)
    nc = await nats.connect(nats_url)
    client = NatsCoordinatorClient(nats_url, subjects, max_part_bytes=60)   # 5 digests per part
    try:
        async with running_coordinator(cfg) as (app, base):
            w = Worker(nc, subjects)
            await w.register()
            await w.watch_watermarks()
            await w.fill([block(i) for i in range(12)])            # all in the log before the restart
        async with running_coordinator(cfg) as (app, base):    # restarted: w1 suspended
            await client.connect()
            forged = replica_digest(block(99), "compressed", "gpu:w1", 1, "c99")
            held = b"".join(w.held.values()) + forged
            msg = WorkerResume(worker_id="w1", epoch=1, namespace=NS, catalogue=CATALOGUE,
                               pool_slots={"compressed": w.slots}, emitted_seq=w.seq, held=held)
            bad = await w.request(subjects.request("resume", "w1"), msgspec.structs.replace(msg, held=held[:40], part=1,
                                                                                 parts=3))
            assert isinstance(bad, ErrorReply) and bad.code == ErrorCode.INVALID and "out of order" in bad.message
            reply = await client.resume(msg)                      # 13 digests: 3 parts
            assert reply.complete and reply.kept == 12 and reply.drop == forged
            assert not app[COORDINATOR].ledger.state.workers["w1"].suspended
    finally:
        await client.close()
        await nc.drain()


async def test_a_reclaim_cut_short_after_its_delete_is_completed_by_the_next(
        database_url: str, nats_url: str, subjects: Subjects) -> None:
    """A reclaim that deleted the consumer and then timed out (a broker timeout right after a
    long stall) left none: every later fetch and reclaim failed and nothing was committed again
    (found by the stall-past-grace drill). The next reclaim creates it, and ingest goes on."""
    cfg = fast_config(database_url, nats_url, subjects)
    async with running_coordinator(cfg) as (app, base):
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            w = Worker(nc, subjects)
            await w.register()
            await w.watch_watermarks()
            hashes = [block(i) for i in range(4)]
            grant = await w.acquire(hashes)
            commits = [w.commit(hashes, i, grant.lease_id) for i in range(4)]
            await w.publish(commits[0])
            await w.wait_watermark(1)
            await js.delete_consumer(subjects.stream_name, CONSUMER_NAME)     # the cut-short reclaim's delete
            assert await app[COORDINATOR].service.reclaim_in_flight() == 0
            consumer = (await js.consumer_info(subjects.stream_name, CONSUMER_NAME)).config
            assert consumer.ack_policy == AckPolicy.EXPLICIT
            for t in commits[1:]:
                await w.publish(t)
            await w.wait_watermark(4)        # the first commit came again from the stream's start: absorbed
            await _audit_clean(base)
        finally:
            await nc.drain()
