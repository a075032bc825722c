"""The embedded path: PostgreSQL and NATS from pip packages, started and stopped cleanly.

This test always starts its own servers, whatever KVL_TEST_* say, so the path a machine
without PostgreSQL and NATS takes is exercised on every run.
"""

import asyncio
import socket
from pathlib import Path

import asyncpg
import nats

from shared.embedded import _ephemeral_floor, free_port, resolve_services


def test_embedded_servers_answer_and_stop(tmp_path: Path) -> None:
    with resolve_services("", "", tmp_path) as svc:
        assert svc.postgres is not None and svc.nats is not None
        pg_proc, nats_proc = svc.postgres.proc, svc.nats.proc

        async def check() -> None:
            conn = await asyncpg.connect(svc.database_url)
            assert await conn.fetchval("select 1") == 1
            await conn.close()
            nc = await nats.connect(svc.nats_url)
            js = nc.jetstream()
            await js.add_stream(name="EMBED_T", subjects=["embed.t"])
            ack = await js.publish("embed.t", b"x")
            assert ack.seq == 1
            await nc.drain()

        asyncio.run(check())
    assert pg_proc is not None and pg_proc.poll() is not None
    assert nats_proc is not None and nats_proc.poll() is not None


def test_configured_urls_are_used_as_is(tmp_path: Path) -> None:
    with resolve_services("postgresql://u@h/db", "nats://h:1", tmp_path) as svc:
        assert svc.postgres is None and svc.nats is None
        assert svc.database_url == "postgresql://u@h/db" and svc.nats_url == "nats://h:1"


def test_fixtures_isolate_tests(database_url: str, subjects, nats_url: str) -> None:  # type: ignore[no-untyped-def]
    async def check() -> None:
        conn = await asyncpg.connect(database_url)
        assert (await conn.fetchval("select current_database()")).startswith("kvl_t_")
        await conn.close()
    asyncio.run(check())
    assert subjects.prefix.startswith("kvlt")


def test_relative_state_dir_works(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The default state_dir (.kvl-state) is relative; PostgreSQL must still find its socket dir."""
    monkeypatch.chdir(tmp_path)
    with resolve_services("", "nats://unused:1", ".kvl-state") as svc:
        async def check() -> None:
            conn = await asyncpg.connect(svc.database_url)
            assert await conn.fetchval("select 1") == 1
            await conn.close()
        asyncio.run(check())


def test_free_port_stays_out_of_the_ephemeral_range() -> None:
    """A server binds the port later; an outgoing connection must not be able to take it first."""
    floor = _ephemeral_floor()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < floor for p in ports), (floor, sorted(ports))
    assert len(ports) > 1                      # random picks, so concurrent callers part ways
    for p in ports:                            # and each is bindable
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))
