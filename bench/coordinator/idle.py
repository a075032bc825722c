"""Phase of ``bench.coordinator``: what liveness costs the log — idle workers heartbeating."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

from bench.coordinator.harness import CoordinatorProc, create_db, log
from bench.coordinator.synthetic_worker import BenchWorker


#: The production heartbeat interval the idle figures are scaled to (the config default).
DEFAULT_HEARTBEAT_MS = 1000


def idle_rates(events: int, heartbeats: float, workers: int, window_s: float, interval_ms: int) -> dict[str, float]:
    """Events and heartbeats per worker per hour *at the default 1 s heartbeat interval*, from a
    window of ``window_s`` run at ``interval_ms``.

    Everything the coordinator does for an idle worker is paced by the heartbeat interval (the
    worker's heartbeats, the expiry check, the leader's renewal), so ``window_s`` at ``interval_ms``
    covers as many intervals as ``window_s × 1000 / interval_ms`` seconds at the default:
    ``idle_time_scale`` is that factor. One event per heartbeat gives 3600 per worker per hour."""
    scale = DEFAULT_HEARTBEAT_MS / interval_ms
    worker_hours = workers * window_s * scale / 3600
    return {"idle_events_per_worker_per_hour": round(events / worker_hours, 2),
            "idle_heartbeats_per_worker_per_hour": round(heartbeats / worker_hours, 1),
            "idle_time_scale": round(scale, 3)}


async def idle_phase(nc: Any, base_url: str, nats_url: str, tmp: Path, dbs: list[str], procs: list[CoordinatorProc],
                     streams: list[str], workers: int, window_s: float, interval_ms: int) -> dict[str, Any]:
    """``workers`` registered bench workers heartbeat every ``interval_ms``, holding nothing: events
    appended to the log during ``window_s`` (and heartbeats answered), per worker per hour."""
    import asyncpg

    from shared.subjects import Subjects
    db_url, name = await create_db(base_url, "idle")
    dbs.append(name)
    subjects = Subjects(f"kvlbench{uuid.uuid4().hex[:8]}")
    streams.append(subjects.stream_name)
    coord = CoordinatorProc(tmp, "idle", db_url, nats_url, subjects.prefix,
                            coordinator={"heartbeat_interval_ms": interval_ms})
    procs.append(coord)
    log(f"idle: coordinator with heartbeat_interval_ms {interval_ms}, {workers} workers ...")
    coord.start()
    await coord.wait_ready()
    ws = [BenchWorker(nc, subjects, slots=64, worker_id=f"benchidle{i}") for i in range(workers)]
    conn = await asyncpg.connect(db_url)
    try:
        for w in ws:
            await w.register()
        await asyncio.sleep(max(1.0, 10 * interval_ms / 1000))  # registrations committed, heartbeats flowing
        last = "SELECT coalesce(max(position), 0) FROM events"

        async def heartbeats() -> tuple[float, float]:
            """Heartbeats the coordinator answered so far: (ok, all outcomes)."""
            hb = [(lb, v) for lb, v in await coord.samples("kvl_coordinator_requests_total")
                  if lb.get("op") == "heartbeat"]
            return sum(v for lb, v in hb if lb.get("outcome") == "ok"), sum(v for _, v in hb)
        p0, (ok0, all0) = await conn.fetchval(last), await heartbeats()
        client0 = sum(w.heartbeats_ok for w in ws)
        t0 = time.perf_counter()
        log(f"idle: counting events for {window_s:g} s (log at position {p0}) ...")
        await asyncio.sleep(window_s)
        p1, (ok1, all1) = await conn.fetchval(last), await heartbeats()
        states = {lb.get("state", "?"): round(v) for lb, v in await coord.samples("kvl_coordinator_workers")}
        dt = time.perf_counter() - t0
        client = sum(w.heartbeats_ok for w in ws) - client0
        types = {r[0]: r[1] for r in await conn.fetch(
            "SELECT type, count(*) FROM events WHERE position > $1 AND position <= $2 GROUP BY type ORDER BY type",
            p0, p1)}
    finally:
        await conn.close()
        for w in ws:
            w.stop()
        coord.stop()
    events, answered = p1 - p0, ok1 - ok0
    out = idle_rates(events, answered, workers, dt, interval_ms)
    log(f"idle: {events} events, {answered:.0f} heartbeats answered ({client} seen by the workers, "
         f"{all1 - all0 - answered:.0f} refused) in {dt:.1f} s: {out['idle_events_per_worker_per_hour']} events and "
         f"{out['idle_heartbeats_per_worker_per_hour']} heartbeats per worker per hour at a 1 s interval; {types}")
    return {"idle_workers": workers, "idle_window_s": round(dt, 2), "idle_heartbeat_interval_ms": interval_ms,
            "idle_events": events, "idle_event_types": types, "idle_heartbeats_answered": round(answered),
            "idle_heartbeats_refused": round(all1 - all0 - answered), **out,
            "idle_worker_states": states, "idle_leadership_losses": coord.log_events("leadership_lost")}
