"""The PostgreSQL event log: SQLAlchemy async engine for everything, raw asyncpg for appends.

Ordering and locking (see also :mod:`coordinator.log.schema`):

* Every append transaction first locks the single ``leader`` row ``FOR UPDATE`` and compares
  its epoch with the caller's. That is the fence (a deposed leader's append fails inside
  PostgreSQL, whatever it believes) and the serialisation point: appenders run one at a
  time, so ``max(position) + 1`` read *after* the lock (a new statement, hence a fresh
  READ COMMITTED snapshot) is the next position, and positions are dense and in commit
  order. The primary key on ``position`` would catch any mistake in that reasoning.
* The epoch bump of a takeover updates the same row, so it waits for an in-flight append
  of the old leader to finish; every append after the bump sees the new epoch.
* The leader's renewal never touches that row (it would wait behind every append in
  flight, and a slow append would cost the leadership): it updates ``leader_renewal``,
  which appends never lock, ``WHERE leader_epoch = <its epoch>``. The epoch bump rewrites
  ``leader_renewal`` in the same statement (:data:`TAKE_LEADERSHIP`), so the two rows agree
  on the epoch whenever either is visible, and a superseded leader's renewal matches nothing.
* Duplicate source ids are filtered inside the same locked transaction, so the UNIQUE
  constraint on ``source_id`` is the guarantee and never the control flow.

NOTE: the append path talks to asyncpg directly (the driver connection under the
SQLAlchemy pool): one prepared statement with array parameters inserts the whole batch
(``INSERT … SELECT FROM unnest(…)``) in a single round trip, where SQLAlchemy's
executemany would bind and send row by row in pages. Reads, snapshots and the leader rows
use SQLAlchemy Core on the same pool.

Driver errors are translated once, here, into :mod:`coordinator.log.port` errors; only
errors that PostgreSQL guarantees rolled the transaction back and that may pass on their
own (serialization failure, deadlock, lock timeout) are retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg
import sqlalchemy.exc
from sqlalchemy import Text, and_, cast, func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from coordinator.log.port import (
    LeaderInfo, LogError, LogUnavailable, NewEvent, NotLeader, Snapshot, StoredEvent, plan_append,
)
from coordinator.log.schema import events, leader, leader_renewal, snapshots
from shared.embedded import asyncpg_url
from shared.tls import client_context


@dataclass(frozen=True, slots=True)
class PgSettings:
    """Connection bounds: a dead or unreachable PostgreSQL must fail calls quickly, not hang them."""

    url: str
    pool_size: int = 5
    connect_timeout_s: float = 3.0
    statement_timeout_s: float = 6.0
    #: ``application_name`` of every session (a takeover terminates the old holder's sessions by it).
    application_name: str = "kvledger"
    #: TLS context of every connection (``shared.tls.client_context``: set when ``tls.ca_file`` is);
    #: ``None`` = asyncpg decides (``PGSSLMODE``; default ``prefer``: try TLS, fall back to plain).
    ssl: ssl.SSLContext | None = None

    @classmethod
    def from_config(cls, url: str, db_cfg: Any, application_name: str = "kvledger",
                    tls: Any = None) -> "PgSettings":
        connect = db_cfg.connect_timeout_ms / 1000
        return cls(url=url, pool_size=db_cfg.pool_size, connect_timeout_s=connect,
                   statement_timeout_s=max(2 * connect, 5.0), application_name=application_name[:63],
                   ssl=client_context(tls) if tls is not None and db_cfg.tls else None)

    def server_settings(self) -> dict[str, str]:
        return {
            "application_name": self.application_name[:63],
            "statement_timeout": str(int(self.statement_timeout_s * 1000)),
            "lock_timeout": str(int(self.connect_timeout_s * 1000)),
            "idle_in_transaction_session_timeout": str(int(self.statement_timeout_s * 2000)),
        }


def create_engine(settings: PgSettings) -> AsyncEngine:
    return create_async_engine(
        asyncpg_url(settings.url),
        pool_size=settings.pool_size,
        max_overflow=2,
        pool_timeout=settings.connect_timeout_s,
        pool_pre_ping=True,
        connect_args={
            "timeout": settings.connect_timeout_s,
            "command_timeout": settings.statement_timeout_s,
            "server_settings": settings.server_settings(),
            # only when set: an explicit ssl=None would override a ?ssl= in the URL
            **({"ssl": settings.ssl} if settings.ssl is not None else {}),
        },
    )


# --- error translation ----------------------------------------------------------------

#: Rolled back by PostgreSQL and likely to pass on a retry.
RETRYABLE_SQLSTATES = frozenset({"40001", "40P01", "55P03"})
#: The server is going away, not accepting connections, or cancelled us on a timeout.
UNAVAILABLE_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "53300", "57014"})


def _root(e: BaseException) -> BaseException:
    """The driver's own exception under SQLAlchemy's wrappers."""
    if isinstance(e, sqlalchemy.exc.DBAPIError) and e.orig is not None:
        orig: BaseException = e.orig
        return orig.__cause__ if isinstance(orig.__cause__, BaseException) else orig
    return e


def sqlstate(e: BaseException) -> str | None:
    return getattr(_root(e), "sqlstate", None)


def is_retryable(e: BaseException) -> bool:
    return sqlstate(e) in RETRYABLE_SQLSTATES


def is_unavailable(e: BaseException) -> bool:
    root = _root(e)
    state = getattr(root, "sqlstate", None) or ""
    return (
        isinstance(root, (OSError, TimeoutError, asyncio.TimeoutError, asyncpg.PostgresConnectionError,
                          asyncpg.InterfaceError, sqlalchemy.exc.TimeoutError))
        or state.startswith("08") or state in UNAVAILABLE_SQLSTATES
        or (isinstance(e, sqlalchemy.exc.DBAPIError) and e.connection_invalidated)
    )


def describe(e: BaseException) -> str:
    """One readable line for operators (no SQL text, no parameters)."""
    root = _root(e)
    msg = str(root).splitlines()[0] if str(root) else type(root).__name__
    state = getattr(root, "sqlstate", None)
    return f"{type(root).__name__}{f' [{state}]' if state else ''}: {msg}"


def translate(e: BaseException, what: str, *, committed_unknown: bool = False) -> LogError:
    if is_unavailable(e):
        return LogUnavailable(f"PostgreSQL unavailable during {what}: {describe(e)}",
                              committed_unknown=committed_unknown)
    return LogError(f"PostgreSQL refused {what}: {describe(e)}")


# --- SQL of the append path -------------------------------------------------------------

LOCK_LEADER = "SELECT leader_epoch FROM leader WHERE id = 1 FOR UPDATE"
HEAD = "SELECT coalesce(max(position), 0) FROM events"
KNOWN_SOURCES = "SELECT source_id FROM events WHERE source_id = ANY($1::text[])"
# One index probe per stream (max() on the unique (stream_id, stream_version) index).
STREAM_HEADS = ("SELECT s, coalesce((SELECT max(stream_version) FROM events WHERE stream_id = s), 0) "
                "FROM unnest($1::text[]) AS s")
INSERT_BATCH = """
INSERT INTO events (position, stream_id, stream_version, source_id, type, payload, leader_epoch)
SELECT p, s, v, src, t, pl::jsonb, $7
FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::text[], $5::text[], $6::text[]) AS u(p, s, v, src, t, pl)
"""
#: The epoch bump and the renewal row, in one statement (one transaction). Updating ``leader``
#: waits for an append in flight (it holds the row ``FOR UPDATE``); the renewal row is
#: written after that (it reads ``bumped``), so an old leader's renewal is never blocked
#: by the wait, and one that runs after the bump matches no row. An upsert, so a missing
#: renewal row is recreated rather than leaving the new leader looking stale.
TAKE_LEADERSHIP = """
WITH bumped AS (
    UPDATE leader SET leader_epoch = leader_epoch + 1, holder = $1, since = now(), renewed_at = now()
    WHERE id = 1 RETURNING leader_epoch, holder, renewed_at
), renewal AS (
    INSERT INTO leader_renewal (id, leader_epoch, holder, renewed_at)
    SELECT 1, leader_epoch, holder, renewed_at FROM bumped
    ON CONFLICT (id) DO UPDATE
        SET leader_epoch = excluded.leader_epoch, holder = excluded.holder, renewed_at = excluded.renewed_at
    RETURNING leader_epoch
)
SELECT b.leader_epoch FROM bumped b JOIN renewal r ON r.leader_epoch = b.leader_epoch
"""
#: The leader's renewal: "UPDATE 1" while ``epoch`` ($1) is current, "UPDATE 0" once it was
#: superseded. It locks only the renewal row; the check on ``leader`` is a plain read (a
#: row locked ``FOR UPDATE`` by an append does not block it) and catches an epoch bumped
#: by anything that did not also rewrite the renewal row (an older coordinator, a hand edit).
RENEW_LEADERSHIP = ("UPDATE leader_renewal SET renewed_at = now() WHERE id = 1 AND leader_epoch = $1 "
                    "AND EXISTS (SELECT 1 FROM leader WHERE id = 1 AND leader_epoch = $1)")
#: holder, epoch, and whether the leader is stale ($1 = takeover_after_s). The renewal row
#: counts only for the current epoch; ``leader.renewed_at`` is what a coordinator older
#: than migration 0002 renews (``greatest`` ignores NULLs).
LEADER_STALE = """
SELECT l.holder, l.leader_epoch, coalesce(now() - greatest(l.renewed_at, r.renewed_at)
                                          > make_interval(secs => $1), true)
