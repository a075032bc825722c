"""Log retention: archiving the oldest events of a long log, against reading the same rows.

Builds the replay benchmark's log (``bench.coordinator.log_builder.build_log``: the real core's events,
~92 % commit transitions, a snapshot ``--tail`` events before the end) in a fresh database,
then runs ``coordinator.log.archive.archive`` up to that snapshot, as ``kvledger log archive``
does: read every event, write the gzip file, fold it, compare the anchor's hash, then
``kvl_archive`` (floors, delete). Baseline in the same run: the raw read of the same rows
(``bench.coordinator.replay.read_baseline``). After it: a replay "from the beginning" (it starts at the
anchor now) and the offline verification of the file.

Prints one JSON line: ``archive_events``, ``archive_seconds``, ``archive_write_seconds``,
``archive_delete_seconds``, ``archive_ratio_vs_read`` (raw read time / archive time),
``archive_file_bytes_per_event``, ``stream_floors`` (rows of ``log_stream_floors`` it left),
``events_rows_before``/``after`` (the table's file keeps its size:
PostgreSQL's vacuum makes the deleted rows' space reusable for new events rather than returning it),
``replay_after_archive_seconds`` and ``replay_after_archive_events``, ``verify_seconds``.

    .venv/bin/python -m bench.archive            # 1M events (~3 min here)
    .venv/bin/python -m bench.archive --quick    # 100k events
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.coordinator.harness import scratch_database

    tmp = Path(tempfile.mkdtemp(prefix="kvl-bench-archive-"))
    try:
        async with scratch_database(args.database_url, "archive", tmp) as db:
            return await _archive(db, args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def _archive(db: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Build the log in ``db``, archive it up to its snapshot, replay and verify."""
    import asyncpg

    from bench.coordinator.harness import log as _log
    from bench.coordinator.log_builder import build_log
    from bench.coordinator.replay import read_baseline
    from coordinator.core import CoreParams
    from coordinator.log.archive import archive, verify_archives
    from coordinator.log.postgres import PgSettings, PostgresEventLog
    from coordinator.replay import load_state

    result: dict[str, Any] = {"quick": args.quick}
    _log(f"archive: building a {args.events:,}-event log ...")
    built = await build_log(db, args.events, args.tail)
    anchor = built["snapshot_position"]
    read_s = await read_baseline(db, built["events"])
    conn = await asyncpg.connect(db, server_settings={"statement_timeout": "0"})
    try:
        rows = "SELECT count(*) FROM events"
        before = int(await conn.fetchval(rows))
        _log(f"archive: archiving positions 1..{anchor:,} ...")
        t0 = time.perf_counter()
        out = await archive(conn, tmp / "archive", anchor, CoreParams())
        archive_s = time.perf_counter() - t0
        after = int(await conn.fetchval(rows))
        floors = int(await conn.fetchval("SELECT count(*) FROM log_stream_floors"))
    finally:
        await conn.close()
    log = PostgresEventLog.connect(PgSettings(url=db))
    try:
        res = await load_state(log, CoreParams(), use_snapshot=False)
    finally:
        await log.close()
    assert res.from_archive_anchor and res.position == built["events"], (res.position, built["events"])
    t0 = time.perf_counter()
    verified = await asyncio.to_thread(verify_archives, [Path(out["file"])], CoreParams())
    verify_s = time.perf_counter() - t0
    assert verified["state_hash"] == out["anchor_hash"]
    result.update({
        "log_events": built["events"], "archive_events": out["events"],
        "archive_seconds": round(archive_s, 3), "archive_write_seconds": out["write_seconds"],
        "archive_delete_seconds": out["delete_seconds"], "read_seconds": round(read_s * out["events"]
                                                                                / built["events"], 3),
        "archive_ratio_vs_read": round(read_s * out["events"] / built["events"] / archive_s, 3),
        "archive_events_per_s": round(out["events"] / archive_s),
        "archive_file_bytes_per_event": round(out["bytes"] / out["events"], 1),
        "events_rows_before": before, "events_rows_after": after, "stream_floors": floors,
        "replay_after_archive_seconds": round(res.seconds, 3), "replay_after_archive_events": res.events,
        "verify_seconds": round(verify_s, 3), "verify_events_per_s": round(out["events"] / verify_s),
    })
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.archive", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="100k events")
    ap.add_argument("--events", type=int, help="events in the log (default 1000000, quick 100000)")
    ap.add_argument("--tail", type=int, help="events after the anchor snapshot (default 20000, quick 2000)")
    ap.add_argument("--database-url", default=os.environ.get("KVL_DATABASE_URL", ""))
    args = ap.parse_args(argv)
    args.events = args.events or (100_000 if args.quick else 1_000_000)
    args.tail = args.tail or (2_000 if args.quick else 20_000)
    from bench.cli import run_and_print
    return run_and_print(run(args))


if __name__ == "__main__":
    main()
