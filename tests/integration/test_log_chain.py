"""The event log's hash chain on the real database (issue 51, migration 0006).

The attack: as the superuser, with ``session_replication_role = replica`` (the append-only
triggers off), an event's payload was rewritten, another deleted and a forged row put in its
place; the audit saw the gap while it existed and said ``ok: True`` after the forged row. Each
tampering here must make the audit report the first position where the chain breaks; an
untouched log must pass; the chain must survive snapshots, a restart (replay) and an archive.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import asyncpg
import nats
import pytest

from coordinator.audit import run_audit, verify_chain
from coordinator.core import CoreParams
from coordinator.log import NewEvent
from coordinator.log.archive import ArchiveError, archive, read_archive, verify_archives
from coordinator.log.chain import GENESIS, link
from coordinator.log.memory import InMemoryEventLog
from coordinator.log.migrate import upgrade
from coordinator.log.postgres import PgSettings, PostgresEventLog
from shared.subjects import Subjects
from tests.integration.coordinator_kit import Worker, block, fast_config, running_coordinator
from tests.integration.test_log_archive import Traffic, serving


def ev(stream: str, n: int, source: str | None = None) -> NewEvent:
    return NewEvent(stream_id=stream, type="t.x", payload=b'{"n":%d,"s":"\xc3\xa9"}' % n, source_id=source)


#: Batches that take every append path: lone events, sets with and without duplicate sources, COPY.
BATCHES = [
    [ev("a", 1)],
    [ev("a", 2, "w.1.1"), ev("b", 3, "w.1.2"), ev("a", 4)],
    [ev("b", 5, "w.1.2"), ev("c", 6, "w.1.3"), ev("c", 7, "w.1.3"), ev("a", 8)],   # duplicates left out
    [ev("d", 10 + i, f"w.2.{i}") for i in range(40)],                               # by COPY (min 32)
    [ev("e", 99, "w.1.1")],                                                         # a lone duplicate
    [ev("e", 100)],
]


@pytest.fixture
async def pg(database_url: str) -> AsyncIterator[PostgresEventLog]:
    log = PostgresEventLog.connect(PgSettings(url=database_url, pool_size=4, copy_min_events=32))
    await upgrade(log.engine)
    try:
        yield log
    finally:
        await log.close()


@pytest.fixture
async def owner(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """The superuser, with the append-only triggers off for its session, as the attacker had it."""
    conn = await asyncpg.connect(database_url)
    await conn.execute("SET session_replication_role = replica")
    try:
        yield conn
    finally:
        await conn.close()


async def filled(log: PostgresEventLog | InMemoryEventLog) -> int:
    epoch = await log.take_leadership("test")
    for b in BATCHES:
        await log.append(b, epoch)
    return await log.head()


async def test_untouched_log_verifies_and_matches_the_twin(pg: PostgresEventLog) -> None:
    head = await filled(pg)
    assert head == 1 + 3 + 2 + 40 + 0 + 1
    chain = await verify_chain(pg, head)
    assert chain["ok"] and chain["verified_events"] == head and chain["anchor"] == "start", chain
    stored = await pg.read(1, 1000)
    assert all(e.chain_hash is not None and len(e.chain_hash) == 32 for e in stored)
    # the in-memory twin chains the same way: same batches, same hashes
    twin = InMemoryEventLog()
    assert await filled(twin) == head
    assert [e.chain_hash for e in await twin.read(1, 1000)] == [e.chain_hash for e in stored]
    assert (await verify_chain(twin, head))["ok"]
    # a fresh adapter (a restart) learns the head from the database and continues the chain
    fresh = PostgresEventLog.connect(pg.settings)
    try:
        epoch = await fresh.take_leadership("again")
        assert await fresh.append([ev("f", 1), ev("f", 2)], epoch) == [head + 1, head + 2]
        assert fresh.rechains == 1
        assert await fresh.append([ev("f", 3)], epoch) == [head + 3]
        assert fresh.rechains == 1   # one round trip per append once the head is known
    finally:
        await fresh.close()
    assert (await verify_chain(pg, head + 3))["ok"]


COLUMNS = "position, stream_id, stream_version, source_id, type, payload, leader_epoch, recorded_at, chain_hash"


async def _rewrite_payload(o: asyncpg.Connection, k: int) -> None:
    await o.execute("UPDATE events SET payload = ' ' || payload WHERE position = $1", k)


async def _delete(o: asyncpg.Connection, k: int) -> None:
    await o.execute("DELETE FROM events WHERE position = $1", k)


async def _forge_naive(o: asyncpg.Connection, k: int) -> None:
    """Delete k and put a forged row in its place, copying the deleted row's chain hash."""
    await o.execute("CREATE TEMP TABLE gone AS SELECT * FROM events WHERE position = $1", k)
    await _delete(o, k)
    await o.execute(f"INSERT INTO events ({COLUMNS}) SELECT position, stream_id, stream_version, source_id, type, "
                    "'{\"forged\":true}', leader_epoch, recorded_at, chain_hash FROM gone")


