"""Phases of ``bench.coordinator``: durable ingest through the worker's publisher, the same
unbatched, and the drain of a backlog after a restart — each against ``COPY`` of the same rows."""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.coordinator.harness import (
    COLUMNS, SETUP_LEASE_BLOCKS, CoordinatorProc, append_delta, cpu_delta, cpu_seconds, h, log,
)
from bench.coordinator.synthetic_worker import BenchWorker, commit_transition
from coordinator.log.chain import GENESIS, link


async def copy_baseline(db_url: str, rows: list[tuple[Any, ...]], tag: str) -> float:
    """Seconds to COPY ``rows`` into a fresh ``LIKE events INCLUDING ALL`` table (then dropped)."""
    import asyncpg
    conn = await asyncpg.connect(db_url)
    table = f"bench_copy_{tag}"
    try:
        await conn.execute(f"CREATE TABLE {table} (LIKE events INCLUDING ALL)")
        t0 = time.perf_counter()
        await conn.copy_records_to_table(table, records=rows, columns=COLUMNS)
        dt = time.perf_counter() - t0
        await conn.execute(f"DROP TABLE {table}")
        return dt
    finally:
        await conn.close()


async def grant_writes(w: BenchWorker, hashes: list[str], what: str) -> tuple[list[tuple[str, list[str]]], float]:
    """Write leases on ``hashes`` (``SETUP_LEASE_BLOCKS`` per lease): ``[(lease id, its blocks)]``
    and the seconds it took."""
    from shared.messages import ErrorReply, LeaseGrant

    n = len(hashes)
    log(f"{what}: granting write leases on {n} blocks ({SETUP_LEASE_BLOCKS} per lease) ...")
    t0 = time.perf_counter()
    leases: list[tuple[str, list[str]]] = []
    for k in range(0, n, SETUP_LEASE_BLOCKS):
        chunk = hashes[k:k + SETUP_LEASE_BLOCKS]
        g = await w.request(w.subjects.request("acquire", w.worker_id), w.acquire(chunk, write=True, reuse=False))
        if isinstance(g, ErrorReply) or not isinstance(g, LeaseGrant):
            raise RuntimeError(f"setup lease refused: {g}")
        if g.write.get("compressed") != list(range(len(chunk))):
            raise RuntimeError(f"setup lease granted {len(g.write.get('compressed', []))} of {len(chunk)} writes")
        leases.append((g.lease_id, chunk))
    setup_s = time.perf_counter() - t0
    log(f"{what}: {n} ALLOCATED replicas in {setup_s:.1f} s ({n / setup_s:,.0f} grants/s, setup only)")
    return leases, setup_s


def commits(w: BenchWorker, leases: list[tuple[str, list[str]]], seq0: int
            ) -> tuple[list[tuple[bytes, str]], list[tuple[Any, ...]]]:
    """The commit transition of every block of ``leases`` (seqs from ``seq0 + 1``), encoded with its
    source id, and the row the coordinator will store for each (for the COPY baseline)."""
    from coordinator.core.events import TransitionApplied
    from coordinator.ledger import to_new_event
    from shared.messages import encode, now_ms

    ts = now_ms()
    msgs: list[tuple[bytes, str]] = []
    rows: list[tuple[Any, ...]] = []
    chained = GENESIS   # the baseline stores the chain hash too (the coordinator's rows carry one)
    seq = seq0
    for lease_id, chunk in leases:
        for i in range(len(chunk)):
            seq += 1
            t = commit_transition(w.epoch, seq, chunk, i, lease_id, ts, w.worker_id)
            msgs.append((encode(t), t.source_id))
            # exactly what the coordinator will store for it
            ne = to_new_event(TransitionApplied(transition=t, kind="commit", at_ms=ts))
            chained = link(chained, seq, 1, ne.stream_id, ne.type, ne.source_id, ne.payload)
            rows.append((seq, ne.stream_id, 2, ne.source_id, ne.type, ne.payload.decode(), 1, chained))
    return msgs, rows


async def publish_all(nc: Any, subject: str, msgs: list[tuple[bytes, str]]) -> float:
    """Publish ``msgs`` to JetStream, pipelined, each with its source id as ``Nats-Msg-Id``; seconds
    until JetStream has stored them all."""
    js = nc.jetstream(timeout=30, publish_async_max_pending=4000)
    futs = []
    t0 = time.perf_counter()
    for data, sid in msgs:
        futs.append(await js.publish_async(subject, data, headers={"Nats-Msg-Id": sid}))
    await js.publish_async_completed()
    bad = [f for f in futs if f.exception() is not None]
    if bad:
        raise RuntimeError(f"{len(bad)} publishes failed: {bad[0].exception()}")
    return time.perf_counter() - t0


