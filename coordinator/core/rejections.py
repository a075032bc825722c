"""Bounded amplification of refused transitions: one log row per worker epoch and kind of reason
per commit, with a count, never one row per copy.

A worker may publish transitions the ledger refuses (a stale generation after a race, a copy
whose source is gone) and a compromised worker may publish thousands of them in one message;
each refusal must still be durable (the commit watermark covers its seq, so the worker's outbox
drops it) but need not be a row of its own. :func:`coalesce_rejections` runs on a commit's
events after they were applied one by one: the rejections of one ``(worker, epoch, kind)`` become
the first of them, whose ``count`` says how many it stands for and whose ``more`` lists the
other seqs as inclusive ranges (``state.apply`` records every one of them). The live state and a
replay of the log therefore agree; what the log loses is the other transitions' fields and
exact reasons (the first is kept as the sample).

:func:`rejection_kind` maps a reason to one of a fixed set of kinds, so that the number of rows
per commit is bounded whatever the transitions carry (reasons name hashes, tenants, locations).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from coordinator.core.events import TransitionRejected
from shared.messages import ReplicaState

#: (needle in the reason, kind), first match wins; the reasons are ``transitions._judge``'s.
_KINDS = (
    ("is fenced", "fenced_epoch"),
    ("never registered", "unknown_epoch"),
    ("is not registered", "unknown_worker"),
    ("is not the worker's namespace", "namespace"),
    ("is not declared", "undeclared_form"),
    ("cannot change replicas at", "foreign_location"),
    ("expected gpu:<worker>", "bad_location"),
    ("cannot move a replica", "illegal_move"),
    ("already exists", "already_exists"),
    ("stale generation", "stale_generation"),
    ("stale:", "stale_state"),
    ("only the lease holder", "not_lease_holder"),
    ("was allocated to lease", "other_lease"),
    ("carries no checksum", "no_checksum"),
    ("belongs to tenant", "tenant"),
    ("is pinned by", "pinned"),
    ("only its writer may evict", "not_writer"),
    ("a GPU copy needs", "offload_to_gpu"),
    ("to copy", "no_offload_source"),
)
#: Every kind :func:`rejection_kind` can return.
KINDS = (*(k for _, k in _KINDS), "illegal_transition")


def rejection_kind(reason: str) -> str:
    """The kind of a rejection reason (one of :data:`KINDS`)."""
    for needle, kind in _KINDS:
        if needle in reason:
            return kind
    return "illegal_transition"


def strands_bytes(t: Any) -> bool:
    """Whether refusing transition ``t`` leaves the worker holding bytes the ledger does not list:
    a copy to its host tier, or a commit of a GPU slot it filled (the lease had ended first).
    The commit watermark names such seqs (``CommitWatermark.refused``) and the worker drops them."""
    return t.to_state is ReplicaState.READY and (
        t.from_state is None and t.location.startswith("host:")
        or t.from_state is ReplicaState.ALLOCATED and t.location.startswith("gpu:"))


def _ranges(seqs: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s in sorted(seqs):
        if out and s == out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def covered_seqs(e: TransitionRejected) -> list[int]:
    """Every seq a rejection row stands for: its transition's, then those of ``more``."""
    return [e.transition.seq, *(s for lo, hi in e.more for s in range(lo, hi + 1))]


def coalesce_rejections(events: Sequence[Any]) -> list[Any]:
    """``events`` with the rejections of each ``(worker, epoch, kind)`` folded into the first of
    them (see the module docstring); every other event, and the order, as they were."""
    groups: dict[tuple[str, int, str], list[int]] = {}
    first: dict[tuple[str, int, str], int] = {}
    out: list[Any] = []
    for e in events:
        if type(e) is TransitionRejected:
            t = e.transition
            key = (t.worker_id, t.epoch, e.kind or rejection_kind(e.reason))
            at = first.get(key)
            if at is not None:
                groups[key].extend(covered_seqs(e))
                continue
            first[key] = len(out)
            groups[key] = []
        out.append(e)
    for key, seqs in groups.items():
        if seqs:
            e = out[first[key]]
            more = _ranges([s for lo, hi in e.more for s in range(lo, hi + 1)] + seqs)
            out[first[key]] = msgspec.structs.replace(e, kind=key[2], count=e.count + len(seqs), more=more)
    return out
