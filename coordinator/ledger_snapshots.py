"""The ledger's snapshots, and the freeze they and the audits take.

Mixed into :class:`coordinator.ledger.Ledger` (it reads the ledger's state, position, epoch,
log, metrics and commit queue). :meth:`LedgerSnapshots.frozen` stops new decisions and
commits everything queued, so that the live state equals the log up to ``position`` exactly
while a snapshot or an audit (``coordinator.audit``) reads it. :meth:`LedgerSnapshots.snapshot`
saves one (hashed and encoded in a forked child where the OS can: ``coordinator.snapshot_child``,
the ledger frozen only for the ``fork()``); :meth:`LedgerSnapshots._maybe_snapshot` starts one
after every ``snapshot_every`` events stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from coordinator.core import LedgerState, state_hash, to_snapshot
from coordinator.log.port import LogError, Snapshot
from coordinator.snapshot_child import ForkedSnapshot, SnapshotChildFailed, fork_snapshot
from coordinator.unavailable import Unavailable


class LedgerSnapshots:
    """Freezes and snapshots, for :class:`coordinator.ledger.Ledger` (see the module's docstring)."""

    @contextlib.asynccontextmanager
    async def frozen(self) -> AsyncIterator[LedgerState]:
        """No new decisions, everything queued committed; yields the live state (read it, don't keep it)."""
        async with self._freeze_lock:
            self.check_serving()
            self._open.clear()
            try:
                if self.committer is not None:
                    await self.committer.flush()
                self.check_serving()
                yield self.state
            finally:
                self._open.set()

    async def snapshot(self) -> Snapshot:
        """Save a snapshot of the live state at the current position (fenced by the epoch).

        NOTE: decisions wait only while the state is frozen: for a ``fork()`` when a child
        serialises it (``snapshot_fork``), for the whole hash and encoding otherwise (~0.5 s
        with a 100k-slot worker). ``kvl_coordinator_snapshot_freeze_seconds`` shows which.
        """
        t0 = time.perf_counter()
        child: ForkedSnapshot | None = None
        async with self.frozen() as state:
            position, epoch = self.position, self.epoch
            if self.snapshot_fork:
                try:
                    child = fork_snapshot(state)
                except OSError as e:   # no memory or processes left for a child: take it here
                    self.logger.warning("snapshot_fork_failed", error=str(e), action="snapshotting in process")
            if child is None:
                hashed, data = state_hash(state), to_snapshot(state)
        self.metrics.snapshot_freeze.labels(how="fork" if child is not None else "in_process").observe(
            time.perf_counter() - t0)
        if child is not None:
            try:
                hashed, data = await child.result(self.snapshot_timeout_s)
            except SnapshotChildFailed as e:
                self.metrics.snapshot_failures.inc()
                raise Unavailable(f"snapshot not taken: {e}") from e
        snap = Snapshot(position=position, state_hash=hashed, state=data)
        try:
            await self.log.save_snapshot(snap, epoch)
        except LogError as e:
            raise Unavailable(f"snapshot not saved: {e}") from e
        self.metrics.snapshots.inc()
        self.metrics.snapshot_seconds.observe(time.perf_counter() - t0)
        await self.read_archived()
        self.logger.info("snapshot_saved", position=snap.position, state_hash=snap.state_hash,
                         bytes=len(snap.state), seconds=round(time.perf_counter() - t0, 3),
                         in_child=child is not None)
        return snap

    async def _periodic_snapshot(self) -> None:
        try:
            await self.snapshot()
        except Unavailable as e:
            self.logger.warning("snapshot_skipped", reason=str(e))
        # NOTE: events stored while this one was taken count towards the next: if they are
        # enough already, it starts now rather than at the next commit, which may be long off
        self._snapshotting = None
        self._maybe_snapshot()

    def _maybe_snapshot(self) -> None:
        """Start a periodic snapshot once ``snapshot_every`` events were stored since the last
        one started (and none is in flight)."""
        if self._since_snapshot >= self.snapshot_every and self.serving and (
                self._snapshotting is None or self._snapshotting.done()):
            self._since_snapshot = 0
            self._snapshotting = asyncio.create_task(self._periodic_snapshot(), name="snapshot")


__all__ = ["LedgerSnapshots"]
