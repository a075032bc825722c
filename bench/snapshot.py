"""Snapshots of a large ledger state: how long decisions stall while one is taken and saved.

Builds the state of a worker with a ``--pool-slots`` GPU pool in steady state (the replay
benchmark's workload, ``bench.coordinator.log_builder.LogBuilder``: every written block evicts one, as
many tombstones as slots), puts it in a real ``coordinator.ledger.Ledger`` on PostgreSQL (a
fresh database; embedded when no URL is given), and takes snapshots while a probe decides
one durable event after another (a decision, its append, 1 ms of sleep). Alternating rounds:
the snapshot serialised by a forked child (``coordinator.snapshot_fork``, the default) and
in the coordinator's process (the baseline, as before stop 34).

Prints one JSON line: ``snapshot_state_replicas``, ``snapshot_bytes``, and per way
(``fork``, ``in_process``) the medians over rounds of ``snapshot_stall_ms_<way>`` (the longest
the probe went without an answer, over the gaps that overlap a snapshot), ``snapshot_freeze_ms_<way>`` (how long the ledger held
decisions), ``snapshot_seconds_<way>`` (freeze to saved), ``snapshot_decisions_<way>`` (probe
decisions completed meanwhile); ``snapshot_stall_ratio`` (in process / fork).

    .venv/bin/python -m bench.snapshot            # 100k slots (~200k replicas, 46 MB), 3 rounds each: ~40 s here
    .venv/bin/python -m bench.snapshot --quick    # 10k slots, 3 rounds each
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def build_state(slots: int, events: int) -> Any:
    """The ledger state after ``events`` events of one worker with ``slots`` pool slots."""
    from bench.coordinator.log_builder import LogBuilder
    from coordinator.core import CoreParams

    b = LogBuilder(CoreParams(), pool_slots=slots)
    b.start()
    n = 0
    while n < events:
        n += len(b.request())
    return b.state


async def rounds(db: str, state: Any, n: int) -> dict[str, Any]:
    from coordinator.core import CoreParams
    from coordinator.core import events as ev
    from coordinator.ledger import Ledger
    from coordinator.log.migrate import upgrade
    from coordinator.log.postgres import PgSettings, PostgresEventLog, create_engine
    from coordinator.metrics import CoordinatorMetrics
    from coordinator.snapshot_child import can_fork
    from shared.logging import get_logger

    if not can_fork():
        raise SystemExit("bench.snapshot: this OS has no fork(); snapshots are always taken in process here")
    settings = PgSettings(url=db)
    engine = create_engine(settings)
    try:
        await upgrade(engine)
    finally:
        await engine.dispose()
    log = PostgresEventLog.connect(settings)
    metrics = CoordinatorMetrics()
    ledger = Ledger(log, CoreParams(), batch_ms=0, batch_max=2000, snapshot_every=10**12, metrics=metrics,
                    logger=get_logger("bench.snapshot"))
    out: dict[str, list[float]] = {}
    size = 0
    try:
        await ledger.take_over(await log.take_leadership("bench.snapshot"))
        # NOTE: the built state stands in for the folded log (the snapshot's bytes and timing are
        # what is measured; the log holds only the takeover and the probe's events)
        ledger.state = state
        gc.freeze()
        for k in range(2 * n):
            way = "fork" if k % 2 == 0 else "in_process"
            ledger.snapshot_fork = way == "fork"
            ends: list[float] = []   # when each probe decision was answered (durable)
            stop = False

            async def probe() -> None:
                while not stop:
                    await ledger.execute(lambda s: (None, [ev.CoordinatorResumed(at_ms=s.resumed_at_ms)]))
                    ends.append(time.perf_counter())
                    await asyncio.sleep(0.001)
            task = asyncio.create_task(probe())
            await asyncio.sleep(0.2)
            freeze0 = metrics.registry.get_sample_value("kvl_coordinator_snapshot_freeze_seconds_sum",
                                                        {"how": way}) or 0.0
            t0 = time.perf_counter()
            snap = await ledger.snapshot()
            t1 = time.perf_counter()
            await asyncio.sleep(0.2)
            stop = True
            await task
            freeze = metrics.registry.get_sample_value("kvl_coordinator_snapshot_freeze_seconds_sum",
                                                       {"how": way}) - freeze0
            # the stall: the longest time without an answer, over gaps that overlap the snapshot
            # (a decision held by the freeze is answered only after it; the loop may be blocked too)
            gaps = [b - a for a, b in zip(ends, ends[1:]) if b >= t0 and a <= t1]
            during = sum(1 for e in ends if t0 <= e <= t1)
            size = len(snap.state)
            for key, v in (("stall_ms", 1000 * max(gaps, default=t1 - t0)), ("freeze_ms", 1000 * freeze),
                           ("seconds", t1 - t0), ("decisions", during)):
                out.setdefault(f"snapshot_{key}_{way}", []).append(v)
            print(f"[bench.snapshot] {way}: {t1 - t0:.2f} s, {during} decisions answered meanwhile, longest without "
                  f"an answer {1000 * max(gaps, default=t1 - t0):.0f} ms, frozen {1000 * freeze:.1f} ms", flush=True)
    finally:
        await ledger.stand_down("bench done")
        await log.close()
    res: dict[str, Any] = {"snapshot_bytes": size}
    for key, vs in sorted(out.items()):
        res[key] = round(statistics.median(vs), 3 if "seconds" in key else 1)
    # NOTE: from the medians before rounding: on a tiny state both stalls are a few ms or less,
    # and a ratio of rounded figures said 0.0
    stall = {way: statistics.median(out[f"snapshot_stall_ms_{way}"]) for way in ("fork", "in_process")}
    res["snapshot_stall_ratio"] = round(stall["in_process"] / max(stall["fork"], 1e-6), 3)
    return res


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.coordinator.harness import log as _log
    from bench.coordinator.harness import scratch_database

    tmp = Path(tempfile.mkdtemp(prefix="kvl-bench-snapshot-"))
    result: dict[str, Any] = {"quick": args.quick, "pool_slots": args.pool_slots}
    try:
        async with scratch_database(args.database_url, "snapshot", tmp) as db:
            _log(f"snapshot: building a {args.pool_slots:,}-slot worker's state ({args.events:,} events) ...")
            state = await asyncio.to_thread(build_state, args.pool_slots, args.events)
            result["snapshot_state_replicas"] = len(state.replicas)
            result.update(await rounds(db, state, args.rounds))
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.snapshot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 10k-slot pool")
    ap.add_argument("--pool-slots", type=int, help="the worker's GPU pool slots (default 100000, quick 10000)")
    ap.add_argument("--events", type=int, help="events folded into the state (default 4 per slot: past the point "
                                               "where the pool and its tombstones are full)")
    ap.add_argument("--rounds", type=int, default=3, help="snapshots of each way (default 3)")
    ap.add_argument("--database-url", default=os.environ.get("KVL_DATABASE_URL", ""))
    args = ap.parse_args(argv)
    args.pool_slots = args.pool_slots or (10_000 if args.quick else 100_000)
    if not 64 <= args.pool_slots <= 10_000_000:
        ap.error("--pool-slots must be within 64-10000000")
    if not 1 <= args.rounds <= 100:
        ap.error("--rounds must be within 1-100")
    args.events = args.events or 4 * args.pool_slots
    from bench.cli import run_and_print
    return run_and_print(run(args))


if __name__ == "__main__":
    main()
