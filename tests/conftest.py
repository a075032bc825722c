"""Fixtures backed by real servers.

``KVL_TEST_DATABASE_URL`` / ``KVL_TEST_NATS_URL`` name servers to use (this machine runs
both); otherwise one embedded PostgreSQL and one embedded nats-server are started for the
session. Each test then gets its own database and its own NATS subject prefix (hence its
own JetStream stream), so tests never see each other's state and can run in parallel.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import nats
import pytest
from hypothesis import settings

from shared.embedded import Services, start_services
from shared.subjects import Subjects

# NOTE: CI (.ci/run sets HYPOTHESIS_PROFILE=ci) draws the same examples on every run, so a property
# test that fails there fails again on a rerun and a change cannot land or be held back by the
# luck of a draw; a developer's run draws new examples each time (the "dev" profile) and prints
# the blob that reproduces a failure (@reproduce_failure).
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture(scope="session")
def services() -> Iterator[Services]:
    state = tempfile.mkdtemp(prefix="kvl-test-services-")
    svc = start_services(os.environ.get("KVL_TEST_DATABASE_URL", ""),
                         os.environ.get("KVL_TEST_NATS_URL", ""), state)
    try:
        yield svc
    finally:
        svc.stop()


def _admin_dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://")


def _with_db(url: str, db: str) -> str:
    base, _, _ = url.rpartition("/")
    return f"{base}/{db}"


class _Databases:
    """Fresh, empty databases for the tests, each made before a test asks for it.

    ``CREATE DATABASE`` copies the template and waits for its WAL to reach disk: 0.1 s on an idle
    machine, 0.4-0.6 s while the tests load it, and as long again for the ``DROP``, for each of
    ~200 tests. A thread of its own makes the next database while a test runs and drops the used
    ones behind it, so a test waits only when it asks faster than the server makes them.
    """

    def __init__(self, admin_dsn: str) -> None:
        self._dsn = admin_dsn
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvl-test-db")
        self._next: concurrent.futures.Future[str] | None = None

    def _run(self, sql: str) -> None:
        async def go() -> None:
            conn = await asyncpg.connect(self._dsn)
            try:
                await conn.execute(sql)
            finally:
                await conn.close()

        asyncio.run(go())

    def _create(self) -> str:
        name = f"kvl_t_{uuid.uuid4().hex[:12]}"
        self._run(f'CREATE DATABASE "{name}"')
        return name

    def take(self) -> str:
        ready, self._next = self._next, self._pool.submit(self._create)
        return ready.result() if ready is not None else self._create()

    def give_back(self, name: str) -> None:
        self._pool.submit(self._run, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def close(self) -> None:
        if self._next is not None:
            with contextlib.suppress(Exception):
                self.give_back(self._next.result())
        self._pool.shutdown(wait=True)


@pytest.fixture(scope="session")
def _databases(services: Services) -> Iterator[_Databases]:
    dbs = _Databases(_admin_dsn(services.database_url))
    try:
        yield dbs
    finally:
        dbs.close()


@contextlib.contextmanager
def _fresh_database(services: Services, dbs: _Databases) -> Iterator[str]:
    name = dbs.take()
    try:
        yield _with_db(_admin_dsn(services.database_url), name)
    finally:
        dbs.give_back(name)


@pytest.fixture
def database_url(services: Services, _databases: _Databases) -> Iterator[str]:
    """A fresh, empty database for this test (dropped afterwards)."""
    with _fresh_database(services, _databases) as url:
        yield url


@pytest.fixture
def other_database_url(services: Services, _databases: _Databases) -> Iterator[str]:
    """A second fresh, empty database, for a test that compares two logs."""
    with _fresh_database(services, _databases) as url:
        yield url


@pytest.fixture
def nats_url(services: Services) -> str:
    return services.nats_url


@pytest.fixture
def subjects(services: Services) -> Iterator[Subjects]:
    """A unique subject prefix (and JetStream stream) for this test; the stream is deleted after."""
    subj = Subjects(prefix=f"kvlt{uuid.uuid4().hex[:10]}")
    yield subj

    async def cleanup() -> None:
        nc = await nats.connect(services.nats_url)
        try:
            js = nc.jetstream()
            try:
                await js.delete_stream(subj.stream_name)
            except Exception:  # noqa: BLE001 - the test may never have created it
                pass
        finally:
            await nc.drain()

    asyncio.run(cleanup())


@pytest.fixture
async def cluster(tmp_path, database_url: str, nats_url: str, subjects: Subjects) -> AsyncIterator[Any]:
    """Real coordinator and worker processes on this test's database and subject prefix, as the
    test starts them (:class:`tests.worker.processes.Cluster`); all stopped afterwards."""
    from tests.worker.processes import running_cluster   # here, not at the top: the unit tests need no torch

    async with running_cluster(tmp_path, database_url, nats_url, subjects) as c:
        yield c


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[nats.NATS]:
    conn = await nats.connect(nats_url)
    yield conn
    await conn.drain()
