"""The core against a simple model, driven by Hypothesis.

The model keeps, per replica key, only what a reader of docs/architecture.md would: its state, who
created it (worker, epoch, lease), its generation and checksum; per lease, the keys it pins
and writes; per worker, its epoch, liveness, suspension and last heartbeat (heartbeats are
soft state: the machine passes them to ``expire`` as the shell does). It judges transitions by
the design's rules directly and computes the usable prefix by brute force. The core must
agree with it on every replica after every step, keep its invariants, and rebuild the same
state by replay and from a snapshot.

``KVL_CORE_HYPOTHESIS_EXAMPLES`` / ``KVL_CORE_HYPOTHESIS_STEPS`` raise the effort.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from coordinator.core import (
    CoreParams, LeaseExpired, TransitionApplied, TransitionRejected, WorkerLost, WorkerSuspended, acquire_lease,
    check_invariants, drain_worker, expire, from_snapshot, heartbeat, ingest_transition, invalidate,
    register_worker, release_lease, renew_lease, replay, resume, resume_worker, state_hash, to_snapshot,
)
from shared.forms import FormScope
from shared.hashing import split_digests
from shared.messages import ErrorCode, ErrorReply, LeaseGrant, ReplicaState as S, ResumeReply
from tests.fuzz import examples

from .support import CAT, Driver, acquire, hb, held, register, release, renew, resume_msg, transition

WORKERS = ("w1", "w2")
FAMILIES = {fam: [f"{fam * 2}{i:030x}" for i in range(6)] for fam in ("a", "b", "c")}
ALL_BLOCKS = [b for blocks in FAMILIES.values() for b in blocks]
LIVE = (S.ALLOCATED, S.READY)
WINDOW_BLOCKS = {f.name: CAT.window_blocks(f) for f in CAT.forms if f.scope is FormScope.WINDOW}
TTL, HB_INTERVAL, MISSED, GRACE = 400, 100, 3, 600


@dataclass
class MReplica:
    state: S
    owner: str
    epoch: int
    lease: str = ""
    generation: int = 0
    checksum: str = ""
    tenant: str = ""
    #: Last grant, pin or commit time: eviction takes the least recently used first.
    used: int = 0


@dataclass
class MLease:
    worker: str
    epoch: int
    tenant: str
    pins: set[tuple[str, str, str]]
    writes: set[tuple[str, str, str]]
    expires: int
    granted: int


@dataclass
class MWorker:
    epoch: int = 0
    alive: bool = False
    last_hb: int = 0
    draining: bool = False
    #: When the epoch was suspended (0 = not suspended).
    suspended_at: int = 0


@dataclass
class Model:
    replicas: dict[tuple[str, str, str], MReplica] = field(default_factory=dict)
    leases: dict[str, MLease] = field(default_factory=dict)
    workers: dict[str, MWorker] = field(default_factory=dict)
    resumed: int = 0
    #: Ended replicas kept per owner, oldest first: at most ``tomb_capacity`` (the owner's pool slots).
    tombs: dict[str, dict[tuple[str, str, str], None]] = field(default_factory=dict)
    tomb_capacity: int = 0

    def end(self, key: tuple[str, str, str], state: S) -> None:
        """``key`` ends in ``state``; the owner's oldest ended replicas past the capacity are forgotten."""
        r = self.replicas[key]
        r.state = state
        ring = self.tombs.setdefault(r.owner, {})
        ring[key] = None
        while len(ring) > self.tomb_capacity:
            oldest = next(iter(ring))
            del ring[oldest]
            del self.replicas[oldest]

    def create(self, key: tuple[str, str, str], r: MReplica) -> None:
        old = self.replicas.get(key)
        if old is not None:
            assert old.state not in LIVE
            del self.tombs[old.owner][key]
        self.replicas[key] = r

    def state(self, key: tuple[str, str, str]) -> S | None:
        r = self.replicas.get(key)
        return r.state if r else None

    def pins(self, key: tuple[str, str, str]) -> int:
        return sum(key in l.pins for l in self.leases.values())

    def unpin(self, key: tuple[str, str, str]) -> None:
        for l in self.leases.values():
            l.pins.discard(key)

    def end_lease(self, lid: str) -> None:
        lease = self.leases.pop(lid)
        for key in sorted(lease.writes):
            r = self.replicas.get(key)
            if r is not None and r.state is S.ALLOCATED and r.lease == lid:
                self.end(key, S.EVICTED)

    def lose(self, wid: str) -> None:
        w = self.workers[wid]
        for lid in [lid for lid, l in self.leases.items() if l.worker == wid]:
            self.leases.pop(lid)
        for key in sorted(self.replicas):
            r = self.replicas.get(key)
            if r is not None and r.owner == wid and r.epoch == w.epoch and r.state in LIVE:
                if r.state is S.ALLOCATED or key[2] != "disk":
                    self.end(key, S.LOST)
                    self.unpin(key)
        w.alive = False
        w.draining = False
        w.suspended_at = 0

    def readable(self, wid: str) -> tuple[str, ...]:
        return (f"gpu:{wid}", f"host:{wid}", "disk")

    def ready_at(self, wid: str, block: str, form: str) -> str | None:
        for loc in self.readable(wid):
            if self.state((block, form, loc)) is S.READY:
                return loc
        return None

    def prefix(self, wid: str, blocks: list[str]) -> tuple[int, list[tuple[str, str, str]]]:
        """Brute force: try every boundary from the longest down."""
        for p in range(len(blocks), 0, -1):
            pins: list[tuple[str, str, str]] = []
            for spec in CAT.forms:
                if spec.scope is FormScope.FULL_HISTORY:
                    idx = range(p)
                elif spec.scope is FormScope.WINDOW:
                    idx = range(max(0, p - WINDOW_BLOCKS[spec.name]), p)
                else:
                    idx = range(p - 1, p)
                for i in idx:
                    loc = self.ready_at(wid, blocks[i], spec.name)
                    if loc is None:
                        break
                    pins.append((blocks[i], spec.name, loc))
                else:
                    continue
                break
            else:
                return p, pins
        return 0, []


class CoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.seq: dict[tuple[str, int], int] = {}
        self.sent: list[Any] = []
        self.n_leases = 0
        self.requests: list[tuple[str, str, int, tuple[str, ...], str]] = []
        self.m = Model()
        #: The shell's soft liveness: when each (worker, epoch) was last heard from.
        self.seen: dict[tuple[str, int], int] = {}

    @initialize(slots=st.sampled_from([3, 5]), quota=st.sampled_from([0, 0, 8]))
    def setup(self, slots: int, quota: int) -> None:
        self.slots = slots
        self.quota = quota
        self.m.tomb_capacity = slots * len(CAT.forms)
        self.d = Driver(CoreParams(lease_ttl_ms=TTL, heartbeat_interval_ms=HB_INTERVAL, missed_heartbeats=MISSED,
                                   resume_grace_ms=GRACE, tenant_quota_replicas=quota))
        for wid in WORKERS:
            self.register(wid)

    # --- helpers -----------------------------------------------------------------------

    def next_seq(self, wid: str, epoch: int) -> int:
        k = (wid, epoch)
        self.seq[k] = self.seq.get(k, 0) + 1
        return self.seq[k]

    def send(self, t: Any, expect_applied: bool) -> None:
        before = {k: (r.state, r.pins, r.generation) for k, r in self.d.state.replicas.items()}
        out = self.d.run(ingest_transition, t, self.now)
        self.sent.append(t)
        assert len(out) == 1, out
        event(f"transition {'applied' if expect_applied else 'rejected'}")
        if expect_applied:
            assert isinstance(out[0], TransitionApplied), out[0]
        else:
            assert isinstance(out[0], TransitionRejected), (t, out[0])
            after = {k: (r.state, r.pins, r.generation) for k, r in self.d.state.replicas.items()}
            assert after == before

    def live_worker(self, wid: str) -> MWorker | None:
        w = self.m.workers.get(wid)
        return w if w is not None and w.alive else None

    # --- workers -----------------------------------------------------------------------

    @rule(wid=st.sampled_from(WORKERS))
    def register(self, wid: str) -> None:
        reply = self.d.run(register_worker, register(wid, slots=self.slots), self.now)
        w = self.m.workers.setdefault(wid, MWorker())
        assert reply.epoch == w.epoch + 1
        if w.alive:
            self.m.lose(wid)
        w.epoch, w.alive, w.last_hb, w.draining, w.suspended_at = reply.epoch, True, self.now, False, 0

    @rule(wid=st.sampled_from(WORKERS), stale=st.booleans())
    def heartbeat(self, wid: str, stale: bool) -> None:
        w = self.m.workers.get(wid)
        epoch = (w.epoch if w else 1) - (1 if stale else 0)
        if epoch < 1:
            return
        reply = self.d.run(heartbeat, hb(wid, epoch), self.now)
        if w is None:
            assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.NOT_FOUND
        elif stale or not w.alive:
            assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.FENCED
        elif w.suspended_at:
            assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.SUSPENDED
        else:
            assert reply.committed_seq == self.d.state.committed_seq(wid, w.epoch)
            self.seen[(wid, w.epoch)] = w.last_hb = self.now

    @rule(wid=st.sampled_from(WORKERS))
    def drain(self, wid: str) -> None:
        if wid not in self.m.workers:
            return
        self.d.run(drain_worker, wid, self.now)
        if self.m.workers[wid].alive:
            self.m.workers[wid].draining = True

    @rule(dt=st.sampled_from([10, 50, 150, 301]), beat=st.sampled_from([True, True, False]))
    def tick_and_expire(self, dt: int, beat: bool) -> None:
        """Time passes (live workers heartbeating on the way, usually), then expiry runs."""
        self.now += dt
        if beat:
            for wid, w in sorted(self.m.workers.items()):
                if w.alive and not w.suspended_at:
                    assert self.d.run(heartbeat, hb(wid, w.epoch), self.now).committed_seq >= 0
                    self.seen[(wid, w.epoch)] = w.last_hb = self.now
        timeout = MISSED * HB_INTERVAL
        lost = {wid for wid, w in self.m.workers.items()
                if w.alive and w.suspended_at and self.now - w.suspended_at > GRACE}
        suspended = {wid for wid, w in self.m.workers.items()
                     if w.alive and not w.suspended_at and self.now - max(w.last_hb, self.m.resumed) > timeout}
        expired = {lid for lid, l in self.m.leases.items() if l.worker not in lost and self.now >= (
            l.expires if l.granted >= self.m.resumed else max(l.expires, self.m.resumed + timeout))}
        events = self.d.run(expire, self.now, self.seen)
        assert {e.worker_id for e in events if isinstance(e, WorkerLost)} == lost
        assert {e.worker_id for e in events if isinstance(e, WorkerSuspended)} == suspended
        assert {e.lease_id for e in events if isinstance(e, LeaseExpired)} == expired
        # in the order the core decides them (sorted): it is the order replicas end in, hence of
        # the tombstones the state keeps
        for wid in sorted(lost):
            event("worker lost past the grace")
            self.m.lose(wid)
        for wid in suspended:
            event("worker suspended by timeout")
            self.m.workers[wid].suspended_at = self.now
        for lid in sorted(expired):
            self.m.end_lease(lid)

    @rule()
    def takeover(self) -> None:
        self.now += 1000
        self.d.run(resume, self.now)
        self.m.resumed = self.now
        for w in self.m.workers.values():
            if w.alive and not w.suspended_at:
                w.suspended_at = self.now

    @rule(wid=st.sampled_from(WORKERS), data=st.data(), dt=st.sampled_from([0, 10, 700]),
          damage=st.sampled_from(["none", "none", "lose", "regenerate", "corrupt", "forge"]))
    def resume_epoch(self, wid: str, data: st.DataObject, dt: int, damage: str) -> None:
        """The worker reaches a coordinator again with its inventory, maybe one that disagrees."""
        w = self.m.workers.get(wid)
        if w is None:
            return
        self.now += dt
        gpu, host, other = f"gpu:{wid}", f"host:{wid}", WORKERS[1 - WORKERS.index(wid)]
        mine = sorted(k for k, r in self.m.replicas.items() if r.owner == wid and r.epoch == w.epoch
                      and r.state in LIVE and k[2] in (gpu, host))
        ready = [k for k in mine if self.m.replicas[k].state is S.READY]
        truth = {k: held(*k, self.m.replicas[k].generation, self.m.replicas[k].checksum) for k in ready}
        items = dict(truth)
        if damage == "lose" and ready:
            items.pop(data.draw(st.sampled_from(ready)))
        elif damage == "regenerate" and ready:
            k = data.draw(st.sampled_from(ready))
            items[k] = held(*k, self.m.replicas[k].generation + 1, self.m.replicas[k].checksum)
        elif damage == "corrupt" and ready:
            k = data.draw(st.sampled_from(ready))
            items[k] = held(*k, self.m.replicas[k].generation, self.m.replicas[k].checksum + "x")
        elif damage == "forge":
            k = (data.draw(st.sampled_from(ALL_BLOCKS)), "swa", data.draw(st.sampled_from([gpu, f"gpu:{other}"])))
            if k not in mine:
                items[k] = held(*k)
        reply = self.d.run(resume_worker, resume_msg(wid, w.epoch, list(items.values()),
                                                     emitted_seq=self.seq.get((wid, w.epoch), 0),
                                                     pool_slots={f.name: self.slots for f in CAT.forms}), self.now)
        if not w.alive or (w.suspended_at and self.now - w.suspended_at > GRACE):
            assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.FENCED, reply
            if w.alive:
                event("resume past the grace: fenced")
                self.m.lose(wid)
            return
        assert isinstance(reply, ResumeReply), reply
        event(f"resumed ({damage})")
        bad = [k for k in ready if items.get(k) != truth[k]]
        for k in sorted(bad):
            self.m.end(k, S.INVALID)
            self.m.unpin(k)
        assert reply.kept == len(ready) - len(bad)
        assert sorted(split_digests(reply.drop)) == sorted(d for k, d in items.items() if d != truth.get(k))
        w.suspended_at = 0
        self.seen[(wid, w.epoch)] = w.last_hb = self.now

    # --- leases ------------------------------------------------------------------------

    @rule(wid=st.sampled_from(WORKERS), fam=st.sampled_from(sorted(FAMILIES)), n=st.integers(1, 6),
          forms=st.sampled_from([("compressed", "swa", "tail")] * 3 + [("compressed",), ("swa", "tail"), ()]),
          tenant=st.sampled_from(["t1", "t2"]), reuse=st.booleans())
    def acquire(self, wid: str, fam: str, n: int, forms: tuple[str, ...], tenant: str, reuse: bool) -> None:
        blocks = FAMILIES[fam][:n]
        self.requests.append((wid, fam, n, forms, tenant))
        w = self.m.workers.get(wid)
        epoch = w.epoch if w else 1
        self.n_leases += 1
        lid = f"L{self.n_leases}"
        reply = self.d.run(acquire_lease, acquire(wid, epoch, blocks, forms, tenant=tenant, reuse=reuse),
                           self.now, lid)
        if w is None or not w.alive:
            assert isinstance(reply, ErrorReply) and reply.code in (ErrorCode.NOT_FOUND, ErrorCode.FENCED)
            return
        if w.suspended_at:
            assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.SUSPENDED
            return
        usable, pins = self.m.prefix(wid, blocks) if reuse else (0, [])
        if isinstance(reply, ErrorReply):
            assert reply.code is ErrorCode.OVER_CAPACITY and forms and usable == 0, reply
            return
        assert isinstance(reply, LeaseGrant)
        event(f"grant: usable {'>0' if usable else '0'}, evict {'>0' if reply.evict else '0'}")
        assert reply.usable_blocks == usable
        assert [(r.block_hash, r.form, r.location) for r in reply.read] == pins
        gpu = f"gpu:{wid}"
        pinned_loc = {(k[0], k[1]): k[2] for k in pins}
        need = {form: idx for form in forms if (idx := [
            i for i in range(len(blocks)) if (i >= usable or pinned_loc.get((blocks[i], form), gpu) != gpu)
            and self.m.state((blocks[i], form, gpu)) not in LIVE])}
        # Victims: READY, unpinned, in this worker's pools, not blocks of this request, least recently
        # used first (ties by block hash).
        candidates = {k for k, r in self.m.replicas.items() if k[2] == gpu and r.state is S.READY
                      and self.m.pins(k) == 0 and k[0] not in blocks}
        lru = lambda k: (self.m.replicas[k].used, k[0])  # noqa: E731
        for v in reply.evict:
            key = (v.block_hash, v.form, v.location)
            r = self.m.replicas[key]
            assert key in candidates and v.form in forms and v.generation == r.generation
            spared = [k for k in candidates if k[1] == v.form and k not in
                      {(x.block_hash, x.form, x.location) for x in reply.evict}]
            assert all(lru(key) < lru(k) for k in spared), (key, spared)
        for v in reply.evict:
            self.m.end((v.block_hash, v.form, v.location), S.EVICTED)
        for key in pins:
            self.m.replicas[key].used = self.now
        # Writes: only blocks with no live GPU replica that the worker will compute or reload.
        writes: set[tuple[str, str, str]] = set()
        for form, idx in reply.write.items():
            assert form in forms and idx == sorted(idx)
            for i in idx:
                key = (blocks[i], form, gpu)
                assert self.m.state(key) not in LIVE
                assert i >= usable or pinned_loc.get((blocks[i], form), gpu) != gpu
                writes.add(key)
                self.m.create(key, MReplica(S.ALLOCATED, wid, w.epoch, lease=lid, tenant=tenant, used=self.now))
        self.m.leases[lid] = MLease(wid, w.epoch, tenant, set(pins), writes,
                                    self.now + min(30000, TTL), self.now)
        # Whole blocks in order: every needed form of each granted block, up to the first block that
        # does not fit — for lack of an evictable slot in some form's pool, or of tenant quota.
        blocks_needed = sorted(set().union(*need.values())) if need else []
        granted = sorted({i for idx in reply.write.values() for i in idx})
        assert granted == blocks_needed[:len(granted)]
        assert reply.write == {f: idx for f in forms if (idx := [i for i in granted if i in need.get(f, ())])}
        if len(granted) < len(blocks_needed):
            event("fewer writes than needed")
            first = blocks_needed[len(granted)]
            first_forms = [f for f in forms if first in need.get(f, ())]
            tenant_used = sum(1 for k, r in self.m.replicas.items()
                              if k[2].startswith("gpu:") and r.tenant == tenant and r.state in LIVE)
            same_tenant_victims = sum(1 for v in reply.evict if self.m.replicas[
                (v.block_hash, v.form, v.location)].tenant == tenant)
            def pool_exhausted(form: str) -> bool:
                pool = [k for k, r in self.m.replicas.items() if k[2] == gpu and k[1] == form and r.state in LIVE]
                evictable = [k for k in pool if self.m.replicas[k].state is S.READY and self.m.pins(k) == 0
                             and k[0] not in blocks]
                return len(pool) >= self.slots and not evictable
            assert (w.draining or any(pool_exhausted(f) for f in first_forms)
                    or (self.quota and tenant_used + same_tenant_victims + len(first_forms) > self.quota)), (
                first, need, reply)
        self.m.leases[lid].writes = writes

    @rule(wid=st.sampled_from(WORKERS), fam=st.sampled_from(["a", "b"]), n=st.integers(1, 6),
          tenant=st.sampled_from(["t1", "t1", "t2"]))
    def serve(self, wid: str, fam: str, n: int, tenant: str) -> None:
        """A whole request: acquire with reuse, fill every write, release."""
        self.acquire(wid, fam, n, ("compressed", "swa", "tail"), tenant, True)
        lid = f"L{self.n_leases}"
        if lid in self.m.leases:
            self._fill(lid)
            l = self.m.leases[lid]
            assert self.d.run(release_lease, release(l.worker, l.epoch, lid), self.now).lease_id == lid
            self.m.end_lease(lid)

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data(), more=st.integers(0, 2), other_worker=st.sampled_from([False, False, False, True]))
    def repeat_request(self, data: st.DataObject, more: int, other_worker: bool) -> None:
        """A request that extends an earlier one (the prefix-reuse case), maybe on the other worker."""
        wid, fam, n, forms, tenant = data.draw(st.sampled_from(self.requests))
        if other_worker:
            wid = WORKERS[1 - WORKERS.index(wid)]
        self.acquire(wid, fam, min(6, n + more), forms, tenant, True)

    def _pick_lease(self, data: st.DataObject) -> str | None:
        live = sorted(self.m.leases)
        return data.draw(st.sampled_from(live)) if live else None

    @precondition(lambda self: bool(self.m.leases))
    @rule(data=st.data(), wrong_epoch=st.booleans())
    def release(self, data: st.DataObject, wrong_epoch: bool) -> None:
        lid = self._pick_lease(data)
        if lid is None:
            return
        l = self.m.leases[lid]
        reply = self.d.run(release_lease, release(l.worker, l.epoch + (1 if wrong_epoch else 0), lid), self.now)
        if wrong_epoch:
            assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.FENCED
            return
        assert reply.lease_id == lid
        self.m.end_lease(lid)

    @precondition(lambda self: bool(self.m.leases))
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        lid = self._pick_lease(data)
        if lid is None:
            return
        l = self.m.leases[lid]
        reply = self.d.run(renew_lease, renew(l.worker, l.epoch, lid), self.now)
        if self.m.workers[l.worker].suspended_at:
            assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.SUSPENDED
        elif self.now >= (l.expires if l.granted >= self.m.resumed else max(l.expires, self.m.resumed + 300)):
            assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.NOT_FOUND
        else:
            assert reply.expires_at_ms == self.now + TTL
            l.expires = self.now + TTL

    # --- worker transitions ------------------------------------------------------------

    def _keys(self, states: tuple[S, ...]) -> list[tuple[str, str, str]]:
        return sorted(k for k, r in self.m.replicas.items() if r.state in states)

    @precondition(lambda self: any(r.state is S.ALLOCATED for r in self.m.replicas.values()))
    @rule(data=st.data(), checksum=st.sampled_from(["c1", "c2", ""]))
    def commit(self, data: st.DataObject, checksum: str) -> None:
        keys = self._keys((S.ALLOCATED,))
        if not keys:
            return
        key = data.draw(st.sampled_from(keys))
        r = self.m.replicas[key]
        w = self.m.workers[r.owner]
        gen = data.draw(st.integers(1, 3))
        t = transition(r.owner, r.epoch, self.next_seq(r.owner, r.epoch), key[0], key[1], S.ALLOCATED, S.READY,
                       location=key[2], generation=gen, checksum=checksum, tenant=r.tenant, lease_id=r.lease)
        ok = bool(checksum) and w.alive and w.epoch == r.epoch
        self.send(t, ok)
        if ok:
            r.state, r.generation, r.checksum, r.used = S.READY, gen, checksum, self.now

    @precondition(lambda self: any(l.writes for l in self.m.leases.values()))
    @rule(data=st.data())
    def fill_lease(self, data: st.DataObject) -> None:
        """The holder commits every write of one lease, in order (the common case)."""
        self._fill(data.draw(st.sampled_from(sorted(lid for lid, l in self.m.leases.items() if l.writes))))

    def _fill(self, lid: str) -> None:
        lease = self.m.leases[lid]
        for key in sorted(lease.writes):
            r = self.m.replicas.get(key)
            if r is None or r.state is not S.ALLOCATED or r.lease != lid:
                continue
            t = transition(r.owner, r.epoch, self.next_seq(r.owner, r.epoch), key[0], key[1], S.ALLOCATED,
                           S.READY, location=key[2], generation=2, checksum="c1", tenant=r.tenant, lease_id=lid)
            self.send(t, True)
            r.state, r.generation, r.checksum, r.used = S.READY, 2, "c1", self.now

    @precondition(lambda self: any(r.state is S.READY for r in self.m.replicas.values()))
    @rule(data=st.data(), stale=st.booleans(), to=st.sampled_from([S.EVICTED, S.INVALID]))
    def drop(self, data: st.DataObject, stale: bool, to: S) -> None:
        """A worker evicts or invalidates a READY replica (possibly with a stale generation)."""
        keys = [k for k in self._keys((S.READY,)) if not k[2].startswith("gpu:")
                or self.live_worker(k[2][4:]) is not None]
        if not keys:
            return
        key = data.draw(st.sampled_from(keys))
        r = self.m.replicas[key]
        wid = key[2][4:] if key[2].startswith("gpu:") else data.draw(st.sampled_from(WORKERS))
        w = self.live_worker(wid)
        if w is None:
            return
        gen = r.generation + (1 if stale else 0)
        t = transition(wid, w.epoch, self.next_seq(wid, w.epoch), key[0], key[1], S.READY, to, location=key[2],
                       generation=gen, tenant=r.tenant)
        ok = not stale and (to is S.INVALID or self.m.pins(key) == 0)
        if key[2].startswith("host:") and key[2] != f"host:{wid}":
            ok = False          # another worker's host tier: not this worker's to change
        if key[2] == "disk" and to is S.EVICTED and r.owner != wid:
            ok = False          # only a disk replica's writer evicts it (any reader may invalidate it)
        self.send(t, ok)
        if ok:
            self.m.unpin(key)
            self.m.end(key, to)

    @precondition(lambda self: any(r.state in (S.READY, S.EVICTED) for r in self.m.replicas.values()))
    @rule(data=st.data(), tier=st.sampled_from(["disk", "host"]), corrupt=st.booleans())
    def offload(self, data: st.DataObject, tier: str, corrupt: bool) -> None:
        # A source may be READY or already EVICTED (an LRU victim copied down before its slot
        # is reused); an EVICTED source that was never committed has no checksum to copy.
        keys = [k for k in self._keys((S.READY, S.EVICTED))
                if k[2].startswith("gpu:") and self.m.replicas[k].checksum]
        if not keys:
            return
        key = data.draw(st.sampled_from(keys))
        wid = key[2][4:]
        w = self.live_worker(wid)
        if w is None:
            return
        r = self.m.replicas[key]
        loc = "disk" if tier == "disk" else f"host:{wid}"
        dest = (key[0], key[1], loc)
        checksum = "bad" if corrupt else r.checksum
        t = transition(wid, w.epoch, self.next_seq(wid, w.epoch), key[0], key[1], None, S.READY, location=loc,
                       generation=r.generation, checksum=checksum, tenant=r.tenant)
        ok = not corrupt and self.m.state(dest) not in LIVE
        self.send(t, ok)
        if ok:
            self.m.create(dest, MReplica(S.READY, wid, w.epoch, generation=r.generation, checksum=checksum,
                                         tenant=r.tenant, used=self.now))

    @rule(data=st.data(), block=st.sampled_from(ALL_BLOCKS[:4] + FAMILIES["b"][:2]),
          form=st.sampled_from(["compressed", "swa", "tail"]),
          pair=st.sampled_from([(S.READY, S.ALLOCATED), (S.READY, S.LOST), (S.EVICTED, S.READY),
                                (S.INVALID, S.READY), (S.LOST, S.READY), (S.ALLOCATED, S.READY),
                                (S.READY, S.EVICTED), (None, S.EVICTED), (S.ALLOCATED, S.EVICTED)]))
    def illegal(self, data: st.DataObject, block: str, form: str, pair: tuple[S | None, S]) -> None:
        """Transitions that are wrong for the replica's current state (or name a state it is not in)."""
        wid = data.draw(st.sampled_from(WORKERS))
        w = self.m.workers.get(wid)
        epoch = w.epoch if w else 1
        key = (block, form, f"gpu:{wid}")
        cur = self.m.state(key)
        frm, to = pair
        if frm is cur and (frm, to) in ((S.ALLOCATED, S.READY), (S.READY, S.EVICTED), (S.ALLOCATED, S.EVICTED)):
            frm = S.INVALID if cur is not S.INVALID else S.EVICTED  # make it stale
        t = transition(wid, epoch, self.next_seq(wid, epoch), block, form, frm, to, location=key[2])
        self.send(t, expect_applied=False)

    @precondition(lambda self: bool(self.sent))
    @rule(data=st.data())
    def redeliver(self, data: st.DataObject) -> None:
        if not self.sent:
            return
        t = data.draw(st.sampled_from(self.sent))
        h0 = self.d.hash
        assert self.d.run(ingest_transition, t, self.now) == []
        assert self.d.hash == h0

    # --- operator ----------------------------------------------------------------------

    @rule(block=st.sampled_from(ALL_BLOCKS[:3]))
    def invalidate_block(self, block: str) -> None:
        (e,) = self.d.run(invalidate, "block", block, "test", self.now)
        expected = sorted(k for k, r in self.m.replicas.items() if k[0] == block and r.state in LIVE)
        # EVICTED ones are retired: no offload in flight may copy from them any more. The decision
        # names those it saw; ending the live ones first may push some out of their owner's
        # tombstone ring, and only those still remembered are retired (as the core folds it).
        retired = sorted(k for k, r in self.m.replicas.items() if k[0] == block and r.state is S.EVICTED)
        assert e.affected == expected
        assert e.retired == retired
        for k in expected:
            self.m.unpin(k)
            self.m.end(k, S.INVALID)
        for k in retired:
            r = self.m.replicas.get(k)
            if r is not None and r.state is S.EVICTED:
                self.m.end(k, S.INVALID)

    # --- after every step ----------------------------------------------------------------

    def teardown(self) -> None:
        if hasattr(self, "d"):
            n = len(self.d.log)
            event(f"log length {'<20' if n < 20 else '<100' if n < 100 else '>=100'}")

    @invariant()
    def agrees_with_the_model(self) -> None:
        if not hasattr(self, "d"):
            return
        s = self.d.state
        assert {k: r.state for k, r in s.replicas.items()} == {k: r.state for k, r in self.m.replicas.items()}
        assert {k: r.pins for k, r in s.replicas.items()} == {k: self.m.pins(k) for k in self.m.replicas}
        assert {k: r.last_used_ms for k, r in s.replicas.items() if r.state in LIVE} == {
            k: r.used for k, r in self.m.replicas.items() if r.state in LIVE}
        assert set(s.leases) == set(self.m.leases)
        for lid, l in s.leases.items():
            assert set(l.pins) == self.m.leases[lid].pins
        for wid, w in self.m.workers.items():
            cw = s.workers[wid]
            assert (cw.epoch, cw.alive, cw.draining, cw.suspended_at_ms) == (
                w.epoch, w.alive, w.draining, w.suspended_at)

    @invariant()
    def invariants_hold(self) -> None:
        if hasattr(self, "d"):
            assert check_invariants(self.d.state) == []

    @invariant()
    def replay_and_snapshot_rebuild_the_live_state(self) -> None:
        if not hasattr(self, "d"):
            return
        live = self.d.hash
        assert state_hash(replay(self.d.log, self.d.state.params)) == live
        assert state_hash(from_snapshot(to_snapshot(self.d.state))) == live


CoreMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVL_CORE_HYPOTHESIS_EXAMPLES", str(examples(150)))),
    stateful_step_count=int(os.environ.get("KVL_CORE_HYPOTHESIS_STEPS", "50")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    phases=[p for p in Phase if p is not Phase.shrink or not os.environ.get("KVL_CORE_NO_SHRINK")],
)
TestCore = CoreMachine.TestCase


class _Draws:
    """A ``data`` argument that hands out given values, for replaying a found sequence."""

    def __init__(self, *values: object) -> None:
        self.values = list(values)

    def draw(self, strategy: object, label: object = None) -> object:
        return self.values.pop(0)


def test_a_block_invalidation_whose_ends_push_evicted_replicas_out_of_the_ring(monkeypatch) -> None:
    """Found by the machine above in CI: the block's live replicas ending INVALID pushed some of
    its EVICTED ones out of their owner's tombstone ring. The decision names every EVICTED one it
    saw (``retired``); the fold retires those still remembered. The model had computed
    ``retired`` after ending the live ones, and expected fewer."""
    monkeypatch.setattr(sys.modules[__name__], "event", lambda *a, **k: None)   # outside Hypothesis
    m = CoreMachine()

    def step(rule: str, **kw: object) -> None:
        getattr(m, rule)(**kw)
        m.agrees_with_the_model()
        m.invariants_hold()
        m.replay_and_snapshot_rebuild_the_live_state()

    a0, a1, b0 = "aa" + "0" * 30, "aa" + "0" * 29 + "1", "bb" + "0" * 30
    step("setup", slots=3, quota=0)
    step("illegal", block=a0, data=_Draws("w1"), form="compressed", pair=(S.READY, S.ALLOCATED))
    step("drain", wid="w1")
    step("serve", fam="a", n=1, tenant="t1", wid="w1")
    step("serve", fam="a", n=3, tenant="t1", wid="w2")
    step("offload", corrupt=False, data=_Draws((a1, "compressed", "gpu:w2")), tier="disk")
    step("serve", fam="b", n=3, tenant="t1", wid="w2")
    step("drop", data=_Draws((b0, "compressed", "gpu:w2")), stale=False, to=S.EVICTED)
    step("drain", wid="w1")
    step("invalidate_block", block=a1)
    m.teardown()