FROM leader l LEFT JOIN leader_renewal r ON r.id = 1 AND r.leader_epoch = l.leader_epoch
WHERE l.id = 1
"""


class PostgresEventLog:
    """:class:`~coordinator.log.port.EventLog` on PostgreSQL (schema from ``migrations/``)."""

    def __init__(self, engine: AsyncEngine, *, max_attempts: int = 3) -> None:
        self.engine = engine
        self._max_attempts = max_attempts

    @classmethod
    def connect(cls, settings: PgSettings) -> "PostgresEventLog":
        return cls(create_engine(settings))

    @contextlib.asynccontextmanager
    async def _driver(self, what: str) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection's asyncpg driver connection; only checkout errors are translated here."""
        conn = self.engine.connect()
        try:
            await conn.start()
            drv = (await conn.get_raw_connection()).driver_connection
        except BaseException as e:
            with contextlib.suppress(Exception):
                await conn.close()
            if isinstance(e, Exception):
                raise translate(e, what) from e
            raise
        try:
            yield drv  # type: ignore[misc]
        finally:
            with contextlib.suppress(Exception):
                await conn.close()

    async def append(self, batch: Sequence[NewEvent], leader_epoch: int) -> list[int | None]:
        if not batch:
            return []
        for attempt in range(1, self._max_attempts + 1):
            try:
                return await self._append_once(batch, leader_epoch)
            except _Retry as r:
                if attempt == self._max_attempts:
                    raise translate(r.cause, "append") from r.cause
                await asyncio.sleep(0.01 * 2 ** attempt)
        raise AssertionError("unreachable")

    async def _append_once(self, batch: Sequence[NewEvent], leader_epoch: int) -> list[int | None]:
        commit_sent = False
        try:
            async with self._driver("append") as drv:
                tx = drv.transaction()
                await tx.start()
                try:
                    current = await drv.fetchval(LOCK_LEADER)
                    if current is None:
                        raise LogError("the leader row is missing: run `kvledger db upgrade`")
                    if current != leader_epoch:
                        raise NotLeader(leader_epoch, current)
                    head = await drv.fetchval(HEAD)
                    sources = [e.source_id for e in batch if e.source_id is not None]
                    known = {r[0] for r in await drv.fetch(KNOWN_SOURCES, sources)} if sources else set()
                    streams = list({e.stream_id for e in batch})
                    heads = {r[0]: r[1] for r in await drv.fetch(STREAM_HEADS, streams)}
                    rows, out = plan_append(batch, head, heads, known)
                    if rows:
                        await drv.execute(
                            INSERT_BATCH,
                            [p for p, _, _ in rows], [e.stream_id for _, _, e in rows], [v for _, v, _ in rows],
                            [e.source_id for _, _, e in rows], [e.type for _, _, e in rows],
                            [e.payload.decode() for _, _, e in rows], leader_epoch)
                except BaseException:
                    with contextlib.suppress(Exception):
                        await tx.rollback()
                    raise
                commit_sent = True
                await tx.commit()
                return out
        except LogUnavailable as e:
            e.committed_unknown = commit_sent
            raise
        except (LogError, asyncio.CancelledError):
            raise
        except Exception as e:
            if not commit_sent and is_retryable(e):
                raise _Retry(e) from e
            raise translate(e, "append", committed_unknown=commit_sent) from e

    async def read(self, from_position: int = 1, limit: int = 1000) -> list[StoredEvent]:
        q = (select(events.c.position, events.c.stream_id, events.c.stream_version, events.c.type,
                    cast(events.c.payload, Text), events.c.source_id, events.c.leader_epoch, events.c.recorded_at)
             .where(events.c.position >= from_position).order_by(events.c.position).limit(max(limit, 0)))
        return await self._read_events(q, "read")

    async def read_stream(self, stream_id: str, from_version: int = 1, limit: int = 10_000) -> list[StoredEvent]:
        q = (select(events.c.position, events.c.stream_id, events.c.stream_version, events.c.type,
                    cast(events.c.payload, Text), events.c.source_id, events.c.leader_epoch, events.c.recorded_at)
             .where(events.c.stream_id == stream_id, events.c.stream_version >= from_version)
             .order_by(events.c.stream_version).limit(max(limit, 0)))
        return await self._read_events(q, "read_stream")

    async def _read_events(self, q: Any, what: str) -> list[StoredEvent]:
        rows = await self._fetch(q, what)
        return [StoredEvent(r[0], r[1], r[2], r[3], r[4].encode(), r[5], r[6], r[7]) for r in rows]

    async def _fetch(self, q: Any, what: str, params: dict[str, Any] | None = None) -> Sequence[Any]:
        try:
            async with self.engine.connect() as conn:
                return (await conn.execute(q, params or {})).all()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise translate(e, what) from e

    async def ping(self) -> None:
        """Raise the translated error if PostgreSQL cannot be used (unreachable, bad credentials…)."""
        await self._fetch(text("SELECT 1"), "connect")

    async def head(self) -> int:
        rows = await self._fetch(text(HEAD), "head")
        return int(rows[0][0])

    async def take_leadership(self, holder: str) -> int:
        async with self._driver("take_leadership") as drv:
            try:
                epoch = await drv.fetchval(TAKE_LEADERSHIP, holder)
            except Exception as e:
                raise translate(e, "take_leadership") from e
        if epoch is None:
            raise LogError("the leader row is missing: run `kvledger db upgrade`")
        return int(epoch)

    async def leader(self) -> LeaderInfo:
        # Same rule as LEADER_STALE: the renewal row counts for the current epoch only.
        renewed_at = func.greatest(leader.c.renewed_at, leader_renewal.c.renewed_at)
        current = and_(leader_renewal.c.id == 1, leader_renewal.c.leader_epoch == leader.c.leader_epoch)
        rows = await self._fetch(
            select(leader.c.leader_epoch, leader.c.holder, leader.c.since, renewed_at)
            .select_from(leader.outerjoin(leader_renewal, current))
            .where(leader.c.id == 1), "leader")
        if not rows:
            raise LogError("the leader row is missing: run `kvledger db upgrade`")
        return LeaderInfo(*rows[0])

    async def latest_snapshot(self) -> Snapshot | None:
        rows = await self._fetch(
            select(snapshots.c.position, snapshots.c.state_hash, snapshots.c.state, snapshots.c.leader_epoch,
                   snapshots.c.created_at).order_by(snapshots.c.position.desc()).limit(1), "latest_snapshot")
        return Snapshot(rows[0][0], rows[0][1], bytes(rows[0][2]), rows[0][3], rows[0][4]) if rows else None

    async def save_snapshot(self, snapshot: Snapshot, leader_epoch: int) -> None:
        try:
            async with self.engine.begin() as conn:
                current = (await conn.execute(text(LOCK_LEADER))).scalar()
                if current != leader_epoch:
                    raise NotLeader(leader_epoch, current or 0)
                head = (await conn.execute(text(HEAD))).scalar() or 0
                if snapshot.position > head:
                    raise LogError(f"snapshot at position {snapshot.position} is past the head {head}")
                await conn.execute(text(
                    "INSERT INTO snapshots (position, state_hash, state, leader_epoch) "
                    "VALUES (:p, :h, :s, :e) ON CONFLICT (position) DO NOTHING"),
                    {"p": snapshot.position, "h": snapshot.state_hash, "s": snapshot.state, "e": leader_epoch})
        except (LogError, asyncio.CancelledError):
            raise
        except Exception as e:
            raise translate(e, "save_snapshot") from e

    async def close(self) -> None:
        await self.engine.dispose()


class _Retry(Exception):
    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause
