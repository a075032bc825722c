"""Retention of the event log on the real database (``coordinator.log.archive``, migration 0005):
events up to a snapshot move to a file only once they provably fold to it; replays and the audit
start at the anchor afterwards; positions and stream versions continue; the guards still refuse
every other edit; the files verify offline and a damaged or missing one is named."""

from __future__ import annotations

import dataclasses

import gzip
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from coordinator import core
from coordinator.audit import run_audit
from coordinator.core import CoreParams, state_hash
from coordinator.ledger import Ledger
from coordinator.log import NewEvent
from coordinator.log.archive import ArchiveError, archive, list_archives, open_streams, plan, verify_archives
from coordinator.log.migrate import head_revision, upgrade
from coordinator.log.port import Snapshot
from coordinator.log.postgres import PgSettings, PostgresEventLog
from coordinator.metrics import CoordinatorMetrics
from coordinator.replay import load_state
from shared.ids import ROOT_HASH
from shared.logging import get_logger
from shared.messages import LeaseAcquire, LeaseGrant, LeaseRelease, ReplicaState, TransitionEvent, WorkerRegister
from tests.integration.coordinator_kit import CATALOGUE, NS, block

_blocks = itertools.count(1)


@pytest.fixture
async def pg(database_url: str) -> AsyncIterator[PostgresEventLog]:
    log = PostgresEventLog.connect(PgSettings(url=database_url, pool_size=4))
    await upgrade(log.engine)
    try:
        yield log
    finally:
        await log.close()


@pytest.fixture
async def owner(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(database_url)
    try:
        yield conn
    finally:
        await conn.close()


async def serving(log: PostgresEventLog) -> Ledger:
    ledger = Ledger(log, CoreParams(), batch_ms=0, batch_max=100, snapshot_every=10**9,
                    metrics=CoordinatorMetrics(), logger=get_logger("test"))
    await ledger.take_over(await log.take_leadership("test"))
    return ledger


class Traffic:
    """Requests through the real ledger: a write grant of fresh blocks, their commits, a release."""

    def __init__(self, ledger: Ledger, worker: str = "w1") -> None:
        self.ledger, self.worker, self.epoch, self.seq, self.n = ledger, worker, 0, 0, 0

    async def register(self) -> None:
        msg = WorkerRegister(worker_id=self.worker, namespace=NS, catalogue=CATALOGUE, pool_slots={"compressed": 16})
        reply = await self.ledger.execute(lambda s: core.register_worker(s, msg, 1000))
        self.epoch = reply.epoch

    async def request(self, blocks: int = 3, release: bool = True) -> str:
        self.n += 1
        hashes = [block(next(_blocks)) for _ in range(blocks)]
        lease_id = f"l-{self.worker}-{self.n}"
        msg = LeaseAcquire(worker_id=self.worker, epoch=self.epoch, request_id=f"q{self.n}", namespace=NS,
                           block_hashes=hashes, write_forms=["compressed"], reuse=True)
        grant = await self.ledger.execute(lambda s: core.acquire_lease(s, msg, 2000 + self.n, lease_id))
        assert isinstance(grant, LeaseGrant), grant
        for i in grant.write.get("compressed", []):
            self.seq += 1
            t = TransitionEvent(
                worker_id=self.worker, epoch=self.epoch, seq=self.seq, namespace=NS, block_hash=hashes[i],
                parent_hash=hashes[i - 1] if i else ROOT_HASH, token_start=16 * i, token_end=16 * (i + 1),
                form="compressed", location=f"gpu:{self.worker}", from_state=ReplicaState.ALLOCATED,
                to_state=ReplicaState.READY, generation=1, checksum=f"{self.seq:016x}", lease_id=lease_id,
                block_size=16, model_name="m", ts_ms=2000 + self.n)
            await self.ledger.execute(lambda s, t=t: (None, core.ingest_transition(s, t, 2000 + self.n)))
        if release:
            rel = LeaseRelease(worker_id=self.worker, epoch=self.epoch, lease_id=lease_id)
            await self.ledger.execute(lambda s: core.release_lease(s, rel, 3000 + self.n))
        return lease_id


async def small_log(log: PostgresEventLog, *, after: int = 1) -> Snapshot:
    """A worker, one request, a snapshot (returned), then ``after`` more requests; no leader left."""
    ledger = await serving(log)
    w = Traffic(ledger)
    await w.register()
    await w.request()
    snap = await ledger.snapshot()
    for _ in range(after):
        await w.request()
    await ledger.stand_down("test")
    return snap


async def events_stored(owner: asyncpg.Connection) -> int:
    return int(await owner.fetchval("SELECT count(*) FROM events"))


@pytest.mark.parametrize("copy_min_events", [0, 1], ids=["kvl_append", "copy"])
async def test_archive_then_replay_audit_append_and_verify_offline(pg: PostgresEventLog, owner: asyncpg.Connection,
                                                                   tmp_path: Path, copy_min_events: int) -> None:
    # every append by kvl_append, or every one by COPY: both continue positions and versions past an archive
    pg.settings = dataclasses.replace(pg.settings, copy_min_events=copy_min_events)
    ledger = await serving(pg)
    w = Traffic(ledger)
    await w.register()
    for _ in range(6):
        await w.request()
    live_lease = await w.request(release=False)  # a lease that outlives the archive
    first = await ledger.snapshot()
    for _ in range(4):
        await w.request()
    second = await ledger.snapshot()
    await w.request()
    head = await pg.head()
    assert await pg.archive_anchor() == (0, None)

    # a dry plan names the newest snapshot at or before --before
    p = await plan(owner, second.position - 1)
    assert (p["first_position"], p["last_position"], p["anchor_hash"]) == (1, first.position, first.state_hash)

    out = await archive(owner, tmp_path, second.position - 1, CoreParams())
    assert out["events"] == first.position and Path(out["file"]).is_file()
    assert Path(out["file"]).stat().st_mode & 0o777 == 0o600  # tenant metadata: the owner's alone
    assert await events_stored(owner) == head - first.position
    assert await owner.fetchval("SELECT min(position) FROM events") == first.position + 1
    assert (await pg.archive_anchor())[0] == first.position
    assert await pg.head() == head

    # "from the beginning" is now the anchor; the state is the same, stream versions still check
    res = await load_state(pg, CoreParams(), use_snapshot=False, check_streams=True)
    assert res.from_archive_anchor and res.snapshot_position == first.position
    assert res.position == head and not res.stream_errors
    assert state_hash(res.state) == state_hash(ledger.state)
    report = await run_audit(ledger, check_workers=False)
    assert report["ok"] and report["hash_match"] and report["snapshot_position"] == first.position, report

    # appends continue: positions after the head, stream versions after the archived ones
    versions_before = dict(await owner.fetch("SELECT stream_id, max(stream_version) FROM events GROUP BY stream_id"))
    floors = dict(await owner.fetch("SELECT stream_id, stream_version FROM log_stream_floors"))
    assert floors.get(f"lease:{live_lease}") is not None  # live at the anchor: it may get more events
    assert "lease:l-w1-1" not in floors  # released before the anchor: not open, no floor
    anchor_state = (await load_state(pg, CoreParams(), upto=first.position)).state
    bounded = set(open_streams(anchor_state))
    assert {k for k in floors if k.startswith(("replica:", "lease:"))} <= bounded  # bounded by the live state
    rel = LeaseRelease(worker_id="w1", epoch=w.epoch, lease_id=live_lease)
    await ledger.execute(lambda s: core.release_lease(s, rel, 9000))
    row = await owner.fetchrow("SELECT position, stream_version FROM events WHERE stream_id = $1",
                               f"lease:{live_lease}")
    assert row["position"] == head + 1 and row["stream_version"] == floors[f"lease:{live_lease}"] + 1
    assert not versions_before.get(f"lease:{live_lease}")
    assert (pg.append_paths["copy"] > 0) == (copy_min_events > 0)

    # a second archive continues the chain; superseded snapshots go, anchors stay
    head2 = await pg.head()
    out2 = await archive(owner, tmp_path, head2, CoreParams())
    assert (out2["first_position"], out2["last_position"]) == (first.position + 1, second.position)
    assert [r[0] for r in await owner.fetch("SELECT position FROM snapshots ORDER BY position")] == \
        [first.position, second.position]
    assert [(a["first_position"], a["last_position"]) for a in await list_archives(owner)] == \
        [(1, first.position), (first.position + 1, second.position)]
    with pytest.raises(ArchiveError, match="no snapshot between"):
        await plan(owner, head2)

    # a restarted coordinator loads the latest snapshot; the audit still replays clean
    await ledger.stand_down("test")
    again = await serving(pg)
    assert again.archived_upto == second.position  # the status and kvl_coordinator_log_archived_position
    assert again.metrics.log_archived._value.get() == second.position
    report = await run_audit(again, check_workers=False)
    assert report["ok"] and report["snapshot_position"] == second.position, report
    await again.stand_down("test")

    # offline: the files alone reproduce both anchors
    files = sorted(tmp_path.glob("kvledger-log-*.jsonl.gz"))
    ok = verify_archives(list(reversed(files)), CoreParams())
    assert ok["position"] == second.position and ok["state_hash"] == second.state_hash
    assert [f["sha256"] for f in ok["files"]] == [out["sha256"], out2["sha256"]]
    with pytest.raises(ArchiveError, match="a file is missing"):
        verify_archives(files[1:], CoreParams())
    damaged = tmp_path / "damaged" / files[0].name
    damaged.parent.mkdir()
    with gzip.open(files[0], "rb") as f:
        lines = f.read().split(b"\n")
    with gzip.open(damaged, "wb") as f:
        f.write(b"\n".join(lines[:5]) + b"\n")  # cut after four events, no trailer
    with pytest.raises(ArchiveError, match="truncated"):
        verify_archives([damaged], CoreParams())


async def test_nothing_is_deleted_unless_the_events_fold_to_the_anchor(pg: PostgresEventLog, owner: asyncpg.Connection,
                                                                       tmp_path: Path) -> None:
    snap = await small_log(pg)
    # a snapshot whose hash is not what the events fold to (a bug, or a tampered row)
    await owner.execute("INSERT INTO snapshots (position, state_hash, state, leader_epoch) "
                        "SELECT position + 2, 'f' || state_hash, state, leader_epoch FROM snapshots")
    stored = await events_stored(owner)
    with pytest.raises(ArchiveError, match="fold to state hash"):
        await archive(owner, tmp_path, snap.position + 2, CoreParams())
    assert await events_stored(owner) == stored and list(tmp_path.iterdir()) == []
    assert await owner.fetchval("SELECT count(*) FROM log_archives") == 0


async def test_one_archive_at_a_time(pg: PostgresEventLog, owner: asyncpg.Connection, database_url: str,
                                     tmp_path: Path) -> None:
    from coordinator.log.archive import ARCHIVE_LOCK

    snap = await small_log(pg, after=0)
    other = await asyncpg.connect(database_url)
    try:
        assert await other.fetchval("SELECT pg_try_advisory_lock($1)", ARCHIVE_LOCK)  # an archive in progress
        with pytest.raises(ArchiveError, match="another archive"):
            await archive(owner, tmp_path, snap.position, CoreParams())
        assert list(tmp_path.iterdir()) == []
    finally:
        await other.close()
    assert (await archive(owner, tmp_path, snap.position, CoreParams()))["events"] == snap.position


async def test_the_database_guards_the_archive(pg: PostgresEventLog, owner: asyncpg.Connection) -> None:
    snap = await small_log(pg, after=0)
    n = snap.position
    # the switch alone (no archive recorded in the same transaction) lets nothing through
    async with owner.transaction():
        await owner.execute(f"SET LOCAL kvledger.archiving = '{n}'")
        with pytest.raises(asyncpg.RestrictViolationError, match="append-only"):
            await owner.execute(f"DELETE FROM events WHERE position <= {n}")
    with pytest.raises(asyncpg.PostgresError, match="no snapshot with state hash") as e:
        await owner.fetchval("SELECT kvl_archive($1, $2, 'x', 's', 'f', '{}')", n, n)
    assert e.value.sqlstate == "KV011"
    with pytest.raises(asyncpg.PostgresError, match="the archive holds") as e:
        await owner.fetchval("SELECT kvl_archive($1, $2, $3, 's', 'f', '{}')", n, n - 1, snap.state_hash)
    assert e.value.sqlstate == "KV012"
    assert await owner.fetchval("SELECT kvl_archive($1, $2, $3, 's', 'f', '{}')", n, n, snap.state_hash) == n
    with pytest.raises(asyncpg.PostgresError, match="already archived") as e:
        await owner.fetchval("SELECT kvl_archive($1, $2, $3, 's', 'f', '{}')", n, n, snap.state_hash)
    assert e.value.sqlstate == "KV010"
    for statement in ("UPDATE log_archives SET sha256 = 'x'", "DELETE FROM log_archives", "TRUNCATE log_archives",
                      "DELETE FROM events"):
        with pytest.raises(asyncpg.RestrictViolationError, match="append-only"):
            await owner.execute(statement)
    # a log archived up to its head still appends after it
    ledger = await serving(pg)
    positions = [r[0] for r in await owner.fetch("SELECT position FROM events ORDER BY position")]
    assert positions and positions == list(range(n + 1, ledger.position + 1))  # the takeover's own events
    await ledger.stand_down("test")
    with pytest.raises(Exception, match="refusing to downgrade below 0005"):
        async with pg.engine.begin() as conn:
            await conn.run_sync(_downgrade, "0004")


def _downgrade(conn: Any, revision: str) -> None:
    from alembic import command

    from coordinator.log.migrate import alembic_config

    cfg = alembic_config()
    cfg.attributes["connection"] = conn
    command.downgrade(cfg, revision)


async def test_migration_0005_round_trip_keeps_the_append_function_configured(pg: PostgresEventLog,
                                                                               owner: asyncpg.Connection) -> None:
    config = "SELECT proconfig FROM pg_proc WHERE proname = 'kvl_append'"
    at_head = sorted(await owner.fetchval(config))
    assert any(c.startswith("search_path=") for c in at_head) and "plan_cache_mode=force_generic_plan" in at_head
    async with pg.engine.begin() as conn:
        await conn.run_sync(_downgrade, "0004")
    assert sorted(await owner.fetchval(config)) == at_head
    assert await owner.fetchval("SELECT to_regclass('log_archives')") is None
    assert "log_archives" not in await owner.fetchval("SELECT prosrc FROM pg_proc WHERE proname = 'kvl_append'")
    epoch = await pg.take_leadership("old")
    # (this build's adapter appends with 0006's kvl_append: the rows of an older log are chained by 0006)
    assert await owner.fetchval("SELECT kvl_append($1, ARRAY['s'], ARRAY['t'], ARRAY[NULL], ARRAY['{}'], NULL)",
                                epoch) == [1]
    assert await upgrade(pg.engine) == head_revision()
    assert sorted(await owner.fetchval(config)) == at_head
    assert await pg.append([NewEvent("s", "t", b"{}"), NewEvent("s", "t", b"{}")], epoch) == [2, 3]


def test_the_command_line_archives_lists_and_verifies(database_url: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import asyncio

    from kvledger.cli import main

    async def make() -> Any:
        log = PostgresEventLog.connect(PgSettings(url=database_url, pool_size=4))
        await upgrade(log.engine)
        try:
            return await small_log(log)
        finally:
            await log.close()

    snap = asyncio.run(make())
    db = ["--database-url", database_url]
    assert main(["log", "archives", *db]) == 0
    assert "nothing archived" in capsys.readouterr().out
    assert main(["log", "archive", "--before", str(snap.position), "--out", str(tmp_path), "--dry-run", *db]) == 0
    assert f"would archive positions 1..{snap.position}" in capsys.readouterr().out
    assert main(["log", "archive", "--keep-events", "0", "--out", str(tmp_path), "--dry-run", *db]) == 0
    assert f"would archive positions 1..{snap.position}" in capsys.readouterr().out  # the newest snapshot
    assert main(["log", "archive", "--keep-events", "100000", "--out", str(tmp_path), *db]) == 3
    assert "nothing to archive" in capsys.readouterr().err
    assert main(["log", "archive", "--before", "1", "--page", "0", "--out", str(tmp_path), *db]) == 1
    assert "--page must be" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one of --before / --keep-events, not both
        main(["log", "archive", "--before", "1", "--keep-events", "1", "--out", str(tmp_path), *db])
    capsys.readouterr()
    assert list(tmp_path.iterdir()) == []
    assert main(["log", "archive", "--before", str(snap.position), "--out", str(tmp_path), *db]) == 0
    assert f"archived positions 1..{snap.position}" in capsys.readouterr().out
    assert main(["log", "archive", "--before", str(snap.position), "--out", str(tmp_path), *db]) == 3
    assert "no snapshot between" in capsys.readouterr().err
    files = [str(p) for p in tmp_path.iterdir()]
    assert main(["log", "verify", *files]) == 0
    assert "archives OK" in capsys.readouterr().out
    assert main(["log", "verify", *files, *db]) == 0
    assert "every file is the one the database recorded" in capsys.readouterr().out
    with gzip.open(files[0], "rb") as f:
        content = f.read()
    with gzip.open(files[0], "wb", compresslevel=9) as f:  # the same events, other bytes
        f.write(content)
    assert main(["log", "verify", *files]) == 0  # still folds
    assert main(["log", "verify", *files, *db]) == 3
    assert "not the file that was archived" in capsys.readouterr().out
    assert main(["log", "verify", str(tmp_path / "nope.jsonl.gz")]) == 1
    assert "no such file" in capsys.readouterr().err
    assert main(["replay", "--database-url", database_url, "--json"]) == 0
    assert '"ok": true' in capsys.readouterr().out


def test_files_are_matched_with_what_the_database_recorded() -> None:
    from coordinator.log.archive import match_recorded

    rec = [{"first_position": 1, "last_position": 9, "sha256": "a", "file": "x1"},
           {"first_position": 10, "last_position": 20, "sha256": "b", "file": "x2"}]
    good = {"file": "f1", "first_position": 1, "last_position": 9, "sha256": "a"}
    assert match_recorded([good, {**good, "first_position": 10, "last_position": 20, "sha256": "b"}], rec) == []
    assert match_recorded([good], rec) == ["no file given for the recorded archive x2 (positions 10..20)"]
    assert "records no archive of positions 1..8" in match_recorded([{**good, "last_position": 8}], rec[:1])[0]


async def test_a_failure_after_the_file_is_written_deletes_nothing_and_a_rerun_completes(
        pg: PostgresEventLog, owner: asyncpg.Connection, database_url: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The window between the file and ``kvl_archive`` (a crash, a lost connection): the file is
    there, the log untouched; the next run writes the file again and records it."""
    from coordinator.log import archive as ar

    snap = await small_log(pg)
    stored = await events_stored(owner)
    monkeypatch.setattr(ar, "ARCHIVE", "SELECT kvl_archive_gone($1, $2, $3, $4, $5, $6)")  # the step fails
    with pytest.raises(asyncpg.PostgresError):
        await archive(owner, tmp_path, snap.position, CoreParams())
    left = list(tmp_path.glob("*.jsonl.gz"))
    assert len(left) == 1 and await events_stored(owner) == stored and (await pg.archive_anchor())[0] == 0
    other = await asyncpg.connect(database_url)
    try:  # the archive lock was released (another session may take it)
        assert await other.fetchval("SELECT pg_try_advisory_lock($1)", ar.ARCHIVE_LOCK)
    finally:
        await other.close()
    monkeypatch.undo()
    out = await archive(owner, tmp_path, snap.position, CoreParams())
    assert out["file"] == str(left[0]) and out["sha256"] == ar.sha256_of(left[0])
    assert (await pg.archive_anchor())[0] == snap.position
