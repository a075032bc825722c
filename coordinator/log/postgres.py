"""The PostgreSQL event log on asyncpg: one statement per append, reads without re-serialising.

Ordering and locking (see also :mod:`coordinator.log.schema`):

* Every append is one call of ``kvl_append`` (migration 0004), one statement in its own
  transaction: it first locks the single ``leader`` row ``FOR UPDATE`` and compares its epoch
  with the caller's. That is the fence (a deposed leader's append fails inside PostgreSQL,
  whatever it believes) and the serialisation point: appenders run one at a time, so
  ``max(position) + 1`` read after the lock is the next position, and positions are dense and
  in commit order. The primary key on ``position`` would catch any mistake in that reasoning.
* The epoch bump of a takeover updates the same row, so it waits for an in-flight append
  of the old leader to finish; every append after the bump sees the new epoch.
* The leader's renewal never touches that row (it would wait behind every append in
  flight, and a slow append would cost the leadership): it updates ``leader_renewal``,
  which appends never lock, ``WHERE leader_epoch = <its epoch>``. The epoch bump rewrites
  ``leader_renewal`` in the same statement (:data:`TAKE_LEADERSHIP`), so the two rows agree
  on the epoch whenever either is visible, and a superseded leader's renewal matches nothing.
* The hash chain (migration 0006, :mod:`coordinator.log.chain`): this writer chains each batch
  from the head it keeps (``_chain``); kvl_append checks under the leader lock that the batch
  links to the stored head and lines up with the events it keeps, and refuses it otherwise
  (KV004/KV005: re-chain and send again). The COPY path chains from the head it reads under the
  same lock. The hashing is the writer's, never PostgreSQL's: an append stays one statement.
* Duplicate source ids are filtered inside the same statement, so the UNIQUE constraint on
  ``source_id`` is the guarantee and never the control flow.

NOTE: appends run on one held connection and are a single round trip plus the commit's
WAL flush: no pool checkout, no pre-ping, no BEGIN/COMMIT. The earlier path (SQLAlchemy
pool, pre-ping, lock, head, sources, stream heads, insert, commit: about ten round trips)
cost more than the commit itself (docs/BENCHMARKS.md, Coordinator). Payloads are stored as
the coordinator's own JSON text and read back as is.

Driver errors are translated once (:mod:`.pg_errors`) into :mod:`coordinator.log.port`
errors; only errors that PostgreSQL guarantees rolled the statement back and that may pass
on their own (serialization failure, deadlock, lock timeout) are retried. The connection
settings are in :mod:`.pg_settings`, the statements in :mod:`.pg_sql`.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import asyncpg

from coordinator.log.chain import GENESIS, chain_batch
# NOTE: the errors, the settings and the SQL live in modules of their own (pg_errors, pg_settings,
# pg_sql); every name of theirs is re-exported here, where callers import them from.
from coordinator.log.pg_errors import (
    RETRYABLE_SQLSTATES, UNAVAILABLE_SQLSTATES, describe, is_retryable, is_unavailable, sqlstate, translate,
)
from coordinator.log.pg_settings import PgSettings, create_engine
from coordinator.log.pg_sql import (
    APPEND, ARCHIVE_ANCHOR, ARCHIVED_UPTO, CHAIN_ANCHOR, CHAIN_AT, COPY_APPEND_HEADS, COPY_APPEND_LOCK, COPY_COLUMNS,
    EVENT_COLUMNS, HEAD, LATEST_SNAPSHOT, LEADER_INFO, LEADER_STALE, READ, READ_LEADER_EPOCH, READ_PAYLOADS,
    READ_STREAM, READ_STREAMS, RENEW_LEADERSHIP, REPLICATION_STATUS, SAVE_SNAPSHOT, SCHEMA_REVISION, SNAPSHOT_COLUMNS,
    SNAPSHOT_EXISTS, SQLSTATE_CHAIN_ALIGN, SQLSTATE_CHAIN_HEAD, SQLSTATE_NO_LEADER_ROW, SQLSTATE_NOT_LEADER,
    SQLSTATE_STREAM_CONFLICT, SQLSTATE_UNIQUE_VIOLATION, STREAM_PIECE_BYTES, STREAM_SNAPSHOT_BYTES, TAKE_LEADERSHIP,
)
from coordinator.log.port import (
    LeaderInfo, LogError, NewEvent, NotLeader, Snapshot, StoredEvent, StreamConflict,
)

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

#: PostgreSQL's binary COPY header: signature, flags, header extension length.
_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack("!ii", 0, 0)


async def _snapshot_copy(snapshot: Snapshot, leader_epoch: int, chain: bytes | None) -> AsyncIterator[bytes]:
    """One snapshot row in PostgreSQL's binary COPY format (``SNAPSHOT_COLUMNS``), in pieces."""
    hashed = snapshot.state_hash.encode()
    data = memoryview(snapshot.state)
    yield (_COPY_HEADER + struct.pack("!h", len(SNAPSHOT_COLUMNS)) + struct.pack("!iq", 8, snapshot.position)
           + struct.pack("!i", len(hashed)) + hashed + struct.pack("!i", len(data)))
    for at in range(0, len(data), STREAM_PIECE_BYTES):
        yield bytes(data[at:at + STREAM_PIECE_BYTES])
    tail = struct.pack("!i", -1) if chain is None else struct.pack("!i", len(chain)) + chain
    yield struct.pack("!iq", 8, leader_epoch) + tail + struct.pack("!h", -1)