async def worker_publish(nats_url: str, w: BenchWorker, events: list[Any], batch: int) -> tuple[float, int]:
    """``events`` (the worker's next seqs) through the worker's own path: its outbox and
    :class:`worker.publisher.TransitionPublisher` (``batch`` transitions per JetStream message,
    each message's broker ack awaited before the next) over its NATS client. Seconds from the
    first emit until the commit watermark covers the last, and the messages sent."""
    from worker.client.nats_adapter import NatsCoordinatorClient
    from worker.metrics import WorkerMetrics
    from worker.publisher import TransitionPublisher

    client = NatsCoordinatorClient(nats_url, w.subjects, timeout_s=30, name="bench.coordinator worker path")
    await client.connect()
    metrics = WorkerMetrics()
    pub = TransitionPublisher(client, capacity=len(events) + 1, resend_ms=600_000, metrics=metrics, batch=batch)
    pub.new_epoch(w.worker_id, w.epoch)
    seq0 = events[0].seq - 1
    assert pub.outbox is not None
    pub.outbox.next_seq, pub.outbox.watermark = seq0 + 1, seq0
    try:
        t0 = time.perf_counter()
        for ev in events:
            pub.emit(lambda seq, ev=ev: ev)
        while await pub.publish_due():
            pass
        await w.wait_watermark(events[-1].seq, timeout_s=max(120, len(events) / 500))
        t = time.perf_counter() - t0
    finally:
        await client.close()
    w.emitted_seq = max(w.emitted_seq, events[-1].seq)
    return t, int(metrics.published_messages._value.get())


async def ingest_phase(nc: Any, nats_url: str, coord: CoordinatorProc, w: BenchWorker, db_url: str,
                       n: int) -> dict[str, Any]:
    """Durable ingest of ``n`` commit transitions through the worker's own path with its default
    batching (:func:`worker_publish`); baseline COPY of the rows the coordinator stores."""
    from shared.config import WorkerConfig
    from shared.messages import decode

    batch = WorkerConfig().publish_batch
    hashes = [h(i + 1) for i in range(n)]
    leases, setup_s = await grant_writes(w, hashes, "ingest")
    msgs, rows = commits(w, leases, w.emitted_seq)
    msg_bytes = statistics.fmean(len(m) for m, _ in msgs)
    row_bytes = statistics.fmean(len(r[5]) for r in rows)

    log(f"ingest: baseline COPY of {n} rows ({row_bytes:.0f}-byte payloads) ...")
    copy1 = await copy_baseline(db_url, rows, "before")
    log(f"ingest: COPY {n / copy1:,.0f} rows/s")

    log(f"ingest: {n} commit transitions ({msg_bytes:.0f} bytes each) through the worker's publisher, "
         f"{batch} per message ...")
    seq0 = w.emitted_seq
    st0 = await coord.append_stats()
    with coord.spy("ingest"):
        cpu0 = cpu_seconds(coord.pid)
        t_ingest, sent = await worker_publish(nats_url, w, [decode(m) for m, _ in msgs], batch)
    cpu = cpu_delta(cpu0, cpu_seconds(coord.pid), n, "ingest")
    log(f"ingest: watermark {w.emitted_seq} after {t_ingest:.2f} s ({sent} messages): {n / t_ingest:,.0f} "
         "events/s durable")
    w.note_committed([(bh, seq0 + k + 1) for k, bh in enumerate(bh for _, chunk in leases for bh in chunk)])
    appends = append_delta(st0, await coord.append_stats(), "ingest", t_ingest)
    log(f"ingest: {appends}; {cpu}")

    copy2 = await copy_baseline(db_url, rows, "after")
    log(f"ingest: COPY (again) {n / copy2:,.0f} rows/s")

    # Put the log back as a worker would leave it: every lease released (nothing to abort).
    for lease_id, _ in leases:
        await w.request(w.subjects.request("release", w.worker_id), w.release(lease_id))

    copy_rate = statistics.fmean([n / copy1, n / copy2])
    rate = n / t_ingest
    return {
        "ingest_events": n, "ingest_events_per_s": round(rate), "ingest_seconds": round(t_ingest, 3),
        "ingest_publish_batch": batch, "ingest_messages": sent, "ingest_message_bytes": round(msg_bytes),
        "ingest_payload_bytes": round(row_bytes),
        "copy_rows_per_s": round(copy_rate), "copy_rows_per_s_before": round(n / copy1),
        "copy_rows_per_s_after": round(n / copy2),
        "ingest_ratio_vs_copy": round(rate / copy_rate, 3),
        "ingest_setup_grants_per_s": round(n / setup_s), **appends, **cpu,
        "_hashes": hashes,
    }


#: Block numbers of the ingest comparison's blocks (apart from the others').
INGEST_CMP_BLOCK0 = 1 << 37


