"""One writer: a session advisory lock on a dedicated connection, plus a fencing epoch.

The lock says who *should* write; the epoch makes PostgreSQL enforce it. On acquiring the
lock the new leader bumps ``leader.leader_epoch`` (the fencing token) and every append
checks it inside its own transaction (:mod:`coordinator.log.postgres`), so a former leader
that was paused, partitioned or slow cannot write once it has been replaced.

NOTE: the lock lives on its own connection, never on a pooled one: asyncpg's pool runs
``pg_advisory_unlock_all()`` when a connection is released, and SQLAlchemy's pool would
hand a locked session to someone else. Losing that connection means losing leadership.

A paused leader keeps its TCP connection (the kernel answers keepalives for a stopped
process), so PostgreSQL would hold its lock forever. The leader therefore renews
``leader_renewal.renewed_at`` (database clock) every ``renew_interval_s``; a standby that
finds the lock held but the renewal older than ``takeover_after_s`` terminates the holder's
sessions — the lock connection and any pooled connection mid-append, found by
``application_name`` — and takes the lock. The epoch bump makes this safe even if the old
leader was merely slow: its next append fails with ``NotLeader`` and it steps down.

NOTE: the renewal must never wait for an append. Appends lock the ``leader`` row
``FOR UPDATE`` for the whole append transaction, so a renewal on that row waited behind a
slow append until it timed out and the leader stepped down (and replayed the log). The
renewal therefore updates ``leader_renewal``, which appends never lock, and only
``WHERE leader_epoch = <our epoch>``: after a takeover it updates no row and we step down
(:data:`~coordinator.log.postgres.RENEW_LEADERSHIP`).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from coordinator.aio import bounded
from coordinator.log.port import LogUnavailable
from coordinator.log.postgres import (
    LEADER_STALE, RENEW_LEADERSHIP, TAKE_LEADERSHIP, PgSettings, describe,
)

#: pg_advisory_lock(int4, int4) keys: "kvl", 1 = the coordinator leader.
LOCK_CLASS = 0x6B766C
LOCK_ID = 1


def make_holder_id() -> str:
    """A unique holder name; its first 63 characters are the sessions' ``application_name``."""
    return f"kvl-coord-{secrets.token_hex(4)}@{socket.gethostname()[:32]}:{os.getpid()}"


