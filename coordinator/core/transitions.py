"""Judging a worker's replica transition (``ingest_transition``): the one command with no reply, kept apart."""

from __future__ import annotations

from coordinator.core import events as ev
from coordinator.core.lifecycle import (
    ALLOCATED, EVICTED, KIND_OF_PAIR, LIVE, READY, TRANSITIONS, WORKER_KINDS, IllegalTransition,
)
from coordinator.core.rejections import rejection_kind
from coordinator.core.replies import Events, readable_locations
from coordinator.core.state import LedgerState
from shared import messages as m

#: States a replica may be in to serve as the source of an offload copy.
OFFLOAD_SOURCES = (READY, EVICTED)


def _judge(state: LedgerState, t: m.TransitionEvent) -> tuple[str, str]:
    """``(kind, "")`` if the transition is legal now, else ``("", reason)``."""
    w = state.workers.get(t.worker_id)
    if w is None:
        return "", f"worker {t.worker_id} is not registered"
    if w.is_fenced(t.epoch):
        return "", f"epoch {t.epoch} of worker {t.worker_id} is fenced (latest epoch {w.epoch})"
    if t.epoch > w.epoch:
        return "", f"epoch {t.epoch} of worker {t.worker_id} was never registered (latest {w.epoch})"
    if t.namespace != w.namespace:
        return "", f"namespace {t.namespace} is not the worker's namespace {w.namespace}"
    # NOTE: a loop, not ``catalogue.names`` (a tuple built per call): this runs per transition.
    for spec in w.catalogue.forms:
        if spec.name == t.form:
            break
    else:
        return "", f"form {t.form!r} is not declared; declared: {list(w.catalogue.names)}"
    loc = t.location
    if loc.startswith("gpu:"):
        if loc != w.gpu:
            return "", f"worker {t.worker_id} cannot change replicas at {loc}"
    elif loc.startswith("host:"):
        # a host tier is the memory of its worker's process: no one else holds (or may drop) its bytes
        if loc != w.host:
            return "", f"worker {t.worker_id} cannot change replicas at {loc} (its host tier is {w.host})"
    elif loc != "disk":
        return "", f"location {loc!r}: expected gpu:<worker>, host:<node> or disk"
    kind = KIND_OF_PAIR.get((t.from_state, t.to_state))   # kind_of() and step() inlined: per transition
    if kind is None or kind not in WORKER_KINDS:
        frm = t.from_state.value if t.from_state else "absent"
        return "", f"a worker cannot move a replica from {frm} to {t.to_state.value}"
    key = (t.block_hash, t.form, loc)
    r = state.replicas.get(key)
    cur = r.state if r is not None else None
    if kind == "offload":
        if cur in LIVE:
            return "", f"replica {key} already exists ({cur})"
    elif cur != t.from_state:
        return "", f"stale: replica {key} is {cur.value if cur else 'absent'}, not {t.from_state}"
    moves = TRANSITIONS.get(cur)
    if moves is None or kind not in moves:
        return "", str(IllegalTransition(cur, kind, key))
    holder = r is not None and r.owner == t.worker_id and r.owner_epoch == t.epoch
    if kind in ("commit", "abort") or (kind == "invalidate" and cur is ALLOCATED):
        assert r is not None
        if not holder:
            return "", f"only the lease holder {r.owner}.{r.owner_epoch} may {kind} replica {key}"
        if t.lease_id and t.lease_id != r.lease_id:
            return "", f"replica {key} was allocated to lease {r.lease_id}, not {t.lease_id}"
        if kind == "commit":
            if not t.checksum:
                return "", f"commit of {key} carries no checksum"
            if t.tenant != r.tenant:
                return "", f"replica {key} belongs to tenant {r.tenant}, not {t.tenant}"
    elif kind in ("evict", "invalidate"):
        assert r is not None
        if t.generation != r.generation:
            return "", f"stale generation {t.generation} for {key} (current {r.generation})"
        if kind == "evict" and r.pins:
            return "", f"replica {key} is pinned by {r.pins} live lease(s); it cannot be evicted"
        if kind == "evict" and loc == "disk" and r.owner != t.worker_id:
            # (an invalidate stays open to every reader: whoever finds the bytes bad says so)
            return "", f"disk replica {key} was written by {r.owner}; only its writer may evict it"
    elif kind == "offload":
        if loc.startswith("gpu:"):
            return "", "an offload copies to host:<node> or disk; a GPU copy needs a write lease"
        if not t.checksum:
            return "", f"offload of {key} carries no checksum"
        # NOTE: a worker copies from where it can read: its GPU, its node's host tier, disk.
        # The source may already be EVICTED: a worker learns of an LRU eviction from the
        # grant that made it, and copies the victim to a lower tier before reusing the slot.
        # Bytes whose checksum equals the one committed are the committed bytes, and every
        # reload re-verifies that checksum, so an evicted source is as good as a READY one.
        for src_loc in readable_locations(w):
            src = state.replicas.get((t.block_hash, t.form, src_loc))
            if (src_loc != loc and src is not None and src.state in OFFLOAD_SOURCES and src.checksum
                    and src.checksum == t.checksum):
                break
        else:
            return "", (f"no READY or EVICTED replica of block {t.block_hash} form {t.form} with checksum "
                        f"{t.checksum} at {list(readable_locations(w))} to copy")
    return kind, ""


def ingest_transition(state: LedgerState, t: m.TransitionEvent, now_ms: int | None = None) -> Events:
    """Judge one worker transition: ``[TransitionApplied]``, ``[TransitionRejected]``, or ``[]``.

    ``[]`` means the source id (``worker.epoch.seq``) is already in the ledger — a redelivery,
    harmless. Never raises for bad input: a rejection is recorded with its reason, so the
    worker's outbox can drop it (the watermark covers it) and an operator can see why.
    ``now_ms`` defaults to the worker's ``ts_ms``.
    """
    wm = state.watermarks.get((t.worker_id, t.epoch))
    if wm is not None and wm.has(t.seq):
        return []
    at = t.ts_ms if now_ms is None else now_ms
    kind, reason = _judge(state, t)
    if kind:
        return [ev.TransitionApplied(transition=t, kind=kind, at_ms=at)]
    return [ev.TransitionRejected(transition=t, reason=reason, kind=rejection_kind(reason), at_ms=at)]