async def _forge_linked(o: asyncpg.Connection, k: int) -> None:
    """The same, by an attacker who links the forged row correctly to its predecessor: the next
    event's link is what breaks then."""
    await o.execute("CREATE TEMP TABLE gone AS SELECT * FROM events WHERE position = $1", k)
    await _delete(o, k)
    await o.execute(f"INSERT INTO events ({COLUMNS}) SELECT g.position, g.stream_id, g.stream_version, g.source_id, g.type, "
                    "'{\"forged\":true}', g.leader_epoch, g.recorded_at, kvl_chain_link(p.chain_hash, g.position, "
                    "g.leader_epoch, g.stream_id, g.type, g.source_id, '{\"forged\":true}') "
                    "FROM gone g JOIN events p ON p.position = g.position - 1")


async def _reorder(o: asyncpg.Connection, k: int) -> None:
    """Swap the events at k and k + 1 (positions, every other column kept)."""
    await o.execute("UPDATE events SET position = position + 1000000 WHERE position IN ($1::bigint, $1::bigint + 1)", k)
    await o.execute("UPDATE events SET position = CASE WHEN position = $1::bigint + 1000000 THEN $1::bigint + 1 "
                    "ELSE $1::bigint END WHERE position IN ($1::bigint + 1000000, $1::bigint + 1000001)", k)


async def _delete_and_renumber(o: asyncpg.Connection, k: int) -> None:
    """Delete k and close the gap (every later position one less): dense again, chain broken."""
    await _delete(o, k)
    await o.execute("UPDATE events SET position = position + 1000000 WHERE position > $1", k)
    await o.execute("UPDATE events SET position = position - 1000001 WHERE position > 1000000")


TAMPERS: dict[str, tuple[Callable[[asyncpg.Connection, int], Awaitable[None]], int, str]] = {
    "payload_rewrite": (_rewrite_payload, 0, "chain hash mismatch"),
    "delete": (_delete, 0, "is missing"),
    "forged_insert": (_forge_naive, 0, "chain hash mismatch"),
    "forged_insert_linked": (_forge_linked, 1, "chain hash mismatch"),
    "reorder": (_reorder, 0, "chain hash mismatch"),
    "delete_and_renumber": (_delete_and_renumber, 0, "chain hash mismatch"),
}


@pytest.mark.parametrize("tamper", list(TAMPERS))
async def test_tampering_is_reported_at_the_first_broken_position(pg: PostgresEventLog, owner: asyncpg.Connection,
                                                                  tamper: str) -> None:
    head = await filled(pg)
    k = 5
    fn, offset, what = TAMPERS[tamper]
    assert (await verify_chain(pg, head))["ok"]
    await fn(owner, k)
    chain = await verify_chain(pg, head)
    assert not chain["ok"], chain
    assert chain["first_break"]["position"] == k + offset, chain
    assert what in chain["first_break"]["what"], chain
    assert chain["head_position"] == k + offset - 1   # verified up to the last good event


async def test_audit_is_not_ok_after_a_rewrite_the_replay_cannot_see(pg: PostgresEventLog,
                                                                     owner: asyncpg.Connection) -> None:
    """The payload rewritten with the same meaning (JSON whitespace): the replay folds to the same
    state, so only the chain can tell. Then the issue's forged row: a deleted event put back."""
    ledger = await serving(pg)
    w = Traffic(ledger)
    await w.register()
    for _ in range(3):
        await w.request()
    report = await run_audit(ledger, check_workers=False)
    assert report["ok"] and report["chain"]["ok"] and report["chain"]["verified_events"] == ledger.position, report
    k = 4
    await _rewrite_payload(owner, k)
    report = await run_audit(ledger, check_workers=False)
    assert report["hash_match"], report          # the replay alone is fooled
    assert not report["ok"] and report["chain"]["first_break"]["position"] == k, report
    assert any(f"hash chain broken at position {k}" in e for e in report["log_errors"]), report
    await ledger.stand_down("test")


