"""Helpers for tests that drive a real coordinator over NATS and HTTP (in-process or as a process).

A small "worker" that speaks the protocol exactly as ``shared.messages`` defines it, and a
way to run the coordinator app in this event loop with fast timings.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import nats
from aiohttp import web

from shared.config import Config, parse_config
from shared.embedded import free_port
from shared.forms import FormCatalogue, FormScope, FormSpec
from shared.messages import (
    CommitWatermark, ErrorReply, Heartbeat, LeaseAcquire, LeaseRelease, LeaseRenew, ReplicaState, TransitionEvent,
    WorkerRegister, WorkerResume, decode, encode,
)
from shared.hashing import replica_digest
from shared.subjects import Subjects

NS = "ab" * 16
CATALOGUE = FormCatalogue(model_id="m", block_size=16, forms=(
    FormSpec(name="compressed", scope=FormScope.FULL_HISTORY, bytes_per_block=512, dtype="float32"),))


def block(i: int) -> str:
    return f"{i:032x}"


def fast_config(database_url: str, nats_url: str, subjects: Subjects, **coordinator: Any) -> Config:
    """A config with short timings so liveness, takeover and recovery happen in test time."""
    return parse_config({
        "database": {"url": database_url, "connect_timeout_ms": 1000},
        "nats": {"url": nats_url, "subject_prefix": subjects.prefix, "request_timeout_ms": 2000},
        # a worker is lost (and a silent leader replaced) after 200 ms × 50 = 10 s
        "coordinator": {"heartbeat_interval_ms": 200, "missed_heartbeats": 50, "commit_batch_ms": 2,
                        "lease_ttl_ms": 30000, **coordinator},
        "logging": {"format": "json"},
    })


@contextlib.asynccontextmanager
async def running_coordinator(config: Config, *, ready: bool = True,
                              timeout_s: float = 20) -> AsyncIterator[tuple[web.Application, str]]:
    """The coordinator app in this event loop; yields ``(app, base_url)``."""
    from coordinator.app import create_app

    app = create_app(config)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    base = f"http://127.0.0.1:{port}"
    try:
        if ready:
            await wait_ready(base, timeout_s)
        yield app, base
    finally:
        await runner.cleanup()


async def wait_ready(base: str, timeout_s: float = 20, *, want: int = 200) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            try:
                async with http.get(f"{base}/readyz") as r:
                    last = await r.json()
                    if r.status == want:
                        return last  # type: ignore[no-any-return]
            except aiohttp.ClientError as e:
                last = repr(e)
            await asyncio.sleep(0.1)
    raise AssertionError(f"{base}/readyz did not return {want} within {timeout_s}s; last: {last}")


class Worker:
    """The protocol side of a worker, nothing more."""

    def __init__(self, nc: nats.NATS, subjects: Subjects, worker_id: str = "w1", slots: int = 1000) -> None:
        self.nc = nc
        self.subjects = subjects
        self.worker_id = worker_id
        self.slots = slots
        self.epoch = 0
        self.seq = 0
        self.watermark = 0
        self.refused: list[int] = []   # seqs the watermarks said the ledger refused (host copies, GPU commits)
        self._wm_sub: Any = None
        #: Replica digests of what this worker committed (what it "holds"), for a resume.
        self.held: dict[str, bytes] = {}

    async def request(self, subject: str, msg: Any, timeout: float = 5.0) -> Any:
        reply = await self.nc.request(subject, encode(msg), timeout=timeout)
        return decode(reply.data)

    async def register(self, disown_replicas: bool = False) -> Any:
        reply = await self.request(self.subjects.request("register", self.worker_id), WorkerRegister(
            worker_id=self.worker_id, namespace=NS, catalogue=CATALOGUE, pool_slots={"compressed": self.slots},
            disown_replicas=disown_replicas))
        assert not isinstance(reply, ErrorReply), reply
        self.epoch = reply.epoch
        self.seq = 0
        self.held.clear()
        return reply

    async def resume(self, timeout: float = 5.0) -> Any:
        """Keep the epoch after an outage, claiming every replica this worker committed."""
        return await self.request(self.subjects.request("resume", self.worker_id), WorkerResume(
            worker_id=self.worker_id, epoch=self.epoch, namespace=NS, catalogue=CATALOGUE,
            pool_slots={"compressed": self.slots}, emitted_seq=self.seq, held=b"".join(self.held.values())), timeout)

    async def heartbeat(self, timeout: float = 5.0) -> Any:
        return await self.request(self.subjects.request("heartbeat", self.worker_id),
                                  Heartbeat(worker_id=self.worker_id, epoch=self.epoch), timeout)

    async def acquire(self, hashes: list[str], write: bool = True, timeout: float = 5.0) -> Any:
        return await self.request(self.subjects.request("acquire", self.worker_id), LeaseAcquire(
            worker_id=self.worker_id, epoch=self.epoch, namespace=NS, block_hashes=hashes,
            write_forms=["compressed"] if write else []), timeout)

    async def renew(self, lease_id: str) -> Any:
        return await self.request(self.subjects.request("renew", self.worker_id),
                                  LeaseRenew(worker_id=self.worker_id, epoch=self.epoch, lease_id=lease_id))

    async def release(self, lease_id: str) -> Any:
        return await self.request(self.subjects.request("release", self.worker_id),
                                  LeaseRelease(worker_id=self.worker_id, epoch=self.epoch, lease_id=lease_id))

    def commit(self, hashes: list[str], index: int, lease_id: str, seq: int | None = None) -> TransitionEvent:
        """A commit transition (ALLOCATED → READY) of block ``index`` of a lease's request."""
        if seq is None:
            self.seq += 1
            seq = self.seq
        self.held[hashes[index]] = replica_digest(hashes[index], "compressed", f"gpu:{self.worker_id}", 1,
                                                  f"c{index}")
        return TransitionEvent(
            worker_id=self.worker_id, epoch=self.epoch, seq=seq, namespace=NS, block_hash=hashes[index],
            parent_hash=hashes[index - 1] if index else "0" * 32, token_start=16 * index,
            token_end=16 * (index + 1), form="compressed", location=f"gpu:{self.worker_id}",
            from_state=ReplicaState.ALLOCATED, to_state=ReplicaState.READY, generation=1, checksum=f"c{index}",
            lease_id=lease_id)

    async def publish(self, t: TransitionEvent, msg_id: str | None = None) -> Any:
        js = self.nc.jetstream()
        return await js.publish(self.subjects.events(self.worker_id), encode(t),
                                headers={"Nats-Msg-Id": msg_id or t.source_id})

    async def watch_watermarks(self) -> None:
        async def on(msg: Any) -> None:
            wm = decode(msg.data, expect=CommitWatermark)
            if wm.epoch == self.epoch:
                self.watermark = max(self.watermark, wm.seq)
                self.refused.extend(wm.refused)
        self._wm_sub = await self.nc.subscribe(self.subjects.watermark(self.worker_id), cb=on)

    async def fill(self, hashes: list[str]) -> Any:
        """A write lease for ``hashes``, every block committed and acknowledged by the watermark
        (call :meth:`watch_watermarks` first); returns the grant."""
        grant = await self.acquire(hashes)
        for i in range(len(hashes)):
            await self.publish(self.commit(hashes, i, grant.lease_id))
        await self.wait_watermark(self.seq)
        return grant

    async def wait_watermark(self, seq: int, timeout_s: float = 10) -> None:
        deadline = time.monotonic() + timeout_s
        while self.watermark < seq:
            if time.monotonic() > deadline:
                raise AssertionError(f"watermark {self.watermark} did not reach {seq} within {timeout_s}s")
            await asyncio.sleep(0.02)
