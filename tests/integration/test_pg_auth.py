"""The embedded PostgreSQL is closed (issue 51): a SCRAM password for every connection, a unix
socket only its owner can open, and a data directory made with ``trust`` by an older build is
upgraded on its next start.

These tests always start their own embedded server (whatever KVL_TEST_* say): the attack was
on the embedded one (``initdb --auth=trust``: any local user in as superuser, any password
accepted for the coordinator's role).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from coordinator.log.migrate import upgrade
from coordinator.log.postgres import PgSettings, PostgresEventLog
from coordinator.log.roles import ensure_login_role, with_credentials
from shared.embedded import PG_SYSTEM_USER, EmbeddedPostgres

#: What asyncpg raises when the server asks for a password it was not given, or refuses one.
REFUSED = (asyncpg.InvalidAuthorizationSpecificationError, asyncpg.InterfaceError)


@pytest.fixture
def pg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EmbeddedPostgres]:
    for var in ("PGPASSWORD", "PGPASSFILE", "PGUSER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PGPASSFILE", str(tmp_path / "no-such-pgpass"))
    server = EmbeddedPostgres(tmp_path / "postgres").start()
    try:
        yield server
    finally:
        server.stop()


def _without_password(url: str) -> str:
    return with_credentials(url, "postgres", "").replace("postgres:@", "postgres@")


async def _refused(dsn: str) -> BaseException:
    try:
        conn = await asyncpg.connect(dsn, timeout=10)
    except REFUSED as e:
        return e
    await conn.close()
    raise AssertionError(f"connected to {dsn.split('@')[-1]} without the right password")


def test_no_connection_without_the_password(pg: EmbeddedPostgres) -> None:
    async def go() -> None:
        # the superuser's own URL works ...
        conn = await asyncpg.connect(pg.url)
        assert await conn.fetchval("SELECT current_user") == "postgres"
        await conn.close()
        # ... but not without its password (TCP), nor with a wrong one, nor over the socket
        e = await _refused(_without_password(pg.url))
        assert "password" in str(e).lower()
        await _refused(with_credentials(pg.url, "postgres", "not-the-password"))
        await _refused(f"postgresql://postgres@/postgres?host={pg.socket_dir}&port={pg.port}")

    asyncio.run(go())


def test_coordinator_role_needs_its_own_password(pg: EmbeddedPostgres) -> None:
    async def go() -> None:
        log = PostgresEventLog.connect(PgSettings(url=pg.url))
        try:
            await upgrade(log.engine)
        finally:
            await log.close()
        await ensure_login_role(pg.url, "kvledger_coordinator", "the-right-password")
        conn = await asyncpg.connect(with_credentials(pg.url, "kvledger_coordinator", "the-right-password"))
        assert await conn.fetchval("SELECT current_user") == "kvledger_coordinator"
        await conn.close()
        e = await _refused(with_credentials(pg.url, "kvledger_coordinator", "a-wrong-password"))
        assert isinstance(e, asyncpg.InvalidPasswordError), e
        await _refused(with_credentials(pg.url, "kvledger_coordinator", "").replace(":@", "@"))
        # stored as a SCRAM verifier, never as MD5 or plain text
        conn = await asyncpg.connect(pg.url)
        verifier = await conn.fetchval("SELECT rolpassword FROM pg_authid WHERE rolname = 'kvledger_coordinator'")
        assert verifier.startswith("SCRAM-SHA-256$")
        hba = await conn.fetch("SELECT type, address, auth_method FROM pg_hba_file_rules")
        await conn.close()
        assert {r["auth_method"] for r in hba} == {"scram-sha-256"}
        assert {r["address"] for r in hba if r["type"] == "host"} == {"127.0.0.1", "::1"}

    asyncio.run(go())


def test_socket_and_password_file_are_the_owners_only(pg: EmbeddedPostgres) -> None:
    sock = pg.socket_dir / f".s.PGSQL.{pg.port}"
    assert stat.S_IMODE(pg.socket_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(sock.stat().st_mode) == 0o700
    assert stat.S_IMODE(pg.password_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(pg.data_dir.stat().st_mode) == 0o700
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        return
    # as root (CI's containers): OS user nobody can neither reach the socket nor get in by TCP
    psql = str(pg.bin_dir() / "psql")
    for target in (["-h", str(pg.socket_dir)], ["-h", "127.0.0.1"]):
        r = subprocess.run(["runuser", "-u", "nobody", "--", psql, *target, "-p", str(pg.port), "-U", "postgres",
                            "-d", "postgres", "-w", "-X", "-c", "SELECT 1"],
                           capture_output=True, text=True, timeout=30, env={"PATH": os.environ["PATH"]})
        assert r.returncode != 0, (target, r.stdout)
        assert "Permission denied" in r.stderr or "password" in r.stderr, r.stderr
    assert PG_SYSTEM_USER  # the server's own user is the one that may


def test_a_trust_data_directory_is_upgraded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A state directory made by the old build (``initdb --auth=trust``, no password file) keeps its
    data and comes back closed: a password for the superuser, SCRAM only."""
    monkeypatch.setenv("PGPASSFILE", str(tmp_path / "no-such-pgpass"))
    monkeypatch.delenv("PGPASSWORD", raising=False)
    old = EmbeddedPostgres(tmp_path / "postgres").start()
    # what the old build left: a superuser without a password, trust everywhere, no password file

    async def make_old() -> None:
        conn = await asyncpg.connect(old.url)
        await conn.execute("CREATE TABLE kept (v int); INSERT INTO kept VALUES (51)")
        await conn.execute("ALTER ROLE postgres PASSWORD NULL")
        await conn.close()

    asyncio.run(make_old())
    old.stop()
    hba = old.data_dir / "pgdata" / "pg_hba.conf"
    hba.write_text("local all all trust\nhost all all 127.0.0.1/32 trust\nhost all all ::1/128 trust\n"
                   "local replication all trust\nhost replication all 127.0.0.1/32 trust\n")
    old.password_file.unlink()

    server = EmbeddedPostgres(old.data_dir).start()
    try:
        async def go() -> None:
            conn = await asyncpg.connect(server.url)
            rules = await conn.fetch("SELECT auth_method FROM pg_hba_file_rules")
            assert await conn.fetchval("SELECT v FROM kept") == 51
            await conn.close()
            assert {r["auth_method"] for r in rules} == {"scram-sha-256"}
            await _refused(_without_password(server.url))

        asyncio.run(go())
        assert stat.S_IMODE(server.password_file.stat().st_mode) == 0o600
    finally:
        server.stop()
    # and the next start is an ordinary one
    again = EmbeddedPostgres(old.data_dir).start()
    try:
        async def check() -> None:
            conn = await asyncpg.connect(again.url)
            assert await conn.fetchval("SELECT 1") == 1
            await conn.close()
            await _refused(_without_password(again.url))
        asyncio.run(check())
    finally:
        again.stop()
