"""Least privilege (migration 0003): the coordinator's role cannot switch the append-only guard
off, edit or drop the log, or create objects; and it is all the coordinator needs — appends,
snapshots, leadership and a takeover that terminates a stale leader's sessions."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import AsyncIterator

import aiohttp
import asyncpg
import nats
import pytest

from coordinator.app import COORDINATOR
from coordinator.log import LogUnavailable, NewEvent, NotLeader, Snapshot
from coordinator.log.leader import LeaderElection, make_holder_id
from coordinator.log.migrate import head_revision, upgrade
from coordinator.log.postgres import PgSettings, PostgresEventLog
from coordinator.log.roles import RoleError, ensure_login_role, with_credentials
from coordinator.log.schema import WRITER_ROLE
from shared.subjects import Subjects
from tests.integration.coordinator_kit import Worker, block, fast_config, running_coordinator


def ev(stream: str, n: int = 0) -> NewEvent:
    return NewEvent(stream_id=stream, type="t", payload=b'{"n":%d}' % n)


async def _make_role(owner_url: str) -> tuple[str, str]:
    name = f"kvl_t_app_{uuid.uuid4().hex[:10]}"
    password = secrets.token_urlsafe(16)
    await ensure_login_role(owner_url, name, password)
    return name, with_credentials(owner_url, name, password)


async def _drop_role(owner_url: str, name: str) -> None:
    conn = await asyncpg.connect(owner_url)
    try:
        await conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", name)
        await conn.execute(f'DROP ROLE IF EXISTS "{name}"')
    finally:
        await conn.close()


@pytest.fixture
async def migrated(database_url: str) -> str:
    """The test database migrated to head by its owner (the superuser); returns the owner's URL."""
    log = PostgresEventLog.connect(PgSettings(url=database_url))
    try:
        assert await upgrade(log.engine) == head_revision()
    finally:
        await log.close()
    return database_url


@pytest.fixture
async def app_role(migrated: str) -> AsyncIterator[tuple[str, str]]:
    """A LOGIN role, member of kvledger_writer only: ``(name, url)``."""
    name, url = await _make_role(migrated)
    try:
        yield name, url
    finally:
        await _drop_role(migrated, name)


@pytest.fixture
async def app_log(app_role: tuple[str, str]) -> AsyncIterator[PostgresEventLog]:
    log = PostgresEventLog.connect(PgSettings(url=app_role[1]))
    try:
        yield log
    finally:
        await log.close()


async def _contents(url: str) -> tuple[list[tuple], list[tuple]]:
    conn = await asyncpg.connect(url)
    try:
        events = [tuple(r) for r in await conn.fetch("SELECT position, stream_id, type, payload::text FROM events "
                                                      "ORDER BY position")]
        snaps = [tuple(r) for r in await conn.fetch("SELECT position, state_hash, state FROM snapshots "
                                                     "ORDER BY position")]
        return events, snaps
    finally:
        await conn.close()


BYPASSES = [
    "UPDATE events SET type = 'x'",
    "DELETE FROM events",
    "TRUNCATE events",
    "UPDATE snapshots SET state_hash = 'x'",
    "DELETE FROM snapshots",
    "TRUNCATE snapshots",
    "SET session_replication_role = replica",
    "ALTER TABLE events DISABLE TRIGGER ALL",
    "ALTER TABLE events DISABLE TRIGGER events_refuse_truncate",
    "ALTER TABLE snapshots DISABLE TRIGGER ALL",
    "DROP TRIGGER events_refuse_update_delete ON events",
    "DROP TABLE events",
    "DROP TABLE snapshots",
    "CREATE TABLE events_copy (position bigint)",
    "CREATE FUNCTION kvl_noop() RETURNS int LANGUAGE sql AS 'SELECT 1'",
    "ALTER TABLE events OWNER TO CURRENT_USER",
    "UPDATE alembic_version SET version_num = '0001'",
    "DELETE FROM leader",
    "DELETE FROM leader_renewal",
    "TRUNCATE leader",
    f"SET ROLE {WRITER_ROLE}; SET session_replication_role = replica",
    "ALTER ROLE CURRENT_USER SUPERUSER",
    "ALTER ROLE CURRENT_USER REPLICATION",
]


@pytest.mark.parametrize("statement", BYPASSES)
async def test_the_app_role_cannot_edit_history_or_switch_the_guard_off(
        app_log: PostgresEventLog, app_role: tuple[str, str], migrated: str, statement: str) -> None:
    epoch = await app_log.take_leadership("me")
    await app_log.append([ev("a", 1), ev("b", 2)], epoch)
    await app_log.save_snapshot(Snapshot(2, "h", b"state", epoch), epoch)
    before = await _contents(migrated)
    conn = await asyncpg.connect(app_role[1])
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute(statement)
        # the replica-role bypass inside one transaction, as an attacker would write it
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            async with conn.transaction():
                await conn.execute("SET LOCAL session_replication_role = replica")
                await conn.execute("DELETE FROM events")
    finally:
        await conn.close()
    assert await _contents(migrated) == before
    assert [e.type for e in await app_log.read()] == ["t", "t"]


