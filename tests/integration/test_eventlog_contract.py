"""One contract, two adapters: the PostgreSQL event log and its in-memory twin.

Every guarantee in :mod:`coordinator.log.port` is asserted here, once, against both. The
twin exists for fast unit tests of the shell; this file is what keeps it honest.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from coordinator.log import InMemoryEventLog, NewEvent, NotLeader, Snapshot, StreamConflict
from coordinator.log.migrate import upgrade
from coordinator.log.port import EventLog
from coordinator.log.postgres import PgSettings, PostgresEventLog


def ev(stream: str, n: int = 0, source: str | None = None, expected: int | None = None) -> NewEvent:
    return NewEvent(stream_id=stream, type="test.event", payload=b'{"type":"test.event","n":%d}' % n,
                    source_id=source, expected_version=expected)


class EventLogContract:
    """Subclasses provide a ``log`` fixture: an empty, migrated log."""

    async def test_empty_log(self, log: EventLog) -> None:
        assert await log.head() == 0
        assert await log.read() == []
        assert await log.read_stream("s") == []
        assert await log.latest_snapshot() is None
        assert await log.archive_anchor() == (0, None) and await log.archived_upto() == 0  # replays start at 1
        assert (await log.leader()).leader_epoch == 0

    async def test_positions_are_dense_and_in_append_order(self, log: EventLog) -> None:
        e = await log.take_leadership("me")
        assert await log.append([ev("a", 1), ev("b", 2)], e) == [1, 2]
        assert await log.append([ev("a", 3)], e) == [3]
        assert await log.append([], e) == []
        stored = await log.read()
        assert [s.position for s in stored] == [1, 2, 3]
        assert [(s.stream_id, s.stream_version) for s in stored] == [("a", 1), ("b", 1), ("a", 2)]
        assert all(s.leader_epoch == e and s.type == "test.event" for s in stored)
        assert await log.head() == 3

    async def test_payload_round_trips_as_json(self, log: EventLog) -> None:
        e = await log.take_leadership("me")
        await log.append([ev("a", 7)], e)
        (s,) = await log.read()
        import json
        assert json.loads(s.payload) == {"type": "test.event", "n": 7}

    async def test_read_pages_by_position(self, log: EventLog) -> None:
        e = await log.take_leadership("me")
        await log.append([ev("s", i) for i in range(10)], e)
        assert [s.position for s in await log.read(4, 3)] == [4, 5, 6]
        assert [s.position for s in await log.read(9, 100)] == [9, 10]
        assert await log.read(11) == []

    async def test_read_stream_in_version_order(self, log: EventLog) -> None:
        e = await log.take_leadership("me")
        await log.append([ev("x", 1), ev("y", 2), ev("x", 3)], e)
        await log.append([ev("x", 4)], e)
        xs = await log.read_stream("x")
        assert [s.stream_version for s in xs] == [1, 2, 3]
        assert [s.position for s in xs] == [1, 3, 4]
        assert [s.stream_version for s in await log.read_stream("x", from_version=3)] == [3]

    async def test_read_streams_in_position_order(self, log: EventLog) -> None:
        e = await log.take_leadership("me")
        await log.append([ev("x", 1), ev("y", 2), ev("z", 3), ev("x", 4)], e)
        got = await log.read_streams(["x", "z", "nothing"])
        assert [(s.stream_id, s.position) for s in got] == [("x", 1), ("z", 3), ("x", 4)]
        assert [s.position for s in await log.read_streams(["x", "y"], limit=2)] == [1, 2]

    async def test_source_id_is_stored_once(self, log: EventLog) -> None:
        e = await log.take_leadership("me")
        assert await log.append([ev("a", source="w.1.1"), ev("a", source="w.1.2")], e) == [1, 2]
        # redelivered across batches, and twice within one batch
        assert await log.append([ev("a", source="w.1.2"), ev("b", source="w.1.3"), ev("b", source="w.1.3")],
                                e) == [None, 3, None]
        assert await log.append([ev("c", source="w.1.1")], e) == [None]   # alone in its batch, too
        stored = await log.read()
        assert [s.source_id for s in stored] == ["w.1.1", "w.1.2", "w.1.3"]
        assert [(s.stream_id, s.stream_version) for s in stored] == [("a", 1), ("a", 2), ("b", 1)]

    async def test_null_source_ids_never_collide(self, log: EventLog) -> None:
        e = await log.take_leadership("me")
        assert await log.append([ev("a"), ev("a"), ev("a")], e) == [1, 2, 3]

    async def test_expected_version_conflict_fails_the_whole_batch(self, log: EventLog) -> None:
        e = await log.take_leadership("me")
        await log.append([ev("a", expected=0), ev("a", expected=1)], e)
        with pytest.raises(StreamConflict) as info:
            await log.append([ev("b", expected=0), ev("a", expected=1)], e)
        assert (info.value.stream_id, info.value.expected, info.value.actual) == ("a", 1, 2)
        assert await log.head() == 2 and await log.read_stream("b") == []
        assert await log.append([ev("a", expected=2)], e) == [3]

    async def test_concurrent_appends_with_same_expected_version_one_wins(self, log: EventLog) -> None:
        e = await log.take_leadership("me")
        results = await asyncio.gather(*[log.append([ev("race", i, expected=0)], e) for i in range(20)],
                                       return_exceptions=True)
        assert sum(isinstance(r, list) for r in results) == 1
        assert all(isinstance(r, (list, StreamConflict)) for r in results)
        assert len(await log.read_stream("race")) == 1

    async def test_concurrent_batches_do_not_interleave(self, log: EventLog) -> None:
        e = await log.take_leadership("me")
        a, b = await asyncio.gather(log.append([ev("a", i) for i in range(100)], e),
                                    log.append([ev("b", i) for i in range(100)], e))
        for got in (a, b):
            assert got == list(range(got[0], got[0] + 100))
        assert sorted(a + b) == list(range(1, 201))

    async def test_stale_leader_epoch_is_refused_and_writes_nothing(self, log: EventLog) -> None:
        old = await log.take_leadership("old")
        await log.append([ev("a")], old)
        new = await log.take_leadership("new")
        assert new == old + 1
        info = await log.leader()
        assert info.leader_epoch == new and info.holder == "new"
        with pytest.raises(NotLeader) as err:
            await log.append([ev("a"), ev("b")], old)
        assert (err.value.mine, err.value.current) == (old, new)
        assert await log.head() == 1
        with pytest.raises(NotLeader):
            await log.save_snapshot(Snapshot(1, "h", b"s"), old)
        assert await log.append([ev("a")], new) == [2]

    async def test_snapshots(self, log: EventLog) -> None:
        e = await log.take_leadership("me")
        await log.append([ev("a", i) for i in range(5)], e)
        await log.save_snapshot(Snapshot(2, "h2", b"\x00state2"), e)
        await log.save_snapshot(Snapshot(4, "h4", b"state4"), e)
        await log.save_snapshot(Snapshot(4, "other", b"ignored"), e)  # same position: first one stays
        snap = await log.latest_snapshot()
        assert snap is not None
        assert (snap.position, snap.state_hash, snap.state, snap.leader_epoch) == (4, "h4", b"state4", e)
        with pytest.raises(Exception, match="past the head"):
            await log.save_snapshot(Snapshot(6, "h6", b"x"), e)


class TestInMemoryEventLog(EventLogContract):
    @pytest.fixture
    async def log(self) -> AsyncIterator[EventLog]:
        yield InMemoryEventLog()


class TestPostgresEventLog(EventLogContract):
    @pytest.fixture
    async def log(self, database_url: str) -> AsyncIterator[EventLog]:
        pg = PostgresEventLog.connect(PgSettings(url=database_url, pool_size=25))
        await upgrade(pg.engine)
        try:
            yield pg
        finally:
            await pg.close()


class TestPostgresEventLogByCopy(EventLogContract):
    """The same contract with every append (but those naming expected versions) written by COPY."""

    @pytest.fixture
    async def log(self, database_url: str) -> AsyncIterator[EventLog]:
        pg = PostgresEventLog.connect(PgSettings(url=database_url, pool_size=25, copy_min_events=1))
        await upgrade(pg.engine)
        try:
            yield pg
        finally:
            await pg.close()
