"""A request's leases: waiting for a shared prefix, acquiring, renewing, settling and releasing.

Mixed into :class:`worker.cache.manager.Session`. A lease pins the replicas a request reads
and reserves the slots it writes (``shared.messages.LeaseAcquire``); it is renewed while the
request runs (every third of ``lease_ttl_ms``) and released only once the commit watermark
covers the request's transitions — a release processed before a commit would abort the
replica the commit fills. A release that would have to wait longer than
``settle_timeout_s`` happens in the background instead (the lease stays renewed).

Before leasing, a request whose prompt shares blocks another request here is computing waits
for their commits (``worker.inflight``), so a burst sharing a prefix computes it once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import msgspec

from shared import tracing
from shared.messages import ErrorCode, LeaseAcquire, LeaseGrant, LeaseRelease, LeaseRenew
from worker.client import CoordinatorRefused, CoordinatorUnavailable
from worker.inflight import wait_for

#: How long a request told "suspended" waits for the engine's resume before it recomputes.
RESUME_WAIT_S = 2.0


@dataclass(slots=True)
class _Lease:
    grant: LeaseGrant
    epoch: int


class LeaseHolder:
    """Leases, for :class:`worker.cache.manager.Session` (see the module's docstring)."""

    async def _wait_for_shared(self) -> None:
        """Wait (while the worker prefills; ``cache.prefix_wait_ms`` without progress at most) for
        this prompt's blocks that other requests here claim (:mod:`worker.inflight`), so the lease
        that follows finds them committed."""
        ports = self.ports
        futures = ports.inflight.others(self.hashes, self)
        if not futures:
            return
        t0 = time.perf_counter()
        with tracing.span("worker.prefix_wait", {"kvl.blocks": len(futures)}) as sp:
            # NOTE: again while others hold claims: a request that waited with this one for the
            # same prefix may have claimed the next blocks of it first
            outcome = ""
            while futures and outcome != "timeout":
                outcome = await wait_for(futures, ports.knobs.prefix_wait_s, ports.runner.stepper.computing_prompt)
                futures = ports.inflight.others(self.hashes, self)
            sp.set_attribute("kvl.outcome", outcome)
        ports.metrics.prefix_waits.labels(outcome=outcome).inc()
        ports.metrics.prefix_wait_seconds.observe(time.perf_counter() - t0)
        self._spent("prefix_wait", t0)

    async def _rerouted(self, hashes: list[str]) -> bool:
        """After a ``wrong_shard`` refusal (the shard map moved under this worker): read the map
        again and take the ports of the chain's shard by it. True if that is another shard whose
        epoch may lease now (the lease is asked once more, there). A session holding a lease stays
        on its shard: its commits and their watermark are that shard's."""
        ports = self.ports
        if ports.shards is None or self.leases:
            return False
        await ports.shards.refresh()
        moved = ports.for_chain(hashes)
        if moved.contact is ports.contact or moved.contact.degraded:
            return False
        self.ports, self.epoch = moved, moved.contact.epoch
        return True

    async def _acquire(self, hashes: list[str], *, write: bool, reuse: bool) -> LeaseGrant | None:
        ports = self.ports
        if ports.shards is not None:
            ports.shards.note(hashes)           # the root of every block a commit may name
        msg = LeaseAcquire(worker_id=ports.ctx.worker_id, epoch=self.epoch, request_id=f"r{id(self) & 0xffffff:x}",
                           namespace=ports.ctx.namespace, tenant=self.tenant, block_hashes=hashes,
                           write_forms=list(ports.ctx.catalogue.names) if write else [], reuse=reuse,
                           ttl_ms=ports.contact.lease_ttl_ms)
        t0 = time.perf_counter()
        with tracing.span("worker.lease", {"kvl.epoch": self.epoch, "kvl.tenant": self.tenant,
                                           "kvl.blocks": len(hashes), "kvl.write": write, "kvl.reuse": reuse},
                          kind=tracing.CLIENT) as sp:
            try:
                try:
                    grant = await ports.contact.call("acquire", ports.leases.acquire(msg))
                except CoordinatorRefused as err:
                    if err.code is ErrorCode.WRONG_SHARD and await self._rerouted(hashes):
                        ports = self.ports
                        msg = msgspec.structs.replace(msg, epoch=self.epoch, ttl_ms=ports.contact.lease_ttl_ms)
                    # NOTE: suspended = a coordinator took over and has not heard from us yet; the
                    # engine resumes at once (milliseconds), far cheaper than recomputing the prompt.
                    elif err.code is not ErrorCode.SUSPENDED or not await ports.contact.wait_resumed(RESUME_WAIT_S):
                        raise
                    grant = await ports.contact.call("acquire", ports.leases.acquire(msg))
            except CoordinatorRefused as err:
                sp.set_attribute("kvl.outcome", err.code.value)
                self.fallback(f"lease:{err.code.value}")
                return None
            except CoordinatorUnavailable as err:
                tracing.failed(sp, err)
                self.degraded = True
                self.fallback("degraded")
                return None
            finally:
                self._spent("lease", t0)
            if sp.is_recording():
                sp.set_attributes({"kvl.outcome": "granted", "kvl.usable_blocks": grant.usable_blocks,
                                   "kvl.read_replicas": len(grant.read),
                                   "kvl.write_replicas": sum(len(v) for v in grant.write.values()),
                                   "kvl.evicted_replicas": len(grant.evict)})
        self.leases.append(_Lease(grant, self.epoch))
        if self._renew is None:
            self._renew = asyncio.get_running_loop().create_task(self._renew_loop())
        return grant

    async def _renew_loop(self) -> None:
        ports = self.ports
        while True:
            await asyncio.sleep(max(0.05, ports.contact.lease_ttl_ms / 3000))
            for lease in list(self.leases):
                if lease.epoch != ports.contact.epoch:
                    continue
                try:
                    await ports.contact.call("renew", ports.leases.renew(LeaseRenew(
                        worker_id=ports.ctx.worker_id, epoch=lease.epoch, lease_id=lease.grant.lease_id,
                        ttl_ms=ports.contact.lease_ttl_ms)))
                except (CoordinatorRefused, CoordinatorUnavailable):
                    pass

    async def close(self, *, release_later: bool = False) -> None:
        """Settle this session's transitions, then release its leases (idempotent).

        NOTE: a release aborts every write of the lease not yet committed in the ledger, so it
        waits for the commit watermark to cover this session's transitions. If that takes longer
        than ``settle_timeout_s`` (a slow or starved coordinator), the lease stays renewed and is
        released in the background once they are covered, instead of aborting them now.

        ``release_later``: return once the transitions are settled and release in the background
        (the serving path: a response's end waits for its blocks to be READY in the ledger, which
        is what the next turn's lease needs, not for the release's round trip and log append).
        """
        if self._closed:
            return
        self._closed = True
        ports = self.ports
        t0 = time.perf_counter()
        try:
            await self._close(release_later)
        finally:
            if self._claims:
                ports.inflight.drop(self)       # what it did not commit: waiters lease (and compute) now
                self._claims = False
            ports.metrics.close_seconds.observe(time.perf_counter() - t0)

    async def _close(self, release_later: bool) -> None:
        ports = self.ports
        settled = True
        await self._quiesce()               # a run cancelled twice may still hold the state
        with tracing.span("worker.commit") as sp:
            self._commit_pending()
            self._release_reservations()    # a request that ended before its restore
            try:
                await self._commit_reply()
            except (CoordinatorRefused, CoordinatorUnavailable, ValueError) as err:
                ports.log.warning("reply blocks not cached", error=type(err).__name__)
            if self.leases and self.last_seq and ports.outbox is not None:
                settled = await ports.outbox.wait_committed(self.epoch, self.last_seq,
                                                            timeout=ports.knobs.settle_timeout_s)
            if self._claims and settled:
                ports.inflight.committed(self, self._emitted)     # before the announcements' own tasks run
            sp.set_attributes({"kvl.replicas_committed": self.commits, "kvl.reply_blocks": self.reply_blocks,
                               "kvl.settled": settled})
        # nothing reads the state past its commits: let it go now (its buffers go to the next
        # request, worker.model.recycle), not when whatever still holds this session lets go of it
        self.state = None
        self._fresh = None
        if not self.leases:
            self._stop_renewing()
            return
        if not settled or release_later:
            ports.releasing.add(self)
            ports.background(self._settle_then_release())
            return
        await self._release()

    async def _settle_then_release(self) -> None:
        ports = self.ports
        assert ports.outbox is not None
        try:
            await ports.outbox.wait_committed(self.epoch, self.last_seq,
                                             timeout=max(5.0, ports.contact.lease_ttl_ms / 1000 * 0.8))
            await self._release()
        finally:
            ports.releasing.discard(self)

    def _stop_renewing(self) -> None:
        if self._renew is not None:
            self._renew.cancel()
            self._renew = None

    async def _release(self) -> None:
        ports = self.ports
        self._stop_renewing()
        async def release(lease: _Lease) -> None:
            try:
                await ports.contact.call("release", ports.leases.release(LeaseRelease(
                    worker_id=ports.ctx.worker_id, epoch=lease.epoch, lease_id=lease.grant.lease_id)))
            except (CoordinatorRefused, CoordinatorUnavailable):
                pass

        with tracing.span("worker.release", {"kvl.leases": len(self.leases)}, kind=tracing.CLIENT):
            # at once: the prompt's lease and the reply's are independent (one round trip, not two,
            # of what a response's last chunk waits for)
            await asyncio.gather(*(release(lease) for lease in self.leases if lease.epoch == ports.contact.epoch))
        self.leases = []


__all__ = ["RESUME_WAIT_S", "LeaseHolder"]
