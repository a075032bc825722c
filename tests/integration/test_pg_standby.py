"""The embedded PostgreSQL's streaming standby (shared/pg_standby.py), on real servers.

A primary and its standby made with ``pg_basebackup -R``: a synchronous standby holds a commit
until it has flushed it (a stopped standby stalls the commit; an asynchronous one does not);
``kvledger db promote`` refuses while the primary runs, promotes once it was killed with
SIGKILL, and the multi-host ``target_session_attrs=read-write`` URL then reaches the promoted
standby with every committed row; what an asynchronous standby can lose (a commit acknowledged
while it was down is not on it when promoted); only the replication role may replicate; and
compose's initdb script makes that role, its slot and its pg_hba line on a real server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import psutil
import pytest

from shared import pg_standby
from shared.embedded import EmbeddedPostgres
from tests.e2e.coordinator_processes import REPO, clean_env


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A directory outside pytest's base temp dir. NOTE: as root the servers run as an unprivileged
    user that must traverse the path, and every pytest session that starts resets its base
    directory (``/tmp/pytest-of-<user>``) to 0700: another session starting meanwhile made
    initdb and pg_basebackup fail with "Permission denied" here."""
    d = Path(tempfile.mkdtemp(prefix="kvl-pg-standby-"))
    d.chmod(0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[EmbeddedPostgres, pg_standby.EmbeddedStandby]]:
    primary = EmbeddedPostgres(tmp_path / "postgres").start()
    standby = None
    try:
        standby = pg_standby.start_standby(primary, tmp_path, synchronous=True)
        yield primary, standby
    finally:
        if standby is not None:
            with_cont(standby)
            standby.stop()
        primary.stop()


def signal_all(pg: EmbeddedPostgres, sig: int) -> None:
    """``sig`` to the server and every process of it (PostgreSQL's children each lead a process
    group of their own, so ``killpg`` of the postmaster reaches only the postmaster)."""
    if pg.proc is None:
        return
    main = psutil.Process(pg.proc.pid)
    for p in [main, *main.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)


def with_cont(pg: EmbeddedPostgres) -> None:
    signal_all(pg, signal.SIGCONT)


async def _insert(url: str, value: int, timeout_s: float) -> None:
    conn = await asyncpg.connect(url, timeout=5)
    try:
        await asyncio.wait_for(conn.execute("INSERT INTO t VALUES ($1)", value), timeout_s)
    finally:
        conn.terminate()


def test_a_synchronous_standby_holds_the_commit_and_an_asynchronous_one_does_not(pair) -> None:
    primary, standby = pair
    assert pg_standby.replication_state(primary)["sync_state"] == "sync"
    asyncio.run(_run(primary.url, "CREATE TABLE t (x int)"))
    assert standby.proc is not None
    signal_all(standby, signal.SIGSTOP)  # every process of the standby, its WAL receiver included
    try:
        with pytest.raises(asyncio.TimeoutError):
            asyncio.run(_insert(primary.url, 1, 2.0))
    finally:
        signal_all(standby, signal.SIGCONT)

    pg_standby.set_synchronous(primary, False)
    assert pg_standby.replication_state(primary)["sync_state"] == "async"
    signal_all(standby, signal.SIGSTOP)
    try:
        asyncio.run(_insert(primary.url, 2, 10.0))  # returns at the primary's own flush
    finally:
        signal_all(standby, signal.SIGCONT)


async def _run(url: str, sql: str) -> object:
    conn = await asyncpg.connect(url, timeout=5)
    try:
        return await conn.fetchval(sql)
    finally:
        await conn.close()