async def test_delete_then_forged_copy_is_not_ok(pg: PostgresEventLog, owner: asyncpg.Connection) -> None:
    """The issue's sequence: the gap is seen while it exists; the forged row in its place (the
    deleted event's own content and hash, put back as the attacker wished) must not make it ok."""
    ledger = await serving(pg)
    w = Traffic(ledger)
    await w.register()
    for _ in range(3):
        await w.request()
    k = 6
    row = await owner.fetchrow("SELECT * FROM events WHERE position = $1", k)
    await _delete(owner, k)
    report = await run_audit(ledger, check_workers=False)
    assert not report["ok"] and report["chain"]["first_break"]["position"] == k, report
    # put back, reworded (the same meaning: it folds to the same state), its chain hash copied
    await owner.execute("INSERT INTO events (position, stream_id, stream_version, source_id, type, payload, "
                        "leader_epoch, recorded_at, chain_hash) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                        k, row["stream_id"], row["stream_version"], row["source_id"], row["type"],
                        " " + row["payload"],
                        row["leader_epoch"], row["recorded_at"], row["chain_hash"])
    report = await run_audit(ledger, check_workers=False)
    assert not report["ok"] and report["chain"]["first_break"]["position"] == k, report
    await ledger.stand_down("test")


async def test_chain_survives_snapshot_restart_and_archive(pg: PostgresEventLog, database_url: str,
                                                            tmp_path: Path) -> None:
    ledger = await serving(pg)
    w = Traffic(ledger)
    await w.register()
    await w.request()
    snap = await ledger.snapshot()
    await w.request()
    # the snapshot carries the chain head at its position
    stored = await pg.latest_snapshot()
    assert stored is not None and stored.position == snap.position
    at = (await pg.read(snap.position, 1))[0]
    assert stored.chain_hash == at.chain_hash and stored.chain_hash is not None
    report = await run_audit(ledger, check_workers=False, from_snapshot=True)
    assert report["ok"] and report["chain"]["anchor"] == "snapshot", report
    assert report["chain"]["anchor_position"] == snap.position
    await ledger.stand_down("test")

    # a restart: a new adapter and ledger replay the log, learn the head and keep chaining
    log2 = PostgresEventLog.connect(pg.settings)
    try:
        ledger2 = await serving(log2)
        w2 = Traffic(ledger2, "w2")
        await w2.register()
        await w2.request()
        snap2 = await ledger2.snapshot()
        await w2.request()
        report = await run_audit(ledger2, check_workers=False)
        assert report["ok"] and report["chain"]["verified_events"] == ledger2.position, report
        await ledger2.stand_down("test")

        # an archive up to the second snapshot records the chain head; the check starts there
        owner = await asyncpg.connect(database_url)
        try:
            out = await archive(owner, tmp_path, snap2.position, CoreParams())
            recorded = await owner.fetchval("SELECT chain_hash FROM log_archives")
        finally:
            await owner.close()
        assert await log2.chain_anchor() == (snap2.position, bytes(recorded))
        # the file carries the head too (a copy outside the database), and its events re-chain to it
        header, _rows = read_archive(Path(out["file"]))
        assert header["chain_hash"] == bytes(recorded).hex()
        assert verify_archives([Path(out["file"])], CoreParams())["chain_hash"] == bytes(recorded).hex()
        ledger3 = await serving(log2)
        await Traffic(ledger3, "w3").register()
        report = await run_audit(ledger3, check_workers=False)
        assert report["ok"] and report["chain"]["anchor"] == "archive", report
        assert report["chain"]["anchor_position"] == snap2.position
        assert report["chain"]["head_position"] == ledger3.position
        await ledger3.stand_down("test")
    finally:
        await log2.close()


def test_link_is_what_sql_computes() -> None:
    """The documented bytes (``coordinator.log.chain``): a hand check with PostgreSQL's sha256() needs them."""
    import hashlib
    import struct

    payload = '{"n":1}'.encode()
    manual = hashlib.sha256(GENESIS + struct.pack(">qqi", 7, 2, 1) + b"s" + struct.pack(">i", 1) + b"t"
                            + struct.pack(">i", -1) + payload).digest()
    assert link(GENESIS, 7, 2, "s", "t", None, payload) == manual
    assert link(GENESIS, 7, 2, "s", "t", "", payload) != manual   # an empty source is not a missing one


