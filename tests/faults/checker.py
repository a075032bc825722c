"""The history checker of the fault drills, in the style of Jepsen's queue checker.

Pure functions over three records of one run, so that it can be tested on made-up histories
(``test_checker.py``) before it is trusted with a real one:

* **the log** — every event the coordinator appended, in position order, as
  ``GET /v1/events`` returns them (``position``, ``type``, ``source_id``, ``event``);
* **what the workers published** — every transition seen on ``<prefix>.events.>`` by a
  passive NATS subscriber (the observer), keyed by its source id ``worker.epoch.seq``;
* **what the workers saw acknowledged** — the highest commit watermark the coordinator
  announced on ``<prefix>.worker.<id>.watermark`` per (worker, epoch), seen by the same
  observer. A worker drops a transition from its outbox once the watermark covers it, so
  every seq at or below an announced watermark must be in the log.

The sets, as in ``jepsen.nats.queue``: *attempts* = published; *acknowledged* = covered by an
announced watermark; *logged* = transition source ids in the log. Then

* ``lost`` = acknowledged − logged (must be empty: the worker forgot them, the log never had them);
* ``duplicated`` = source ids logged more than once (must be empty);
* ``unexpected`` = logged transitions whose content differs from what was published under the
  same id, or that claim an epoch the log never registered (must be empty);
* ``unknown`` = published, never acknowledged, not logged (a worker killed with a full outbox:
  allowed); ``recovered`` = logged without an acknowledgement seen (allowed); ``unobserved`` =
  logged but never seen published (the observer was reconnecting: allowed, reported).

Beyond the queue, an independent fold of the replica life cycle as docs/architecture.md draws it checks
that every *applied* transition was legal when it was applied (state, holder epoch, generation,
offload source: a READY or EVICTED replica with the same committed checksum), counts the *rejected* ones by reason, and checks **fencing**: no lease pins a
replica that is not READY at the generation pinned, lies where the lease's worker cannot read,
or belongs to a GPU or host replica of a fenced epoch; no applied transition comes from a fenced
epoch; a worker's new epoch leaves no live GPU/host replica of an older one.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

LIVE = ("ALLOCATED", "READY")
#: What an offload may copy: committed bytes, still READY or evicted since (never INVALID or LOST).
OFFLOAD_SOURCES = ("READY", "EVICTED")
#: (from_state, to_state) → kind, as docs/architecture.md's replica life cycle draws it.
KIND = {(None, "ALLOCATED"): "grant", ("ALLOCATED", "READY"): "commit", ("ALLOCATED", "EVICTED"): "abort",
        ("ALLOCATED", "INVALID"): "invalidate", ("READY", "EVICTED"): "evict", ("READY", "INVALID"): "invalidate",
        ("ALLOCATED", "LOST"): "lose", ("READY", "LOST"): "lose", (None, "READY"): "offload"}
WORKER_KINDS = {"commit", "abort", "evict", "invalidate", "offload"}
#: Fields of a transition that must be the same in the log as on the wire.
COMPARED = ("worker_id", "epoch", "seq", "namespace", "tenant", "block_hash", "form", "location", "from_state",
            "to_state", "generation", "checksum", "lease_id")
MAX_LISTED = 20


@dataclass
class Observed:
    """What the passive NATS observer saw during the run."""

    #: source id → the transition (its JSON fields) as last published.
    published: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: source id → how many times it was published (re-sends after a missing watermark).
    publishes: Counter[str] = field(default_factory=Counter)
    #: (worker, epoch) → highest watermark announced.
    watermarks: dict[tuple[str, int], int] = field(default_factory=dict)

    def on_transition(self, t: dict[str, Any]) -> None:
        sid = f"{t['worker_id']}.{t['epoch']}.{t['seq']}"
        self.published[sid] = t
        self.publishes[sid] += 1

    def on_watermark(self, worker_id: str, epoch: int, seq: int) -> None:
        key = (worker_id, epoch)
        self.watermarks[key] = max(self.watermarks.get(key, 0), seq)


@dataclass
class Report:
    events: int = 0
    positions: tuple[int, int] = (0, 0)
    logged: int = 0
    applied: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    published: int = 0
    republished: int = 0
    acknowledged: int = 0
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    unknown: int = 0
    recovered: int = 0
    unobserved: int = 0
    illegal: list[str] = field(default_factory=list)
    fenced: list[str] = field(default_factory=list)
    gaps: list[str] = field(default_factory=list)
    registrations: int = 0
    losses: int = 0
    suspensions: int = 0
    resumes: int = 0
    grants: int = 0
    pins: int = 0
    types: Counter[str] = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.unexpected or self.illegal or self.fenced or self.gaps)

    def problems(self) -> dict[str, list[str]]:
        out = {k: v[:MAX_LISTED] for k, v in (("lost", self.lost), ("duplicated", self.duplicated),
                                                ("unexpected", self.unexpected), ("illegal", self.illegal),
                                                ("fenced", self.fenced), ("gaps", self.gaps)) if v}
        return out

    def summary(self) -> dict[str, Any]:
        return {"events": self.events, "transitions_logged": self.logged, "applied": self.applied,
                "rejected": sum(self.rejected.values()), "rejected_by_reason": dict(self.rejected.most_common()),
                "published": self.published, "republished": self.republished, "acknowledged": self.acknowledged,
                "lost": len(self.lost), "duplicated": len(self.duplicated), "unexpected": len(self.unexpected),
                "unknown": self.unknown, "recovered": self.recovered, "unobserved": self.unobserved,
                "illegal": len(self.illegal), "fenced_reuse": len(self.fenced), "gaps": len(self.gaps),
                "registrations": self.registrations, "workers_lost": self.losses, "suspensions": self.suspensions,
                "resumes": self.resumes, "grants": self.grants,
                "pins_checked": self.pins}


_REASONS = (
    ("is fenced", "transition from a fenced epoch"),
    ("never registered", "epoch never registered"),
    ("is not registered", "worker not registered"),
    ("stale generation", "stale generation"),
    ("stale:", "stale state (replica moved on)"),
    ("to copy", "offload without a READY or EVICTED source"),
    ("already exists", "offload target already live"),
    ("pinned", "evict of a pinned replica"),
    ("only the lease holder", "not the lease holder"),
    ("was allocated to lease", "another lease's replica"),
    ("cannot move a replica", "illegal state pair"),
    ("cannot ", "illegal move"),
    ("checksum", "no checksum"),
)


def reason_kind(reason: str) -> str:
    """A rejection reason without its hashes and numbers, in a few words."""
    for needle, kind in _REASONS:
        if needle in reason:
            return kind
    return re.sub(r"[0-9a-f]{16,}|\d+", "#", reason)[:60]


@dataclass
class _Replica:
    state: str
    owner: tuple[str, int]
    generation: int = 0
    checksum: str = ""
    #: The lease whose grant allocated it ("" for offload copies).
    lease: str = ""


@dataclass
class _Worker:
    epoch: int
    alive: bool
    node: str
    suspended: bool = False


def check(log: list[dict[str, Any]], observed: Observed) -> Report:
    """Check one run's log against what the workers published and saw acknowledged."""
    rep = Report(events=len(log), published=len(observed.published),
                 republished=sum(n - 1 for n in observed.publishes.values()))
    if log:
        rep.positions = (log[0]["position"], log[-1]["position"])
    expected_pos = log[0]["position"] if log else 1
    logged: Counter[str] = Counter()
    replicas: dict[tuple[str, str, str], _Replica] = {}
    workers: dict[str, _Worker] = {}
    registered: set[tuple[str, int]] = set()
    #: live lease → (holder, the replicas it pins, the replicas it may write)
    leases: dict[str, tuple[tuple[str, int], set[tuple[str, str, str]], list[tuple[str, str, str]]]] = {}

    def pinned(key: tuple[str, str, str]) -> bool:
        return any(key in pins for _, pins, _ in leases.values())

    def unpin(key: tuple[str, str, str]) -> None:
        for _, pins, _ in leases.values():
            pins.discard(key)

    def allocate(pos: int, key: tuple[str, str, str], lease_id: str, holder: tuple[str, int]) -> None:
        """A grant's write reservation (a ``replica.allocated`` event, or part of a grant)."""
        r = replicas.get(key)
        if r is not None and r.state in LIVE:
            note(rep.illegal, pos, f"grant of {key}, which is already {r.state}")
        if lease_id not in leases:
            note(rep.illegal, pos, f"grant of {key} for lease {lease_id}, which is not live")
        if fenced(holder):
            note(rep.fenced, pos, f"grant of {key} to fenced {holder}")
        replicas[key] = _Replica("ALLOCATED", holder, lease=lease_id)

    def evict(pos: int, key: tuple[str, str, str], why: str) -> None:
        """The coordinator's eviction (an LRU victim of a grant, an abort, an operator's)."""
        r = replicas.get(key)
        if r is None or r.state not in LIVE:
            note(rep.illegal, pos, f"eviction of {key}, which is {r.state if r else 'absent'}")
        elif r.state == "READY" and pinned(key):
            note(rep.illegal, pos, f"eviction ({why}) of {key}, which a live lease pins")
        else:
            r.state = "EVICTED"

    def fenced(owner: tuple[str, int]) -> bool:
        w = workers.get(owner[0])
        return w is None or w.epoch != owner[1] or not w.alive

    def note(kind: list[str], pos: int, text: str) -> None:
        kind.append(f"@{pos}: {text}")

    for row in log:
        pos = row["position"]
        if pos != expected_pos:
            note(rep.gaps, pos, f"position {pos} follows {expected_pos - 1}")
        expected_pos = pos + 1
        e = row["event"]
        typ = e["type"]
        rep.types[typ] += 1
        if typ == "worker.registered":
            rep.registrations += 1
            wid, epoch = e["worker_id"], e["epoch"]
            old = workers.get(wid)
            if old is not None and old.alive:
                note(rep.fenced, pos, f"{wid} epoch {epoch} registered while epoch {old.epoch} was not fenced")
            stale = [k for k, r in replicas.items() if r.owner[0] == wid and r.owner[1] < epoch
                     and r.state in LIVE and not k[2] == "disk"]
            if stale:
                note(rep.fenced, pos, f"{wid} epoch {epoch} registered with {len(stale)} live replicas of an "
                                      f"older epoch, e.g. {stale[0]}")
            workers[wid] = _Worker(epoch, True, e.get("node") or wid)
            registered.add((wid, epoch))
        elif typ == "worker.lost":
            rep.losses += 1
            w = workers.get(e["worker_id"])
            if w is None or w.epoch != e["epoch"]:
                note(rep.illegal, pos, f"loss of {e['worker_id']} epoch {e['epoch']}, not its live epoch")
            for lid in e.get("released", []):
                leases.pop(lid, None)
            for key in e.get("lost", []):
                r = replicas.get(tuple(key))
                if r is None or r.state not in LIVE:
                    note(rep.illegal, pos, f"loss of replica {key} that is {r.state if r else 'absent'}")
                else:
                    r.state = "LOST"
                    unpin(tuple(key))
            if w is not None:
                w.alive = False
                w.suspended = False
                left = [k for k, r in replicas.items() if r.owner == (e["worker_id"], e["epoch"])
                        and r.state in LIVE and k[2] != "disk"]
                if left:
                    note(rep.fenced, pos, f"{e['worker_id']} epoch {e['epoch']} lost but {len(left)} of its "
                                          f"GPU/host replicas stay live, e.g. {left[0]}")
        elif typ == "worker.suspended":
            rep.suspensions += 1
            w = workers.get(e["worker_id"])
            if w is None or w.epoch != e["epoch"] or not w.alive or w.suspended:
                note(rep.illegal, pos, f"suspension of {e['worker_id']} epoch {e['epoch']}, not its live, "
                                       "unsuspended epoch")
            else:
                w.suspended = True
        elif typ == "worker.resumed":
            rep.resumes += 1
            w = workers.get(e["worker_id"])
            if w is None or w.epoch != e["epoch"] or not w.alive:
                note(rep.fenced, pos, f"resume of {e['worker_id']} epoch {e['epoch']}, which is fenced")
                continue
            w.suspended = False
            for key in e.get("invalidated", []):
                r = replicas.get(tuple(key))
                if r is None or r.state != "READY" or r.owner != (e["worker_id"], e["epoch"]):
                    note(rep.illegal, pos, f"resume invalidates {key}, which is not a READY replica of that epoch")
                else:
                    r.state = "INVALID"
                    unpin(tuple(key))
        elif typ == "lease.granted":
            rep.grants += 1
            holder = (e["worker_id"], e["epoch"])
            if fenced(holder):
                note(rep.fenced, pos, f"lease {e['lease_id']} granted to fenced {holder}")
            elif workers[holder[0]].suspended:
                note(rep.fenced, pos, f"lease {e['lease_id']} granted to suspended {holder} before it resumed")
            gpu = f"gpu:{holder[0]}"
            for block_hash, form, _ in e.get("evicted", []):   # the grant's LRU victims, evicted first
                evict(pos, (block_hash, form, gpu), "lru")
            pins: set[tuple[str, str, str]] = set()
            hashes = e.get("block_hashes", [])
            writes = [(hashes[i], form, gpu) for form, idx in e.get("write", {}).items() for i in idx]
            leases[e["lease_id"]] = (holder, pins, writes)
            w = workers.get(holder[0])
            readable = {f"gpu:{holder[0]}", f"host:{w.node if w else holder[0]}", "disk"}
            for ref in e.get("read", []):
                rep.pins += 1
                key = (ref["block_hash"], ref["form"], ref["location"])
                r = replicas.get(key)
                if r is None or r.state != "READY":
                    note(rep.fenced, pos, f"lease {e['lease_id']} pins {key}, which is "
                                          f"{r.state if r else 'absent'}")
                    continue
                if ref["generation"] != r.generation:
                    note(rep.fenced, pos, f"lease {e['lease_id']} pins {key} at generation {ref['generation']}, "
                                          f"current {r.generation}")
                if key[2] not in readable:
                    note(rep.fenced, pos, f"lease {e['lease_id']} of {holder[0]} pins {key}, which it cannot read")
                if key[2] != "disk" and fenced(r.owner):
                    note(rep.fenced, pos, f"lease {e['lease_id']} pins {key} of fenced epoch {r.owner}")
                pins.add(key)
            if e.get("allocated"):
                for key in writes:
                    allocate(pos, key, e["lease_id"], holder)
        elif typ in ("lease.released", "lease.expired"):
            ended = leases.pop(e["lease_id"], None)
            # the lease's writes never committed are aborted by its end (written out as
            # replica.evicted events before the release in older logs)
            for key in ended[2] if ended is not None else ():
                r = replicas.get(key)
                if r is not None and r.state == "ALLOCATED" and r.lease == e["lease_id"]:
                    r.state = "EVICTED"
        elif typ == "replica.allocated":
            allocate(pos, (e["block_hash"], e["form"], e["location"]), e["lease_id"], (e["worker_id"], e["epoch"]))
        elif typ == "replica.evicted":
            evict(pos, (e["block_hash"], e["form"], e["location"]), e.get("reason", ""))
        elif typ == "invalidated":
            for key in e.get("affected", []):
                r = replicas.get(tuple(key))
                if r is None or r.state not in LIVE:
                    note(rep.illegal, pos, f"invalidation of {key}, which is {r.state if r else 'absent'}")
                else:
                    r.state = "INVALID"
                    unpin(tuple(key))
        elif typ in ("transition.applied", "transition.rejected"):
            t = e["transition"]
            sid = f"{t['worker_id']}.{t['epoch']}.{t['seq']}"
            if row.get("source_id") not in (None, sid):
                note(rep.illegal, pos, f"transition {sid} stored under source id {row.get('source_id')}")
            logged[sid] += 1
            rep.logged += 1
            if logged[sid] > 1:
                note(rep.duplicated, pos, sid)
            sent = observed.published.get(sid)
            if sent is not None:
                diff = [f for f in COMPARED if sent.get(f) != t.get(f)]
                if diff:
                    note(rep.unexpected, pos, f"{sid} logged with {diff} different from what was published")
            elif (t["worker_id"], t["epoch"]) not in registered and typ == "transition.applied":
                note(rep.unexpected, pos, f"{sid} applied for an epoch the log never registered")
            if typ == "transition.rejected":
                rep.rejected[reason_kind(e.get("reason", ""))] += int(e.get("count", 1))
                # one row may stand for several refusals of the epoch (coordinator.core.rejections)
                for lo, hi in e.get("more", []):
                    for seq in range(lo, hi + 1):
                        other = f"{t['worker_id']}.{t['epoch']}.{seq}"
                        logged[other] += 1
                        rep.logged += 1
                        if logged[other] > 1:
                            note(rep.duplicated, pos, other)
                continue
            rep.applied += 1
            problem = _judge(t, replicas, workers)
            key = (t["block_hash"], t["form"], t["location"])
            if not problem and t["from_state"] == "READY" and t["to_state"] == "EVICTED" and pinned(key):
                problem = f"eviction of {key}, which a live lease pins"
            if problem:
                note(rep.illegal, pos, f"{sid} applied: {problem}")
                continue
            _apply(t, replicas)
            if t["to_state"] in ("INVALID", "LOST"):
                unpin(key)

    rep.duplicated = sorted(set(rep.duplicated))
    acked: set[str] = set()
    for (wid, epoch), seq in observed.watermarks.items():
        acked.update(f"{wid}.{epoch}.{s}" for s in range(1, seq + 1))
    rep.acknowledged = len(acked)
    rep.lost = sorted(sid for sid in acked if sid not in logged)
    rep.unknown = sum(1 for sid in observed.published if sid not in acked and sid not in logged)
    rep.recovered = sum(1 for sid in logged if sid not in acked)
    rep.unobserved = sum(1 for sid in logged if sid not in observed.published)
    return rep