def promote(state_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvledger.cli", "db", "promote", "--state-dir", str(state_dir)],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)


def test_promote_after_the_primary_is_killed_keeps_every_committed_row(pair, tmp_path: Path) -> None:
    primary, standby = pair
    url = pg_standby.failover_url(primary.url, (standby.host, standby.port))

    async def fill() -> None:
        conn = await asyncpg.connect(url, timeout=5)
        try:
            assert await conn.fetchval("SELECT inet_server_port()") == primary.port
            await conn.execute("CREATE TABLE t (x int PRIMARY KEY)")
            for i in range(200):  # each its own commit, each acknowledged once the standby flushed it
                await conn.execute("INSERT INTO t VALUES ($1)", i)
        finally:
            await conn.close()

    asyncio.run(fill())
    refused = promote(tmp_path)
    assert refused.returncode == 1 and "still runs" in refused.stderr, refused.stdout + refused.stderr
    assert not standby.promoted

    signal_all(primary, signal.SIGKILL)  # kill -9 of every process: a lost machine, as far as PostgreSQL can tell
    primary.proc.wait(10)
    primary.proc = None
    with pytest.raises((OSError, asyncpg.InternalClientError)):  # nothing accepts writes yet
        asyncio.run(_run(url, "SELECT 1"))
    done = promote(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert standby.promoted

    async def check() -> None:
        conn = await asyncpg.connect(url, timeout=5)
        try:
            assert await conn.fetchval("SELECT inet_server_port()") == standby.port
            assert await conn.fetchval("SELECT count(*) FROM t") == 200
            await conn.execute("INSERT INTO t VALUES (200)")  # it takes writes, and waits for no standby
        finally:
            await conn.close()

    asyncio.run(check())
    again = promote(tmp_path)
    assert again.returncode == 1 and "promoted already" in again.stderr
    # the next `kvledger up` beside it refuses, with a standby or without: the old primary is behind
    from kvledger.pg_failover import PgFailover

    with pytest.raises(pg_standby.StandbyError, match="was promoted"):
        pg_standby.start_standby(primary, tmp_path, synchronous=True)
    with pytest.raises(pg_standby.StandbyError, match="was promoted"):
        PgFailover.without_standby(primary, tmp_path)


def test_an_asynchronous_standby_loses_what_it_had_not_received(pair, tmp_path: Path) -> None:
    """What ``database.synchronous_standby: false`` can lose (docs/architecture.md): a commit
    acknowledged while the standby lagged is not on it when it is promoted."""
    primary, standby = pair
    asyncio.run(_run(primary.url, "CREATE TABLE t (x int)"))
    pg_standby.set_synchronous(primary, False)
    standby.stop()  # down for a moment (a restart, a network blip): nothing reaches it meanwhile
    asyncio.run(_insert(primary.url, 1, 10.0))  # acknowledged at the primary's own flush
    signal_all(primary, signal.SIGKILL)
    primary.proc.wait(10)
    primary.proc = None
    standby.start()
    assert promote(tmp_path).returncode == 0
    assert asyncio.run(_run(standby.url, "SELECT count(*) FROM t")) == 0


def test_both_restart_the_primary_on_a_new_port_and_the_standby_streams_again(tmp_path: Path) -> None:
    """A second `kvledger up`: the primary gets a new port, its data directory still names the
    standby synchronous (no commit may wait for it before it streams), the standby follows the
    new address; run later without a standby, the primary must not wait for one either."""
    from kvledger.pg_failover import PgFailover

    primary = EmbeddedPostgres(tmp_path / "postgres").start()
    standby = pg_standby.start_standby(primary, tmp_path, synchronous=True)
    asyncio.run(_run(primary.url, "CREATE TABLE t (x int)"))
    first_port = primary.port
    standby.stop()
    primary.stop()
    primary = EmbeddedPostgres(tmp_path / "postgres").start()
    try:
        assert primary.port != first_port and pg_standby.synchronous_configured(primary)
        standby = pg_standby.start_standby(primary, tmp_path, synchronous=True, timeout_s=60)
        assert pg_standby.replication_state(primary)["sync_state"] == "sync"
        asyncio.run(_insert(primary.url, 1, 10.0))
        assert asyncio.run(_run(standby.url, "SELECT count(*) FROM t")) == 1
        standby.stop()
        PgFailover.without_standby(primary, tmp_path)
        assert not pg_standby.synchronous_configured(primary)
        asyncio.run(_insert(primary.url, 2, 10.0))  # no standby runs: the commit must not wait for one
    finally:
        standby.stop()
        primary.stop()


def test_only_the_replication_role_may_replicate(pair, tmp_path: Path) -> None:
    primary, _ = pair
    r = subprocess.run([str(primary.bin_dir() / "pg_basebackup"), "-D", str(tmp_path / "copy"), "-h", primary.host,
                        "-p", str(primary.port), "-U", "postgres", "-w"],
                       env={**os.environ, "PGPASSWORD": primary.password}, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "pg_hba.conf" in r.stderr, r.stderr
    password_file = primary.data_dir / pg_standby.REPLICATION_PASSWORD_FILE
    assert password_file.stat().st_mode & 0o777 == 0o600


def test_compose_initdb_script_makes_the_replication_role_slot_and_hba_line(tmp_path: Path) -> None:
    """deploy/postgres/initdb/10-replication.sh (compose's postgres, once per volume), run for real
    the way the image's entrypoint runs it: psql as the owner, ``$PGDATA`` its data directory."""
    pg = EmbeddedPostgres(tmp_path / "postgres").start()
    try:
        pgdata = tmp_path / "pgdata"
        pgdata.mkdir()
        (pgdata / "pg_hba.conf").write_text("# the image's own lines\n")
        env = {"PATH": f"{pg.bin_dir()}:{os.environ['PATH']}", "PGHOST": pg.host, "PGPORT": str(pg.port),
               "PGPASSWORD": pg.password, "POSTGRES_USER": "postgres", "POSTGRES_DB": "postgres",
               "PGDATA": str(pgdata), "KVL_PG_REPLICATION_PASSWORD": "it's-a-secret"}
        r = subprocess.run(["sh", str(REPO / "deploy" / "postgres" / "initdb" / "10-replication.sh")], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert (pgdata / "pg_hba.conf").read_text().endswith(
            "host replication kvledger_replication all scram-sha-256\n")

        async def check() -> None:
            conn = await asyncpg.connect(pg.url, timeout=5)
            try:
                row = await conn.fetchrow("SELECT rolcanlogin, rolreplication, rolsuper, rolcreaterole, rolcreatedb "
                                          "FROM pg_roles WHERE rolname = 'kvledger_replication'")
                assert tuple(row) == (True, True, False, False, False)
                assert await conn.fetchval("SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'kvl_standby'") == 1
            finally:
                await conn.close()
            # its password is the one given, quote and all (SCRAM, checked by the server)
            as_role = await asyncpg.connect(host=pg.host, port=pg.port, user="kvledger_replication",
                                            password="it's-a-secret", database="postgres", timeout=5)
            await as_role.close()

        asyncio.run(check())
        assert "synchronous_standby_names = 'kvl_standby'" in (pg.data_dir / "pgdata" / "postgresql.auto.conf").read_text()
    finally:
        pg.stop()
