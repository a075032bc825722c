"""Phases of ``bench.coordinator``: replay of a large log from empty (against reading its rows),
the pure fold, and a coordinator process restarted on it (then the takeover rounds)."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from bench.coordinator.harness import CoordinatorProc, create_db, log
from bench.coordinator.log_builder import build_log
from bench.coordinator.takeover import takeover_phase


async def read_payloads(db_url: str, n: int) -> list[bytes]:
    """The log's ``n`` payloads, in position order."""
    import asyncpg
    conn = await asyncpg.connect(db_url)
    try:
        rows = await conn.fetch("SELECT convert_to(payload, 'UTF8') FROM events ORDER BY position")
    finally:
        await conn.close()
    assert len(rows) == n, (len(rows), n)
    return [r[0] for r in rows]


async def read_baseline(db_url: str, n: int) -> float:
    """Seconds to read the log's rows as load_state does (the same statement, columns and pages,
    one page after another), raw asyncpg."""
    import asyncpg

    from coordinator.log.postgres import READ_PAYLOADS
    from coordinator.replay import REPLAY_PAGE
    page = REPLAY_PAGE
    conn = await asyncpg.connect(db_url)
    q = READ_PAYLOADS
    try:
        stmt = await conn.prepare(q)
        t0 = time.perf_counter()
        pos, got = 0, 0
        while True:
            rows = await stmt.fetch(pos + 1, page)
            if not rows:
                break
            got += len(rows)
            pos = rows[-1][0]
        dt = time.perf_counter() - t0
    finally:
        await conn.close()
    assert got == n, (got, n)
    return dt


async def replay_and_restart(nc: Any, base_url: str, nats_url: str, tmp: Path, n: int, dbs: list[str],
                             procs: list[CoordinatorProc], streams: list[str], takeover_rounds: int,
                             pool_slots: int = 512, repeats: int = 1) -> dict[str, Any]:
    from coordinator.core import CoreParams, decode_event, replay, state_hash
    from coordinator.log.postgres import PgSettings, PostgresEventLog
    from coordinator.replay import load_state
    from shared.subjects import Subjects

    db_url, name = await create_db(base_url, "replay")
    dbs.append(name)
    tail = max(n // 50, 1000)
    log(f"replay: building a {n:,}-event log with the core commands (snapshot {tail:,} events before the end) ...")
    built = await build_log(db_url, n, tail, pool_slots)
    n = built["events"]

    event_log = PostgresEventLog.connect(PgSettings(url=db_url))
    try:
        # NOTE: the read baseline and the replay alternate ``repeats`` times and each key is the
        # median: on this VM one run of either moved by up to a third between minutes.
        reads, replays = [], []
        for k in range(repeats):
            log(f"replay: baseline: read the same rows, same columns and pages, raw asyncpg (no decode, "
                 f"no fold) ({k + 1}/{repeats}) ...")
            reads.append(await read_baseline(db_url, n))
            log(f"replay: read {n / reads[-1]:,.0f} rows/s; coordinator.replay.load_state from empty over "
                 f"{n:,} events ...")
            res = await load_state(event_log, CoreParams(), use_snapshot=False)
            replays.append(res.seconds)
            if res.events != n or state_hash(res.state) != built["state_hash"]:
                raise RuntimeError(f"replay disagrees with the builder: {res.events} events, "
                                   f"hash {state_hash(res.state)}")
            del res
            log(f"replay: {n:,} events in {replays[-1]:.2f} s: {n / replays[-1]:,.0f} events/s (state hash matches)")
        t_read, t_replay = statistics.median(reads), statistics.median(replays)
        res = await load_state(event_log, CoreParams())
        t_snap = res.seconds
        assert res.snapshot_position == built["snapshot_position"]
        del res
        log(f"replay: from the snapshot + {n - built['snapshot_position']:,}-event tail in {t_snap:.2f} s")
    finally:
        await event_log.close()

    # The fold alone: decode + apply of the same events from memory (no PostgreSQL, no paging).
    # NOTE: read back after the timed replays, not kept from the build: a million payloads held
    # through them (~0.7 GB) slowed the replay by a tenth, a cost no coordinator pays.
    payloads = await read_payloads(db_url, n)

    def fold() -> float:
        t0 = time.perf_counter()
        replay((decode_event(p) for p in payloads), CoreParams())
        return time.perf_counter() - t0
    t_fold = await asyncio.to_thread(fold)
    log(f"replay: pure fold (decode + apply, in memory) {n / t_fold:,.0f} events/s")
    del payloads

    subjects = Subjects(f"kvlbench{uuid.uuid4().hex[:8]}")
    streams.append(subjects.stream_name)
    coord = CoordinatorProc(tmp, "restart", db_url, nats_url, subjects.prefix)
    procs.append(coord)
    log("restart: starting a coordinator process on that log ...")
    coord.start()
    restart_s, body = await coord.wait_ready()
    lr = body.get("last_replay", {})
    log(f"restart: ready in {restart_s:.2f} s (snapshot at {lr.get('snapshot_position')}, "
         f"{lr.get('events')} events replayed in {lr.get('seconds')} s)")
    # That coordinator now leads on the log: a standby takes over when it is killed (and so on).
    last, takeover = await takeover_phase(nc, coord, db_url, nats_url, tmp, subjects, procs, takeover_rounds)
    last.stop()
    return {
        "replay_events": n, "replay_pool_slots": pool_slots, "replay_repeats": repeats,
        "replay_seconds_each": [round(t, 3) for t in replays], "replay_seconds": round(t_replay, 3), "replay_events_per_s": round(n / t_replay),
        "replay_read_rows_per_s": round(n / t_read), "replay_ratio_vs_read": round(t_read / t_replay, 3),
        "replay_fold_events_per_s": round(n / t_fold),
        "replay_seconds_per_1m": round(t_replay * 1e6 / n, 3),
        "replay_from_snapshot_s": round(t_snap, 3),
        "replay_log_mix": built["mix"], "replay_log_requests": built["requests"],
        "replay_state_replicas": built["replicas"], "replay_log_build_events_per_s": round(built["build_per_s"]),
        "replay_us_per_request": round(1e6 * t_replay / built["requests"], 1),
        "snapshot_position": built["snapshot_position"], "snapshot_bytes": built["snapshot_bytes"],
        "snapshot_replicas": built["snapshot_replicas"], "snapshot_live_replicas": built["snapshot_live_replicas"],
        "restart_to_ready_s": round(restart_s, 3), "restart_history_events": n, "restart_tail_events": lr.get("events"),
        "restart_replay_s": lr.get("seconds"),
        **takeover, "takeover_baseline_restart_to_ready_s": round(restart_s, 3),
        "takeover_ratio_vs_restart": round(takeover["takeover_to_ready_s"] / restart_s, 3),
    }
