"""One request's walk through the cache engine: lease, validate, restore, prefill, commit, release.

A :class:`Session` is what the serving layer drives step by step::

    s = await engine.open(tokens, tenant=..., max_new_tokens=...)   # lease + hit validation + restore
    logits = await s.prefill_rest()                                   # the prompt as one stepper run
    await s.decode_run(run)                                           # the decode loop as one run
    logits = await s.decode(token)                                    # (or one decode step at a time)
    result = await s.close()                                          # commits settled, leases released

:func:`worker.generation.generate` is that loop with sampling (the serving scheduler and
:meth:`Engine.generate <worker.engine.Engine.generate>` both run it).

A session is a request's cache manager. It is given narrow ports (``worker.cache.ports``: the
lease client and the worker's standing with the coordinator, the replica writer and outbox,
the store and tiers, the cache's fixed context, the model's stepper), never the engine. Its
parts: this module (opening, commits, forks), ``worker.cache.hits`` (speculation, validation,
restore), ``worker.cache.leases`` (prefix waits, acquire, renew, settle, release) and
``worker.cache.steps`` (the prefill plan, prefill and decode steps and runs on the stepper).

Theory of operation
-------------------
*Opening.* The prompt's whole blocks are hashed (chained, tenant-salted, namespaced) and a
lease asks for all of them: reads for the longest usable prefix, writes for every form of
the blocks this worker will compute or reload. LRU victims named by the grant are copied
to the host tier before their slots are freed. The resume point is the grant's boundary
capped below the last prompt token and floored to the prefill grid (``chunk_blocks``); if
the pinned replicas do not serve that point (a different boundary, or a replica failing
validation), a read-only lease for the shorter prefix asks the coordinator again — after
the INVALID transitions are committed, so it does not offer the same replicas — at most
:data:`MAX_EXTRA_LEASES` times. Every replica is validated
(:func:`worker.cache.planner.validate`) on the bytes the model state is then restored from: a
host-tier entry or a disk record in a buffer of its own, or a pool slot itself (a hit on this
worker's host-memory pools, or a granted disk reload read into a reserved slot), which must be
unchanged — not freed and taken again — once the restore is done (``CacheStore.unchanged``).

*Prefill and decode.* Steps go to the engine's stepper (``worker.stepper``), which fuses the
steps of every ready request into one forward and decides how much of a prompt runs (whole
blocks within ``service.max_batch_tokens``; the ``cache.chunk_blocks`` grid where the ops are
not batch-invariant). After each piece the blocks it completed that the lease lets this
worker write are exported, put in a fresh pool slot and committed (ALLOCATED→READY,
generation, checksum). At close, the reply's whole blocks are committed the same way under a
second, write-only lease (their hashes were unknown at open).

*Closing.* Leases are released only once the commit watermark covers this session's
transitions (or a timeout passes): a release processed before a commit would abort the
replica the commit fills.

*Images.* A prompt may hold images (``shared.images.PromptImage``: a run of image tokens, a
content hash, the pixels). Their keys enter the hashes of the blocks they overlap
(``image_block_keys``: at open and for the reply's commit alike, so the prompt's hashes stay a
prefix of the grown chain). Once the resume point is known, the vision encoder runs on the model
thread for each image the prefill still reads (one that ends before the resume point is served
whole from the cache and never encoded), and each prefill piece carries its image rows' vectors.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from shared import tracing
from shared.hashing import chain_hashes
from shared.ids import ROOT_HASH
from shared.images import PromptImage, check_placement, image_block_keys
from shared.messages import LeaseGrant
from worker.cache.hits import HitFinder, _Found
from worker.cache.leases import LeaseHolder, _Lease
from worker.cache.planner import BlockMeta, Need, best_boundary, grid_floor, map_reads, needs, resume_cap
from worker.cache.steps import ModelSteps
from worker.cache.store import Reservation, as_bytes
from worker.model.vision import PromptEmbeds, encode_images

if TYPE_CHECKING:
    from worker.cache.ports import CachePorts

#: Read-only leases a session may take after its first grant (cap/grid or failed validation).
MAX_EXTRA_LEASES = 2
#: Arrival order of sessions (the step queue's tie-break after priority).
_ORDER = itertools.count()


class CacheValidationError(RuntimeError):
    """A reused replica failed validation and ``cache.on_invalid`` is ``error``."""


@dataclass(slots=True)
class Result:
    """What one request did: its tokens and what the cache contributed."""

    tokens: list[int]
    #: ``[len(tokens), vocab]``: the logits each generated token was sampled from.
    logits: torch.Tensor | None
    prompt_tokens: int
    #: Prompt tokens restored from validated cache (a whole number of blocks).
    cached_tokens: int
    #: Prompt tokens the coordinator first offered (a hash hit, before validation).
    hit_tokens: int
    #: Replicas that passed validation and were read.
    validated: int
    #: Replicas that failed validation, as ``layer:form:block``.
    invalid: list[str]
    #: Why this request recomputed more than it might have (empty = nothing to report).
    fallbacks: list[str]
    #: Blocks (all forms) reloaded per tier.
    reloaded: dict[str, int]
    degraded: bool
    epoch: int
    ttft_s: float = 0.0
    #: Seconds spent per phase: ``hash``, ``lease``, ``speculate`` (validation while the lease is
    #: in flight), ``evict``, ``validate``, ``restore`` (state build, the part not hidden behind
    #: the lease), ``vision`` (the image encoder), ``forward`` (model prefill), ``export``,
    #: ``handoff`` (to the model thread and back), ``commit`` (off the TTFT path). Everything but
    #: ``restore``, ``vision`` and ``forward`` is the cache engine's own cost.
    timings: dict[str, float] = field(default_factory=dict)


class Session(HitFinder, LeaseHolder, ModelSteps):
    """One request's cache: :meth:`open` prepares it (lease, validation, restore: the resume
    point and the blocks it may write), :meth:`prefill_step` / :meth:`decode` run it and commit
    what it computes, :meth:`close` finishes it (commits settled, leases released)."""

    def __init__(self, ports: CachePorts, tokens: Sequence[int], *, tenant: str, reuse: bool,
                 max_new_tokens: int, images: Sequence[PromptImage] = ()) -> None:
        self.ports = ports
        self.tokens = [int(t) for t in tokens]
        self.tenant = tenant
        self.reuse = reuse
        self.bs = ports.ctx.block_size
        n = len(self.tokens)
        if n == 0:
            raise ValueError("a request needs at least one prompt token")
        if images:
            check_placement(images, self.tokens, getattr(ports.runner.model.cfg, "image_token_id", None))
        self.images = tuple(images)
        #: Per-block hash keys of the images (``shared.images.image_block_keys``).
        self._image_keys = image_block_keys(self.images, self.bs)
        #: The vectors of the images the prefill reads (set at open).
        self.embeds: PromptEmbeds | None = None
        limit = ports.ctx.max_context
        if n + max(0, max_new_tokens - 1) > limit:
            raise ValueError(f"prompt of {n} tokens + {max_new_tokens} new tokens exceeds the context limit of "
                             f"{limit} tokens")
        self.capacity = -(-(n + max(1, max_new_tokens)) // self.bs) * self.bs
        self.hashes: list[str] = []
        self.epoch = 0
        self.leases: list[_Lease] = []
        #: Reply blocks committed at close (decode-made, exported like prefill blocks).
        self.reply_blocks = 0
        #: Blocks the reply may still cache under the tenant's quota (None = no quota).
        self.write_room: int | None = None
        self.main: LeaseGrant | None = None
        #: block index → forms this session may commit for it.
        self.writes: dict[int, list[str]] = {}
        self.found: dict[Need, _Found] = {}
        self.bad: set[tuple[Need, str, int]] = set()
        self.resume_blocks = 0
        self.hit_blocks = 0
        self.invalid: list[str] = []
        self.fallbacks: list[str] = []
        self.reloaded: dict[str, int] = {}
        self.last_seq = 0
        #: Replicas this session committed (filled slots sent to the ledger).
        self.commits = 0
        self.state = None
        #: Prompt tokens the state holds (restored or prefilled).
        self.prefill_pos = 0
        #: Generated tokens fed back by :meth:`decode` (the reply the state holds).
        self.fed: list[int] = []
        #: Where this request stands in the model's step queue: (priority, arrival).
        self.order: tuple = (0, next(_ORDER))
        self.logits: torch.Tensor | None = None
        self.degraded = False
        self._renew: asyncio.Task | None = None
        self._closed = False
        self.timings: dict[str, float] = {}
        self._fresh: asyncio.Future | None = None
        self._speculated = False
        #: ``(meta, bytes)`` to install and commit once the model is busy again (or at close);
        #: the bytes of a disk reload read straight into a slot are that slot's reservation.
        self._pending: list[tuple[BlockMeta, torch.Tensor | memoryview | Reservation]] = []
        #: Slots reserved for granted disk reloads (the read lands in them), until committed or
        #: released; ``found[need].data`` is the slot's memory.
        self._reserved: dict[Need, Reservation] = {}
        self._outcomes: dict[tuple[str, str], int] = {}
        #: A fork (a copy of another session's state after its prompt, ``n`` > 1 samples) holds
        #: no lease of its own and caches only its reply's blocks, under a lease taken at close:
        #: whether its source's prompt was leased. None: not a fork.
        self._source_leased: bool | None = None
        #: Whether this session holds claims on blocks it will commit (:mod:`worker.inflight`),
        #: and the claimed blocks whose commits it has sent.
        self._claims = False
        self._emitted: set[str] = set()
        #: The stepper run that holds this session's state now or last (``_ride``).
        self._run = None

    def _spent(self, phase: str, since: float) -> None:
        self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - since

    async def open(self) -> None:
        ports = self.ports
        try:
            if ports.ctx.cache_enabled:
                ports.metrics.queries.inc(len(self.tokens))
                t0 = time.perf_counter()
                self.hashes = chain_hashes(self.tokens, self.bs, ports.ctx.namespace, ports.salt(self.tenant),
                                           self._image_keys)
                self._spent("hash", t0)
                await self._lease_and_restore()
        finally:
            if self._fresh is None:
                self._build_state(None)
            t0 = time.perf_counter()
            fresh = await self._take_state()
            self._spent("restore", t0)      # only the part of the state build the lease did not hide
        if self.state is None:
            if self._speculated:
                fresh.restore([], 0)        # a speculative restore that was not used: empty again
            self.state = fresh
            self.resume_blocks = 0
        self.prefill_pos = self.resume_blocks * self.bs
        await self._encode_images()
        if self.main is not None:
            for form, idx in self.main.write.items():
                for i in idx:
                    if i >= self.resume_blocks:
                        self.writes.setdefault(i, []).append(form)
        if self._claims:
            ports.inflight.keep(self, [self.hashes[i] for i in self.writes])
        if ports.ctx.cache_enabled:
            ports.metrics.validated_hits.inc(self.resume_blocks * self.bs)

    async def _encode_images(self) -> None:
        """Run the vision encoder (on the model thread, each image alone) for the images the
        prefill still has to read: those ending after the resume point."""
        todo = [im for im in self.images if im.offset + im.tokens > self.prefill_pos]
        if not todo:
            return
        model = self.ports.runner.model
        t0 = time.perf_counter()
        vectors = await self.ports.runner.compute(lambda: encode_images(model, [im.pixels for im in todo]))
        self.embeds = PromptEmbeds([(im.offset, v) for im, v in zip(todo, vectors, strict=True)])
        self._spent("vision", t0)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens restored from validated cache (a whole number of blocks)."""
        return self.resume_blocks * self.bs

    def limit_writes(self, blocks: int) -> int:
        """Commit at most ``blocks`` of the prompt's blocks (the first ones; a tenant's quota):
        the others are computed but not cached. Returns how many were dropped."""
        keep = sorted(self.writes)[:blocks]
        dropped = len(self.writes) - len(keep)
        self.write_room = blocks - len(keep)      # what the reply may still cache
        if dropped:
            self.writes = {i: self.writes[i] for i in keep}
            if self._claims:
                self.ports.inflight.keep(self, [self.hashes[i] for i in keep])
        return dropped

    def fallback(self, reason: str) -> None:
        self.fallbacks.append(reason)
        # the whole reason (``lease:over_capacity``, not ``lease``): the codes are a small fixed set
        self.ports.metrics.fallbacks.labels(reason=reason).inc()

    async def _lease_and_restore(self) -> None:
        ports = self.ports
        if not self.hashes:
            return  # shorter than a block: nothing to reuse or cache
        self.ports = ports = ports.for_chain(self.hashes)     # its shard's, where the ledger is sharded
        if ports.contact.degraded:
            self.degraded = True
            self.fallback("degraded")
            return
        self.epoch = ports.contact.epoch
        if ports.knobs.prefix_wait_s > 0:
            # a burst sharing a prefix computes it once (worker.inflight): wait for the blocks
            # another request here is computing, then claim the rest before asking for them
            if self.reuse:
                await self._wait_for_shared()
            # NOTE: not the prefix this worker holds already (a lease reads it): a claim on it would
            # make the next request wait for this one's grant for nothing. Probed only up to the
            # first block it lacks, so a long cached prompt costs its held prefix here, not more.
            held = next((i for i, h in enumerate(self.hashes) if not ports.holds_block(h)), len(self.hashes))
            self._claims = ports.inflight.claim(self, self.hashes[held:]) > 0
        lease = asyncio.get_running_loop().create_task(
            self._acquire(self.hashes, write=not ports.contact.draining, reuse=self.reuse))
        # NOTE: while the lease is in flight, validate and restore what this worker's own pools
        # hold; the grant then only has to confirm it (same replicas, same generations).
        spec = None
        if self.reuse and ports.knobs.speculate:
            with tracing.span("worker.validation", {"kvl.speculative": True}) as sp:
                spec = self._speculate()
                sp.set_attribute("kvl.resume_blocks", spec.p if spec is not None else 0)
        self._build_state(spec)
        grant = await lease
        if self._claims:
            ports.inflight.keep(self, [self.hashes[i] for idx in grant.write.values() for i in idx] if grant else ())
        if grant is None:
            return
        self.main = grant
        t0 = time.perf_counter()
        ports.replicas.apply_evictions(grant)
        self._spent("evict", t0)
        if not self.reuse:
            return
        self.hit_blocks = grant.usable_blocks
        ports.metrics.hits.inc(grant.usable_blocks * self.bs)
        cap = resume_cap(len(self.tokens), self.bs)
        grid = ports.resume_grid
        target = grid_floor(min(grant.usable_blocks, cap), grid)
        if target < min(grant.usable_blocks, cap):
            self.fallback("grid")
        refs = map_reads(self.hashes, grant.read).refs
        tries = 0
        while target > 0:
            want = needs(ports.ctx.catalogue, target)
            if spec is not None and spec.p == target and all(refs.get(n) == spec.found[n].ref for n in want):
                with tracing.span("worker.restore", {"kvl.resume_blocks": spec.p, "kvl.speculative": True}):
                    accepted = await self._accept(spec)
                if accepted:
                    return
                spec = None     # a slot it read was recycled meanwhile: validate the grant's refs afresh
            if all(n in refs for n in want):
                with tracing.span("worker.validation", {"kvl.blocks": target, "kvl.replicas": len(want)}) as sp:
                    failed = await self._gather(refs, want)
                    sp.set_attribute("kvl.failed", failed)
                ok = best_boundary(ports.ctx.catalogue, set(self.found), target, grid)
                if ok == target:
                    break
                if failed and ports.ctx.on_invalid == "error":
                    raise CacheValidationError(f"hit validation failed ({'; '.join(self.invalid)}) and "
                                               f"cache.on_invalid is 'error'")
                if failed:
                    await ports.outbox.wait_committed(self.epoch, self.last_seq, timeout=1.0)
            if tries >= MAX_EXTRA_LEASES:
                break
            tries += 1
            again = await self._acquire(self.hashes[:target], write=False, reuse=True)
            if again is None:
                break
            refs.update(map_reads(self.hashes, again.read).refs)
            target = grid_floor(min(again.usable_blocks, target), grid)
        p = best_boundary(ports.ctx.catalogue, set(self.found), target, grid)
        if self.invalid:
            self.fallback("validation")
        if p:
            with tracing.span("worker.restore", {"kvl.resume_blocks": p}) as sp:
                await self._restore(p)
                sp.set_attributes({"kvl.reloaded_host": self.reloaded.get("host", 0),
                                   "kvl.reloaded_disk": self.reloaded.get("disk", 0)})

    def fork(self, state) -> Session:
        """Another sample of this prompt: a session at the end of the prompt holding ``state``
        (a :meth:`CacheState.fork` of this one's, taken before this session decodes anything).

        Its next logits are this session's, so it samples its first token from exactly what a
        session of its own would have computed (the state is a bit-for-bit copy), without a
        lease, a restore or a prefill of its own. It reports the prompt's cache use as this
        session's (the one prefill they share)."""
        if not self.done_prefill or self.fed or self.logits is None:
            raise RuntimeError("a session forks at the end of its prompt, before it decodes")
        if state.pos != self.state.pos:
            raise ValueError(f"fork: the state is at {state.pos}, the session at {self.state.pos}")
        c = Session(self.ports, self.tokens, tenant=self.tenant, reuse=self.reuse, max_new_tokens=1,
                    images=self.images)
        c.capacity = self.capacity      # the state's, which this session's max_new_tokens sized
        c.hashes = list(self.hashes)
        c.epoch = self.epoch
        c.write_room = self.write_room
        c.resume_blocks, c.hit_blocks = self.resume_blocks, self.hit_blocks
        c.fallbacks = list(self.fallbacks)
        c.degraded = self.degraded
        c.state, c.prefill_pos, c.logits = state, self.prefill_pos, self.logits
        c._source_leased = self._leased_prompt
        return c

    @property
    def _leased_prompt(self) -> bool:
        """Whether a lease covered this prompt when it opened (the fork's source's, for a fork)."""
        return self.main is not None if self._source_leased is None else self._source_leased

    @property
    def done_prefill(self) -> bool:
        return self.prefill_pos >= len(self.tokens)

    def _block_meta(self, i: int, form: str, checksum: str = "") -> BlockMeta:
        ports = self.ports
        return BlockMeta(namespace=ports.ctx.namespace, tenant=self.tenant, block_hash=self.hashes[i],
                         parent_hash=self.hashes[i - 1] if i else ROOT_HASH, token_start=i * self.bs,
                         token_end=(i + 1) * self.bs, form=form, spec_digest=ports.ctx.spec_digests[form],
                         checksum=checksum)

    def _commit_pending(self, lease: LeaseGrant | None = None) -> None:
        """Install and commit what earlier model calls produced (checksums computed here)."""
        if not self._pending:
            return
        ports = self.ports
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        lease = lease or self.main
        if lease is not None and self.epoch == ports.contact.epoch:
            for meta, data in pending:
                # a block computed here has no checksum yet: the store sums it as it installs it
                assert meta.checksum or not isinstance(data, (Reservation, memoryview)), \
                    "a reload carries its record's checksum"
                seq = ports.replicas.commit(meta, data, lease_id=lease.lease_id)
                if seq:
                    self.last_seq = max(self.last_seq, seq)
                    self.commits += 1
            ports.replicas.committed()
            if self._claims:
                # NOTE: every form of a block is exported by the same piece, so a block here is whole
                done = {m.block_hash for m, _ in pending}
                self._emitted |= done
                ports.background(self._announce(done, self.epoch, self.last_seq))
        else:
            # the epoch that holds the lease is gone: its writes were fenced
            for _, data in pending:
                if isinstance(data, Reservation):
                    ports.store.release(data)
        self._spent("commit", t0)

    async def _announce(self, hashes: set[str], epoch: int, seq: int) -> None:
        """Tell requests waiting for ``hashes`` (:mod:`worker.inflight`) once the watermark
        covers their commits: the ledger lists them READY for the lease they ask next. (Not
        covered in time: the claims stay until the close drops them, or the waiters' wait ends.)"""
        ports = self.ports
        if ports.outbox is None or await ports.outbox.wait_committed(epoch, seq, timeout=ports.knobs.settle_timeout_s):
            ports.inflight.committed(self, hashes)

    async def _commit_reply(self) -> None:
        """Cache the blocks the reply completed, like prefill blocks (a later turn reuses them).

        Their hashes were unknown when the session opened, so a second, write-only lease asks
        for the whole chain (the prompt's blocks keep their hashes: the chain only grows). With
        batch-invariant ops a decode-made block holds the bits a prefill of the same tokens
        computes, so it is as reusable as any; without, it is never exported.
        """
        ports = self.ports
        state = self.state
        if (not ports.ctx.cache_enabled or state is None or ports.contact.degraded or ports.contact.draining
                or not ports.runner.stepper.fused):
            return
        first_lease = not self._leased_prompt
        if first_lease:
            if self.hashes or self.degraded:
                return              # the opening lease was refused or never asked: leave it
            self.epoch = ports.contact.epoch
        first, full = len(self.tokens) // self.bs, state.completed_blocks
        if full <= first:
            return
        t0 = time.perf_counter()
        tokens = (self.tokens + self.fed)[:full * self.bs]
        hashes = chain_hashes(tokens, self.bs, ports.ctx.namespace, ports.salt(self.tenant), self._image_keys)
        assert hashes[:len(self.hashes)] == self.hashes
        if first_lease:             # a prompt shorter than a block: this is its first lease, on its shard
            self.ports = ports = ports.for_chain(hashes)
            if ports.contact.degraded or ports.contact.draining:
                return
            self.epoch = ports.contact.epoch
        if self.epoch != ports.contact.epoch:
            return
        grant = await self._acquire(hashes, write=True, reuse=False)
        if grant is None:
            return
        self.hashes = hashes
        ports.replicas.apply_evictions(grant)
        writes: dict[int, list[str]] = {}
        for form, idx in grant.write.items():
            for i in idx:
                if first <= i < full:
                    writes.setdefault(i, []).append(form)
        if self.write_room is not None:
            writes = {i: writes[i] for i in sorted(writes)[:self.write_room]}
        if writes:
            payloads = await ports.runner.compute(lambda: [(i, state.export_block(i)) for i in sorted(writes)])
            for i, payload in payloads:
                for form in writes[i]:
                    self._pending.append((self._block_meta(i, form), as_bytes(payload[form])))
            self.reply_blocks = len(writes)
            ports.metrics.reply_blocks.inc(len(writes))
        self._commit_pending(lease=grant)
        self._spent("reply", t0)

    def result(self, tokens: list[int], logits: torch.Tensor | None, ttft: float) -> Result:
        return Result(tokens=tokens, logits=logits, prompt_tokens=len(self.tokens),
                      cached_tokens=self.resume_blocks * self.bs, hit_tokens=self.hit_blocks * self.bs,
                      validated=len(self.found), invalid=list(self.invalid), fallbacks=list(self.fallbacks),
                      reloaded=dict(self.reloaded), degraded=self.degraded, epoch=self.epoch, ttft_s=ttft,
                      timings=dict(self.timings))


__all__ = ["MAX_EXTRA_LEASES", "CacheValidationError", "Result", "Session"]