class PostgresEventLog:
    """:class:`~coordinator.log.port.EventLog` on PostgreSQL (schema from ``migrations/``).

    Connections: one held *writer* connection for appends (one append is in flight at a time:
    the group committer is the only caller), a small asyncpg pool for everything else, and a
    SQLAlchemy engine only for the Alembic migrations (:attr:`engine`, created on first use).
    """

    def __init__(self, settings: PgSettings, *, max_attempts: int = 3) -> None:
        self.settings = settings
        self._max_attempts = max_attempts
        self._engine: AsyncEngine | None = None
        self._writer: asyncpg.Connection | None = None
        self._pool: asyncpg.Pool | None = None
        self._pool_lock = asyncio.Lock()
        #: Appends committed by each path (``function``, ``copy``) and COPYs refused for a
        #: duplicate source (``copy_refused``), for ``kvl_coordinator_append_path_total``.
        self.append_paths: dict[str, int] = {"function": 0, "copy": 0, "copy_refused": 0}
        #: ``(position, chain hash)`` of the last event this writer stored or learned of; None:
        #: unknown (the next append learns it from kvl_append's KV004 and re-chains).
        self._chain: tuple[int, bytes] | None = None
        self._append_lock = asyncio.Lock()
        #: Appends re-chained because the head was not the one assumed (a takeover, a restart).
        self.rechains = 0

    @classmethod
    def connect(cls, settings: PgSettings) -> "PostgresEventLog":
        """The adapter; connections are opened when first needed."""
        return cls(settings)

    @property
    def chain_head(self) -> tuple[int, bytes] | None:
        """``(position, chain hash)`` of the last event this writer appended or learned of (None: unknown)."""
        return self._chain

    @property
    def engine(self) -> AsyncEngine:
        """A SQLAlchemy engine on the same database, for the Alembic migrations."""
        if self._engine is None:
            self._engine = create_engine(self.settings)
        return self._engine

    # --- connections ------------------------------------------------------------------------

    async def _connect(self) -> asyncpg.Connection:
        st = self.settings
        return await asyncpg.connect(st.dsn, timeout=st.connect_timeout_s, command_timeout=st.statement_timeout_s,
                                     server_settings=st.server_settings(), ssl=st.ssl)

    async def _reader_pool(self) -> asyncpg.Pool:
        if self._pool is None:
            async with self._pool_lock:
                if self._pool is None:
                    st = self.settings
                    self._pool = await asyncpg.create_pool(
                        st.dsn, min_size=0, max_size=st.pool_size, timeout=st.connect_timeout_s,
                        command_timeout=st.statement_timeout_s, server_settings=st.server_settings(), ssl=st.ssl,
                        max_inactive_connection_lifetime=60.0)
        return self._pool

    async def _call(self, what: str, method: str, query: str, *args: Any) -> Any:
        """One statement on a pooled connection, errors translated.

        NOTE: a pooled connection whose server went away (a PostgreSQL restart) fails the next
        statement sent on it; reads are idempotent, so that one failure is retried on a fresh
        connection once instead of reaching the caller.
        """
        for attempt in (1, 2):
            try:
                pool = await self._reader_pool()
                async with pool.acquire(timeout=self.settings.connect_timeout_s) as conn:
                    return await getattr(conn, method)(query, *args)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - translated for the caller
                if attempt == 1 and _connection_lost(e):
                    continue
                raise translate(e, what) from e
        raise AssertionError("unreachable")

    async def replication(self) -> tuple[int, bool]:
        """``(standbys streaming from the server appends go to, whether its commits wait for one)``;
        a read, so it answers also while synchronous commits stall for want of a standby."""
        row = await self._call("the replication status", "fetchrow", REPLICATION_STATUS)
        return int(row[0]), bool(row[1])

    def _drop_writer(self) -> None:
        conn, self._writer = self._writer, None
        if conn is not None and not conn.is_closed():
            conn.terminate()

    # --- appends --------------------------------------------------------------------------

    async def append(self, batch: Sequence[NewEvent], leader_epoch: int) -> list[int | None]:
        if not batch:
            return []
        # NOTE: one append at a time per adapter (the group committer never has two in flight): the
        # chain head it keeps must be the one the next batch is chained from.
        async with self._append_lock:
            return await self._append(batch, leader_epoch)

    async def _append(self, batch: Sequence[NewEvent], leader_epoch: int) -> list[int | None]:
        expected = any(e.expected_version is not None for e in batch)
        by_copy = 0 < self.settings.copy_min_events <= len(batch) and not expected
        args = ([e.stream_id for e in batch], [e.type for e in batch], [e.source_id for e in batch],
                [e.payload.decode() for e in batch],
                [e.expected_version for e in batch] if expected else None)
        for attempt in range(1, self._max_attempts + 1):
            try:
                if by_copy:
                    positions = await self._append_copy(batch, leader_epoch, args)
                    if positions is not None:
                        self.append_paths["copy"] += 1
                        return positions
                    self.append_paths["copy_refused"] += 1
                    by_copy = False   # a source already stored: kvl_append filters it
                stored = await self._append_once(batch, leader_epoch, args)
                self.append_paths["function"] += 1
                return stored
            except _Retry as r:
                if attempt == self._max_attempts:
                    raise translate(r.cause, "append") from r.cause
                await asyncio.sleep(0.01 * 2 ** attempt)
        raise AssertionError("unreachable")

    async def _append_once(self, batch: Sequence[NewEvent], leader_epoch: int,
                           args: tuple[Any, ...]) -> list[int | None]:
        """kvl_append, with the batch chained from the head this writer knows. NOTE: the head is
        known after the first append (kept from each commit), so an append is still one round
        trip; after a start, a takeover or a failure the first one learns it from KV004 and
        re-chains (a second round trip, once)."""
        skip: set[int] = set()
        for _ in range(4):
            head = self._chain or (-1, GENESIS)
            chained = chain_batch(head[1], head[0] + 1, leader_epoch,
                                  [None if i in skip else (e.stream_id, e.type, e.source_id, e.payload)
                                   for i, e in enumerate(batch)])
            try:
                positions = await self._append_chained(batch, leader_epoch, args, head, chained)
            except _Rechain as r:
                self.rechains += 1
                if r.head is not None:
                    self._chain = r.head
                if r.skip is not None:
                    skip = r.skip
                continue
            except BaseException:
                self._chain = None
                raise
            last = next((i for i in range(len(positions) - 1, -1, -1) if positions[i] is not None), None)
            if last is not None:
                hashed = chained[last]
                assert hashed is not None, "kvl_append stored an event the batch's chain left out"
                self._chain = (positions[last], hashed)
            return positions
        self._chain = None
        raise LogError("append: the batch could not be chained to the log's head (it kept moving)")

    async def _append_chained(self, batch: Sequence[NewEvent], leader_epoch: int, args: tuple[Any, ...],
                              head: tuple[int, bytes], chained: list[bytes | None]) -> list[int | None]:
        sent = False
        try:
            conn = await self._writer_connection()
            sent = True
            positions = await conn.fetchval(APPEND, leader_epoch, *args, head[0], head[1], chained)
        except asyncio.CancelledError:
            self._drop_writer()   # the statement's fate and the connection's state are unknown
            raise
        except asyncpg.PostgresError as e:
            state = e.sqlstate
            if state == SQLSTATE_CHAIN_HEAD:
                pos, _, hexed = (e.detail or "0|").partition("|")
                if not hexed:
                    raise LogError(f"the log's head at position {pos} has no chain hash: it was written around "
                                   f"the coordinator; run `kvledger audit` (docs/operations.md, \"The log's hash "
                                   f"chain\")") from None
                raise _Rechain(head=(int(pos), bytes.fromhex(hexed))) from None
            if state == SQLSTATE_CHAIN_ALIGN:
                raise _Rechain(skip={int(o) - 1 for o in (e.detail or "").split(",") if o}) from None
            if state == SQLSTATE_NOT_LEADER:
                raise NotLeader(leader_epoch, int(e.detail or 0)) from None
            if state == SQLSTATE_STREAM_CONFLICT:
                ordinal, expected, actual = (e.detail or "0|0|0").split("|")
                raise StreamConflict(batch[int(ordinal) - 1].stream_id, int(expected), int(actual)) from None
            if state == SQLSTATE_NO_LEADER_ROW:
                raise LogError("the leader row is missing: run `kvledger db upgrade`") from None
            raise self._failed(e, sent) from e
        except Exception as e:  # noqa: BLE001 - connection trouble: whether it committed is unknown once sent
            self._drop_writer()
            raise translate(e, "append", committed_unknown=sent) from e
        return list(positions)

    async def _writer_connection(self) -> asyncpg.Connection:
        conn = self._writer
        if conn is None or conn.is_closed():
            self._writer = None
            conn = self._writer = await self._connect()
        return conn

    def _failed(self, e: asyncpg.PostgresError, sent: bool) -> Exception:
        """What to raise for an append PostgreSQL failed, once its path's own errors are handled."""
        if e.sqlstate in RETRYABLE_SQLSTATES:
            return _Retry(e)
        if is_unavailable(e):
            self._drop_writer()
            return translate(e, "append", committed_unknown=sent)
        # refused by the server: the statement (its transaction) was rolled back
        return translate(e, "append")

    async def _append_copy(self, batch: Sequence[NewEvent], leader_epoch: int,
                           args: tuple[Any, ...]) -> list[int] | None:
        """A large append as one transaction: the fence, then head and stream versions, then the
        rows by binary COPY. ``None`` if a source id was already stored (the UNIQUE
        constraint refused the COPY, which rolled back): the caller retries with ``kvl_append``.

        NOTE: what kvl_append computes in its statement (positions after the head, each stream's
        next versions, in batch order) is computed here from the same reads, under the same
        leader-row lock, held until the commit, so the two paths store the same rows. Duplicate
        sources are left to the constraint: they are rare (a redelivery after a restart) and
        filtering them is what made kvl_append's plan sort every row (docs/BENCHMARKS.md).
        Measured at ~1,400 events: 20 ms against kvl_append's 36, with less client CPU.
        """
        streams, types, sources, payloads, _ = args
        distinct = list(dict.fromkeys(streams))
        sent = False
        try:
            conn = await self._writer_connection()
            sent = True
            tx = conn.transaction()
            await tx.start()
            try:
                epoch = await conn.fetchval(COPY_APPEND_LOCK)
                if epoch is None:
                    raise LogError("the leader row is missing: run `kvledger db upgrade`")
                if epoch != leader_epoch:
                    raise NotLeader(leader_epoch, epoch)
                head, versions, head_hash = await conn.fetchrow(COPY_APPEND_HEADS, distinct)
                if head_hash is None and head > 0:
                    raise LogError(f"the log's head at position {head} has no chain hash: it was written around "
                                   f"the coordinator; run `kvledger audit`")
                version = dict(zip(distinct, versions))
                chained = chain_batch(head_hash or GENESIS, head + 1, leader_epoch,
                                      [(e.stream_id, e.type, e.source_id, e.payload) for e in batch])
                records = []
                for i, stream in enumerate(streams):
                    v = version[stream] + 1
                    version[stream] = v
                    records.append((head + 1 + i, stream, v, sources[i], types[i], payloads[i], leader_epoch,
                                    chained[i]))
                await conn.copy_records_to_table("events", records=records, columns=COPY_COLUMNS)
            except (LogError, asyncpg.PostgresError):
                await tx.rollback()   # refused by the server or by the fence: the connection stays usable
                raise
            await tx.commit()
        except asyncio.CancelledError:
            self._chain = None
            self._drop_writer()   # the transaction's fate and the connection's state are unknown
            raise
        except LogError:
            self._chain = None
            raise
        except asyncpg.PostgresError as e:
            self._chain = None
            if e.sqlstate == SQLSTATE_UNIQUE_VIOLATION and getattr(e, "constraint_name", "") == "uq_events_source_id":
                return None
            raise self._failed(e, sent) from e
        except Exception as e:  # noqa: BLE001 - connection trouble: whether it committed is unknown once sent
            self._chain = None
            self._drop_writer()
            raise translate(e, "append", committed_unknown=sent) from e
        self._chain = (head + len(records), chained[-1])
        return list(range(head + 1, head + 1 + len(records)))

    # --- reads ----------------------------------------------------------------------------

    async def read(self, from_position: int = 1, limit: int = 1000) -> list[StoredEvent]:
        rows = await self._call("read", "fetch", READ, from_position, max(limit, 0))
        return _stored(rows)

    async def read_payloads(self, from_position: int = 1, limit: int = 1000) -> Sequence[tuple[int, bytes]]:
        """``(position, payload)`` of the events from ``from_position``: what a replay folds."""
        return await self._call("read", "fetch", READ_PAYLOADS, from_position, max(limit, 0))  # type: ignore[no-any-return]

    async def read_stream(self, stream_id: str, from_version: int = 1, limit: int = 10_000) -> list[StoredEvent]:
        rows = await self._call("read_stream", "fetch", READ_STREAM, stream_id, from_version, max(limit, 0))
        return _stored(rows)

    async def read_streams(self, stream_ids: Sequence[str], limit: int = 10_000) -> list[StoredEvent]:
        rows = await self._call("read_streams", "fetch", READ_STREAMS, list(stream_ids), max(limit, 0))
        return _stored(rows)

    async def ping(self) -> None:
        """Raise the translated error if PostgreSQL cannot be used (unreachable, bad credentials…)."""
        await self._call("connect", "fetchval", "SELECT 1")

    async def head(self) -> int:
        return int(await self._call("head", "fetchval", HEAD))

    async def schema_revision(self) -> str | None:
        """The database's Alembic revision (None: never migrated)."""
        if not await self._call("schema check", "fetchval", "SELECT to_regclass('alembic_version') IS NOT NULL"):
            return None
        return await self._call("schema check", "fetchval", "SELECT version_num FROM alembic_version LIMIT 1")  # type: ignore[no-any-return]

    # --- leadership and snapshots -----------------------------------------------------------

    async def take_leadership(self, holder: str) -> int:
        epoch = await self._call("take_leadership", "fetchval", TAKE_LEADERSHIP, holder)
        if epoch is None:
            raise LogError("the leader row is missing: run `kvledger db upgrade`")
        return int(epoch)

    async def leader(self) -> LeaderInfo:
        row = await self._call("leader", "fetchrow", LEADER_INFO)
        if row is None:
            raise LogError("the leader row is missing: run `kvledger db upgrade`")
        return LeaderInfo(row[0], row[1], row[2], row[3])

    async def latest_snapshot(self) -> Snapshot | None:
        row = await self._call("latest_snapshot", "fetchrow", LATEST_SNAPSHOT)
        return Snapshot(row[0], row[1], bytes(row[2]), row[3], row[4], row[5]) if row is not None else None

    async def archived_upto(self) -> int:
        return int(await self._call("archived_upto", "fetchval", ARCHIVED_UPTO) or 0)

    async def archive_anchor(self) -> tuple[int, Snapshot | None]:
        """``(archived up to, the anchor snapshot there)``; ``(0, None)`` if nothing is archived."""
        row = await self._call("archive_anchor", "fetchrow", ARCHIVE_ANCHOR)
        if row is None:
            return 0, None
        return row[0], Snapshot(row[0], row[1], bytes(row[2]), row[3], row[4], row[5]) if row[2] is not None else None

    async def chain_anchor(self) -> tuple[int, bytes]:
        row = await self._call("chain_anchor", "fetchrow", CHAIN_ANCHOR)
        return (0, GENESIS) if row is None else (row[0], bytes(row[1]) if row[1] is not None else GENESIS)

    async def save_snapshot(self, snapshot: Snapshot, leader_epoch: int) -> None:
        """Fenced by the epoch, read without holding the leader row.

        NOTE: holding the row (``FOR UPDATE``, as an append does) while a large snapshot is
        written stopped every append for as long: ~1 s for a 46 MB snapshot (a 100k-slot
        worker's state), every reply waiting behind it. Without the lock, a takeover that lands
        between the check and the insert lets the old leader's snapshot in, and that is safe: a
        snapshot is the fold of the log up to its position (the state is frozen with everything
        it applied committed), which the old leader's is as much as the new one's; the head check
        keeps it within the log.
        """
        try:
            pool = await self._reader_pool()
            async with pool.acquire(timeout=self.settings.connect_timeout_s) as conn:
                current = await conn.fetchval(READ_LEADER_EPOCH)
                if current != leader_epoch:
                    raise NotLeader(leader_epoch, current or 0)
                head = await conn.fetchval(HEAD)
                if snapshot.position > head:
                    raise LogError(f"snapshot at position {snapshot.position} is past the head {head}")
                chain = await conn.fetchval(CHAIN_AT, snapshot.position) if snapshot.position else GENESIS
                if len(snapshot.state) < STREAM_SNAPSHOT_BYTES:
                    await conn.execute(SAVE_SNAPSHOT, snapshot.position, snapshot.state_hash, snapshot.state,
                                       leader_epoch, chain)
                elif await conn.fetchval(SNAPSHOT_EXISTS, snapshot.position) is None:
                    # NOTE: a bind message of tens of MB is built on the event loop's thread in one
                    # go (~80 ms for 46 MB, every decision waiting); COPY takes it in 1 MB pieces
                    with contextlib.suppress(asyncpg.UniqueViolationError):   # saved meanwhile: the first stays
                        await conn.copy_to_table("snapshots", source=_snapshot_copy(snapshot, leader_epoch, chain),
                                                 columns=SNAPSHOT_COLUMNS, format="binary")
        except (LogError, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - translated for the caller
            raise translate(e, "save_snapshot") from e

    async def close(self) -> None:
        self._drop_writer()
        pool, self._pool = self._pool, None
        if pool is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(pool.close(), 5)
            pool.terminate()
        engine, self._engine = self._engine, None
        if engine is not None:
            await engine.dispose()


def _stored(rows: Sequence[Any]) -> list[StoredEvent]:
    """Rows of ``EVENT_COLUMNS`` as StoredEvents (payloads as bytes)."""
    return [StoredEvent(r[0], r[1], r[2], r[3], r[4].encode(), r[5], r[6], r[7], r[8]) for r in rows]


def _connection_lost(e: BaseException) -> bool:
    """An error of a connection that had been working (not a refusal to connect)."""
    return isinstance(e, (asyncpg.ConnectionDoesNotExistError, asyncpg.InterfaceError, asyncpg.InternalClientError,
                          ConnectionResetError, BrokenPipeError)) or getattr(e, "sqlstate", None) in ("57P01", "57P02")


class _Rechain(Exception):
    """kvl_append refused the batch's chain (KV004/KV005): chain it again from ``head`` / without ``skip``."""

    def __init__(self, head: tuple[int, bytes] | None = None, skip: set[int] | None = None) -> None:
        super().__init__("re-chain")
        self.head = head
        self.skip = skip


class _Retry(Exception):
    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause
