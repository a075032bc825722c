"""The coordinator as an operator meets it: `kvledger db upgrade|current`, one readable line for a
configuration or connection problem, SIGTERM, and the embedded path with no URLs at all."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from shared.subjects import Subjects
from tests.e2e.coordinator_processes import REPO, CoordinatorProcess, clean_env, coordinators  # noqa: F401

KVLEDGER = [sys.executable, "-c", "import sys; from kvledger.cli import main; sys.exit(main())"]


def kvledger(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVLEDGER, *args], cwd=REPO, env=env or clean_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_db_upgrade_and_current(database_url: str) -> None:
    env = clean_env(KVL_DATABASE_URL=database_url)
    before = kvledger("db", "current", env=env)
    assert before.returncode == 1 and "current: (none)" in before.stdout and "not migrated" in before.stdout
    up = kvledger("db", "upgrade", env=env)
    assert up.returncode == 0, up.stderr
    assert "event log schema at revision 0006" in up.stdout
    after = kvledger("db", "current", env=env)
    assert after.returncode == 0 and "up to date" in after.stdout


def test_operator_errors_are_one_readable_line(tmp_path: Path, database_url: str, nats_url: str,
                                              subjects: Subjects) -> None:
    bad_key = kvledger("coordinator", env=clean_env(KVL_COORDINATOR__PORT="eighty"))
    assert bad_key.returncode == 2
    assert bad_key.stderr.strip().splitlines() == [
        "kvledger: configuration error: config key coordinator.port: Expected `int`, got `str`"]

    no_db = database_url.rsplit("/", 1)[0] + "/no_such_database"
    missing = subprocess.run(
        [sys.executable, "-m", "coordinator", "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=60,
        env=clean_env(KVL_DATABASE_URL=no_db, KVL_NATS_URL=nats_url, KVL_LOGGING__LEVEL="error",
                      KVL_NATS__SUBJECT_PREFIX=subjects.prefix))  # its stream is the fixture's to delete
    assert missing.returncode == 2
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvledger coordinator: PostgreSQL at "), missing.stderr
    assert 'database "no_such_database" does not exist' in lines[0]
    assert "Traceback" not in missing.stderr

    no_nats = subprocess.run(
        [sys.executable, "-m", "coordinator", "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=60,
        env=clean_env(KVL_DATABASE_URL=database_url, KVL_NATS_URL="nats://127.0.0.1:9", KVL_LOGGING__LEVEL="error"))
    assert no_nats.returncode == 2
    assert no_nats.stderr.strip().startswith("kvledger coordinator: cannot connect to NATS at nats://127.0.0.1:9")
    assert "Traceback" not in no_nats.stderr


async def test_embedded_services_when_no_url_is_set_and_clean_sigterm(
        tmp_path: Path, coordinators: list[CoordinatorProcess]) -> None:
    c = CoordinatorProcess("embedded", tmp_path)  # no database.url, no nats.url
    coordinators.append(c.start())
    ready = await c.wait_status("serving", timeout_s=90)
    assert ready["leader_epoch"] == 1
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{c.base}/v1/snapshot") as r:  # loopback: no token needed
            assert r.status == 200, await r.text()
    assert c.terminate() == 0
    text = c.text()
    assert "embedded_services_started" in text and "embedded_services_stopped" in text
    assert "coordinator_stopped" in text
    # the embedded PostgreSQL kept the log: a second run replays it
    c.start()
    again = await c.wait_status("serving", timeout_s=90)
    assert again["leader_epoch"] == 2 and again["last_replay"]["snapshot_position"] is not None
    c.signal(signal.SIGINT)
    assert c.popen is not None and c.popen.wait(30) == 0



async def test_services_start_a_nats_with_one_user_per_participant(tmp_path: Path, database_url: str) -> None:
    """`kvledger services` (for processes run by hand) gives its embedded NATS the same users as
    `kvledger up`: anonymous clients are refused, a worker's password file lets it in."""
    import nats
    import nats.errors

    proc = subprocess.Popen([*KVLEDGER, "services", "--worker", "w0"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=clean_env(KVL_STATE_DIR=str(tmp_path / "state"), KVL_DATABASE_URL=database_url))
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(4)]
        assert lines[-1].startswith("(Ctrl-C stops them)"), lines
        url = lines[1].split()[1]
        creds = tmp_path / "state" / "nats" / "credentials"
        assert f"passwords in {creds}/<user>.password" in lines[2] and "worker.w0" in lines[2]
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
        nc = await nats.connect(url, user="worker.w0", password=(creds / "worker.w0.password").read_text().strip(),
                                inbox_prefix="_INBOX.worker.w0", allow_reconnect=False)
        assert nc.is_connected
        await nc.close()
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "stopped" in out


async def test_rolling_the_schema_back_and_a_schema_too_new_for_a_coordinator(
        tmp_path: Path, database_url: str, nats_url: str, subjects: Subjects,
        coordinators: list[CoordinatorProcess]) -> None:
    """A rollback's schema step (docs/operations.md, 'Releases and rollback'): `db downgrade` takes
    the schema back one release and `db upgrade` forward again; it is refused while a coordinator
    is connected and for a revision that is not older; and a coordinator meeting a schema newer
    than it knows refuses to start with one line saying what to do."""
    import asyncpg

    env = clean_env(KVL_DATABASE_URL=database_url)
    assert kvledger("db", "upgrade", env=env).returncode == 0
    not_older = kvledger("db", "downgrade", "0006", env=env)
    assert not_older.returncode == 1 and "refused: the schema is at 0006; 0006 is not older" in not_older.stderr
    unknown = kvledger("db", "downgrade", "0099", env=env)
    assert unknown.returncode == 1 and "'0099' is not one of this release's: 0001, 0002, 0003, 0004, 0005, 0006" in unknown.stderr
    c = CoordinatorProcess("leader", tmp_path, database_url=database_url, nats_url=nats_url, subjects=subjects)
    coordinators.append(c.start())
    await c.wait_status("serving", timeout_s=90)
    busy = kvledger("db", "downgrade", "0003", env=env)
    assert busy.returncode == 1 and "coordinator session(s) are connected" in busy.stderr, busy.stderr
    assert c.terminate() == 0
    down = kvledger("db", "downgrade", "0003", env=env)
    assert down.returncode == 0 and "event log schema at revision 0003" in down.stdout, down.stderr
    behind = kvledger("db", "current", env=env)
    assert behind.returncode == 1 and "current: 0003" in behind.stdout
    assert kvledger("db", "upgrade", env=env).returncode == 0
    # a newer release migrated the database: this coordinator refuses, naming both revisions
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("UPDATE alembic_version SET version_num = '0099'")
    finally:
        await conn.close()
    newer = subprocess.run(
        [sys.executable, "-m", "coordinator", "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=60,
        env=clean_env(KVL_DATABASE_URL=database_url, KVL_NATS_URL=nats_url, KVL_LOGGING__LEVEL="error",
                      KVL_NATS__SUBJECT_PREFIX=subjects.prefix))
    assert newer.returncode != 0 and "Traceback" not in newer.stderr
    assert "schema is at revision 0099, which this coordinator (schema 0006) does not know" in newer.stderr + newer.stdout
    assert "kvledger db downgrade 0006" in newer.stderr + newer.stdout