class LeaderElection:
    def __init__(self, settings: PgSettings, holder: str, *, renew_interval_s: float, takeover_after_s: float,
                 logger: Any = None) -> None:
        self.settings = settings
        self.holder = holder
        self.app_name = holder[:63]
        self.renew_interval_s = renew_interval_s
        self.takeover_after_s = takeover_after_s
        self.log = logger
        self.epoch = 0
        #: When (monotonic) the last renewal that succeeded was sent.
        self.confirmed_at = 0.0
        self._conn: asyncpg.Connection | None = None
        self._renew: asyncio.Task[None] | None = None
        self._lost: asyncio.Future[str] | None = None

    @property
    def is_leader(self) -> bool:
        return self._lost is not None and not self._lost.done()

    async def _connect(self) -> asyncpg.Connection:
        settings = self.settings.server_settings() | {
            "application_name": self.app_name,
            # Let PostgreSQL notice a vanished host quickly (the lock is released with the session).
            "tcp_keepalives_idle": "5", "tcp_keepalives_interval": "2", "tcp_keepalives_count": "3",
        }
        return await asyncpg.connect(self.settings.dsn, timeout=self.settings.connect_timeout_s,
                                     command_timeout=self.settings.statement_timeout_s,
                                     server_settings=settings, ssl=self.settings.ssl)

    async def acquire(self, poll_s: float | None = None,
                      on_wait: Callable[[str], Awaitable[None]] | None = None) -> int:
        """Wait until this process holds the lock, bump the epoch, start renewing; returns the epoch.

        ``on_wait("held")`` is awaited while a live leader holds the lock, ``on_wait("unreachable")``
        while PostgreSQL cannot be reached.
        """
        poll = poll_s if poll_s is not None else min(self.renew_interval_s, 1.0)
        last_error = ""
        while True:
            try:
                if self._conn is None or self._conn.is_closed():
                    self._conn = await self._connect()
                got = await self._conn.fetchval("SELECT pg_try_advisory_lock($1, $2)", LOCK_CLASS, LOCK_ID)
                if got:
                    t0 = time.monotonic()
                    epoch = await self._conn.fetchval(TAKE_LEADERSHIP, self.holder)
                    self.epoch = int(epoch)
                    self.confirmed_at = t0
                    self._lost = asyncio.get_running_loop().create_future()
                    self._renew = asyncio.create_task(self._renew_loop(), name="leader-renew")
                    return self.epoch
                if not await self._maybe_take_over() and on_wait is not None:
                    await on_wait("held")
                last_error = ""
            # NOTE: InternalClientError is asyncpg's answer to a statement sent on a session the server
            # ended before the client noticed (a PostgreSQL restart, a terminated backend): wait on.
            except (OSError, asyncio.TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError,
                    asyncpg.InternalClientError) as e:
                msg = describe(e)
                if msg != last_error and self.log is not None:
                    self.log.warning("leader_election_waiting", reason=msg)
                last_error = msg
                await self._close_conn()
                if on_wait is not None:
                    await on_wait("unreachable")
            await asyncio.sleep(poll)

    async def _maybe_take_over(self) -> bool:
        """Terminate a stale holder's sessions; True if there was one."""
        assert self._conn is not None
        row = await self._conn.fetchrow(LEADER_STALE, self.takeover_after_s)
        if row is None or not row[2]:
            return False
        stale_holder, stale_epoch = row[0], row[1]
        killed = await self._conn.fetchval(
            """SELECT count(pg_terminate_backend(a.pid)) FROM pg_stat_activity a
               WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
                 AND (a.application_name = left($1, 63)
                      OR a.pid IN (SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted
                                   AND l.classid = $2::int::oid AND l.objid = $3::int::oid AND l.objsubid = 2))""",
            stale_holder, LOCK_CLASS, LOCK_ID)
        if killed and self.log is not None:
            self.log.warning("leader_stale_taking_over", stale_epoch=stale_epoch, sessions_terminated=killed,
                             takeover_after_s=self.takeover_after_s)
        return True

    async def _renew_loop(self) -> None:
        assert self._conn is not None and self._lost is not None
        timeout = max(self.takeover_after_s - self.renew_interval_s, self.renew_interval_s)
        try:
            while True:
                await asyncio.sleep(self.renew_interval_s)
                t0 = time.monotonic()
                renew = asyncio.ensure_future(self._conn.execute(RENEW_LEADERSHIP, self.epoch))
                renew.add_done_callback(lambda t: t.cancelled() or t.exception())
                done, _ = await asyncio.wait({renew}, timeout=timeout)
                if not done:
                    # NOTE: past this point a standby may already consider us stale: stop now.
                    self._set_lost(f"lock session did not answer within {timeout:.1f}s")
                    await self._close_conn()
                    return
                if renew.result() != "UPDATE 1":
                    self._set_lost(f"fenced: leader epoch {self.epoch} was superseded")
                    return
                self.confirmed_at = t0
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the lock session ends leadership
            self._set_lost(f"lock connection lost: {describe(e)}")
            await self._close_conn()

    def confirmed(self) -> bool:
        """True while no standby can yet consider this leader stale.

        The renewal sent at :attr:`confirmed_at` (or later) is in the database, so a standby
        takes over no earlier than ``takeover_after_s`` after it; one renewal interval is kept
        as margin. Answers that write nothing (heartbeats) are given only while this holds:
        a leader paused past it may already be replaced and must not speak for the ledger.
        """
        return self.is_leader and time.monotonic() - self.confirmed_at < self.takeover_after_s - self.renew_interval_s

    def _set_lost(self, reason: str) -> None:
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(reason)

    async def lost(self) -> str:
        """Completes (with the reason) when leadership is lost."""
        if self._lost is None:
            raise LogUnavailable("not the leader")
        return await asyncio.shield(self._lost)

    async def release(self) -> None:
        """Stop renewing, unlock and close the lock connection (bounded: never hangs)."""
        self._set_lost("released")
        renew, self._renew = self._renew, None
        if renew is not None:
            renew.cancel()
            await bounded(renew, 1.0)
        conn = self._conn
        if conn is not None and not conn.is_closed() and not conn.is_in_transaction():
            await bounded(conn.execute("SELECT pg_advisory_unlock_all()"), 1.0)
        await self._close_conn()

    async def _close_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            # Closing the socket ends the session, which releases the lock; no goodbye needed.
            conn.terminate()
