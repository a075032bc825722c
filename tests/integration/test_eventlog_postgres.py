"""What only the real database can show: the append-only guard, the migration, fencing by
the advisory lock and epoch, a renewal that never waits for an append, group commit into
few transactions, and bounded failure when PostgreSQL cannot be reached."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator

import asyncpg
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from coordinator.log import LogError, LogUnavailable, NewEvent, NotLeader, Snapshot
from coordinator.log.groupcommit import GroupCommitter
from coordinator.log.leader import LeaderElection, make_holder_id
from coordinator.log.migrate import alembic_config, current, head_revision, upgrade
from coordinator.log.postgres import (
    LEADER_STALE, SCHEMA_REVISION, STREAM_SNAPSHOT_BYTES, PgSettings, PostgresEventLog,
)
from coordinator.log.schema import APPEND_ONLY_TRIGGERS, metadata
from shared.embedded import free_port


def ev(stream: str, n: int = 0, source: str | None = None) -> NewEvent:
    return NewEvent(stream_id=stream, type="t", payload=b'{"n":%d}' % n, source_id=source)


async def terminate_sessions(database_url: str, application_name: str) -> int:
    """End every session of ``application_name`` from the server side (as a restart would)."""
    conn = await asyncpg.connect(database_url)
    try:
        return int(await conn.fetchval("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                       "WHERE application_name = $1", application_name))
    finally:
        await conn.close()


@pytest.fixture
async def pg(database_url: str) -> AsyncIterator[PostgresEventLog]:
    log = PostgresEventLog.connect(PgSettings(url=database_url, pool_size=10))
    await upgrade(log.engine)
    try:
        yield log
    finally:
        await log.close()


@pytest.mark.parametrize("statement", [
    "UPDATE events SET type = 'x'",
    "UPDATE events SET type = 'x' WHERE false",
    "DELETE FROM events",
    "DELETE FROM events WHERE position = 1",
    "TRUNCATE events",
    "UPDATE snapshots SET state_hash = 'x'",
])
async def test_the_database_refuses_to_edit_history(pg: PostgresEventLog, database_url: str, statement: str) -> None:
    e = await pg.take_leadership("me")
    await pg.append([ev("a", 1), ev("b", 2)], e)
    conn = await asyncpg.connect(database_url)
    try:
        with pytest.raises(asyncpg.RestrictViolationError, match="append-only"):
            await conn.execute(statement)
    finally:
        await conn.close()
    assert [s.type for s in await pg.read()] == ["t", "t"]


async def test_schema_revision_of_a_database_never_migrated_is_none(database_url: str) -> None:
    log = PostgresEventLog.connect(PgSettings(url=database_url))
    try:
        assert await log.schema_revision() is None
    finally:
        await log.close()


async def test_migration_matches_the_declared_schema(pg: PostgresEventLog) -> None:
    assert await current(pg.engine) == head_revision()
    assert await upgrade(pg.engine) == head_revision()  # idempotent
    # the revision a coordinator checks at start without Alembic is the head of migrations/
    assert SCHEMA_REVISION == head_revision() == await pg.schema_revision()

    def diff(conn):  # type: ignore[no-untyped-def]
        return compare_metadata(MigrationContext.configure(conn), metadata)

    async with pg.engine.connect() as conn:
        assert await conn.run_sync(diff) == []
        triggers = (await conn.exec_driver_sql(
            "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal ORDER BY tgname")).scalars().all()
    assert triggers == ["events_refuse_truncate", "events_refuse_update_delete", "log_archives_refuse_truncate",
                        "log_archives_refuse_update_delete", "snapshots_refuse_delete", "snapshots_refuse_truncate",
                        "snapshots_refuse_update"]
    assert sorted(APPEND_ONLY_TRIGGERS) == triggers


async def test_group_commit_batches_concurrent_appends_and_answers_after_commit(pg: PostgresEventLog,
                                                                                database_url: str) -> None:
    epoch = await pg.take_leadership("me")
    committed_before_answer: list[bool] = []
    gc = GroupCommitter(pg, batch_ms=20, batch_max=500, leader_epoch=epoch)
    gc.start()
    checker = await asyncpg.create_pool(database_url, min_size=1, max_size=4)
    try:
        async def one(i: int) -> list[int | None]:
            positions = await gc.submit([ev(f"s{i % 7}", i, source=f"w.1.{i}")])
            # the event is visible to another session by the time we are answered
            committed_before_answer.append(
                await checker.fetchval("SELECT count(*) FROM events WHERE source_id = $1", f"w.1.{i}") == 1)
            return positions

        results = await asyncio.gather(*[one(i) for i in range(300)])
    finally:
        await gc.close()
        await checker.close()
    assert all(committed_before_answer)
    assert sorted(p[0] for p in results) == list(range(1, 301))
    async with pg.engine.connect() as conn:
        transactions = (await conn.exec_driver_sql("SELECT count(DISTINCT xmin::text) FROM events")).scalar()
    assert gc.batches == transactions
    assert transactions <= 10, f"300 concurrent appends took {transactions} transactions"


async def test_group_commit_failure_fails_the_batch_and_everything_queued_behind_it(pg: PostgresEventLog) -> None:
    epoch = await pg.take_leadership("old")
    failures: list[BaseException] = []
    gc = GroupCommitter(pg, batch_ms=5, batch_max=100, leader_epoch=epoch, on_failure=failures.append)
    gc.start()
    try:
        assert await gc.submit([ev("a")]) == [1]
        await pg.take_leadership("new")
        futs = [gc.submit([ev("a", i)]) for i in range(5)]
        results = await asyncio.gather(*futs, return_exceptions=True)
    finally:
        await gc.close()
    assert all(isinstance(r, NotLeader) for r in results)
    assert len(failures) == 1 and isinstance(failures[0], NotLeader)
    assert await pg.head() == 1


async def test_unreachable_postgres_fails_fast_with_log_unavailable() -> None:
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/nowhere"
    log = PostgresEventLog.connect(PgSettings(url=url, connect_timeout_s=1.0))
    try:
        t0 = time.monotonic()
        with pytest.raises(LogUnavailable, match="PostgreSQL unavailable during append"):
            await log.append([ev("a")], 1)
        with pytest.raises(LogUnavailable):
            await log.read()
        assert time.monotonic() - t0 < 5
    finally:
        await log.close()


async def test_one_leader_and_the_stale_one_is_fenced(pg: PostgresEventLog, database_url: str) -> None:
    a = LeaderElection(PgSettings(url=database_url), make_holder_id(), renew_interval_s=0.1, takeover_after_s=30)
    b = LeaderElection(PgSettings(url=database_url), make_holder_id(), renew_interval_s=0.1, takeover_after_s=30)
    try:
        epoch_a = await asyncio.wait_for(a.acquire(), 5)
        assert a.is_leader
        waiting = asyncio.create_task(b.acquire(poll_s=0.05))
        await asyncio.sleep(0.5)
        assert not waiting.done(), "a second process became leader while the first holds the lock"
        await pg.append([ev("a")], epoch_a)
        await a.release()  # clean step-down releases the lock at once
        epoch_b = await asyncio.wait_for(waiting, 5)
        assert epoch_b == epoch_a + 1
        with pytest.raises(NotLeader):
            await pg.append([ev("a")], epoch_a)
        assert await pg.append([ev("a")], epoch_b) == [2]
        assert (await pg.leader()).holder == b.holder
    finally:
        await a.release()
        await b.release()


async def test_a_standby_whose_session_is_ended_keeps_waiting_and_then_leads(pg: PostgresEventLog,
                                                                            database_url: str) -> None:
    """The standby's polling session is terminated (as a PostgreSQL restart would end it): it
    keeps waiting, on a new session, and takes the lock when the leader releases it."""
    a = LeaderElection(PgSettings(url=database_url), make_holder_id(), renew_interval_s=0.1, takeover_after_s=30)
    b = LeaderElection(PgSettings(url=database_url), make_holder_id(), renew_interval_s=0.1, takeover_after_s=30)
    try:
        epoch_a = await asyncio.wait_for(a.acquire(), 5)
        waiting = asyncio.create_task(b.acquire(poll_s=0.05))
        for _ in range(3):
            await asyncio.sleep(0.2)
            await terminate_sessions(database_url, b.app_name)
        await asyncio.sleep(0.3)
        assert not waiting.done(), waiting.exception() if waiting.done() else None
        await a.release()
        assert await asyncio.wait_for(waiting, 5) == epoch_a + 1
    finally:
        await a.release()
        await b.release()


async def test_standby_takes_over_from_a_leader_that_stopped_renewing(pg: PostgresEventLog, database_url: str) -> None:
    """A paused leader keeps its session (and lock); the standby terminates it and fences it."""
    a = LeaderElection(PgSettings(url=database_url), make_holder_id(), renew_interval_s=0.1, takeover_after_s=0.6)
    b = LeaderElection(PgSettings(url=database_url), make_holder_id(), renew_interval_s=0.1, takeover_after_s=0.6)
    # a's pooled append connections carry its application_name, like the coordinator's do
    a_log = PostgresEventLog.connect(PgSettings(url=database_url, application_name=a.app_name))
    try:
        epoch_a = await a.acquire()
        await a_log.append([ev("a")], epoch_a)
        assert a._renew is not None
        a._renew.cancel()  # "pause": the lock session stays open but renewals stop
        t0 = time.monotonic()
        epoch_b = await asyncio.wait_for(b.acquire(poll_s=0.05), 10)
        assert epoch_b == epoch_a + 1
        assert time.monotonic() - t0 < 5
        with pytest.raises((NotLeader, LogUnavailable)):
            await a_log.append([ev("a")], epoch_a)
        with pytest.raises(NotLeader):  # pool reconnected: PostgreSQL itself refuses the stale epoch
            await a_log.append([ev("a")], epoch_a)
        assert [s.leader_epoch for s in await pg.read()] == [epoch_a]
    finally:
        await a_log.close()
        await a.release()
        await b.release()


async def test_leader_notices_losing_its_lock_session(pg: PostgresEventLog, database_url: str) -> None:
    a = LeaderElection(PgSettings(url=database_url), make_holder_id(), renew_interval_s=0.05, takeover_after_s=5)
    try:
        await a.acquire()
        await terminate_sessions(database_url, a.app_name)
        reason = await asyncio.wait_for(a.lost(), 5)
        assert "lock connection lost" in reason
        assert not a.is_leader
    finally:
        await a.release()


#: What ``kvl_append`` does first (migration 0004): take the leader row.
LOCK_LEADER = "SELECT leader_epoch FROM leader WHERE id = 1 FOR UPDATE"


@contextlib.asynccontextmanager
async def append_in_flight(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """An append transaction that has taken the leader row (as every append does) and not finished."""
    conn = await asyncpg.connect(database_url)
    try:
        async with conn.transaction():
            await conn.fetchval(LOCK_LEADER)
            yield conn
    finally:
        await conn.close()


async def test_renewal_never_waits_for_an_append_in_flight(pg: PostgresEventLog, database_url: str) -> None:
    """A slow append holds the leader row for longer than the standby waits before taking over;
    the leader keeps renewing all along, so it neither steps down nor looks stale."""
    a = LeaderElection(PgSettings(url=database_url), make_holder_id(), renew_interval_s=0.1, takeover_after_s=1.0)
    b = LeaderElection(PgSettings(url=database_url), make_holder_id(), renew_interval_s=0.1, takeover_after_s=1.0)
    try:
        epoch_a = await asyncio.wait_for(a.acquire(), 5)
        standby = asyncio.create_task(b.acquire(poll_s=0.05))
        async with append_in_flight(database_url):
            t0 = time.monotonic()
            ages = []
            while time.monotonic() - t0 < 2.5:  # > takeover_after_s, and > the renewal's own timeout
                await asyncio.sleep(0.25)
                info = await pg.leader()
                assert info.leader_epoch == epoch_a and info.renewed_at is not None
                async with pg.engine.connect() as conn:
                    now = (await conn.exec_driver_sql("SELECT now()")).scalar()
                ages.append((now - info.renewed_at).total_seconds())
            assert a.is_leader, f"the leader stepped down behind a slow append: {await a.lost()}"
            assert not standby.done(), "the standby took over from a leader that was renewing"
        assert max(ages) < 0.6, f"renewals stalled behind the append: ages {ages}"
        assert await pg.append([ev("a")], epoch_a) == [1]
        assert a.is_leader and not standby.done()
    finally:
        await a.release()
        await b.release()


async def test_the_epoch_bump_still_waits_for_an_append_in_flight(pg: PostgresEventLog, database_url: str) -> None:
    """The fence is unchanged: the bump serialises with appends, and the renewal row learns the
    new epoch in the same transaction."""
    old = await pg.take_leadership("old")
    async with append_in_flight(database_url) as append:
        bump = asyncio.create_task(pg.take_leadership("new"))
        await asyncio.sleep(0.5)
        assert not bump.done(), "the epoch bump did not wait for the append in flight"
        # the old leader's renewal is not blocked meanwhile: it is still the leader
        assert await append.fetchval("SELECT leader_epoch FROM leader_renewal") == old
        conn = await asyncpg.connect(database_url)
        try:
            assert await asyncio.wait_for(conn.execute(
                "UPDATE leader_renewal SET renewed_at = now() WHERE leader_epoch = $1", old), 1) == "UPDATE 1"
        finally:
            await conn.close()
    new = await asyncio.wait_for(bump, 5)
    assert new == old + 1
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow("SELECT leader_epoch, holder, renewed_at FROM leader_renewal WHERE id = 1")
        assert (row[0], row[1]) == (new, "new") and row[2] is not None
    finally:
        await conn.close()
    with pytest.raises(NotLeader):
        await pg.append([ev("a")], old)


@pytest.mark.parametrize("bump", ["take_leadership", "epoch_only"])
async def test_a_superseded_leaders_renewal_is_fenced_and_it_steps_down(pg: PostgresEventLog, database_url: str,
                                                                         bump: str) -> None:
    """epoch_only: the epoch moved without the renewal row (a hand edit, a coordinator older
    than migration 0002): the renewal checks ``leader.leader_epoch`` too."""
    a = LeaderElection(PgSettings(url=database_url), make_holder_id(), renew_interval_s=0.05, takeover_after_s=30)
    try:
        epoch_a = await asyncio.wait_for(a.acquire(), 5)
        await asyncio.sleep(0.2)
        assert a.is_leader
        if bump == "take_leadership":
            assert await pg.take_leadership("usurper") == epoch_a + 1
        else:
            conn = await asyncpg.connect(database_url)
            try:
                await conn.execute("UPDATE leader SET leader_epoch = leader_epoch + 1, holder = 'usurper'")
            finally:
                await conn.close()
        reason = await asyncio.wait_for(a.lost(), 5)
        assert reason == f"fenced: leader epoch {epoch_a} was superseded"
        assert not a.is_leader
    finally:
        await a.release()


async def test_staleness_reads_the_renewal_of_the_current_epoch(pg: PostgresEventLog, database_url: str) -> None:
    """A leader older than migration 0002 renews ``leader.renewed_at``; a renewal row of an
    earlier epoch does not make the current leader look alive."""
    conn = await asyncpg.connect(database_url)
    try:
        async def stale() -> bool:
            return (await conn.fetchrow(LEADER_STALE, 10.0))[2]

        assert await stale()  # never taken: no renewal at all
        await pg.take_leadership("new")
        assert not await stale()
        await conn.execute("UPDATE leader_renewal SET renewed_at = now() - interval '1 hour'")
        await conn.execute("UPDATE leader SET renewed_at = now() - interval '1 hour'")
        assert await stale()
        await conn.execute("UPDATE leader SET renewed_at = now()")  # an older coordinator renewing
        assert not await stale()
        # an older coordinator's epoch bump (leader row only), then its renewals stop
        await conn.execute("UPDATE leader_renewal SET renewed_at = now()")
        await conn.execute("UPDATE leader SET leader_epoch = leader_epoch + 1, "
                           "renewed_at = now() - interval '1 hour'")
        assert await stale()
        assert (await pg.leader()).renewed_at == await conn.fetchval("SELECT renewed_at FROM leader")
    finally:
        await conn.close()


async def test_migration_0002_round_trip_keeps_the_leader(database_url: str) -> None:
    log = PostgresEventLog.connect(PgSettings(url=database_url))

    def downgrade(conn, revision: str) -> None:  # type: ignore[no-untyped-def]
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)

    try:
        assert await upgrade(log.engine, "0001") == "0001"
        async with log.engine.begin() as conn:
            await conn.exec_driver_sql("UPDATE leader SET leader_epoch = 7, holder = 'h', since = now(), "
                                       "renewed_at = now() - interval '1 minute'")
        assert await upgrade(log.engine, "0002") == "0002"
        info = await log.leader()
        assert (info.leader_epoch, info.holder) == (7, "h") and info.renewed_at is not None
        async with log.engine.begin() as conn:
            await conn.exec_driver_sql("UPDATE leader_renewal SET renewed_at = now()")
            renewed = (await conn.exec_driver_sql("SELECT renewed_at FROM leader_renewal")).scalar()
        async with log.engine.begin() as conn:
            await conn.run_sync(downgrade, "0001")
        assert await current(log.engine) == "0001"
        async with log.engine.connect() as conn:
            row = (await conn.exec_driver_sql("SELECT leader_epoch, holder, renewed_at FROM leader")).one()
            assert tuple(row) == (7, "h", renewed)  # the last renewal is kept where 0001 reads it
            assert (await conn.exec_driver_sql("SELECT to_regclass('leader_renewal')")).scalar() is None
        assert await upgrade(log.engine) == head_revision()
        assert await log.take_leadership("next") == 8
        assert await log.append([ev("a")], 8) == [1]
    finally:
        await log.close()


async def test_a_large_snapshot_is_streamed_and_read_back_byte_for_byte(pg: PostgresEventLog) -> None:
    """A snapshot of at least STREAM_SNAPSHOT_BYTES goes in by COPY, in pieces; it must come back
    whole (every byte value, pieces cut anywhere), fenced and first-one-stays like a small one."""
    epoch = await pg.take_leadership("t")
    await pg.append([ev("s", i) for i in range(3)], epoch)
    rng = random.Random(3)
    big = bytes(rng.getrandbits(8) for _ in range(STREAM_SNAPSHOT_BYTES + 12_345))
    await pg.save_snapshot(Snapshot(2, "hash-two", bytearray(big)), epoch)
    await pg.save_snapshot(Snapshot(2, "other", b"\x00" * STREAM_SNAPSHOT_BYTES), epoch)   # the first one stays
    got = await pg.latest_snapshot()
    assert got is not None and (got.position, got.state_hash, got.leader_epoch) == (2, "hash-two", epoch)
    assert bytes(got.state) == big
    with pytest.raises(NotLeader):
        await pg.save_snapshot(Snapshot(3, "h3", big), epoch - 1)
    with pytest.raises(LogError, match="past the head"):
        await pg.save_snapshot(Snapshot(9, "h9", big), epoch)


async def test_a_large_append_goes_by_copy_and_stores_what_kvl_append_would(database_url: str,
                                                                            other_database_url: str) -> None:
    """Two logs on two databases, one with COPY for batches of 4 and up, the other never: the same
    appends store the same rows (positions, stream versions, sources), and a duplicate source
    turns a COPY back into ``kvl_append``, which skips it."""
    by_copy = PostgresEventLog.connect(PgSettings(url=database_url, copy_min_events=4))
    by_function = PostgresEventLog.connect(PgSettings(url=other_database_url, copy_min_events=0))

    def ev(stream: str, source: str | None) -> NewEvent:
        return NewEvent(stream, "test.event", b'{"type":"test.event"}', source)

    batches = [
        [ev("a", None), ev("b", "s1")],                                                # small: kvl_append
        [ev("a", "s2"), ev("a", "s3"), ev("c", None), ev("b", "s4"), ev("a", None)],   # COPY, versions go on
        [ev("c", "s5"), ev("c", "s1"), ev("d", "s6"), ev("d", "s6"), ev("a", "s7")],   # duplicates: kvl_append
        [ev("e", f"t{i}") for i in range(300)],                                        # COPY
    ]
    try:
        results = []
        for log in (by_copy, by_function):
            await upgrade(log.engine)
            epoch = await log.take_leadership("me")
            results.append([await log.append(b, epoch) for b in batches])
        assert results[0] == results[1]
        assert results[0][2] == [8, None, 9, None, 10]
        assert by_copy.append_paths == {"function": 2, "copy": 2, "copy_refused": 1}
        assert by_function.append_paths == {"function": 4, "copy": 0, "copy_refused": 0}
        rows = []
        for log in (by_copy, by_function):
            rows.append([(s.position, s.stream_id, s.stream_version, s.source_id, s.leader_epoch)
                         for s in await log.read(1, 1000)])
        assert rows[0] == rows[1] and len(rows[0]) == 310
    finally:
        await by_copy.close()
        await by_function.close()


@pytest.mark.parametrize("copy_min_events", [0, 1], ids=["kvl_append", "copy"])
async def test_an_append_on_a_lost_connection_is_unknown_and_the_next_one_reconnects(
        database_url: str, copy_min_events: int) -> None:
    """The writer's session is terminated between two appends: the next append either finds it
    closed and reconnects, or cannot say whether it committed (it had been sent); the one after
    that runs on a new session, and the log holds each event once."""
    log = PostgresEventLog.connect(PgSettings(url=database_url, application_name="kvl-lost-writer",
                                              copy_min_events=copy_min_events))
    await upgrade(log.engine)
    try:
        epoch = await log.take_leadership("me")
        assert await log.append([NewEvent("a", "test.event", b"{}"), NewEvent("b", "test.event", b"{}")],
                                epoch) == [1, 2]
        assert await terminate_sessions(database_url, "kvl-lost-writer") >= 1   # the writer, and pooled readers
        # whether the client has seen the session end before it sends is a race: either it
        # reconnects first, or the append fails as one that may have committed (never "refused")
        try:
            stored = await log.append([NewEvent("a", "test.event", b"{}")], epoch)
        except LogUnavailable as e:
            assert e.committed_unknown
            stored = []
        assert stored in ([], [3])
        nxt = 3 + len(stored)
        assert await log.append([NewEvent("c", "test.event", b"{}"), NewEvent("a", "test.event", b"{}")],
                                epoch) == [nxt, nxt + 1]
        want = [("a", 1), ("b", 1)] + [("a", 2)] * len(stored) + [("c", 1), ("a", 2 + len(stored))]
        assert [(s.stream_id, s.stream_version) for s in await log.read()] == want
        assert log.append_paths["copy"] == ((2 + len(stored)) if copy_min_events else 0)
    finally:
        await log.close()
