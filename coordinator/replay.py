"""Rebuild a ledger state from the log: latest snapshot (if usable) plus the tail, or from empty.

Used at takeover/restart, after a failed append (the live state may hold events the log
does not), and by the audit (into a fresh state, compared with the live one). Reads page by
page and yields to the event loop between pages, so a long replay never starves the
leader's lock renewal or the health endpoints. Progress is logged every
``progress_every`` events with the rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.core import (
    CoreParams, EventDecodeError, IllegalTransition, LedgerState, ReplayError, SnapshotError, apply, decode_event,
    from_snapshot, state_hash,
)
from coordinator.core.state import FoldFailed, fold_rows, indexes_deferred, no_gc
from coordinator.log.port import EventLog


class LogCorrupt(RuntimeError):
    """The log cannot be folded (gap, undecodable or impossible event); names the position."""


class LogGap(LogCorrupt):
    """A position is missing: a corrupt log, or one archived while this replay read it."""


@dataclass(slots=True)
class ReplayResult:
    state: LedgerState
    #: Last position folded (0 = empty log).
    position: int
    #: Events folded from the log (not counting what the snapshot held).
    events: int
    seconds: float
    #: Position of the snapshot the replay started from (None = from empty).
    snapshot_position: int | None = None
    #: Streams whose versions are not 1, 2, 3, … (only checked with ``check_streams``).
    stream_errors: list[str] = field(default_factory=list)
    #: The replay started at the newest archive's anchor (the log's first events are archived).
    from_archive_anchor: bool = False


#: Events per page of a replay's read (a page of payloads is a few MB).
REPLAY_PAGE = 20_000
#: Events folded between two yields to the event loop while the next page is being read.
YIELD_EVERY = 1_000


def _read_ahead(log: EventLog, pos: int, upto: int | None, page: int) -> tuple[asyncio.Future[Any] | None, int]:
    """The read of the page after ``pos``, started now, and its limit (None when ``upto`` is reached)."""
    limit = page if upto is None else min(page, upto - pos)
    if limit <= 0:
        return None, 0
    return asyncio.ensure_future(log.read_payloads(pos + 1, limit)), limit


def _raise_gap(batch: Sequence[tuple[int, Any]], pos: int) -> None:
    for position, _ in batch:
        if position != pos + 1:
            raise LogGap(f"log gap: position {pos + 1} is missing (next stored is {position})")
        pos = position
    raise AssertionError("no gap in the page")


async def _fold_checked(log: EventLog, state: LedgerState, pos: int, upto: int | None, page: int,
                        from_snapshot: bool) -> tuple[int, int, list[str]]:
    """The audit's fold: whole rows, checking that each stream's versions run 1, 2, 3, …
    Returns ``(position, events folded, stream errors)``."""
    heads: dict[str, int] = {}
    errors: list[str] = []
    n = 0
    while upto is None or pos < upto:
        limit = page if upto is None else min(page, upto - pos)
        batch = await log.read(pos + 1, limit)
        if not batch:
            break
        for se in batch:
            if se.position != pos + 1:
                raise LogGap(f"log gap: position {pos + 1} is missing (next stored is {se.position})")
            try:
                apply(state, decode_event(se.payload))
            except (EventDecodeError, ReplayError, IllegalTransition) as e:
                raise LogCorrupt(f"event at position {se.position} ({se.type}) cannot be folded: {e}") from e
            # From a snapshot, a stream's first version seen may continue an earlier history.
            prev = heads.get(se.stream_id, None if from_snapshot else 0)
            expected = se.stream_version if prev is None else prev + 1
            if se.stream_version != expected and len(errors) < 100:
                errors.append(f"stream {se.stream_id}: version {se.stream_version} at position "
                              f"{se.position}, expected {expected}")
            heads[se.stream_id] = se.stream_version
            pos = se.position
        n += len(batch)
        await asyncio.sleep(0)
    return pos, n, errors


async def _fold(log: EventLog, state: LedgerState, pos: int, upto: int | None, page: int, from_snapshot: bool,
                check_streams: bool, progress_every: int, logger: Any, what: str,
                t0: float) -> tuple[int, int, list[str]]:
    """Fold the events after ``pos`` onto ``state``; ``(position, events folded, stream errors)``."""
    n = 0
    next_report = progress_every
    if check_streams:
        pos, n, errors = await _fold_checked(log, state, pos, upto, page, from_snapshot)
    else:
        errors = []
        # The next page is read while this one is folded: PostgreSQL finds and sends rows
        # while this process decodes and applies.
        ahead, limit = _read_ahead(log, pos, upto, page)
        try:
            while ahead is not None:
                batch = await ahead
                ahead = None
                if not batch:
                    break
                last = batch[-1][0]
                if len(batch) == limit and last - pos == limit:  # a full page, no gap: there may be more
                    ahead, limit = _read_ahead(log, last, upto, page)
                if batch[0][0] != pos + 1 or last - pos != len(batch):
                    _raise_gap(batch, pos)   # positions are read in order: a gap shows at the ends
                for i in range(0, len(batch), YIELD_EVERY):
                    if i:
                        # let the next page's rows be read off the socket meanwhile: PostgreSQL
                        # keeps sending only while its socket buffer has room
                        await asyncio.sleep(0)
                    try:
                        fold_rows(state, batch[i:i + YIELD_EVERY])
                    except FoldFailed as e:
                        raise LogCorrupt(f"event at position {e.position} cannot be folded: {e.__cause__}") from e
                pos = last
                n += len(batch)
                if logger is not None and n >= next_report:
                    elapsed = time.perf_counter() - t0
                    logger.info(f"{what}_progress", events=n, position=pos,
                                events_per_s=round(n / max(elapsed, 1e-9)))
                    next_report = (n // progress_every + 1) * progress_every
                await asyncio.sleep(0)
        finally:
            if ahead is not None:
                ahead.cancel()
                with contextlib.suppress(BaseException):
                    await ahead
    return pos, n, errors


async def load_state(log: EventLog, params: CoreParams, *, upto: int | None = None, use_snapshot: bool = True,
                     check_streams: bool = False, page: int = REPLAY_PAGE, progress_every: int = 50_000,
                     logger: Any = None, what: str = "replay",
                     start: tuple[LedgerState, int] | None = None) -> ReplayResult:
    """``start``: continue folding onto ``(state, position)`` (a standby following the log)
    instead of loading a snapshot or starting from empty; the state is updated in place."""
    t0 = time.perf_counter()
    state: LedgerState | None = None
    pos = 0
    snap_pos: int | None = None
    if start is not None:
        state, pos = start
    elif use_snapshot:
        snap = await log.latest_snapshot()
        if snap is not None and (upto is None or snap.position <= upto):
            try:
                state = from_snapshot(snap.state, params)
                if state_hash(state) != snap.state_hash:
                    raise SnapshotError(f"state hash {state_hash(state)} != recorded {snap.state_hash}")
                pos = snap_pos = snap.position
            except SnapshotError as e:
                if logger is not None:
                    logger.warning("snapshot_unusable", position=snap.position, error=str(e),
                                   action="replaying from empty")
                state = None
    anchor = 0
    if state is None:
        # "From the beginning": position 1, or the newest archive's anchor once the log's oldest
        # events live in archive files (coordinator.log.archive).
        anchor, snap = await log.archive_anchor()
        if anchor and upto is not None and upto < anchor:
            raise LogCorrupt(f"positions up to {anchor} are archived: the log cannot be replayed to {upto}")
        if anchor:
            if snap is None:
                raise LogCorrupt(f"the log is archived up to position {anchor} and the snapshot there (the archive's "
                                 f"anchor) is missing")
            try:
                state = from_snapshot(snap.state, params)
            except SnapshotError as e:
                raise LogCorrupt(f"the archive anchor at position {anchor} cannot be loaded: {e}") from e
            if state_hash(state) != snap.state_hash:
                raise LogCorrupt(f"the archive anchor at position {anchor} does not hash to its recorded "
                                 f"{snap.state_hash}")
            pos = snap_pos = anchor
        else:
            state = LedgerState.empty(params)
    if logger is not None:
        logger.info(f"{what}_started", from_position=pos + 1, snapshot_position=snap_pos, upto=upto,
                    archive_anchor=anchor or None)
    # NOTE: the cyclic GC is paused as in ``core.replay``: a replay allocates millions of
    # long-lived objects and every full collection would rescan all of them (a third of a
    # replay's CPU). It stays paused across the page reads' awaits; nothing else runs long then.
    # a whole log (or its tail after a snapshot) rebuilds the LRU and deadline heaps once, at the
    # end; a standby's step (``start``) keeps them as it folds (see ``indexes_deferred``)
    deferred = indexes_deferred(state) if start is None else contextlib.nullcontext(state)
    try:
        with no_gc(), deferred:
            pos, n, errors = await _fold(log, state, pos, upto, page, snap_pos is not None, check_streams,
                                         progress_every, logger, what, t0)
    except LogGap as e:
        archived, _ = await log.archive_anchor()
        if archived > anchor and archived >= pos + 1:
            raise LogGap(f"the log was archived up to position {archived} while this replay read it: "
                         f"run it again") from e
        raise
    seconds = time.perf_counter() - t0
    if logger is not None:
        logger.info(f"{what}_done", events=n, position=pos, seconds=round(seconds, 3),
                    events_per_s=round(n / max(seconds, 1e-9)))
    return ReplayResult(state, pos, n, seconds, snap_pos, errors, from_archive_anchor=bool(anchor))
