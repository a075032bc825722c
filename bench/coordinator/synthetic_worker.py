"""The worker ``bench.coordinator`` plays over NATS: it registers, heartbeats, takes leases, commits
blocks through JetStream and keeps its epoch across a coordinator takeover (:class:`BenchWorker`)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from bench.coordinator.harness import BLOCK, LEASE_TTL_MS, NS, WORKER, catalogue


class BenchWorker:
    """A synthetic worker: registers, heartbeats, and keeps its epoch across a coordinator takeover.

    A takeover (a restart, a standby taking over, or the leader stepping down and back up)
    suspends every live epoch: heartbeats, acquires and renewals then get
    ``ErrorReply(code=suspended)``. The bench worker then resumes (``WorkerResume``, in ordered
    parts when the inventory exceeds one NATS message) with the digests of the replicas it
    committed (:meth:`note_committed`); it never re-registers, since
    a new epoch would lose what the timed phases set up. It does not track evictions (the
    bench's pools never fill), so every committed replica is still held.
    """

    def __init__(self, nc: Any, subjects: Any, slots: int, worker_id: str = WORKER) -> None:
        self.nc = nc
        self.subjects = subjects
        self.worker_id = worker_id
        self.slots = slots
        self.epoch = 0
        self.watermark = 0
        self._wm_target = 0
        self._wm_event = asyncio.Event()
        self._hb: asyncio.Task[None] | None = None
        self._wm_sub: Any = None
        #: (block hash, seq) of every commit (ALLOCATED → READY) this worker emitted.
        self.committed: list[tuple[str, int]] = []
        self.emitted_seq = 0
        self.heartbeats_ok = 0
        self.heartbeats_refused = 0
        #: ``(perf_counter, ResumeReply)`` of every resume.
        self.resumes: list[tuple[float, Any]] = []
        self._resume_lock = asyncio.Lock()
        self._resumed = asyncio.Event()

    async def request(self, subject: str, msg: Any, timeout: float = 30) -> Any:
        """One request; a SUSPENDED answer is followed by a resume and the request once more."""
        from shared.messages import ErrorCode, ErrorReply, decode, encode
        data = encode(msg)
        seen = len(self.resumes)
        reply = decode((await self.nc.request(subject, data, timeout=timeout)).data)
        if isinstance(reply, ErrorReply) and reply.code == ErrorCode.SUSPENDED:
            await self.resume(seen)
            reply = decode((await self.nc.request(subject, data, timeout=timeout)).data)
        return reply

    async def register(self) -> None:
        from shared.messages import ErrorReply, WorkerRegister
        r = await self.request(self.subjects.request("register", self.worker_id), WorkerRegister(
            worker_id=self.worker_id, namespace=NS, catalogue=catalogue(), pool_slots={"compressed": self.slots}))
        if isinstance(r, ErrorReply):
            raise RuntimeError(f"register refused: {r.code}: {r.message}")
        self.epoch = r.epoch
        self._hb = asyncio.create_task(self._heartbeats(r.heartbeat_interval_ms / 1000))

        from shared.messages import CommitWatermark, decode

        async def on_wm(msg: Any) -> None:
            wm = decode(msg.data, expect=CommitWatermark)
            if wm.epoch == self.epoch and wm.seq > self.watermark:
                self.watermark = wm.seq
                if self.watermark >= self._wm_target:
                    self._wm_event.set()
        self._wm_sub = await self.nc.subscribe(self.subjects.watermark(self.worker_id), cb=on_wm)

    async def _heartbeats(self, interval: float) -> None:
        from shared.messages import ErrorCode, ErrorReply, Heartbeat, HeartbeatReply, decode, encode
        data = encode(Heartbeat(worker_id=self.worker_id, epoch=self.epoch))
        while True:
            await asyncio.sleep(interval)
            seen = len(self.resumes)
            try:
                r = decode((await self.nc.request(self.subjects.request("heartbeat", self.worker_id), data, timeout=10)).data)
            except Exception:  # noqa: BLE001 - no coordinator answering (a takeover under way): next beat
                self.heartbeats_refused += 1
                continue
            if isinstance(r, HeartbeatReply):
                self.heartbeats_ok += 1
                continue
            self.heartbeats_refused += 1
            if isinstance(r, ErrorReply) and r.code == ErrorCode.SUSPENDED:
                with contextlib.suppress(Exception):
                    await self.resume(seen)

    def note_committed(self, pairs: list[tuple[str, int]]) -> None:
        """Commits (block hash, seq) now in the log: replicas this worker holds READY."""
        self.committed.extend(pairs)

    def held(self) -> bytes:
        """The resume inventory: the :func:`shared.hashing.replica_digest` of each committed replica
        (generation 1, checksum = the commit's seq, as :func:`commit_transition` writes them)."""
        from shared.hashing import replica_digest
        gpu = f"gpu:{self.worker_id}"
        return b"".join(replica_digest(bh, "compressed", gpu, 1, f"{seq:016x}") for bh, seq in self.committed)

    async def resume(self, seen: int) -> Any:
        """Resume the (suspended) epoch once: ``seen`` is how many resumes the caller knew of
        when it was told SUSPENDED, so concurrent callers trigger one resume, not one each."""
        from shared.messages import ErrorCode, ErrorReply, ResumeReply, WorkerResume, decode, encode
        async with self._resume_lock:
            if len(self.resumes) > seen:
                return self.resumes[-1][1]
            import nats.errors

            from shared.hashing import REPLICA_DIGEST_BYTES
            held = self.held()
            # NOTE: one 8-byte digest per replica, base64 in JSON: past ~98k replicas an inventory
            # exceeds NATS's default 1 MiB max_payload, so it goes in ordered parts, each well
            # within it (as the worker's client sends them); the last part's answer decides.
            limit = (getattr(self.nc, "max_payload", 0) or 1 << 20) - 16 * 1024
            per_part = max(1, limit * 3 // 4 // REPLICA_DIGEST_BYTES) * REPLICA_DIGEST_BYTES
            n = max(1, -(-len(held) // per_part))
            parts = [encode(WorkerResume(worker_id=self.worker_id, epoch=self.epoch, namespace=NS,
                                         catalogue=catalogue(), pool_slots={"compressed": self.slots},
                                         emitted_seq=self.emitted_seq, part=i, parts=n,
                                         held=held[i * per_part:(i + 1) * per_part])) for i in range(n)]
            deadline = time.monotonic() + 60
            i = 0
            while True:
                try:
                    r = decode((await self.nc.request(self.subjects.request("resume", self.worker_id), parts[i], timeout=10)).data)
                except (nats.errors.NoRespondersError, nats.errors.TimeoutError, asyncio.TimeoutError) as e:
                    # no coordinator answering yet (between the old leader and the new one): retry
                    r = ErrorReply(code=ErrorCode.UNAVAILABLE, message=f"{type(e).__name__}: {e}",
                                   retry_after_ms=100)
                if isinstance(r, ResumeReply) and r.complete == (i == n - 1):
                    if not r.complete:
                        i += 1
                        continue
                    self.resumes.append((time.perf_counter(), r))
                    self._resumed.set()
                    return r
                if not isinstance(r, ErrorReply):
                    raise RuntimeError(f"worker {self.worker_id}: unexpected answer to resume part {i} of {n}: {r}")
                if r.code in (ErrorCode.FENCED, ErrorCode.NOT_FOUND, ErrorCode.INVALID):
                    # NOTE: a bench worker never re-registers: a new epoch would lose what the
                    # timed phases set up, and the figures would silently measure something else.
                    raise RuntimeError(f"worker {self.worker_id} epoch {self.epoch} cannot resume: "
                                       f"{r.code}: {r.message}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker {self.worker_id} could not resume within 60 s: {r.code}: {r.message}")
                i = 0  # a multi-part resume starts again from its first part
                await asyncio.sleep(max(r.retry_after_ms, 20) / 1000)

    async def recover(self, data: bytes, sent_at: float) -> bool:
        """For :func:`drive`: True (after resuming, unless a resume completed since ``sent_at``,
        a perf_counter time) if ``data`` is a SUSPENDED answer: the request is to be sent again."""
        from shared.messages import ErrorCode, ErrorReply, decode
        if b'"suspended"' not in data:
            return False
        r = decode(data)
        if not (isinstance(r, ErrorReply) and r.code == ErrorCode.SUSPENDED):
            return False
        await self.resume(sum(1 for t, _ in self.resumes if t < sent_at))
        return True

    async def wait_watermark(self, seq: int, timeout_s: float) -> None:
        self._wm_target = seq
        self._wm_event.clear()
        if self.watermark >= seq:
            return
        await asyncio.wait_for(self._wm_event.wait(), timeout_s)

    async def wait_resumed(self, after: float, timeout_s: float) -> tuple[float, Any]:
        """The first resume at or after ``after`` (a perf_counter time): (its time, its ResumeReply)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for t, r in self.resumes:
                if t >= after:
                    return t, r
            self._resumed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"worker {self.worker_id} did not resume within {timeout_s} s")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._resumed.wait(), left)

    def stop(self) -> None:
        if self._hb is not None:
            self._hb.cancel()

    def acquire(self, hashes: list[str], *, write: bool, reuse: bool, request_id: str = "r") -> Any:
        from shared.messages import LeaseAcquire
        return LeaseAcquire(worker_id=self.worker_id, epoch=self.epoch, request_id=request_id, namespace=NS,
                            block_hashes=hashes, write_forms=["compressed"] if write else [], reuse=reuse,
                            ttl_ms=LEASE_TTL_MS)

    def release(self, lease_id: str) -> Any:
        from shared.messages import LeaseRelease
        return LeaseRelease(worker_id=self.worker_id, epoch=self.epoch, lease_id=lease_id)


def commit_transition(epoch: int, seq: int, hashes: list[str], i: int, lease_id: str, ts: int,
                      worker: str = WORKER) -> Any:
    """The commit (ALLOCATED → READY) of block ``i`` of a lease's ``hashes``."""
    from shared.ids import ROOT_HASH
    from shared.messages import ReplicaState, TransitionEvent
    return TransitionEvent(
        worker_id=worker, epoch=epoch, seq=seq, namespace=NS, block_hash=hashes[i],
        parent_hash=hashes[i - 1] if i else ROOT_HASH, token_start=BLOCK * i, token_end=BLOCK * (i + 1),
        form="compressed", location=f"gpu:{worker}", from_state=ReplicaState.ALLOCATED,
        to_state=ReplicaState.READY, generation=1, checksum=f"{seq:016x}", lease_id=lease_id,
        block_size=BLOCK, model_name="bench", ts_ms=ts)


async def commit_blocks(nc: Any, w: BenchWorker, hashes: list[str]) -> None:
    """Fill ``hashes`` as a worker would: a write lease, one commit transition per block through
    JetStream, the commit watermark, then the release; the worker then holds them READY."""
    from shared.messages import LeaseGrant, encode, now_ms
    g = await w.request(w.subjects.request("acquire", w.worker_id), w.acquire(hashes, write=True, reuse=False))
    if not isinstance(g, LeaseGrant) or g.write.get("compressed") != list(range(len(hashes))):
        raise RuntimeError(f"setup lease refused or partial: {g}")
    js = nc.jetstream(timeout=30)
    ts = now_ms()
    pairs = []
    for i in range(len(hashes)):
        w.emitted_seq += 1
        t = commit_transition(w.epoch, w.emitted_seq, hashes, i, g.lease_id, ts, w.worker_id)
        await js.publish(w.subjects.events(w.worker_id), encode(t), headers={"Nats-Msg-Id": t.source_id})
        pairs.append((hashes[i], w.emitted_seq))
    await w.wait_watermark(w.emitted_seq, 60)
    w.note_committed(pairs)
    await w.request(w.subjects.request("release", w.worker_id), w.release(g.lease_id))