async def test_sql_link_matches_python(pg: PostgresEventLog, owner: asyncpg.Connection) -> None:
    head = await filled(pg)
    rows = await owner.fetch("SELECT position, kvl_chain_link(coalesce(lag(chain_hash) OVER (ORDER BY position), "
                             "decode(repeat('00', 32), 'hex')), position, leader_epoch, stream_id, type, source_id, payload) "
                             "= chain_hash AS ok FROM events ORDER BY position")
    assert len(rows) == head and all(r["ok"] for r in rows)


async def test_migration_0006_chains_an_existing_log_and_round_trips(pg: PostgresEventLog,
                                                                     owner: asyncpg.Connection) -> None:
    """A log written before 0006 (kvl_append without a chain) is chained by the upgrade, from the
    genesis hash, exactly as the writer would have; appends then continue the chain."""
    from coordinator.log.migrate import head_revision
    from tests.integration.test_log_archive import _downgrade

    async with pg.engine.begin() as conn:
        await conn.run_sync(_downgrade, "0005")
    assert await owner.fetchval("SELECT count(*) FROM information_schema.columns "
                                "WHERE table_name = 'events' AND column_name = 'chain_hash'") == 0
    epoch = await pg.take_leadership("old")
    old_append = "SELECT kvl_append($1, $2::text[], $3::text[], $4::text[], $5::text[], NULL)"
    for b in BATCHES:
        await owner.fetchval(old_append, epoch, [e.stream_id for e in b], [e.type for e in b],
                             [e.source_id for e in b], [e.payload.decode() for e in b])
    head = await pg.head()
    assert await upgrade(pg.engine) == head_revision()
    # the same hashes as a log written by this build's writer
    twin = InMemoryEventLog()
    await twin.take_leadership("x")
    for b in BATCHES:
        await twin.append(b, epoch)
    assert [e.chain_hash for e in await pg.read(1, 1000)] == [e.chain_hash for e in await twin.read(1, 1000)]
    assert (await verify_chain(pg, head))["ok"]
    assert await pg.append([ev("z", 1)], epoch) == [head + 1]
    assert (await verify_chain(pg, head + 1))["ok"]


async def test_running_coordinator_publishes_the_head_and_audits_the_chain(
        database_url: str, nats_url: str, subjects: Subjects) -> None:
    """Through the coordinator's own HTTP surface: /metrics publishes the chain head (position and
    hash prefix, the external anchor), and POST /v1/audit reports the chain, then its first break."""
    token = "chain-test-token"
    cfg = fast_config(database_url, nats_url, subjects, admin_token=token)
    async with running_coordinator(cfg) as (_app, base):
        nc = await nats.connect(nats_url)
        http = aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"})
        owner = await asyncpg.connect(database_url)
        try:
            w = Worker(nc, subjects)
            await w.register()
            await w.watch_watermarks()
            await w.fill([block(i) for i in range(3)])
            head = await owner.fetchrow("SELECT position, chain_hash FROM events ORDER BY position DESC LIMIT 1")
            async with http.get(f"{base}/metrics") as r:
                text = await r.text()
            assert f"kvl_log_chain_head_position {float(head['position'])}" in text, text[-2000:]
            assert f'kvl_log_chain_head_info{{hash_prefix="{bytes(head["chain_hash"]).hex()[:16]}"}} 1.0' in text
            async with http.post(f"{base}/v1/audit", json={}) as r:
                report = await r.json()
            assert report["ok"] and report["chain"]["ok"], report
            assert report["chain"]["head_position"] == head["position"]
            await owner.execute("SET session_replication_role = replica")
            await _rewrite_payload(owner, 2)
            async with http.post(f"{base}/v1/audit", json={}) as r:
                report = await r.json()
            assert not report["ok"] and report["chain"]["first_break"]["position"] == 2, report
        finally:
            await owner.close()
            await http.close()
            await nc.drain()


async def test_archive_refuses_a_broken_chain(pg: PostgresEventLog, database_url: str, tmp_path: Path) -> None:
    """Events that no longer chain are not moved out of the database into a file that would bless them."""
    ledger = await serving(pg)
    w = Traffic(ledger)
    await w.register()
    await w.request()
    await w.request()
    snap = await ledger.snapshot()
    await ledger.stand_down("test")
    owner = await asyncpg.connect(database_url)
    try:
        await owner.execute("SET session_replication_role = replica")
        await _rewrite_payload(owner, 3)
        await owner.execute("SET session_replication_role = DEFAULT")
        with pytest.raises(ArchiveError, match="hash chain breaks at position 3"):
            await archive(owner, tmp_path, snap.position, CoreParams())
        assert await owner.fetchval("SELECT count(*) FROM log_archives") == 0
    finally:
        await owner.close()