def _judge(t: dict[str, Any], replicas: dict[tuple[str, str, str], _Replica],
           workers: dict[str, _Worker]) -> str:
    """Why an applied transition was illegal when applied ('' if it was legal)."""
    wid, epoch = t["worker_id"], t["epoch"]
    w = workers.get(wid)
    if w is None or w.epoch != epoch or not w.alive:
        return f"from epoch {epoch} of {wid}, which is not live (live: {w.epoch if w and w.alive else None})"
    kind = KIND.get((t["from_state"], t["to_state"]))
    if kind not in WORKER_KINDS:
        return f"{t['from_state']} → {t['to_state']} is not a move a worker may make"
    key = (t["block_hash"], t["form"], t["location"])
    if key[2].startswith("gpu:") and key[2] != f"gpu:{wid}":
        return f"{wid} changed a replica on another GPU ({key[2]})"
    r = replicas.get(key)
    if kind == "offload":
        if key[2].startswith("gpu:"):
            return "an offload to a GPU"
        if r is not None and r.state in LIVE:
            return f"offload onto live {key}"
        # The source may already be EVICTED (a worker hears of an LRU eviction from the grant that
        # chose it, and copies the victim down a tier before reusing the slot): bytes with the
        # committed checksum are the committed bytes, and a reload verifies them again.
        readable = (f"gpu:{wid}", f"host:{w.node}", "disk")
        if not any((src := replicas.get((key[0], key[1], loc))) is not None and src.state in OFFLOAD_SOURCES
                   and src.checksum and src.checksum == t["checksum"] for loc in readable if loc != key[2]):
            return f"offload of {key} with no READY or EVICTED source of checksum {t['checksum']}"
        return ""
    if r is None or r.state != t["from_state"]:
        return f"{key} is {r.state if r else 'absent'}, not {t['from_state']}"
    if kind in ("commit", "abort") or (kind == "invalidate" and r.state == "ALLOCATED"):
        if r.owner != (wid, epoch):
            return f"{kind} of {key} held by {r.owner}"
        if kind == "commit" and not t["checksum"]:
            return "commit without a checksum"
    elif t["generation"] != r.generation:
        return f"{kind} of {key} at generation {t['generation']}, current {r.generation}"
    return ""


def _apply(t: dict[str, Any], replicas: dict[tuple[str, str, str], _Replica]) -> None:
    key = (t["block_hash"], t["form"], t["location"])
    if t["from_state"] is None:
        replicas[key] = _Replica("READY", (t["worker_id"], t["epoch"]), t["generation"], t["checksum"])
        return
    r = replicas[key]
    r.state = t["to_state"]
    if t["to_state"] == "READY":
        r.generation = t["generation"]
        r.checksum = t["checksum"]
