"""Retention of the event log: archive its oldest events to a file anchored on a snapshot.

The log is the truth, and it grew forever. An archive moves the events ``first..last`` out
of PostgreSQL into one file, where ``last`` is the position of a snapshot (the *anchor*):

1. the events are read in pages, written to ``<out>/kvledger-log-<first>-<last>.jsonl.gz``
   (a header line, one JSON array per event with every stored column, a trailer line), and
   folded onto the previous anchor's state (empty for the first archive);
2. the fold must reproduce the anchor's state hash: the file then provably holds exactly the
   history the anchor summarises, and the audit may start from the anchor from then on;
3. the file is fsynced and renamed into place, its SHA-256 computed as it was written;
4. ``kvl_archive`` (migration 0005) checks again, in one transaction, that the anchor is
   there and that the stored events are exactly those counted, records the archive, the
   stream version floors and deletes the events (and the snapshots the anchor supersedes).

Nothing is deleted unless 1–3 succeeded, and a crash between 3 and 4 leaves a file and an
untouched log (the next run writes the file again). :func:`verify_archives` re-folds a chain
of files offline (from position 1) and checks each anchor hash and the trailers, so the whole
history stays provable without the database.

An archive runs as the schema owner (``database.owner_url``): the coordinator's role may not
delete. It never blocks appends: it touches only positions at or below a snapshot, and the
coordinator writes past its head.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from coordinator.core import (
    CoreParams, EventDecodeError, IllegalTransition, LedgerState, ReplayError, SnapshotError, apply, decode_event,
    from_snapshot, state_hash,
)
from coordinator.core.events import replica_stream
from coordinator.core.state import no_gc
from coordinator.log.chain import GENESIS, ChainCheck, link
from coordinator.log.postgres import ARCHIVED_UPTO, CHAIN_AT, HEAD

FORMAT = "kvledger-log-archive"
FORMAT_VERSION = 1
#: The columns of each event line, in order (``payload`` is the stored JSON text, as a string).
FIELDS = ("position", "stream_id", "stream_version", "source_id", "type", "leader_epoch", "recorded_at", "payload")
#: Rows read per page (a page of payloads is a few MB).
PAGE = 10_000

READ_PAGE = ("SELECT position, stream_id, stream_version, source_id, type, leader_epoch, recorded_at, payload, "
             "chain_hash FROM events WHERE position > $1 AND position <= $2 ORDER BY position LIMIT $3")
SNAPSHOT_AT = "SELECT position, state_hash, state FROM snapshots WHERE position = $1"
# the newest snapshot an archive may anchor on: past the last archive, at or before the limit
ANCHOR = "SELECT position, state_hash FROM snapshots WHERE position > $1 AND position <= $2 ORDER BY position DESC LIMIT 1"
ARCHIVE = "SELECT kvl_archive($1, $2, $3, $4, $5, $6)"
#: Session advisory lock held for an archive's whole length (any constant nobody else uses).
ARCHIVE_LOCK = 0x6B766C6172636876  # "kvlarchv"
TRY_LOCK = "SELECT pg_try_advisory_lock($1)"
UNLOCK = "SELECT pg_advisory_unlock($1)"
LIST = ("SELECT first_position, last_position, events, anchor_hash, sha256, file_name, archived_at "
        "FROM log_archives ORDER BY last_position")


class ArchiveError(RuntimeError):
    """The archive cannot be made or verified; nothing was deleted."""


@dataclass(frozen=True, slots=True)
class Header:
    first_position: int
    last_position: int
    events: int
    anchor_hash: str
    created_at: str
    #: The log's chain head at ``last_position`` (hex; :mod:`coordinator.log.chain`): a copy outside
    #: the database. Files made before migration 0006 have none.
    chain_hash: str = ""
    format: str = FORMAT
    version: int = FORMAT_VERSION
    fields: tuple[str, ...] = FIELDS

    def line(self) -> bytes:
        return msgspec.json.encode({"format": self.format, "version": self.version,
                                    "first_position": self.first_position, "last_position": self.last_position,
                                    "events": self.events, "anchor_hash": self.anchor_hash,
                                    "created_at": self.created_at, "fields": list(self.fields),
                                    "chain_hash": self.chain_hash}) + b"\n"


def file_name(first: int, last: int) -> str:
    return f"kvledger-log-{first:012d}-{last:012d}.jsonl.gz"


class _Sha256Writer(io.RawIOBase):
    """A file that hashes what is written to it (the gzip stream's bytes, i.e. the file's)."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.sha = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.sha.update(b)
        return int(self._f.write(b))


