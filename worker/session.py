"""One request's walk through the cache engine: lease, validate, restore, prefill, commit, release.

A :class:`Session` is what the serving layer drives step by step::

    s = await engine.open(tokens, tenant=..., max_new_tokens=...)   # lease + hit validation + restore
    while not await s.prefill_step(): ...                            # one piece per call (the stepper sizes it)
    logits = s.logits                                                 # of the last prompt token
    logits = await s.decode(token)                                    # one decode step
    result = await s.close()                                          # commits settled, leases released

:func:`worker.generation.generate` is that loop with sampling (the serving scheduler and
:meth:`Engine.generate <worker.engine.Engine.generate>` both run it).

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
from shared.forms import FormScope
from shared.hashing import chain_hashes
from shared.ids import ROOT_HASH
from shared.images import PromptImage, check_placement, image_block_keys
from shared.messages import (
    ErrorCode,
    LeaseAcquire,
    LeaseGrant,
    LeaseRelease,
    LeaseRenew,
    ReplicaRef,
)
from worker.cache.planner import (
    ALL_PASS,
    LAYERS,
    BlockMeta,
    Expect,
    Layer,
    Need,
    Observed,
    all_pass,
    best_boundary,
    grid_floor,
    map_reads,
    needs,
    resume_cap,
    validate,
)
from worker.cache.cost import FormTimer, ValidationCost
from worker.cache.store import Reservation, SlotRead, as_bytes
from worker.client import CoordinatorRefused, CoordinatorUnavailable
from worker.inflight import wait_for
from worker.model.state import BlockPayload
from worker.model.vision import PromptEmbeds, encode_images

if TYPE_CHECKING:
    from worker.engine import Engine

#: Read-only leases a session may take after its first grant (cap/grid or failed validation).
MAX_EXTRA_LEASES = 2
#: Arrival order of sessions (the step queue's tie-break after priority).
_ORDER = itertools.count()
#: How long a request told "suspended" waits for the engine's resume before it recomputes.
RESUME_WAIT_S = 2.0


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


@dataclass(slots=True)
class _Lease:
    grant: LeaseGrant
    epoch: int


@dataclass(frozen=True, slots=True)
class _Speculation:
    """A resume this worker can serve from its own pools, validated before the grant came."""

    p: int
    needs: list[Need]
    found: dict[Need, _Found]
    outcomes: dict[tuple[str, str], int]


@dataclass(slots=True)
class _Found:
    """The validated bytes of one (block, form), and where they came from: a private copy, or
    the pool slot itself (``slot``: read in place, or reserved and read into), which must be
    unchanged after the restore that reads it (``CacheStore.unchanged``)."""

    data: torch.Tensor
    ref: ReplicaRef
    slot: SlotRead | Reservation | None = None
    #: The same bytes as a memoryview when the host tier has one (an install copies it fastest).
    raw: memoryview | None = None


class Session:
    def __init__(self, engine: Engine, tokens: Sequence[int], *, tenant: str, reuse: bool,
                 max_new_tokens: int, images: Sequence[PromptImage] = ()) -> None:
        e = engine
        self.engine = e
        self.tokens = [int(t) for t in tokens]
        self.tenant = tenant
        self.reuse = reuse
        self.bs = e.block_size
        n = len(self.tokens)
        if n == 0:
            raise ValueError("a request needs at least one prompt token")
        if images:
            check_placement(images, self.tokens, getattr(e.model.cfg, "image_token_id", None))
        self.images = tuple(images)
        #: Per-block hash keys of the images (``shared.images.image_block_keys``).
        self._image_keys = image_block_keys(self.images, self.bs)
        #: The vectors of the images the prefill reads (set at open).
        self.embeds: PromptEmbeds | None = None
        limit = e.max_context
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

    def _spent(self, phase: str, since: float) -> None:
        self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - since

    # --- opening ------------------------------------------------------------------------------

    async def open(self) -> None:
        e = self.engine
        try:
            if e.cache_enabled:
                e.metrics.queries.inc(len(self.tokens))
                t0 = time.perf_counter()
                self.hashes = chain_hashes(self.tokens, self.bs, e.namespace, e.salt(self.tenant), self._image_keys)
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
            e.inflight.keep(self, [self.hashes[i] for i in self.writes])
        if e.cache_enabled:
            e.metrics.validated_hits.inc(self.resume_blocks * self.bs)

    async def _encode_images(self) -> None:
        """Run the vision encoder (on the model thread, each image alone) for the images the
        prefill still has to read: those ending after the resume point."""
        todo = [im for im in self.images if im.offset + im.tokens > self.prefill_pos]
        if not todo:
            return
        model = self.engine.model
        t0 = time.perf_counter()
        vectors = await self.engine.compute(lambda: encode_images(model, [im.pixels for im in todo]))
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
                self.engine.inflight.keep(self, [self.hashes[i] for i in keep])
        return dropped

    def fallback(self, reason: str) -> None:
        self.fallbacks.append(reason)
        # the whole reason (``lease:over_capacity``, not ``lease``): the codes are a small fixed set
        self.engine.metrics.fallbacks.labels(reason=reason).inc()

    async def _lease_and_restore(self) -> None:
        e = self.engine
        if not self.hashes:
            return  # shorter than a block: nothing to reuse or cache
        if e.degraded:
            self.degraded = True
            self.fallback("degraded")
            return
        self.epoch = e.epoch
        if e.prefix_wait_s > 0:
            # a burst sharing a prefix computes it once (worker.inflight): wait for the blocks
            # another request here is computing, then claim the rest before asking for them
            if self.reuse:
                await self._wait_for_shared()
            # NOTE: not the prefix this worker holds already (a lease reads it): a claim on it would
            # make the next request wait for this one's grant for nothing. Probed only up to the
            # first block it lacks, so a long cached prompt costs its held prefix here, not more.
            held = next((i for i, h in enumerate(self.hashes) if not e.holds_block(h)), len(self.hashes))
            self._claims = e.inflight.claim(self, self.hashes[held:]) > 0
        lease = asyncio.get_running_loop().create_task(
            self._acquire(self.hashes, write=not e.draining, reuse=self.reuse))
        # NOTE: while the lease is in flight, validate and restore what this worker's own pools
        # hold; the grant then only has to confirm it (same replicas, same generations).
        spec = None
        if self.reuse and e.speculate:
            with tracing.span("worker.validation", {"kvl.speculative": True}) as sp:
                spec = self._speculate()
                sp.set_attribute("kvl.resume_blocks", spec.p if spec is not None else 0)
        self._build_state(spec)
        grant = await lease
        if self._claims:
            e.inflight.keep(self, [self.hashes[i] for idx in grant.write.values() for i in idx] if grant else ())
        if grant is None:
            return
        self.main = grant
        t0 = time.perf_counter()
        e.apply_evictions(grant)
        self._spent("evict", t0)
        if not self.reuse:
            return
        self.hit_blocks = grant.usable_blocks
        e.metrics.hits.inc(grant.usable_blocks * self.bs)
        cap = resume_cap(len(self.tokens), self.bs)
        grid = e.resume_grid
        target = grid_floor(min(grant.usable_blocks, cap), grid)
        if target < min(grant.usable_blocks, cap):
            self.fallback("grid")
        refs = map_reads(self.hashes, grant.read).refs
        tries = 0
        while target > 0:
            want = needs(e.catalogue, target)
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
                ok = best_boundary(e.catalogue, set(self.found), target, grid)
                if ok == target:
                    break
                if failed and e.cfg.cache.on_invalid == "error":
                    raise CacheValidationError(f"hit validation failed ({'; '.join(self.invalid)}) and "
                                               f"cache.on_invalid is 'error'")
                if failed:
                    await e.publisher.wait_committed(self.epoch, self.last_seq, timeout=1.0)
            if tries >= MAX_EXTRA_LEASES:
                break
            tries += 1
            again = await self._acquire(self.hashes[:target], write=False, reuse=True)
            if again is None:
                break
            refs.update(map_reads(self.hashes, again.read).refs)
            target = grid_floor(min(again.usable_blocks, target), grid)
        p = best_boundary(e.catalogue, set(self.found), target, grid)
        if self.invalid:
            self.fallback("validation")
        if p:
            with tracing.span("worker.restore", {"kvl.resume_blocks": p}) as sp:
                await self._restore(p)
                sp.set_attributes({"kvl.reloaded_host": self.reloaded.get("host", 0),
                                   "kvl.reloaded_disk": self.reloaded.get("disk", 0)})

    async def _wait_for_shared(self) -> None:
        """Wait (while the worker prefills; ``cache.prefix_wait_ms`` without progress at most) for
        this prompt's blocks that other requests here claim (:mod:`worker.inflight`), so the lease that follows finds them committed."""
        e = self.engine
        futures = e.inflight.others(self.hashes, self)
        if not futures:
            return
        t0 = time.perf_counter()
        with tracing.span("worker.prefix_wait", {"kvl.blocks": len(futures)}) as sp:
            # NOTE: again while others hold claims: a request that waited with this one for the
            # same prefix may have claimed the next blocks of it first
            outcome = ""
            while futures and outcome != "timeout":
                outcome = await wait_for(futures, e.prefix_wait_s, e.stepper.computing_prompt)
                futures = e.inflight.others(self.hashes, self)
            sp.set_attribute("kvl.outcome", outcome)
        e.metrics.prefix_waits.labels(outcome=outcome).inc()
        e.metrics.prefix_wait_seconds.observe(time.perf_counter() - t0)
        self._spent("prefix_wait", t0)

    def _build_state(self, spec: _Speculation | None) -> None:
        """Allocate the request state on the model thread (restored at ``spec.p`` if speculating)."""
        e = self.engine
        blocks = self._payloads(spec.found, spec.p) if spec is not None else None
        bs, cap = self.bs, self.capacity

        def work():
            state = e.model.new_state(bs, cap, cache_dtype=e.cache_dtype)
            if blocks is not None:
                timer = FormTimer()
                state.restore(blocks, spec.p, timer=timer)
                timer.observe(e.metrics.restore_seconds)
            return state

        self._speculated = spec is not None
        self._fresh = asyncio.get_running_loop().run_in_executor(e._compute, work)

    async def _accept(self, spec: _Speculation) -> bool:
        """The grant pins exactly the replicas the speculation validated: use its restored state,
        unless a slot it read in place was recycled while the model read it (False: the caller
        validates the grant's refs again and restores from those)."""
        e = self.engine
        t0 = time.perf_counter()
        state = await self._take_state()
        self._spent("restore", t0)
        if self._speculated and not self._slots_unchanged(spec.needs, spec.found):
            e.log.warning("a slot was recycled during the speculative restore; validating again")
            return False
        for key, n in spec.outcomes.items():
            e.metrics.validations.labels(layer=key[0], outcome=key[1]).inc(n)
        if self._speculated:
            self.found.update(spec.found)
            self.state = state
            self.resume_blocks = spec.p
        # else: the model refused the restore; _take_state fell back to recomputing everything
        return True

    async def _take_state(self):
        """The state :meth:`_build_state` made; a speculative restore the model refuses falls back
        to a fresh state (and the request to full recomputation)."""
        e = self.engine
        assert self._fresh is not None
        try:
            return await self._fresh
        except (ValueError, RuntimeError) as err:
            if not self._speculated:
                raise
            e.log.error("restore failed; recomputing the whole prompt", error=str(err)[:300])
            self.fallback("restore_failed")
            self._build_state(None)
            return await self._fresh

    def _speculate(self) -> _Speculation | None:
        """The longest boundary this worker's own pools serve, validated against what it committed.

        Every replica is checked with a ref built from the worker's own record (generation and
        checksum it committed); the grant confirms the speculation only if it pins exactly those
        refs, which makes the check identical to validating against the grant.
        """
        e = self.engine
        t0 = time.perf_counter()
        cap = resume_cap(len(self.tokens), self.bs)
        grid = e.resume_grid
        local: dict[Need, BlockMeta] = {}
        bound = cap
        for spec in e.catalogue.forms:
            if spec.scope is FormScope.FULL_HISTORY:
                for i in range(bound):
                    hit = e.store.lookup(spec.name, self.hashes[i])
                    if hit is None:
                        bound = i
                        break
                    local[(i, spec.name)] = hit[1]
        p = grid_floor(bound, grid)
        while p > 0:
            want = needs(e.catalogue, p)
            for need in want:
                if need not in local:
                    hit = e.store.lookup(need[1], self.hashes[need[0]])
                    if hit is not None:
                        local[need] = hit[1]
            if all(n in local for n in want):
                break
            p -= grid
        if p == 0:
            self._spent("speculate", t0)
            return None
        want = needs(e.catalogue, p)
        expect = Expect(namespace=e.namespace, tenant=self.tenant, block_hashes=self.hashes, block_size=self.bs,
                        specs=e.specs, digests=e.spec_digests, stored_as=e.stored_as)
        found: dict[Need, _Found] = {}
        outcomes: dict[tuple[str, str], int] = {}
        by_form: dict[str, list[Need]] = {}
        for need in want:
            by_form.setdefault(need[1], []).append(need)
        full = e.switches.layers == frozenset(LAYERS)
        cost = ValidationCost()
        for form, items in by_form.items():
            seen = e.store.observe_in_place(form, [self.hashes[i] for i, _ in items])
            for need, (obs, data, slot) in zip(items, seen):
                t1, obs = time.perf_counter(), cost.wrap(obs, form)
                meta = local[need]
                ref = ReplicaRef(block_hash=meta.block_hash, form=form, location=e.gpu, generation=meta.generation,
                                 checksum=meta.checksum)
                if full and form in e.switches.forms and all_pass(ref, need[0], obs, expect):
                    verdict = ALL_PASS
                else:
                    v = validate(ref, need[0], obs, expect, e.switches)
                    if not v.ok:
                        self._spent("speculate", t0)
                        return None     # let the grant-driven path find, invalidate and count it
                    verdict = v.outcomes
                cost.add(form, time.perf_counter() - t1)
                for layer, outcome in verdict:
                    key = (layer.value, outcome)
                    outcomes[key] = outcomes.get(key, 0) + 1
                found[need] = _Found(data, ref, slot)
        cost.observe(e.metrics.validation_seconds)
        self._spent("speculate", t0)
        return _Speculation(p, want, found, outcomes)

    def _payloads(self, found: dict[Need, _Found], p: int) -> list[BlockPayload]:
        e = self.engine
        per_block: list[dict[str, torch.Tensor]] = [{} for _ in range(p)]
        for need in needs(e.catalogue, p):
            layout = e.layouts[need[1]]
            per_block[need[0]][need[1]] = found[need].data.view(layout.dtype).reshape(layout.shape)
        return [BlockPayload(t, {f: e.specs[f] for f in t}) for t in per_block]

    async def _acquire(self, hashes: list[str], *, write: bool, reuse: bool) -> LeaseGrant | None:
        e = self.engine
        msg = LeaseAcquire(worker_id=e.worker_id, epoch=self.epoch, request_id=f"r{id(self) & 0xffffff:x}",
                           namespace=e.namespace, tenant=self.tenant, block_hashes=hashes,
                           write_forms=list(e.catalogue.names) if write else [], reuse=reuse,
                           ttl_ms=e.lease_ttl_ms)
        t0 = time.perf_counter()
        with tracing.span("worker.lease", {"kvl.epoch": self.epoch, "kvl.tenant": self.tenant,
                                           "kvl.blocks": len(hashes), "kvl.write": write, "kvl.reuse": reuse},
                          kind=tracing.CLIENT) as sp:
            try:
                try:
                    grant = await e.call("acquire", e.client.acquire(msg))
                except CoordinatorRefused as err:
                    # NOTE: suspended = a coordinator took over and has not heard from us yet; the
                    # engine resumes at once (milliseconds), far cheaper than recomputing the prompt.
                    if err.code is not ErrorCode.SUSPENDED or not await e.wait_resumed(RESUME_WAIT_S):
                        raise
                    grant = await e.call("acquire", e.client.acquire(msg))
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

    async def _gather(self, refs: dict[Need, ReplicaRef], want: list[Need]) -> int:
        """Validate what ``want`` still lacks; keep good copies in ``self.found``. Returns failures."""
        e = self.engine
        t_start = time.perf_counter()
        self._outcomes: dict[tuple[str, str], int] = {}
        expect = Expect(namespace=e.namespace, tenant=self.tenant, block_hashes=self.hashes, block_size=self.bs,
                        specs=e.specs, digests=e.spec_digests, stored_as=e.stored_as)
        failed = 0
        cost = ValidationCost()     # kvl_worker_validation_seconds (worker.cache.cost)
        disk: list[tuple[Need, ReplicaRef]] = []
        gpu: dict[str, list[tuple[Need, ReplicaRef]]] = {}
        # forms whose reloads may take the all-layers shortcut (the same rule as the GPU's below)
        fast_reload = {f: e.switches.all_run(f, True) for f in e.specs}
        shortcut = 0    # replicas that passed every layer by all_pass (GPU and reloads)
        for need in want:
            ref = refs[need]
            if need in self.found or (need, ref.location, ref.generation) in self.bad:
                continue
            if ref.location == e.gpu:
                gpu.setdefault(ref.form, []).append((need, ref))
            elif ref.location == e.host_location:
                t0 = time.perf_counter()
                obs, data, raw = e.tiers.host_read(ref.block_hash, ref.form)
                t1, obs = time.perf_counter(), cost.wrap(obs, ref.form)
                if fast_reload.get(ref.form) and all_pass(ref, need[0], obs, expect, reload=True):
                    self.found[need] = _Found(data, ref, raw=raw)
                    shortcut += 1
                else:
                    failed += not self._judge(need, ref, obs, data, expect, reload=True)
                cost.add(ref.form, time.perf_counter() - t1)
                e.metrics.reload_seconds.labels(tier="host").observe(time.perf_counter() - t0)
            elif ref.location == "disk":
                disk.append((need, ref))
            else:
                failed += not self._judge(need, ref, Observed(None), None, expect, reload=False)
        full = e.switches.layers == frozenset(LAYERS)
        for form, items in gpu.items():
            seen = e.store.observe_in_place(form, [ref.block_hash for _, ref in items])
            fast = full and form in e.switches.forms
            for (need, ref), (obs, data, slot) in zip(items, seen):
                t1, obs = time.perf_counter(), cost.wrap(obs, form)
                if fast and all_pass(ref, need[0], obs, expect):
                    self.found[need] = _Found(data, ref, slot)
                    shortcut += 1
                else:
                    failed += not self._judge(need, ref, obs, data, expect, reload=False, slot=slot)
                cost.add(form, time.perf_counter() - t1)
        if disk:
            if not e.tiers.disk_available():
                e.metrics.tier_unavailable.labels(tier="disk").inc()
                self.fallback("disk_unavailable")
            else:
                wants = [self._meta(need, ref) for need, ref in disk]
                slots = self._reserve(disk)
                t0 = time.perf_counter()
                # a Reservation is a segments.Destination: the read lands in the slot when it can
                reads = await e.io(lambda: e.tiers.disk_read_many(wants, slots))
                e.metrics.reload_seconds.labels(tier="disk").observe(time.perf_counter() - t0)
                for (need, ref), r, res in zip(disk, reads, slots):
                    if res is not None:
                        if res.filled_by(r.data):
                            self._reserved[need] = res
                        else:
                            e.store.release(res)        # read elsewhere (or not at all)
                    if r.unavailable:
                        e.tiers.mark_disk_down(r.unavailable)
                        e.metrics.tier_unavailable.labels(tier="disk").inc()
                        self.fallback("disk_unavailable")
                        continue
                    slot = self._reserved.get(need)
                    t1, obs = time.perf_counter(), cost.wrap(r.observed, ref.form)
                    if fast_reload.get(ref.form) and all_pass(ref, need[0], obs, expect, reload=True):
                        self.found[need] = _Found(r.data, ref, slot)
                        shortcut += 1
                    elif not self._judge(need, ref, obs, r.data, expect, reload=True, slot=slot):
                        failed += 1
                        self._unreserve(need)
                    cost.add(ref.form, time.perf_counter() - t1)
                for need, _ in disk:
                    if need not in self.found:
                        self._unreserve(need)
        if shortcut:
            for layer, outcome in ALL_PASS:
                key = (layer.value, outcome)
                self._outcomes[key] = self._outcomes.get(key, 0) + shortcut
        for (layer, outcome), n in self._outcomes.items():
            e.metrics.validations.labels(layer=layer, outcome=outcome).inc(n)
        cost.observe(e.metrics.validation_seconds)
        self._spent("validate", t_start)
        return failed

    def _slots_unchanged(self, want: list[Need], found: dict[Need, _Found] | None = None) -> bool:
        """Whether every slot the restore of ``want`` read in place still holds what it read."""
        found = self.found if found is None else found
        store = self.engine.store
        return all(f.slot is None or store.unchanged(f.slot) for f in (found[n] for n in want))

    def _reserve(self, disk: list[tuple[Need, ReplicaRef]]) -> list[Reservation | None]:
        """A pool slot for each disk reload this lease also granted as a GPU write, to read the
        bytes straight into (validated there, then installed without a copy); None where there
        is no grant or no free slot (the read lands in memory of its own, as before)."""
        e = self.engine
        granted = self.main.write if self.main is not None else {}
        if not granted:
            return [None] * len(disk)
        return [e.store.reserve(need[1], ref.block_hash) if need[0] in granted.get(need[1], ()) else None
                for need, ref in disk]

    def _unreserve(self, need: Need) -> None:
        res = self._reserved.pop(need, None)
        if res is not None:
            self.engine.store.release(res)

    def _release_reservations(self) -> None:
        for need in list(self._reserved):
            self._unreserve(need)

    def _judge(self, need: Need, ref: ReplicaRef, obs, data, expect: Expect, *, reload: bool,
               slot: SlotRead | Reservation | None = None) -> bool:
        e = self.engine
        v = validate(ref, need[0], obs, expect, e.switches, reload=reload)
        counts = self._outcomes
        for layer, outcome in v.outcomes:
            key = (layer.value, outcome)
            counts[key] = counts.get(key, 0) + 1
        if v.ok:
            self.found[need] = _Found(data, ref, slot)
            return True
        self.bad.add((need, ref.location, ref.generation))
        assert v.layer is not None
        self.invalid.append(f"{v.layer.value}:{ref.form}:{need[0]}")
        e.metrics.invalid.labels(layer=v.layer.value, form=ref.form).inc()
        tier = "gpu" if ref.location.startswith("gpu:") else "host" if ref.location.startswith("host:") else "disk"
        if reload:
            e.metrics.reload_failures.labels(tier=tier, reason=v.layer.value).inc()
        e.log.warning("hit validation failed", layer=v.layer.value, form=ref.form, block=need[0],
                      location=ref.location, detail=v.detail)
        seq = e.invalidate(self._meta(need, ref), ref, damaged=bool(obs.damage) or v.layer is Layer.INTEGRITY,
                           reason=f"{v.layer.value}: {v.detail}"[:200])
        if seq:
            self.last_seq = max(self.last_seq, seq)
        return False

    def _meta(self, need: Need, ref: ReplicaRef) -> BlockMeta:
        i, form = need
        e = self.engine
        return BlockMeta(namespace=e.namespace, tenant=self.tenant, block_hash=self.hashes[i],
                         parent_hash=self.hashes[i - 1] if i else ROOT_HASH, token_start=i * self.bs,
                         token_end=(i + 1) * self.bs, form=form, spec_digest=e.spec_digests[form],
                         checksum=ref.checksum, generation=ref.generation)

    async def _restore(self, p: int) -> None:
        e = self.engine
        want = needs(e.catalogue, p)
        blocks = self._payloads(self.found, p)

        t0 = time.perf_counter()
        fresh = await self._take_state()

        def work():
            timer = FormTimer()
            fresh.restore(blocks, p, timer=timer)
            timer.observe(e.metrics.restore_seconds)
            return fresh

        try:
            restored = await e.compute(work)
        except (ValueError, RuntimeError) as err:
            # Validated bytes the model still refuses (a model-side check we do not mirror):
            # never guess — start from a fresh state and recompute everything.
            e.log.error("restore failed; recomputing the whole prompt", error=str(err)[:300])
            self.fallback("restore_failed")
            self._release_reservations()
            self._build_state(None)
            self._spent("restore", t0)
            return
        if not self._slots_unchanged(want):
            # A slot read in place was freed and taken again while the model read it (an eviction,
            # a new epoch): what the restore read may not be what was validated. Recompute instead.
            e.log.warning("a slot was recycled during the restore; recomputing the prompt")
            self.fallback("slot_recycled")
            self._release_reservations()
            self._build_state(None)
            self._spent("restore", t0)
            return
        self.state = restored
        self._spent("restore", t0)
        self.resume_blocks = p
        # Reloaded replicas become GPU replicas where the lease granted the slot (committed
        # off the TTFT path, see _commit_pending).
        granted = self.main.write if self.main is not None else {}
        for need in want:
            f = self.found[need]
            if f.ref.location == e.gpu:
                continue
            tier = "host" if f.ref.location.startswith("host:") else "disk"
            self.reloaded[tier] = self.reloaded.get(tier, 0) + 1
            e.metrics.reloaded_bytes.labels(tier=tier).inc(f.data.numel())
            if need[0] in granted.get(need[1], ()):
                into = self._reserved.pop(need, None)
                self._pending.append((self._meta(need, f.ref), into or (f.data if f.raw is None else f.raw)))
        self._release_reservations()        # read but past the resume point: not needed

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
        c = Session(self.engine, self.tokens, tenant=self.tenant, reuse=self.reuse, max_new_tokens=1,
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

    # --- prefill, decode ----------------------------------------------------------------------

    @property
    def done_prefill(self) -> bool:
        return self.prefill_pos >= len(self.tokens)

    def _plan(self, max_tokens: int | None) -> tuple[list[int], list[int]]:
        """The prompt tokens the next forward runs for this request, and the blocks to export.

        ``max_tokens`` None: the next unit of the ``cache.chunk_blocks`` grid (per-request
        schedule). Otherwise whole blocks up to ``max_tokens`` (at least one), and the trailing
        partial block once nothing else is left, or in the same piece when it fits: with
        batch-invariant ops every cut gives the same bits, so the budget may decide it.
        """
        bs, n, start = self.bs, len(self.tokens), self.prefill_pos
        if max_tokens is None:
            end = _next_unit_end(start, n, bs, self.engine.chunk_blocks)
        else:
            full_end = n - n % bs
            end = n if start >= full_end else min(full_end, start + max(bs, max_tokens // bs * bs))
            if end == full_end and n - full_end <= max_tokens - (end - start):
                end = n
        self.prefill_pos = end
        return self.tokens[start:end], [i for i in range(start // bs, end // bs) if i in self.writes]

    async def prefill_step(self) -> bool:
        """Run the next piece of the prompt; True once the prompt is done (``self.logits`` is set).

        The model's stepper decides how much runs, fused with other requests' steps
        (:mod:`worker.stepper`). Blocks a piece completes are exported with it and committed
        while the *next* model call runs (or at :meth:`decode` / :meth:`close`), so commits
        stay off the TTFT path.
        """
        if self.done_prefill:
            return True
        e = self.engine
        t0 = time.perf_counter()
        fut = e.stepper.prefill(self.state, self._plan, self.order, self.embeds)
        self._commit_pending()          # NOTE: overlaps the model call just queued
        res = await fut
        self._spent("forward", t0)
        for i, payload in res.payloads:
            for form in self.writes.get(i, ()):
                self._pending.append((self._block_meta(i, form), as_bytes(payload[form])))
        if self.done_prefill:
            self.logits = res.logits
        return self.done_prefill

    async def prefill_rest(self) -> torch.Tensor:
        """Run every remaining piece of the prompt; returns the last prompt token's logits."""
        if not self.done_prefill:
            with tracing.span("worker.prefill", {"kvl.prompt_tokens": len(self.tokens),
                                                 "kvl.cached_tokens": self.prefill_pos}) as sp:
                pieces = 1
                while not await self.prefill_step():
                    pieces += 1
                sp.set_attribute("kvl.pieces", pieces)
        assert self.logits is not None
        return self.logits

    def _block_meta(self, i: int, form: str, checksum: str = "") -> BlockMeta:
        e = self.engine
        return BlockMeta(namespace=e.namespace, tenant=self.tenant, block_hash=self.hashes[i],
                         parent_hash=self.hashes[i - 1] if i else ROOT_HASH, token_start=i * self.bs,
                         token_end=(i + 1) * self.bs, form=form, spec_digest=e.spec_digests[form],
                         checksum=checksum)

    def _commit_pending(self, lease: LeaseGrant | None = None) -> None:
        """Install and commit what earlier model calls produced (checksums computed here)."""
        if not self._pending:
            return
        e = self.engine
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        lease = lease or self.main
        if lease is not None and self.epoch == e.epoch:
            for meta, data in pending:
                # a block computed here has no checksum yet: the store sums it as it installs it
                assert meta.checksum or not isinstance(data, (Reservation, memoryview)), \
                    "a reload carries its record's checksum"
                seq = e.commit(meta, data, lease_id=lease.lease_id)
                if seq:
                    self.last_seq = max(self.last_seq, seq)
                    self.commits += 1
            e.committed()
            if self._claims:
                # NOTE: every form of a block is exported by the same piece, so a block here is whole
                done = {m.block_hash for m, _ in pending}
                self._emitted |= done
                e.background(self._announce(done, self.epoch, self.last_seq))
        else:
            # the epoch that holds the lease is gone: its writes were fenced
            for _, data in pending:
                if isinstance(data, Reservation):
                    e.store.release(data)
        self._spent("commit", t0)

    async def _announce(self, hashes: set[str], epoch: int, seq: int) -> None:
        """Tell requests waiting for ``hashes`` (:mod:`worker.inflight`) once the watermark
        covers their commits: the ledger lists them READY for the lease they ask next. (Not
        covered in time: the claims stay until the close drops them, or the waiters' wait ends.)"""
        e = self.engine
        if e.publisher is None or await e.publisher.wait_committed(epoch, seq, timeout=e.settle_timeout_s):
            e.inflight.committed(self, hashes)

    async def decode(self, token: int) -> torch.Tensor:
        """Feed one token; returns the logits for the next position."""
        if not self.done_prefill:
            raise RuntimeError("decode before the prompt is prefilled")
        fut = self.engine.stepper.decode(self.state, int(token), self.order)
        self._commit_pending()
        self.logits = (await fut).logits
        self.fed.append(int(token))
        return self.logits

    async def _commit_reply(self) -> None:
        """Cache the blocks the reply completed, like prefill blocks (a later turn reuses them).

        Their hashes were unknown when the session opened, so a second, write-only lease asks
        for the whole chain (the prompt's blocks keep their hashes: the chain only grows). With
        batch-invariant ops a decode-made block holds the bits a prefill of the same tokens
        computes, so it is as reusable as any; without, it is never exported.
        """
        e = self.engine
        state = self.state
        if not e.cache_enabled or state is None or e.degraded or e.draining or not e.stepper.fused:
            return
        if not self._leased_prompt:
            if self.hashes or self.degraded:
                return                  # the opening lease was refused or never asked: leave it
            self.epoch = e.epoch        # a prompt shorter than a block: this is its first lease
        if self.epoch != e.epoch:
            return
        first, full = len(self.tokens) // self.bs, state.completed_blocks
        if full <= first:
            return
        t0 = time.perf_counter()
        tokens = (self.tokens + self.fed)[:full * self.bs]
        hashes = chain_hashes(tokens, self.bs, e.namespace, e.salt(self.tenant), self._image_keys)
        assert hashes[:len(self.hashes)] == self.hashes
        grant = await self._acquire(hashes, write=True, reuse=False)
        if grant is None:
            return
        self.hashes = hashes
        e.apply_evictions(grant)
        writes: dict[int, list[str]] = {}
        for form, idx in grant.write.items():
            for i in idx:
                if first <= i < full:
                    writes.setdefault(i, []).append(form)
        if self.write_room is not None:
            writes = {i: writes[i] for i in sorted(writes)[:self.write_room]}
        if writes:
            payloads = await e.compute(lambda: [(i, state.export_block(i)) for i in sorted(writes)])
            for i, payload in payloads:
                for form in writes[i]:
                    self._pending.append((self._block_meta(i, form), as_bytes(payload[form])))
            self.reply_blocks = len(writes)
            e.metrics.reply_blocks.inc(len(writes))
        self._commit_pending(lease=grant)
        self._spent("reply", t0)

    # --- closing ------------------------------------------------------------------------------

    async def _renew_loop(self) -> None:
        e = self.engine
        while True:
            await asyncio.sleep(max(0.05, e.lease_ttl_ms / 3000))
            for lease in list(self.leases):
                if lease.epoch != e.epoch:
                    continue
                try:
                    await e.call("renew", e.client.renew(LeaseRenew(
                        worker_id=e.worker_id, epoch=lease.epoch, lease_id=lease.grant.lease_id,
                        ttl_ms=e.lease_ttl_ms)))
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
        e = self.engine
        t0 = time.perf_counter()
        try:
            await self._close(release_later)
        finally:
            if self._claims:
                e.inflight.drop(self)       # what it did not commit: waiters lease (and compute) now
                self._claims = False
            e.metrics.close_seconds.observe(time.perf_counter() - t0)

    async def _close(self, release_later: bool) -> None:
        e = self.engine
        settled = True
        with tracing.span("worker.commit") as sp:
            self._commit_pending()
            self._release_reservations()    # a request that ended before its restore
            try:
                await self._commit_reply()
            except (CoordinatorRefused, CoordinatorUnavailable, ValueError) as err:
                e.log.warning("reply blocks not cached", error=type(err).__name__)
            if self.leases and self.last_seq and e.publisher is not None:
                settled = await e.publisher.wait_committed(self.epoch, self.last_seq, timeout=e.settle_timeout_s)
            if self._claims and settled:
                e.inflight.committed(self, self._emitted)     # before the announcements' own tasks run
            sp.set_attributes({"kvl.replicas_committed": self.commits, "kvl.reply_blocks": self.reply_blocks,
                               "kvl.settled": settled})
        if not self.leases:
            self._stop_renewing()
            return
        if not settled or release_later:
            e.releasing.add(self)
            e.background(self._settle_then_release())
            return
        await self._release()

    async def _settle_then_release(self) -> None:
        e = self.engine
        assert e.publisher is not None
        try:
            await e.publisher.wait_committed(self.epoch, self.last_seq,
                                             timeout=max(5.0, e.lease_ttl_ms / 1000 * 0.8))
            await self._release()
        finally:
            e.releasing.discard(self)

    def _stop_renewing(self) -> None:
        if self._renew is not None:
            self._renew.cancel()
            self._renew = None

    async def _release(self) -> None:
        e = self.engine
        self._stop_renewing()
        async def release(lease: _Lease) -> None:
            try:
                await e.call("release", e.client.release(LeaseRelease(
                    worker_id=e.worker_id, epoch=lease.epoch, lease_id=lease.grant.lease_id)))
            except (CoordinatorRefused, CoordinatorUnavailable):
                pass

        with tracing.span("worker.release", {"kvl.leases": len(self.leases)}, kind=tracing.CLIENT):
            # at once: the prompt's lease and the reply's are independent (one round trip, not two,
            # of what a response's last chunk waits for)
            await asyncio.gather(*(release(lease) for lease in self.leases if lease.epoch == e.epoch))
        self.leases = []

    def result(self, tokens: list[int], logits: torch.Tensor | None, ttft: float) -> Result:
        return Result(tokens=tokens, logits=logits, prompt_tokens=len(self.tokens),
                      cached_tokens=self.resume_blocks * self.bs, hit_tokens=self.hit_blocks * self.bs,
                      validated=len(self.found), invalid=list(self.invalid), fallbacks=list(self.fallbacks),
                      reloaded=dict(self.reloaded), degraded=self.degraded, epoch=self.epoch, ttft_s=ttft,
                      timings=dict(self.timings))


def _next_unit_end(start: int, end: int, bs: int, chunk_blocks: int) -> int:
    """Where the prefill unit starting at ``start`` (a block boundary) ends, on the model's grid:
    the next grid point or the last whole block, then the trailing partial block."""
    unit = chunk_blocks * bs
    full_end = end - end % bs
    return min((start // unit + 1) * unit, full_end) if start < full_end else end


__all__ = ["CacheValidationError", "Result", "Session"]
