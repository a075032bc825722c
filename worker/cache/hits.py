"""How a request finds, validates and restores what the cache holds for its prompt.

Mixed into :class:`worker.cache.manager.Session` (it reads the session's hashes, grant and
counters). Two paths lead to a restored state:

* *speculation* — while the lease is in flight, :meth:`HitFinder._speculate` validates the
  longest prefix this worker's own pools serve, against the worker's own records, and the
  state is restored from those slots at once; the grant then only has to pin exactly those
  replicas (:meth:`HitFinder._accept`);
* *the grant's refs* — :meth:`HitFinder._gather` validates each pinned replica
  (:func:`worker.cache.planner.validate`) on the bytes the state is then restored from: a pool
  slot read in place, a host-tier entry, or a disk record (read straight into a reserved pool
  slot when the lease also granted that write). A replica that fails is invalidated in the
  ledger (``ReplicaWriter.invalidate``); :meth:`HitFinder._restore` builds the state.

Either way a slot read in place must be unchanged once the restore is done
(``CacheStore.unchanged``); if it is not, or the model refuses the bytes, the request
recomputes the whole prompt — never a guess. A state that reads restored blocks where they lie
(the dense family, ``DenseState.reads_in_place``; ``cache.restore_in_place``) copies nothing:
it pins each validated slot for its whole life (``CacheStore.hold``), so the unchanged check also
covers every later read.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from shared.forms import FormScope
from shared.ids import ROOT_HASH
from shared.messages import ReplicaRef
from worker.cache.cost import FormTimer, ValidationCost
from worker.cache.planner import (
    ALL_PASS,
    LAYERS,
    BlockMeta,
    Expect,
    Layer,
    Need,
    Observed,
    all_pass,
    grid_floor,
    needs,
    resume_cap,
    validate,
)
from worker.cache.store import Reservation, SlotRead
from worker.model.state import BlockPayload


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


class HitFinder:
    """Validation and restore, for :class:`worker.cache.manager.Session` (see the module's docstring)."""

    def _build_state(self, spec: _Speculation | None) -> None:
        """Allocate the request state on the model thread (restored at ``spec.p`` if speculating)."""
        ports = self.ports
        blocks = self._payloads(spec.found, spec.p) if spec is not None else None
        bs, cap = self.bs, self.capacity

        def work():
            state = ports.runner.model.new_state(bs, cap, cache_dtype=ports.ctx.cache_dtype)
            if blocks is not None:
                timer = FormTimer()
                state.restore(blocks, spec.p, timer=timer, **self._holds(state, spec.found))
                timer.observe(ports.metrics.restore_seconds)
            return state

        self._speculated = spec is not None
        self._fresh = ports.runner.states(work)

    async def _take_state(self):
        """The state :meth:`_build_state` made; a speculative restore the model refuses falls back
        to a fresh state (and the request to full recomputation)."""
        ports = self.ports
        assert self._fresh is not None
        try:
            return await self._fresh
        except (ValueError, RuntimeError) as err:
            if not self._speculated:
                raise
            ports.log.error("restore failed; recomputing the whole prompt", error=str(err)[:300])
            self.fallback("restore_failed")
            self._build_state(None)
            return await self._fresh

    async def _accept(self, spec: _Speculation) -> bool:
        """The grant pins exactly the replicas the speculation validated: use its restored state,
        unless a slot it read in place was recycled while the model read it (False: the caller
        validates the grant's refs again and restores from those)."""
        ports = self.ports
        t0 = time.perf_counter()
        state = await self._take_state()
        self._spent("restore", t0)
        if self._speculated and not self._slots_unchanged(spec.needs, spec.found):
            ports.log.warning("a slot was recycled during the speculative restore; validating again")
            return False
        for key, n in spec.outcomes.items():
            ports.metrics.validations.labels(layer=key[0], outcome=key[1]).inc(n)
        if self._speculated:
            self.found.update(spec.found)
            self.state = state
            self.resume_blocks = spec.p
            self._count_restored(state, spec.p)
        # else: the model refused the restore; _take_state fell back to recomputing everything
        return True

    def _speculate(self) -> _Speculation | None:
        """The longest boundary this worker's own pools serve, validated against what it committed.

        Every replica is checked with a ref built from the worker's own record (generation and
        checksum it committed); the grant confirms the speculation only if it pins exactly those
        refs, which makes the check identical to validating against the grant.
        """
        ports = self.ports
        t0 = time.perf_counter()
        cap = resume_cap(len(self.tokens), self.bs)
        grid = ports.resume_grid
        local: dict[Need, BlockMeta] = {}
        bound = cap
        for spec in ports.ctx.catalogue.forms:
            if spec.scope is FormScope.FULL_HISTORY:
                for i in range(bound):
                    hit = ports.store.lookup(spec.name, self.hashes[i])
                    if hit is None:
                        bound = i
                        break
                    local[(i, spec.name)] = hit[1]
        p = grid_floor(bound, grid)
        while p > 0:
            want = needs(ports.ctx.catalogue, p)
            for need in want:
                if need not in local:
                    hit = ports.store.lookup(need[1], self.hashes[need[0]])
                    if hit is not None:
                        local[need] = hit[1]
            if all(n in local for n in want):
                break
            p -= grid
        if p == 0:
            self._spent("speculate", t0)
            return None
        want = needs(ports.ctx.catalogue, p)
        expect = Expect(namespace=ports.ctx.namespace, tenant=self.tenant, block_hashes=self.hashes, block_size=self.bs,
                        specs=ports.ctx.specs, digests=ports.ctx.spec_digests, stored_as=ports.ctx.stored_as)
        found: dict[Need, _Found] = {}
        outcomes: dict[tuple[str, str], int] = {}
        by_form: dict[str, list[Need]] = {}
        for need in want:
            by_form.setdefault(need[1], []).append(need)
        full = ports.ctx.switches.layers == frozenset(LAYERS)
        cost = ValidationCost()
        for form, items in by_form.items():
            seen = ports.store.observe_in_place(form, [self.hashes[i] for i, _ in items])
            for need, (obs, data, slot) in zip(items, seen):
                t1, obs = time.perf_counter(), cost.wrap(obs, form)
                meta = local[need]
                ref = ReplicaRef(block_hash=meta.block_hash, form=form, location=ports.ctx.gpu,
                                 generation=meta.generation,
                                 checksum=meta.checksum)
                if full and form in ports.ctx.switches.forms and all_pass(ref, need[0], obs, expect):
                    verdict = ALL_PASS
                else:
                    v = validate(ref, need[0], obs, expect, ports.ctx.switches)
                    if not v.ok:
                        self._spent("speculate", t0)
                        return None     # let the grant-driven path find, invalidate and count it
                    verdict = v.outcomes
                cost.add(form, time.perf_counter() - t1)
                for layer, outcome in verdict:
                    key = (layer.value, outcome)
                    outcomes[key] = outcomes.get(key, 0) + 1
                found[need] = _Found(data, ref, slot)
        cost.observe(ports.metrics.validation_seconds)
        self._spent("speculate", t0)
        return _Speculation(p, want, found, outcomes)

    def _payloads(self, found: dict[Need, _Found], p: int) -> list[BlockPayload]:
        ports = self.ports
        per_block: list[dict[str, torch.Tensor]] = [{} for _ in range(p)]
        for need in needs(ports.ctx.catalogue, p):
            layout = ports.ctx.layouts[need[1]]
            per_block[need[0]][need[1]] = found[need].data.view(layout.dtype).reshape(layout.shape)
        return [BlockPayload(t, {f: ports.ctx.specs[f] for f in t}) for t in per_block]

    async def _gather(self, refs: dict[Need, ReplicaRef], want: list[Need]) -> int:
        """Validate what ``want`` still lacks; keep good copies in ``self.found``. Returns failures."""
        ports = self.ports
        t_start = time.perf_counter()
        self._outcomes: dict[tuple[str, str], int] = {}
        expect = Expect(namespace=ports.ctx.namespace, tenant=self.tenant, block_hashes=self.hashes, block_size=self.bs,
                        specs=ports.ctx.specs, digests=ports.ctx.spec_digests, stored_as=ports.ctx.stored_as)
        failed = 0
        cost = ValidationCost()     # kvl_worker_validation_seconds (worker.cache.cost)
        disk: list[tuple[Need, ReplicaRef]] = []
        gpu: dict[str, list[tuple[Need, ReplicaRef]]] = {}
        # forms whose reloads may take the all-layers shortcut (the same rule as the GPU's below)
        fast_reload = {f: ports.ctx.switches.all_run(f, True) for f in ports.ctx.specs}
        shortcut = 0    # replicas that passed every layer by all_pass (GPU and reloads)
        for need in want:
            ref = refs[need]
            if need in self.found or (need, ref.location, ref.generation) in self.bad:
                continue
            if ref.location == ports.ctx.gpu:
                gpu.setdefault(ref.form, []).append((need, ref))
            elif ref.location == ports.ctx.host_location:
                t0 = time.perf_counter()
                obs, data, raw = ports.tiers.host_read(ref.block_hash, ref.form)
                t1, obs = time.perf_counter(), cost.wrap(obs, ref.form)
                if fast_reload.get(ref.form) and all_pass(ref, need[0], obs, expect, reload=True):
                    self.found[need] = _Found(data, ref, raw=raw)
                    shortcut += 1
                else:
                    failed += not self._judge(need, ref, obs, data, expect, reload=True)
                cost.add(ref.form, time.perf_counter() - t1)
                ports.metrics.reload_seconds.labels(tier="host").observe(time.perf_counter() - t0)
            elif ref.location == "disk":
                disk.append((need, ref))
            else:
                failed += not self._judge(need, ref, Observed(None), None, expect, reload=False)
        full = ports.ctx.switches.layers == frozenset(LAYERS)
        for form, items in gpu.items():
            seen = ports.store.observe_in_place(form, [ref.block_hash for _, ref in items])
            fast = full and form in ports.ctx.switches.forms
            for (need, ref), (obs, data, slot) in zip(items, seen):
                t1, obs = time.perf_counter(), cost.wrap(obs, form)
                if fast and all_pass(ref, need[0], obs, expect):
                    self.found[need] = _Found(data, ref, slot)
                    shortcut += 1
                else:
                    failed += not self._judge(need, ref, obs, data, expect, reload=False, slot=slot)
                cost.add(form, time.perf_counter() - t1)
        if disk:
            if not ports.tiers.disk_available():
                ports.metrics.tier_unavailable.labels(tier="disk").inc()
                self.fallback("disk_unavailable")
            else:
                wants = [self._meta(need, ref) for need, ref in disk]
                slots = self._reserve(disk)
                t0 = time.perf_counter()
                # a Reservation is a segments.Destination: the read lands in the slot when it can
                reads = await ports.runner.io(lambda: ports.tiers.disk_read_many(wants, slots))
                ports.metrics.reload_seconds.labels(tier="disk").observe(time.perf_counter() - t0)
                for (need, ref), r, res in zip(disk, reads, slots):
                    if res is not None:
                        if res.filled_by(r.data):
                            self._reserved[need] = res
                        else:
                            ports.store.release(res)        # read elsewhere (or not at all)
                    if r.unavailable:
                        ports.tiers.mark_disk_down(r.unavailable)
                        ports.metrics.tier_unavailable.labels(tier="disk").inc()
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
            ports.metrics.validations.labels(layer=layer, outcome=outcome).inc(n)
        cost.observe(ports.metrics.validation_seconds)
        self._spent("validate", t_start)
        return failed

    def _holds(self, state, found: dict[Need, _Found]) -> dict:
        """``restore``'s ``hold`` for a state that reads restored blocks in place: pins the pool slot
        a validated payload lies in (None for a private copy, or a slot taken again since)."""
        how = self.ports.knobs.restore_in_place
        if (not getattr(state, "reads_in_place", False) or how == "never"
                or (how == "auto" and getattr(state, "buffers_resident", False))):
            return {}
        store = self.ports.store

        def hold(i: int, form: str):
            f = found.get((i, form))
            return None if f is None or f.slot is None else store.hold(f.slot)

        return {"hold": hold}

    def _count_restored(self, state, p: int) -> None:
        in_place = getattr(state, "cached_in_place", 0)
        m = self.ports.metrics.restored_blocks
        if in_place:
            m.labels(how="in_place").inc(in_place)
        if p > in_place:
            m.labels(how="copied").inc(p - in_place)

    def _slots_unchanged(self, want: list[Need], found: dict[Need, _Found] | None = None) -> bool:
        """Whether every slot the restore of ``want`` read in place still holds what it read."""
        found = self.found if found is None else found
        store = self.ports.store
        return all(f.slot is None or store.unchanged(f.slot) for f in (found[n] for n in want))

    def _reserve(self, disk: list[tuple[Need, ReplicaRef]]) -> list[Reservation | None]:
        """A pool slot for each disk reload this lease also granted as a GPU write, to read the
        bytes straight into (validated there, then installed without a copy); None where there
        is no grant or no free slot (the read lands in memory of its own, as before)."""
        ports = self.ports
        granted = self.main.write if self.main is not None else {}
        if not granted:
            return [None] * len(disk)
        return [ports.store.reserve(need[1], ref.block_hash) if need[0] in granted.get(need[1], ()) else None
                for need, ref in disk]

    def _unreserve(self, need: Need) -> None:
        res = self._reserved.pop(need, None)
        if res is not None:
            self.ports.store.release(res)

    def _release_reservations(self) -> None:
        for need in list(self._reserved):
            self._unreserve(need)

    def _judge(self, need: Need, ref: ReplicaRef, obs, data, expect: Expect, *, reload: bool,
               slot: SlotRead | Reservation | None = None) -> bool:
        ports = self.ports
        v = validate(ref, need[0], obs, expect, ports.ctx.switches, reload=reload)
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
        ports.metrics.invalid.labels(layer=v.layer.value, form=ref.form).inc()
        tier = "gpu" if ref.location.startswith("gpu:") else "host" if ref.location.startswith("host:") else "disk"
        if reload:
            ports.metrics.reload_failures.labels(tier=tier, reason=v.layer.value).inc()
        ports.log.warning("hit validation failed", layer=v.layer.value, form=ref.form, block=need[0],
                      location=ref.location, detail=v.detail)
        seq = ports.replicas.invalidate(self._meta(need, ref), ref,
                                        damaged=bool(obs.damage) or v.layer is Layer.INTEGRITY,
                           reason=f"{v.layer.value}: {v.detail}"[:200])
        if seq:
            self.last_seq = max(self.last_seq, seq)
        return False

    def _meta(self, need: Need, ref: ReplicaRef) -> BlockMeta:
        i, form = need
        ports = self.ports
        return BlockMeta(namespace=ports.ctx.namespace, tenant=self.tenant, block_hash=self.hashes[i],
                         parent_hash=self.hashes[i - 1] if i else ROOT_HASH, token_start=i * self.bs,
                         token_end=(i + 1) * self.bs, form=form, spec_digest=ports.ctx.spec_digests[form],
                         checksum=ref.checksum, generation=ref.generation)

    async def _restore(self, p: int) -> None:
        ports = self.ports
        want = needs(ports.ctx.catalogue, p)
        blocks = self._payloads(self.found, p)

        t0 = time.perf_counter()
        fresh = await self._take_state()

        def work():
            timer = FormTimer()
            fresh.restore(blocks, p, timer=timer, **self._holds(fresh, self.found))
            timer.observe(ports.metrics.restore_seconds)
            return fresh

        try:
            restored = await ports.runner.states(work)
        except (ValueError, RuntimeError) as err:
            # Validated bytes the model still refuses (a model-side check we do not mirror):
            # never guess — start from a fresh state and recompute everything.
            ports.log.error("restore failed; recomputing the whole prompt", error=str(err)[:300])
            self.fallback("restore_failed")
            self._release_reservations()
            self._build_state(None)
            self._spent("restore", t0)
            return
        if not self._slots_unchanged(want):
            # A slot read in place was freed and taken again while the model read it (an eviction,
            # a new epoch): what the restore read may not be what was validated. Recompute instead.
            ports.log.warning("a slot was recycled during the restore; recomputing the prompt")
            self.fallback("slot_recycled")
            self._release_reservations()
            self._build_state(None)
            self._spent("restore", t0)
            return
        self.state = restored
        self._spent("restore", t0)
        self.resume_blocks = p
        self._count_restored(restored, p)
        # Reloaded replicas become GPU replicas where the lease granted the slot (committed
        # off the TTFT path, see _commit_pending).
        granted = self.main.write if self.main is not None else {}
        for need in want:
            f = self.found[need]
            if f.ref.location == ports.ctx.gpu:
                continue
            tier = "host" if f.ref.location.startswith("host:") else "disk"
            self.reloaded[tier] = self.reloaded.get(tier, 0) + 1
            ports.metrics.reloaded_bytes.labels(tier=tier).inc(f.data.numel())
            if need[0] in granted.get(need[1], ()):
                into = self._reserved.pop(need, None)
                self._pending.append((self._meta(need, f.ref), into or (f.data if f.raw is None else f.raw)))
        self._release_reservations()        # read but past the resume point: not needed


__all__ = ["HitFinder"]
