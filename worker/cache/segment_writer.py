"""A writer's side of the segment files (:mod:`worker.cache.segments` describes the format):
:class:`SegmentWriter` appends a batch of records with one ``writev`` and one fsync, starts the
next segment past ``segment_bytes`` or when the open one changed behind its back, and lists and
deletes its own segments. Readers (any worker) use :class:`worker.cache.segments.SegmentIndex`.
"""

from __future__ import annotations

import errno
import os
import zlib
from collections.abc import Sequence
from pathlib import Path

from shared.hashing import checksum
from shared.versions import SEGMENT_FORMAT_VERSION
from worker.cache.offload_key import OffloadUnavailable, check_token
from worker.cache.segments import (
    _ZEROS, ALIGN, SUFFIX, Record, RecordHeader, RecordKey, _errno_name, encode_header,
)


class SegmentWriter:
    """One writer's segments: appends batches to the current one, starts a new one past
    ``segment_bytes``, lists and deletes its own. Blocking (the engine's I/O thread)."""

    def __init__(self, root: Path, writer: str, segment_bytes: int) -> None:
        check_token("writer", writer)
        self.root = root
        self.dir = root / "segments" / writer
        self.segment_bytes = segment_bytes
        self._fd: int | None = None
        self.current: Path | None = None
        self._size = 0

    def _open_next(self) -> None:
        self.close()
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        nums = [int(p.stem) for p in self.dir.glob(f"*{SUFFIX}") if p.stem.isdigit()]
        path = self.dir / f"{max(nums, default=0) + 1:08d}{SUFFIX}"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        self.current, self._size = path, 0

    def _still_ours(self) -> bool:
        """The open segment is still the file at its path, as long as we wrote it: appending to
        an unlinked file (someone emptied the directory) would write bytes nobody can find."""
        assert self._fd is not None and self.current is not None
        st = os.fstat(self._fd)
        try:
            at = os.stat(self.current)
        except FileNotFoundError:
            return False
        return st.st_nlink > 0 and st.st_size == self._size and (at.st_dev, at.st_ino) == (st.st_dev, st.st_ino)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self.current, self._size = None, None, 0

    def append(self, items: Sequence[tuple[RecordKey, memoryview]]) -> list[Record]:
        """Append one record per item and fsync once; returns where each lies.

        Raises :class:`OffloadUnavailable` (nothing of the batch is readable then: the segment
        is cut back to where the batch began and closed, so the next batch starts a new one).
        """
        if not items:
            return []
        try:
            if self._fd is not None and not self._still_ours():
                self.close()        # cut, grown, deleted or replaced behind our back: start a new segment
            if self._fd is None or self._size >= self.segment_bytes:
                self._open_next()
            assert self._fd is not None and self.current is not None
            start = self._size
            out: list[Record] = []
            bufs: list[bytes | memoryview] = []
            at = start
            pad = b""                                  # the previous record's padding, sent with this header
            path = self.current
            add_buf, add_rec = bufs.append, out.append
            for key, data in items:
                data = data.cast("B")
                n = len(data)
                h = RecordHeader(SEGMENT_FORMAT_VERSION, key.namespace, key.tenant, key.block_hash, key.form,
                                 key.spec_digest, n, checksum(data))
                head = encode_header(h)
                if pad:
                    add_buf(pad)
                add_buf(head)
                add_buf(data)
                end = at + len(head) + n
                add_rec(Record(path, at, at + len(head), end, h, zlib.crc32(head)))
                pad = _ZEROS[:(-end) % ALIGN]
                at = end + len(pad)
            if pad:
                add_buf(pad)
            try:
                _write_all(self._fd, bufs)
                os.fsync(self._fd)
            except OSError:
                try:
                    os.ftruncate(self._fd, start)
                except OSError:
                    pass
                self.close()
                raise
            self._size = at
            return out
        except OSError as e:
            raise OffloadUnavailable(f"offload write failed ({_errno_name(e)}): {e.strerror}") from e

    def segments(self) -> list[tuple[Path, int]]:
        """This writer's segments, oldest first, with their sizes."""
        out = []
        for p in sorted(self.dir.glob(f"*{SUFFIX}")) if self.dir.exists() else ():
            try:
                out.append((p, p.stat().st_size))
            except FileNotFoundError:
                pass
        return out

    def delete(self, path: Path) -> None:
        if path == self.current:
            self.close()
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise OffloadUnavailable(f"offload delete failed ({_errno_name(e)}): {e.strerror}") from e


def _write_all(fd: int, bufs: list[bytes | memoryview]) -> None:
    """``writev`` until every buffer is written: a short write (a full disk) is followed by
    another, which then fails with the real error (ENOSPC) rather than a made-up one."""
    pending = [b for b in bufs if len(b)]
    i = 0                                              # first buffer not yet wholly written
    while i < len(pending):
        n = os.writev(fd, pending[i:i + 960])          # under IOV_MAX
        if n == 0:
            raise OSError(errno.EIO, "write made no progress")
        while n and i < len(pending):
            size = len(pending[i])
            if n >= size:
                n -= size
                i += 1
            else:
                pending[i] = memoryview(pending[i])[n:]
                n = 0


__all__ = ["SegmentWriter"]