async def test_snapshots_are_append_only_even_for_the_owner(migrated: str) -> None:
    log = PostgresEventLog.connect(PgSettings(url=migrated))
    try:
        epoch = await log.take_leadership("me")
        await log.append([ev("a")], epoch)
        await log.save_snapshot(Snapshot(1, "h", b"s", epoch), epoch)
    finally:
        await log.close()
    conn = await asyncpg.connect(migrated)
    try:
        for statement in ("DELETE FROM snapshots", "DELETE FROM snapshots WHERE false", "TRUNCATE snapshots"):
            with pytest.raises(asyncpg.RestrictViolationError, match="append-only"):
                await conn.execute(statement)
        assert await conn.fetchval("SELECT count(*) FROM snapshots") == 1
    finally:
        await conn.close()


async def test_the_writer_role_holds_exactly_its_privileges(app_role: tuple[str, str], migrated: str) -> None:
    name = app_role[0]
    expected = {
        "events": {"SELECT", "INSERT"}, "snapshots": {"SELECT", "INSERT"},
        "leader": {"SELECT", "UPDATE"}, "leader_renewal": {"SELECT", "INSERT", "UPDATE"},
        "alembic_version": {"SELECT"}, "log_archives": {"SELECT"}, "log_stream_floors": {"SELECT"},
    }
    all_privileges = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")
    conn = await asyncpg.connect(migrated)
    try:
        for role in (WRITER_ROLE, name):
            for table, want in expected.items():
                have = {p for p in all_privileges
                        if await conn.fetchval("SELECT has_table_privilege($1, $2, $3)", role, table, p)}
                assert have == want, (role, table, have)
            assert not await conn.fetchval("SELECT has_schema_privilege($1, current_schema(), 'CREATE')", role)
            # retention is the owner's: the coordinator may not archive (delete) history
            assert not await conn.fetchval(
                "SELECT has_function_privilege($1, 'kvl_archive(bigint, bigint, text, text, text, text[])', 'EXECUTE')", role)
            attrs = await conn.fetchrow("SELECT rolsuper, rolreplication, rolbypassrls, rolcreaterole, rolcreatedb "
                                        "FROM pg_roles WHERE rolname = $1", role)
            assert not any(attrs), (role, dict(attrs))
            owned = await conn.fetchval("SELECT count(*) FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner "
                                        "WHERE r.rolname = $1", role)
            assert owned == 0
        assert not await conn.fetchval("SELECT rolcanlogin FROM pg_roles WHERE rolname = $1", WRITER_ROLE)
        groups = await conn.fetch("SELECT g.rolname FROM pg_auth_members m JOIN pg_roles g ON g.oid = m.roleid "
                                  "JOIN pg_roles u ON u.oid = m.member WHERE u.rolname = $1", name)
        assert [g[0] for g in groups] == [WRITER_ROLE]
    finally:
        await conn.close()


async def test_login_roles_that_would_defeat_the_guard_are_refused(migrated: str) -> None:
    owner = await (await asyncpg.connect(migrated)).fetchval("SELECT current_user")
    with pytest.raises(RoleError, match="owner"):
        await ensure_login_role(migrated, owner, "x")
    name = f"kvl_t_su_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(migrated)
    try:
        await conn.execute(f'CREATE ROLE "{name}" LOGIN SUPERUSER')
        with pytest.raises(RoleError, match="SUPERUSER"):
            await ensure_login_role(migrated, name, "x")
    finally:
        await conn.execute(f'DROP ROLE "{name}"')
        await conn.close()


