"""A snapshot serialised by a forked child, so the ledger stops deciding only for the fork.

Hashing and encoding the state takes time in proportion to it (~0.5 s for a worker with a
100k-slot pool, measured in BENCHMARKS.md), and the ledger must not change while it runs:
done in the coordinator's process, every lease waits that long. ``fork()`` hands a child a
copy-on-write image of the state as it is at that instant (a few ms with a state of hundreds
of MB); the child computes the hash and the bytes and writes them to a pipe, and the ledger
decides again as soon as ``fork()`` returns. The same idea as Redis's ``BGSAVE``.

The child touches nothing but the state, ``state_hash``, ``to_snapshot`` and the pipe: it
closes every other descriptor it inherited (the parent's sessions must end with the parent),
and runs no event loop, no logging, no imports (a lock another thread held at the fork would
stay held in the child). It leaves with ``os._exit``, so nothing the parent buffered is
flushed twice. Wire format on the pipe: the state hash's length and the snapshot's (two
unsigned 64-bit little-endian integers), the hash (ASCII), the snapshot's bytes. The parent
reads the bytes into one buffer of that size, off the event loop's thread: no joining of
chunks, no slicing, two copies of tens of MB fewer while the loop decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import struct
from dataclasses import dataclass

from coordinator.core import LedgerState, state_hash, to_snapshot

#: The child's exit status when computing or writing the snapshot raised.
EXIT_FAILED = 70
#: Bytes per read from the child's pipe.
_CHUNK = 1 << 20
#: The lengths of the hash and of the snapshot, ahead of them.
_HEAD = struct.Struct("<QQ")


class SnapshotChildFailed(RuntimeError):
    """The child ended without handing over a whole snapshot (or ran past its time)."""


def can_fork() -> bool:
    return hasattr(os, "fork")


def _child(state: LedgerState, w: int) -> None:
    """In the child: hash, encode, write, exit. Never returns."""
    status = EXIT_FAILED
    try:
        # NOTE: the sockets (PostgreSQL sessions, the leader's among them; NATS) are the parent's:
        # if it dies first, a copy held here would keep them open until the child ends.
        os.closerange(3, w)
        os.closerange(w + 1, _max_fd())
        # NOTE: a signal meant for the coordinator must not run its handlers here, nor reach
        # the parent's event loop through the wake-up descriptor both processes now hold.
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, signal.SIG_DFL)
        gc.disable()   # a collection would touch every tracked object: copies of pages for nothing
        # NOTE: pages the parent writes meanwhile are copied, up to the state's size again; if
        # that runs a container out of memory, the kernel should kill this child, not the ledger
        with contextlib.suppress(OSError):
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        hashed = state_hash(state).encode("ascii")
        data = to_snapshot(state)
        for part in (_HEAD.pack(len(hashed), len(data)), hashed, data):
            view = memoryview(part)
            while view:
                view = view[os.write(w, view):]
        status = 0
    except BaseException as e:  # noqa: BLE001 - the parent hears the exit status; say which error, no data
        with contextlib.suppress(OSError):
            os.write(2, f"kvledger snapshot child: {type(e).__name__}\n".encode())
    finally:
        os._exit(status)


@dataclass
class ForkedSnapshot:
    """A child computing a snapshot; :meth:`result` collects it."""

    pid: int
    fd: int

    async def result(self, timeout_s: float) -> tuple[str, bytearray]:
        """``(state hash, snapshot bytes)``; raises :class:`SnapshotChildFailed`.

        NOTE: the reading thread owns the pipe and closes it when it ends. On a timeout or a
        cancellation the child is killed: its end of the pipe closes, the thread reads the end
        and returns. Closing the descriptor here instead, under a thread still blocked reading
        it, could hand that thread a reused descriptor number.
        """
        try:
            got = await asyncio.wait_for(asyncio.to_thread(_read_all, self.fd), timeout_s)
        except TimeoutError:
            self._kill()
            raise SnapshotChildFailed(f"the snapshot child ran past {timeout_s:g} s; killed") from None
        except asyncio.CancelledError:
            self._kill()   # the coordinator is stopping (or stepping down): nobody will want it
            raise
        except OSError as e:
            self._kill()
            raise SnapshotChildFailed(f"reading the snapshot child's pipe failed: {e}") from e
        status = await asyncio.to_thread(_wait, self.pid)
        if status != 0 or got is None:
            raise SnapshotChildFailed(f"the snapshot child exited with {_describe(status)} "
                                      f"{'before handing over the whole snapshot' if got is None else ''}".rstrip())
        return got

    def _kill(self) -> None:
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.waitpid(self.pid, 0)


def fork_snapshot(state: LedgerState) -> ForkedSnapshot:
    """Fork a child that serialises ``state`` as it is now. Raises OSError when it cannot fork."""
    r, w = os.pipe()
    try:
        pid = os.fork()
    except BaseException:
        os.close(r)
        os.close(w)
        raise
    if pid == 0:
        os.close(r)
        _child(state, w)
    os.close(w)
    return ForkedSnapshot(pid, r)


def _max_fd() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        return 65536


def _read_exactly(fd: int, buf: bytearray) -> bool:
    """Fill ``buf`` from ``fd``; False if the pipe ends first."""
    view = memoryview(buf)
    while view:
        n = os.readv(fd, [view[:_CHUNK]])
        if n == 0:
            return False
        view = view[n:]
    return True


def _read_all(fd: int) -> tuple[str, bytearray] | None:
    """The child's ``(hash, snapshot)``, or None when the pipe ends before all of it; closes ``fd``."""
    try:
        head = bytearray(_HEAD.size)
        if not _read_exactly(fd, head):
            return None
        hash_len, data_len = _HEAD.unpack(head)
        if hash_len > 1024:
            return None
        hashed, data = bytearray(hash_len), bytearray(data_len)
        if not (_read_exactly(fd, hashed) and _read_exactly(fd, data)) or os.read(fd, 1):
            return None
        return hashed.decode("ascii"), data
    finally:
        os.close(fd)


def _wait(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _describe(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"status {code}" + (" (it raised)" if code == EXIT_FAILED else "")


__all__ = ["ForkedSnapshot", "SnapshotChildFailed", "can_fork", "fork_snapshot"]