async def ingest_compare_phase(nc: Any, nats_url: str, coord: CoordinatorProc, w: BenchWorker, n_single: int,
                               n_old: int, batched_rate: float, copy_rate: float) -> dict[str, Any]:
    """The same ingest without the worker's batching, on fresh blocks, after the lease phase (so
    that phase's state is what it was before the comparison existed): ``n_single`` transitions
    one message each, pipelined (``publish_async``: the coordinator's per-message cost), then
    ``n_old`` through the worker's publisher one message each (the worker's path before batching:
    one broker round trip per transition)."""
    from shared.messages import decode

    hashes = [h(INGEST_CMP_BLOCK0 + i) for i in range(n_single + n_old)]
    leases, _ = await grant_writes(w, hashes, "ingest (unbatched)")
    seq0 = w.emitted_seq
    msgs, _ = commits(w, leases, seq0)
    log(f"ingest (unbatched): {n_single} transitions, one message each, pipelined (publish_async) ...")
    cpu0 = cpu_seconds(coord.pid)
    t0 = time.perf_counter()
    t_pub = await publish_all(nc, w.subjects.events(w.worker_id), msgs[:n_single])
    w.emitted_seq = seq0 + n_single
    await w.wait_watermark(w.emitted_seq, timeout_s=max(120, n_single / 500))
    t_single = time.perf_counter() - t0
    cpu = cpu_delta(cpu0, cpu_seconds(coord.pid), n_single, "ingest_single")
    log(f"ingest (unbatched): one per message: {n_single / t_single:,.0f} events/s durable; {cpu}")
    log(f"ingest (unbatched): {n_old} through the worker's publisher one message each (as before batching) ...")
    t_old, _ = await worker_publish(nats_url, w, [decode(m) for m, _ in msgs[n_single:]], 1)
    log(f"ingest (unbatched): worker path one message each: {n_old / t_old:,.0f} events/s durable")
    w.note_committed([(bh, seq0 + k + 1) for k, bh in enumerate(bh for _, chunk in leases for bh in chunk)])
    for lease_id, _ in leases:
        await w.request(w.subjects.request("release", w.worker_id), w.release(lease_id))
    return {
        "ingest_single_events": n_single, "ingest_single_events_per_s": round(n_single / t_single),
        "ingest_single_publish_per_s": round(n_single / t_pub),
        "ingest_single_ratio_vs_copy": round(n_single / t_single / copy_rate, 3),
        "ingest_worker_unbatched_events": n_old, "ingest_worker_unbatched_events_per_s": round(n_old / t_old),
        "ingest_batch_speedup_vs_unbatched_worker": round(batched_rate / (n_old / t_old), 2), **cpu,
    }


#: Block numbers of the backlog phase's blocks (apart from the others').
BACKLOG_BLOCK0 = 1 << 36


async def backlog_phase(nc: Any, coord: CoordinatorProc, w: BenchWorker, n: int, copy_rate: float) -> dict[str, Any]:
    """Durable ingest of a backlog: the coordinator is stopped, ``n`` commit transitions are
    published in batches (as workers keep doing while no coordinator runs), it is started again: from its
    ``/readyz`` 200 until the watermark covers the last one. What a coordinator's own pipeline
    (JetStream delivery, decode, judge, apply, append, ack) drains per second, without the
    publisher competing for this machine's two cores as it does in :func:`ingest_phase`."""
    from shared.config import WorkerConfig
    from shared.messages import TransitionBatch, decode, encode

    hashes = [h(BACKLOG_BLOCK0 + i) for i in range(n)]
    leases, _ = await grant_writes(w, hashes, "backlog")
    seq0 = w.emitted_seq
    msgs, _ = commits(w, leases, seq0)
    # as workers leave them: batches of worker.publish_batch transitions
    size = WorkerConfig().publish_batch
    batches = [TransitionBatch(worker_id=w.worker_id, epoch=w.epoch, events=[decode(m) for m, _ in msgs[k:k + size]])
               for k in range(0, n, size)]
    log("backlog: stopping the coordinator ...")
    coord.stop()
    t_pub = await publish_all(nc, w.subjects.events(w.worker_id), [(encode(b), b.source_id) for b in batches])
    w.emitted_seq = seq0 + n
    log(f"backlog: {n} commit transitions in {len(batches)} messages stored by JetStream in {t_pub:.2f} s; "
         "starting the coordinator ...")
    coord.start()
    ready_s, _ = await coord.wait_ready()
    t0 = time.perf_counter()
    st0 = await coord.append_stats()
    cpu0 = cpu_seconds(coord.pid)
    await w.wait_watermark(seq0 + n, timeout_s=max(120, n / 500))
    t = time.perf_counter() - t0
    cpu = cpu_delta(cpu0, cpu_seconds(coord.pid), n, "ingest_backlog")
    appends = append_delta(st0, await coord.append_stats(), "ingest_backlog", t)
    rate = n / t
    log(f"backlog: ready {ready_s:.2f} s after its start; watermark {seq0 + n} {t:.2f} s later: {rate:,.0f} "
         f"events/s durable; {appends}; {cpu}")
    w.note_committed([(bh, seq0 + k + 1) for k, bh in enumerate(bh for _, chunk in leases for bh in chunk)])
    for lease_id, _ in leases:
        await w.request(w.subjects.request("release", w.worker_id), w.release(lease_id))
    return {"ingest_backlog_events": n, "ingest_backlog_events_per_s": round(rate),
            "ingest_backlog_seconds": round(t, 3), "ingest_backlog_ratio_vs_copy": round(rate / copy_rate, 3),
            "ingest_backlog_restart_to_ready_s": round(ready_s, 3), **appends, **cpu}