@pytest.mark.parametrize("copy_min_events", [0, 1], ids=["kvl_append", "copy"])
async def test_the_app_role_runs_the_log_and_a_takeover_of_a_stale_leader(
        app_role: tuple[str, str], migrated: str, copy_min_events: int) -> None:
    """Two coordinators of the same role: the standby terminates the paused leader's sessions
    (pg_terminate_backend works between sessions of one role) and fences it; with every append
    by ``kvl_append`` or every one by COPY."""
    url = app_role[1]
    a = LeaderElection(PgSettings(url=url), make_holder_id(), renew_interval_s=0.1, takeover_after_s=0.6)
    b = LeaderElection(PgSettings(url=url), make_holder_id(), renew_interval_s=0.1, takeover_after_s=0.6)
    a_log = PostgresEventLog.connect(PgSettings(url=url, application_name=a.app_name, copy_min_events=copy_min_events))
    b_log = PostgresEventLog.connect(PgSettings(url=url, application_name=b.app_name, copy_min_events=copy_min_events))
    try:
        epoch_a = await a.acquire()
        await a_log.append([ev("a")], epoch_a)
        await a_log.save_snapshot(Snapshot(1, "h", b"s", epoch_a), epoch_a)
        assert a._renew is not None
        a._renew.cancel()  # "pause": the lock session stays open but renewals stop
        lock_pid = a._conn.get_server_pid() if a._conn is not None else None
        t0 = time.monotonic()
        epoch_b = await asyncio.wait_for(b.acquire(poll_s=0.05), 10)
        assert epoch_b == epoch_a + 1 and time.monotonic() - t0 < 5
        conn = await asyncpg.connect(migrated)
        try:  # the paused leader's lock session was terminated by the standby, not just outlived
            assert await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", lock_pid) == 0
        finally:
            await conn.close()
        with pytest.raises((NotLeader, LogUnavailable)):
            await a_log.append([ev("a")], epoch_a)
        with pytest.raises(NotLeader):
            await a_log.append([ev("a")], epoch_a)
        assert await b_log.append([ev("b")], epoch_b) == [2]
        await b_log.save_snapshot(Snapshot(2, "h2", b"s2", epoch_b), epoch_b)
        latest = await b_log.latest_snapshot()
        assert latest is not None and latest.position == 2
        assert (await b_log.leader()).leader_epoch == epoch_b
        assert a_log.append_paths["copy"] + b_log.append_paths["copy"] == (2 if copy_min_events else 0)
    finally:
        await a_log.close()
        await b_log.close()
        await a.release()
        await b.release()


async def test_another_writer_role_may_not_terminate_the_leaders_sessions(
        app_role: tuple[str, str], migrated: str) -> None:
    """Why leader and standbys must share one login role: a *different* member of kvledger_writer
    has no right to signal the leader's backends."""
    other, other_url = await _make_role(migrated)
    leader = await asyncpg.connect(app_role[1])
    conn = await asyncpg.connect(other_url)
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.fetchval("SELECT pg_terminate_backend($1)", leader.get_server_pid())
        assert not leader.is_closed()
    finally:
        await conn.close()
        await leader.close()
        await _drop_role(migrated, other)


async def test_the_coordinator_works_end_to_end_as_the_app_role(
        app_role: tuple[str, str], nats_url: str, subjects: Subjects) -> None:
    cfg = fast_config(app_role[1], nats_url, subjects)
    nc = await nats.connect(nats_url)
    try:
        async with running_coordinator(cfg) as (app, base):
            w = Worker(nc, subjects)
            await w.register()
            await w.watch_watermarks()
            grant = await w.fill([block(i) for i in range(3)])     # the transitions are committed
            assert app[COORDINATOR].ledger.state.committed_seq("w1", 1) == 3
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{base}/v1/snapshot") as r:
                    snap = await r.json()
            assert r.status == 200 and snap["position"] > 0, snap
            position = app[COORDINATOR].ledger.position
        async with running_coordinator(cfg) as (app, base):
            ledger = app[COORDINATOR].ledger
            assert ledger.last_replay["snapshot_position"] == snap["position"]
            assert ledger.last_replay["position"] == position
            assert grant.lease_id in ledger.state.leases
    finally:
        await nc.drain()


async def test_a_coordinator_that_may_not_migrate_waits_for_the_owner(
        app_role: tuple[str, str], migrated: str, nats_url: str, subjects: Subjects) -> None:
    """Schema behind (here: downgraded to 0002 by the owner) and a role that may not migrate: the
    coordinator does not lead, says why, and leads once the owner has upgraded."""
    from alembic import command
    from structlog.testing import capture_logs

    from coordinator.log.migrate import alembic_config, current
    from tests.integration.coordinator_kit import wait_ready

    owner = PostgresEventLog.connect(PgSettings(url=migrated))
    try:
        async with owner.engine.begin() as conn:
            def down(sync_conn: object) -> None:
                cfg = alembic_config()
                cfg.attributes["connection"] = sync_conn
                command.downgrade(cfg, "0002")
            await conn.run_sync(down)
        assert await current(owner.engine) == "0002"
        cfg = fast_config(app_role[1], nats_url, subjects)
        with capture_logs() as logs:
            async with running_coordinator(cfg, ready=False) as (app, base):
                deadline = time.monotonic() + 10
                while not any(e.get("event") == "event_log_schema_behind" for e in logs):
                    assert time.monotonic() < deadline, logs
                    await asyncio.sleep(0.05)
                async with aiohttp.ClientSession() as http:
                    async with http.get(f"{base}/readyz") as r:
                        assert r.status == 503
                assert await current(owner.engine) == "0002"  # it did not (could not) migrate
                assert await upgrade(owner.engine) == head_revision()
                await wait_ready(base, 15)
    finally:
        await owner.close()
