"""Choosing a worker: the most prompt tokens served from cache, against load — pure.

Score of worker ``w`` = ``cached_tokens(w) − load_penalty_tokens × load(w)``, its load being
the larger of what this gateway has in flight on it and the running + queued requests of its
last heartbeat (what every gateway together sent it, up to a heartbeat old). Its cached tokens
are the larger of the usable prefix the coordinator reports and the prefix that prompts this
gateway has in flight on it are computing (:mod:`gateway.inflight`). Draining and
recently failed workers are not candidates; suspended ones only after every other. Ties (no
cache anywhere, equal load) go by rendezvous hashing on the request's affinity key (its first
block's hash: a conversation's turns share it), so a conversation keeps landing on one worker
while the fleet stays the same, and a new worker takes over only its share.

Gradual rollout (``gateway.version_weights``): a request whose best worker holds at least
``version_prefix_tokens`` of its prompt goes there whatever that worker's version (its cache is
the point of routing); any other request goes to a worker version drawn by the weights — among
the versions that have a usable worker, so a weight whose workers are all down or draining is
shared out among the rest — and, within that version, to the best worker by the same score. The
other workers stay in the failover order after them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Worker:
    worker_id: str
    endpoint: str
    namespace: str
    block_size: int
    draining: bool = False
    suspended: bool = False
    #: Running + queued requests of its last heartbeat (the coordinator's route answer).
    reported_load: int = 0
    #: What its ``GET /version`` answered (``worker.version``); "" until the gateway has asked.
    version: str = ""


@dataclass(frozen=True, slots=True)
class Choice:
    worker: Worker
    #: Prompt tokens this worker holds by the coordinator's answer, or is computing for a request
    #: in flight from this gateway, whichever is more (whole blocks).
    cached_tokens: int
    #: ``cache`` (the most cached tokens won), ``inflight`` (the same, the tokens being computed
    #: there for a request in flight), ``load`` (no cache anywhere; least loaded), ``affinity``
    #: (a tie broken by the conversation's key), ``version`` (no strong cache match: the worker
    #: version drawn by ``gateway.version_weights``).
    reason: str


def _rank(key: str, worker_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\0{worker_id}".encode(), digest_size=8).digest(), "big")


def choose(workers: Sequence[Worker], usable_blocks: Mapping[str, int], in_flight: Mapping[str, int], *,
           affinity: str, load_penalty_tokens: int, down: frozenset[str] = frozenset(),
           inflight_blocks: Mapping[str, int] | None = None, version_weights: Mapping[str, int] | None = None,
           version_prefix_tokens: int = 1, draw: float = 0.0) -> list[Choice]:
    """Every usable worker, best first (the rest are the failover order). ``in_flight``: what
    this gateway has running on each worker; ``inflight_blocks``: the prompt's leading blocks
    that its requests in flight on each worker are computing. Suspended workers (their epoch waits for the
    coordinator: they serve, without their cache) come last, only so that a control-plane
    outage that suspends the whole fleet is not an outage of the endpoint. ``version_weights``,
    ``version_prefix_tokens``: the rollout (module docstring); ``draw``: a number in [0, 1) that
    picks the version (uniformly random per request in the gateway)."""
    ok = [w for w in workers if not w.draining and not w.suspended and w.worker_id not in down]
    last = [w for w in workers if not w.draining and w.suspended and w.worker_id not in down]
    if not ok:
        if not last:
            return []
        ranked = sorted(last, key=lambda w: (-max(in_flight.get(w.worker_id, 0), w.reported_load),
                                             _rank(affinity, w.worker_id)), reverse=True)
        return [Choice(ranked[0], 0, "suspended")] + [Choice(w, 0, "failover") for w in ranked[1:]]

    pending = inflight_blocks or {}

    def cached(w: Worker) -> int:
        return max(usable_blocks.get(w.worker_id, 0), pending.get(w.worker_id, 0)) * w.block_size

    def load(w: Worker) -> int:
        return max(in_flight.get(w.worker_id, 0), w.reported_load)

    def score(w: Worker) -> tuple[int, int]:
        return (cached(w) - load_penalty_tokens * load(w), _rank(affinity, w.worker_id))

    ranked = sorted(ok, key=score, reverse=True)
    best = ranked[0]
    version = (pick_version(version_weights, {w.version for w in ok}, draw)
               if version_weights and cached(best) < version_prefix_tokens else None)
    if version is not None:
        ranked = [w for w in ranked if w.version == version] + [w for w in ranked if w.version != version]
        best = ranked[0]
        reason = "version"
    elif cached(best) > 0:
        reason = "inflight" if pending.get(best.worker_id, 0) > usable_blocks.get(best.worker_id, 0) else "cache"
    elif len({load(w) for w in ok}) > 1:
        reason = "load"
    else:
        reason = "affinity"
    return ([Choice(best, cached(best), reason)] + [Choice(w, cached(w), "failover") for w in ranked[1:]]
            + [Choice(w, 0, "failover") for w in last])


def pick_version(weights: Mapping[str, int], present: set[str], draw: float) -> str | None:
    """The version ``draw`` (in [0, 1)) falls on, each version present with a positive weight
    taking its share of [0, 1); None when none is present."""
    shares = sorted((v, n) for v, n in weights.items() if n > 0 and v in present)
    total = sum(n for _, n in shares)
    if not total:
        return None
    at = min(max(draw, 0.0), 1.0) * total
    for v, n in shares:
        if at < n:
            return v
        at -= n
    return shares[-1][0]
