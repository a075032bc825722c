"""The longest usable prefix: how much of a request can resume from cached state.

A boundary ``p`` (in blocks) is usable when *every* form of the model's catalogue is
usable there, each by its scope (see :mod:`shared.forms`):

* ``full_history`` — blocks ``0 .. p-1`` READY;
* ``window``       — the ``ceil(window_tokens / block_size)`` blocks before ``p`` READY
  (fewer near the start: ``max(0, p - wb) .. p-1``);
* ``resume_point`` — block ``p-1`` (the one ending at ``p``) READY.

"READY" means READY at one of the requesting worker's readable locations, tried in order
(own GPU first, then host, then disk); the first found is the one pinned.

The search goes downwards from the longest boundary, so a failure at the longest falls
back to a shorter boundary, never straight to nothing; the smallest reusable prefix is one
block. Cost is O(blocks × forms × locations) dictionary probes at most: full-history forms
are probed only until their first gap, which bounds every other form's probes, and window and
resume-point forms are probed downwards from that bound, each block once, only as deep as
the boundaries tried need.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from coordinator.core.lifecycle import READY
from coordinator.core.state import LedgerState, ReplicaKey
from shared.forms import FormCatalogue, FormScope


_UNSEEN = object()


@dataclass(frozen=True, slots=True)
class PrefixResult:
    #: Longest usable boundary in blocks (0 = nothing reusable).
    usable_blocks: int
    #: One READY replica per (block, form) the resume needs, in catalogue order.
    replicas_to_pin: list[ReplicaKey] = field(default_factory=list)
    #: Why each longer boundary was rejected, longest first.
    rejected: list[str] = field(default_factory=list)


def longest_usable_prefix(state: LedgerState, catalogue: FormCatalogue, block_hashes: Sequence[str],
                          readable_locations: Sequence[str], max_reasons: int = 16) -> PrefixResult:
    """The largest ``p ≤ len(block_hashes)`` at which every catalogue form is usable."""
    n = len(block_hashes)
    if n == 0:
        return PrefixResult(0)
    get = state.replicas.get
    locs = tuple(readable_locations)

    def find(h: str, form: str) -> ReplicaKey | None:
        for loc in locs:
            key = (h, form, loc)
            r = get(key)
            if r is not None and r.state is READY:
                return key
        return None

    # Full-history forms: probe each from block 0 to its first gap; the smallest gap bounds p.
    bound = n
    limit_reason = ""
    found: dict[str, list[ReplicaKey | None]] = {}
    for spec in catalogue.forms:
        if spec.scope is not FormScope.FULL_HISTORY:
            continue
        name = spec.name
        keys: list[ReplicaKey | None] = []
        # NOTE: find() inlined: this loop runs for every block of every lease request.
        for i in range(bound):
            h = block_hashes[i]
            for loc in locs:
                key = (h, name, loc)
                r = get(key)
                if r is not None and r.state is READY:
                    keys.append(key)
                    break
            else:
                break
        if len(keys) < bound:
            bound = len(keys)
            limit_reason = f"{spec.name} of block {bound} not READY"
        found[spec.name] = keys
    rejected: list[str] = []
    if bound < n:
        span = f"p={n}" if bound == n - 1 else f"p={bound + 1}..{n}"
        rejected.append(f"{span} blocks: {limit_reason}")

    # Window and resume-point forms: probed from the bound down, each block at most once, and only
    # as far as the boundaries tried reach (the blocks below a window are never probed: a long
    # prompt's resume costs its window here, not its length).
    checks: list[tuple[str, int, dict[int, ReplicaKey | None]]] = []
    for spec in catalogue.forms:
        if spec.scope is FormScope.FULL_HISTORY:
            continue
        wb = catalogue.window_blocks(spec) if spec.scope is FormScope.WINDOW else 1
        checks.append((spec.name, wb, {}))

    p = bound
    more = 0
    while p > 0:
        why = ""
        for name, wb, seen in checks:
            for i in range(p - 1, max(0, p - wb) - 1, -1):     # the highest missing block first
                k = seen.get(i, _UNSEEN)
                if k is _UNSEEN:
                    k = seen[i] = find(block_hashes[i], name)
                if k is None:
                    why = f"{name} of block {i} not READY"
                    break
            if why:
                break
        if not why:
            break
        if len(rejected) < max_reasons:
            rejected.append(f"p={p} blocks: {why}")
        else:
            more += 1
        p -= 1
    if more:
        rejected.append(f"... and {more} shorter boundaries rejected")
    if p == 0:
        return PrefixResult(0, [], rejected)

    pins: list[ReplicaKey] = []
    probed = {name: seen for name, _, seen in checks}      # every block of p's windows is in them
    for spec in catalogue.forms:
        keys: Mapping[int, ReplicaKey | None] | list[ReplicaKey | None]
        if spec.scope is FormScope.FULL_HISTORY:
            keys, lo = found[spec.name], 0
        elif spec.scope is FormScope.WINDOW:
            keys, lo = probed[spec.name], max(0, p - catalogue.window_blocks(spec))
        else:
            keys, lo = probed[spec.name], p - 1
        for i in range(lo, p):
            k = keys[i]
            assert k is not None, (spec.name, i, p)
            pins.append(k)
    return PrefixResult(p, pins, rejected)