class ArchiveWriter:
    """Writes one archive file to a temporary name; :meth:`commit` fsyncs and renames it."""

    def __init__(self, out_dir: Path, header: Header, *, level: int = 1) -> None:
        self.path = out_dir / file_name(header.first_position, header.last_position)
        self._tmp = self.path.with_name(self.path.name + ".partial")
        # NOTE: 0600 like the offload files: the events name tenants and their blocks
        self._raw = os.fdopen(os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")
        self._hashing = _Sha256Writer(self._raw)
        # NOTE: mtime 0: the same events always give the same bytes (and SHA-256)
        self._gz = gzip.GzipFile(fileobj=self._hashing, mode="wb", compresslevel=level, mtime=0)
        self._gz.write(header.line())
        self.events = 0

    def write_rows(self, rows: list[tuple]) -> None:
        enc = msgspec.json.encode
        self._gz.write(b"\n".join(enc(r) for r in rows) + b"\n")
        self.events += len(rows)

    def commit(self) -> str:
        """Trailer, fsync, rename, fsync the directory; returns the file's SHA-256."""
        self._gz.write(msgspec.json.encode({"end": True, "events": self.events}) + b"\n")
        self._gz.close()
        self._raw.flush()
        os.fsync(self._raw.fileno())
        self._raw.close()
        os.replace(self._tmp, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return self._hashing.sha.hexdigest()

    def abort(self) -> None:
        try:
            self._gz.close()
        finally:
            self._raw.close()
            self._tmp.unlink(missing_ok=True)


def _row(r: Any) -> tuple:
    recorded = r[6]
    return (r[0], r[1], r[2], r[3], r[4], r[5], recorded.isoformat() if recorded is not None else None, r[7])


def open_streams(state: LedgerState) -> list[str]:
    """The replica and lease streams the state holds: the ones that may still get events, whose
    versions must continue after their stored events are archived."""
    return [replica_stream(*key) for key in state.replicas] + [f"lease:{lease_id}" for lease_id in state.leases]


def _fold_one(state: LedgerState, position: int, payload: str | bytes) -> None:
    try:
        apply(state, decode_event(payload))
    except (EventDecodeError, ReplayError, IllegalTransition) as e:
        raise ArchiveError(f"the event at position {position} cannot be folded: {e}") from e


# --- making an archive (PostgreSQL, as the schema owner) ------------------------------------------

async def plan(conn: Any, before: int) -> dict[str, Any]:
    """What an archive ``--before`` would hold: the anchor (newest snapshot past the last archive
    at or before ``before``) and the range of events."""
    archived = int(await conn.fetchval(ARCHIVED_UPTO))
    head = int(await conn.fetchval(HEAD))
    row = await conn.fetchrow(ANCHOR, archived, min(before, head))
    if row is None:
        raise ArchiveError(f"no snapshot between position {archived + 1} (after the last archive) and {before}: an "
                           f"archive ends at a snapshot, and the coordinator takes one every "
                           f"coordinator.snapshot_every_events events (the log's head is {head})")
    last = int(row["position"])
    chain = await conn.fetchval(CHAIN_AT, last)
    return {"first_position": archived + 1, "last_position": last, "events": last - archived,
            "anchor_hash": row["state_hash"], "head": head, "archived_before": archived,
            "chain_hash": bytes(chain).hex() if chain is not None else ""}


async def archive(conn: Any, out_dir: Path, before: int, params: CoreParams, *, page: int = PAGE,
                  progress: Callable[[int], None] | None = None, dry_run: bool = False) -> dict[str, Any]:
    """Archive the events up to the newest snapshot at or before ``before`` (see the module doc).
    ``conn`` is an asyncpg connection of the schema owner, without a statement timeout."""
    # NOTE: one archive at a time, for its whole length: a second one would write the same
    # file name (and kvl_archive would refuse it only after it had replaced the first's file)
    if not await conn.fetchval(TRY_LOCK, ARCHIVE_LOCK):
        raise ArchiveError("another archive of this log is running (it holds the archive lock); try again when "
                           "it has finished")
    try:
        return await _archive_locked(conn, out_dir, before, params, page=page, progress=progress, dry_run=dry_run)
    finally:
        await conn.execute(UNLOCK, ARCHIVE_LOCK)


async def _archive_locked(conn: Any, out_dir: Path, before: int, params: CoreParams, *, page: int,
                          progress: Callable[[int], None] | None, dry_run: bool) -> dict[str, Any]:
    p = await plan(conn, before)
    if dry_run:
        return {**p, "dry_run": True}
    first, last = p["first_position"], p["last_position"]
    if first > 1:
        snap = await conn.fetchrow(SNAPSHOT_AT, first - 1)
        if snap is None:
            raise ArchiveError(f"the previous archive's anchor snapshot at position {first - 1} is missing")
        try:
            state = from_snapshot(bytes(snap["state"]), params)
        except SnapshotError as e:
            raise ArchiveError(f"the previous archive's anchor at position {first - 1} cannot be loaded: {e}") from e
    else:
        state = LedgerState.empty(params)
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    t0 = time.perf_counter()
    header = Header(first, last, p["events"], p["anchor_hash"], datetime.now(UTC).isoformat(), p["chain_hash"])
    writer = ArchiveWriter(out_dir, header)
    pos = first - 1
    prev = await conn.fetchval(CHAIN_AT, pos) if pos else GENESIS
    chain = ChainCheck(pos, bytes(prev) if prev is not None else GENESIS)
    try:
        with no_gc():
            while pos < last:
                rows = await conn.fetch(READ_PAGE, pos, last, page)
                if not rows:
                    break
                for r in rows:
                    if r[0] != pos + 1:
                        raise ArchiveError(f"log gap: position {pos + 1} is missing (next stored is {r[0]})")
                    _fold_one(state, r[0], r[7])
                    pos = r[0]
                if not chain.feed((r[0], r[1], r[4], r[3], r[7].encode(), r[5], r[8]) for r in rows):
                    assert chain.broken is not None
                    raise ArchiveError(f"the log's hash chain breaks at position {chain.broken.position} "
                                       f"({chain.broken.what}): nothing archived; run `kvledger audit`")
                writer.write_rows([_row(r) for r in rows])
                if progress is not None:
                    progress(pos - first + 1)
        if pos != last:
            raise ArchiveError(f"the log ends at position {pos}, before the anchor at {last}")
        got = state_hash(state)
        if got != p["anchor_hash"]:
            raise ArchiveError(f"the events {first}..{last} fold to state hash {got}, not to the anchor snapshot's "
                               f"{p['anchor_hash']}: nothing archived (run it with the coordinator's configuration: "
                               f"the fold's limits are coordinator.* keys; `kvledger replay` checks the log)")
        sha = writer.commit()
    except BaseException:
        writer.abort()
        raise
    t1 = time.perf_counter()
    try:
        await conn.fetchval(ARCHIVE, last, p["events"], p["anchor_hash"], sha, writer.path.name, open_streams(state))
    except Exception as e:
        code = getattr(e, "sqlstate", "")
        if code in ("KV010", "KV011", "KV012"):
            raise ArchiveError(f"the database refused the archive ({e}); the file {writer.path} was written but "
                               f"nothing was deleted") from e
        raise
    return {**p, "file": str(writer.path), "sha256": sha, "bytes": writer.path.stat().st_size, "dry_run": False,
            "write_seconds": round(t1 - t0, 3), "delete_seconds": round(time.perf_counter() - t1, 3)}


async def list_archives(conn: Any) -> list[dict[str, Any]]:
    return [{"first_position": r[0], "last_position": r[1], "events": r[2], "anchor_hash": r[3], "sha256": r[4],
             "file": r[5], "archived_at": r[6].isoformat()} for r in await conn.fetch(LIST)]


# --- reading and verifying archives (offline) -----------------------------------------------------

def read_archive(path: Path) -> tuple[dict[str, Any], Iterator[list[Any]]]:
    """The header and an iterator over the event rows; the iterator raises :class:`ArchiveError`
    for a truncated file, a missing trailer or a trailer whose count differs."""
    f = gzip.open(path, "rb")
    try:
        header = msgspec.json.decode(f.readline())
    except (OSError, EOFError, msgspec.DecodeError) as e:
        f.close()
        raise ArchiveError(f"{path}: not a readable archive ({e})") from e
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != FORMAT_VERSION:
        f.close()
        raise ArchiveError(f"{path}: not a {FORMAT} file of version {FORMAT_VERSION}")

    def rows() -> Iterator[list[Any]]:
        n = 0
        try:
            for line in f:
                doc = msgspec.json.decode(line)
                if isinstance(doc, dict):
                    if doc.get("end") is not True or doc.get("events") != n:
                        raise ArchiveError(f"{path}: the trailer says {doc.get('events')} events, the file holds {n}")
                    return
                n += 1
                yield doc
        except (OSError, EOFError, msgspec.DecodeError) as e:
            raise ArchiveError(f"{path}: damaged after {n} events ({e})") from e
        finally:
            f.close()
        raise ArchiveError(f"{path}: truncated (no trailer after {n} events)")

    return header, rows()


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_archives(paths: list[Path], params: CoreParams, *,
                    progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Fold a chain of archive files from position 1 (in order of their positions) and check
    that each one ends at its anchor's state hash. Returns the report; raises
    :class:`ArchiveError` at the first problem."""
    opened = sorted((read_archive(p) + (p,) for p in paths), key=lambda t: t[0]["first_position"])
    state = LedgerState.empty(params)
    pos = 0
    chain = GENESIS
    files = []
    with no_gc():
        for header, rows, path in opened:
            if header["first_position"] != pos + 1:
                raise ArchiveError(f"{path} starts at position {header['first_position']}; the chain is at {pos} "
                                   f"(a file is missing; the first archive starts at 1)")
            for r in rows:
                if r[0] != pos + 1:
                    raise ArchiveError(f"{path}: position {pos + 1} is missing (next is {r[0]})")
                try:
                    _fold_one(state, r[0], r[7])
                except ArchiveError as e:
                    raise ArchiveError(f"{path}: {e}") from e
                pos = r[0]
                chain = link(chain, r[0], r[5], r[1], r[4], r[3], r[7].encode())
                if progress is not None and not pos % 10_000:
                    progress(pos)
            if pos != header["last_position"]:
                raise ArchiveError(f"{path} ends at position {pos}, its header says {header['last_position']}")
            got = state_hash(state)
            if got != header["anchor_hash"]:
                raise ArchiveError(f"{path}: the events fold to state hash {got}, not to the anchor's "
                                   f"{header['anchor_hash']}")
            if header.get("chain_hash") and header["chain_hash"] != chain.hex():
                raise ArchiveError(f"{path}: the events chain to {chain.hex()[:16]}…, not to the chain head its "
                                   f"header recorded ({header['chain_hash'][:16]}…)")
            if not header.get("chain_hash"):
                chain = GENESIS   # made before migration 0006: the stored chain starts after it
            files.append({"file": str(path), "first_position": header["first_position"], "last_position": pos,
                          "anchor_hash": got, "sha256": sha256_of(path), "chain_hash": chain.hex()})
    return {"ok": True, "position": pos, "state_hash": state_hash(state), "files": files, "chain_hash": chain.hex()}


def match_recorded(files: list[dict[str, Any]], recorded: list[dict[str, Any]]) -> list[str]:
    """What differs between verified files (``verify_archives``' ``files``) and the archives the
    database recorded (``list_archives``): a file it does not know, another SHA-256, one missing."""
    by_range = {(r["first_position"], r["last_position"]): r for r in recorded}
    problems = []
    for f in files:
        r = by_range.pop((f["first_position"], f["last_position"]), None)
        if r is None:
            problems.append(f"{f['file']}: the database records no archive of positions {f['first_position']}.."
                            f"{f['last_position']}")
        elif r["sha256"] != f["sha256"]:
            problems.append(f"{f['file']}: SHA-256 {f['sha256']}, the database recorded {r['sha256']} for "
                            f"{r['file']} (not the file that was archived)")
    problems += [f"no file given for the recorded archive {r['file']} (positions {r['first_position']}.."
                 f"{r['last_position']})" for r in by_range.values()]
    return problems
