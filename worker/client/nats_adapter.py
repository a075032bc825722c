"""The NATS adapter of :class:`worker.client.CoordinatorClient`.

Every request has a timeout (``nats.request_timeout_ms``) and turns a timeout, "no
responders" or a closed connection into :class:`CoordinatorUnavailable`. Transitions go to
JetStream with ``Nats-Msg-Id = <worker>.<epoch>.<seq>.<mac>`` so the broker drops duplicates
in its window and the log's unique source id drops the rest. The mac (an HMAC-SHA256 of the
source id, keyed by a random key that never leaves this process, and of a round number) is what
makes the id this client's alone: JetStream deduplicates by id across the whole stream, whatever
the subject, so an id another identity could compute before this client uses it would let that
identity publish junk under it (on its own subject, which its permissions allow) and have the
real transition dropped for the duplicate window. A fixed per-client nonce was not enough: any
identity allowed to read the transitions (the observer) saw it in one header and could then
compute every later id. Ids seen on the bus are used again only for resends of messages the
broker stored (a duplicate there is the point); after a publish that failed (its id may have been
seen without being stored) the round advances, so no id seen on the bus can ever pre-empt a
message of this client. The client reconnects forever; subscriptions are restored by nats-py after a reconnect.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import ssl
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors

from shared import messages as m
from shared import tracing
from shared.hashing import REPLICA_DIGEST_BYTES
from shared.config import nats_servers
from shared.logging import get_logger, mask_credentials
from shared.subjects import Subjects
from worker.client import (
    CoordinatorRefused, CoordinatorUnavailable, OnControl, OnInventory, OnWatermark, PublishFailed,
)

log = get_logger("kvl.worker.nats")

_TRANSIENT_CODES = (m.ErrorCode.UNAVAILABLE, m.ErrorCode.NOT_LEADER)


def _too_large(e: PublishFailed) -> bool:
    """The stream refused a message over its ``max_msg_size`` (JetStream error 10054)."""
    cause = e.__cause__
    return isinstance(cause, nats.js.errors.APIError) and (cause.err_code == 10054
                                                           or "message size exceeds" in str(cause.description))


class NatsCoordinatorClient:
    def __init__(self, url: str, subjects: Subjects, *, timeout_s: float = 2.0, name: str = "kvl-worker",
                 max_part_bytes: int = 0, tls: ssl.SSLContext | None = None,
                 auth: dict[str, Any] | None = None) -> None:
        self.url = url
        #: ``shared.nats_auth.connect_kwargs``: this worker's NATS user, password and inbox prefix.
        self.auth = dict(auth or {})
        #: TLS context (``shared.tls.client_context``); ``None`` = nats-py's default (``tls://`` URLs).
        self.tls = tls
        self.subjects = subjects
        self.timeout_s = timeout_s
        self.name = name
        #: Largest resume message (0 = the server's max_payload less a margin).
        self.max_part_bytes = max_part_bytes
        self._nc: Any = None
        self._js: Any = None
        self._subs: list[Any] = []
        self._listening: str | None = None
        #: Keys this client's message ids (see the module docstring): the same id for every resend
        #: of an event in one round, so the broker still drops this client's own duplicates.
        self._msg_key = secrets.token_bytes(32)
        #: Advanced after each failed publish: an id that may have been seen but not stored is dropped.
        self._msg_round = 0

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def connect(self) -> None:
        if self._nc is not None and not self._nc.is_closed:
            if not self._nc.is_connected:
                raise CoordinatorUnavailable(f"NATS at {mask_credentials(self.url)} is reconnecting")
            return
        try:
            # every server of a cluster: the connection moves to another node when its own goes away
            self._nc = await nats.connect(nats_servers(self.url), name=self.name, connect_timeout=1,
                                          reconnect_time_wait=0.5,
                                          max_reconnect_attempts=-1, allow_reconnect=True,
                                          error_cb=self._on_error, disconnected_cb=self._on_disconnect,
                                          **({"tls": self.tls} if self.tls is not None else {}), **self.auth)
        except (OSError, asyncio.TimeoutError, nats.errors.Error) as e:
            self._nc = None
            raise CoordinatorUnavailable(f"cannot connect to NATS at {mask_credentials(self.url)}: {e}") from e
        self._js = self._nc.jetstream(timeout=self.timeout_s)

    async def _on_error(self, e: Exception) -> None:
        log.debug("nats error", error=str(e))

    async def _on_disconnect(self) -> None:
        log.warning("nats disconnected", url=self.url)

    async def close(self) -> None:
        nc, self._nc = self._nc, None
        self._subs.clear()
        self._listening = None
        if nc is not None and not nc.is_closed:
            try:
                await asyncio.wait_for(nc.drain(), timeout=2)
            except (asyncio.TimeoutError, nats.errors.Error):
                await nc.close()

    async def _connected(self, op: str) -> None:
        """Return once connected; a connection in the middle of a reconnect gets up to the
        request timeout (≤ 1 s) first: a restarted NATS is usually back in well under a second,
        and recomputing a prompt costs more than that wait."""
        nc = self._nc
        if nc is not None and not nc.is_connected and nc.is_reconnecting:
            deadline = asyncio.get_running_loop().time() + min(self.timeout_s, 1.0)
            while not nc.is_connected and nc.is_reconnecting and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
        if nc is None or not nc.is_connected:
            raise CoordinatorUnavailable(f"{op}: not connected to NATS")

    async def _request(self, subject: str, msg: Any, expect: type, op: str) -> Any:
        await self._connected(op)
        try:
            # the request's trace goes along as a traceparent header (none when tracing is off)
            reply = await self._nc.request(subject, m.encode(msg), timeout=self.timeout_s, headers=tracing.headers())
        except nats.errors.NoRespondersError as e:
            raise CoordinatorUnavailable(f"{op}: no coordinator is listening on {subject}") from e
        except (nats.errors.TimeoutError, asyncio.TimeoutError) as e:
            raise CoordinatorUnavailable(f"{op}: coordinator did not answer within {self.timeout_s:.1f} s") from e
        except nats.errors.Error as e:
            raise CoordinatorUnavailable(f"{op}: {type(e).__name__}: {e}") from e
        try:
            out = m.decode(reply.data, expect=(expect, m.ErrorReply))
        except m.MessageError as e:
            raise CoordinatorRefused(m.ErrorCode.INVALID, f"{op}: unreadable reply: {e}") from e
        if isinstance(out, m.ErrorReply):
            if out.code in _TRANSIENT_CODES:
                raise CoordinatorUnavailable(f"{op}: {out.code.value}: {out.message}")
            raise CoordinatorRefused(out.code, out.message, out.retry_after_ms)
        return out

    async def register(self, msg: m.WorkerRegister) -> m.RegisterReply:
        return await self._request(self.subjects.request("register", msg.worker_id), msg, m.RegisterReply, "register")

    async def resume(self, msg: m.WorkerResume) -> m.ResumeReply:
        """One request, or (an inventory larger than one NATS message) parts sent in order; the
        coordinator answers the last part with its decision."""
        limit = self.max_part_bytes or (self._nc.max_payload if self._nc is not None else 1 << 20) - 16 * 1024
        per_part = max(1, limit * 3 // 4 // REPLICA_DIGEST_BYTES) * REPLICA_DIGEST_BYTES   # base64 in JSON
        held = msg.held
        n = max(1, -(-len(held) // per_part))
        reply: m.ResumeReply | None = None
        for i in range(n):
            part = msgspec.structs.replace(msg, held=held[i * per_part:(i + 1) * per_part], part=i, parts=n)
            reply = await self._request(self.subjects.request("resume", msg.worker_id), part, m.ResumeReply, "resume")
            if reply.complete != (i == n - 1):
                raise CoordinatorRefused(m.ErrorCode.INVALID, f"resume part {i} of {n}: unexpected reply")
        assert reply is not None
        return reply

    async def heartbeat(self, msg: m.Heartbeat) -> m.HeartbeatReply:
        return await self._request(self.subjects.request("heartbeat", msg.worker_id), msg, m.HeartbeatReply, "heartbeat")

    async def acquire(self, msg: m.LeaseAcquire) -> m.LeaseGrant:
        return await self._request(self.subjects.request("acquire", msg.worker_id), msg, m.LeaseGrant, "lease.acquire")

    async def renew(self, msg: m.LeaseRenew) -> m.LeaseRenewed:
        return await self._request(self.subjects.request("renew", msg.worker_id), msg, m.LeaseRenewed, "lease.renew")

    async def release(self, msg: m.LeaseRelease) -> m.LeaseReleased:
        return await self._request(self.subjects.request("release", msg.worker_id), msg, m.LeaseReleased, "lease.release")

    async def disk_gc(self, msg: m.DiskGc) -> m.DiskGcReply:
        return await self._request(self.subjects.request("disk_gc", msg.worker_id), msg, m.DiskGcReply, "disk.gc")

    async def host_evict(self, msg: m.HostEvict) -> m.HostEvictReply:
        return await self._request(self.subjects.request("host_evict", msg.worker_id), msg, m.HostEvictReply,
                                   "host.evict")

    def _check_connected(self) -> None:
        if self._js is None or self._nc is None or not self._nc.is_connected:
            raise PublishFailed("not connected to NATS")

    def msg_id(self, source_id: str) -> str:
        """The ``Nats-Msg-Id`` of the message with this source id, in the current round."""
        mac = hmac.new(self._msg_key, f"{self._msg_round}.{source_id}".encode(), hashlib.sha256).hexdigest()
        return f"{source_id}.{mac[:32]}"

    async def _js_publish(self, msg: m.TransitionEvent | m.TransitionBatch, data: bytes) -> None:
        """One message on the worker's events subject, deduplicated by the broker under its id.

        A refusal by the stream (its byte, message-size or per-worker limits: docs/operations.md,
        "Stream limits") is a :class:`PublishFailed` naming the limit: the message stays in the
        outbox and is sent again; nothing is dropped."""
        try:
            await self._js.publish(self.subjects.events(msg.worker_id), data,
                                   headers={"Nats-Msg-Id": self.msg_id(msg.source_id)}, timeout=self.timeout_s)
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as e:
            self._msg_round += 1
            raise PublishFailed(f"publish {msg.source_id}: {type(e).__name__}: {e}") from e

    async def publish(self, event: m.TransitionEvent) -> None:
        self._check_connected()
        await self._js_publish(event, m.encode(event))

    async def publish_batch(self, batch: m.TransitionBatch) -> None:
        self._check_connected()
        data = m.encode(batch)
        if len(data) > self._nc.max_payload - 4096 and len(batch.events) > 1:
            # NOTE: too large for one message (long reasons or model names): two halves, in order
            # (a failure of the second leaves both due again; the first's are then duplicates)
            half = len(batch.events) // 2
            for part in (batch.events[:half], batch.events[half:]):
                if len(part) == 1:
                    await self.publish(part[0])
                else:
                    await self.publish_batch(m.TransitionBatch(worker_id=batch.worker_id, epoch=batch.epoch,
                                                               events=part))
            return
        try:
            await self._js_publish(batch, data)
        except PublishFailed as e:
            # NOTE: over the stream's message size (nats.stream_max_msg_bytes, below max_payload):
            # in halves, as above; a single transition over it stays an error
            if len(batch.events) > 1 and _too_large(e):
                half = len(batch.events) // 2
                await self.publish_batch(m.TransitionBatch(worker_id=batch.worker_id, epoch=batch.epoch,
                                                           events=batch.events[:half]))
                await self.publish_batch(m.TransitionBatch(worker_id=batch.worker_id, epoch=batch.epoch,
                                                           events=batch.events[half:]))
                return
            raise

    async def listen(self, worker_id: str, on_watermark: OnWatermark, on_inventory: OnInventory,
                     on_control: OnControl) -> None:
        if self._listening == worker_id or self._nc is None:
            return
        s = self.subjects

        async def watermark(msg: Any) -> None:
            try:
                on_watermark(m.decode(msg.data, expect=m.CommitWatermark))
            except m.MessageError as e:
                log.warning("bad watermark message", error=str(e))

        taken: dict[str, m.InventoryReply] = {}   # request_id → the digest inventory its pages come from

        async def inventory(msg: Any) -> None:
            try:
                req = m.decode(msg.data, expect=m.InventoryRequest)
                if req.digests and req.page > 0:
                    whole = taken.get(req.request_id)
                    if whole is None:
                        raise LookupError(f"no inventory taken for request {req.request_id!r}: ask for page 0")
                else:
                    whole = await on_inventory(req)
                reply: Any = whole
                if req.digests and isinstance(whole, m.InventoryReply) and not req.disk:
                    # pages within max_payload (base64 in JSON); later pages from the same inventory
                    limit = req.page_bytes or (self._nc.max_payload - 16 * 1024) * 3 // 4
                    per_page = max(1, limit // REPLICA_DIGEST_BYTES) * REPLICA_DIGEST_BYTES
                    pages = max(1, -(-len(whole.digests) // per_page))
                    if req.page >= pages:
                        raise LookupError(f"page {req.page} of an inventory of {pages} pages")
                    taken.pop(req.request_id, None)
                    if req.page < pages - 1:
                        while len(taken) >= 2:   # two audits at once at most; the oldest is forgotten
                            taken.pop(next(iter(taken)))
                        taken[req.request_id] = whole
                    reply = msgspec.structs.replace(
                        whole, digests=whole.digests[req.page * per_page:(req.page + 1) * per_page],
                        page=req.page, pages=pages)
            except m.MessageError as e:
                reply = m.ErrorReply(code=m.ErrorCode.INVALID, message=str(e))
            except LookupError as e:
                reply = m.ErrorReply(code=m.ErrorCode.NOT_FOUND, message=str(e))
            if msg.reply:
                await self._nc.publish(msg.reply, m.encode(reply))

        async def control(msg: Any) -> None:
            try:
                req = m.decode(msg.data, expect=m.Control)
                reply: Any = await on_control(req)
            except m.MessageError as e:
                reply = m.ErrorReply(code=m.ErrorCode.INVALID, message=str(e))
            if msg.reply:
                await self._nc.publish(msg.reply, m.encode(reply))

        try:
            self._subs = [await self._nc.subscribe(s.watermark(worker_id), cb=watermark),
                          await self._nc.subscribe(s.inventory(worker_id), cb=inventory),
                          await self._nc.subscribe(s.control(worker_id), cb=control)]
        except nats.errors.Error as e:
            raise CoordinatorUnavailable(f"subscribe: {e}") from e
        self._listening = worker_id

    @property
    def nc(self) -> Any:
        """The underlying connection (the worker's debug subjects share it)."""
        return self._nc
