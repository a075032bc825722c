"""Route queries: which workers hold how much of a request's prefix, from the live state.

A gateway asks before it forwards a request. The answer is read from the state and decides
nothing: no event, no log append, no lease — a hint, checked again by the lease the chosen
worker takes (the replicas it finds may have moved on by then, and the lease sees that).
"""

from __future__ import annotations

from collections.abc import Container, Mapping

from coordinator.core.prefix import longest_usable_prefix
from coordinator.core.replies import readable_locations
from coordinator.core.state import LedgerState
from shared import messages as m


def route(state: LedgerState, query: m.RouteQuery, fresh: Container[str],
          load: Mapping[str, tuple[int, int]] | None = None) -> m.RouteReply:
    """Every live worker whose epoch heartbeats (``fresh``: worker ids seen recently), with the
    longest usable prefix of ``query.block_hashes`` on it (only workers of ``query.namespace``
    when it is set; every worker, without figures, when it is not), and its (running, queued)
    requests from ``load`` (its last heartbeat's figures)."""
    load = load or {}
    out = []
    for w in state.workers.values():
        if not w.alive or w.worker_id not in fresh:
            continue
        if query.namespace and w.namespace != query.namespace:
            continue
        usable = 0
        if query.namespace and query.block_hashes and not w.suspended and state.reuse_enabled(query.namespace):
            usable = longest_usable_prefix(state, w.catalogue, query.block_hashes, readable_locations(w),
                                           max_reasons=0).usable_blocks
        running, queued = load.get(w.worker_id, (0, 0))
        out.append(m.RouteCandidate(worker_id=w.worker_id, endpoint=w.endpoint, namespace=w.namespace,
                                    block_size=w.catalogue.block_size, usable_blocks=usable,
                                    draining=w.draining, suspended=w.suspended, running=running, queued=queued))
    return m.RouteReply(workers=out)
