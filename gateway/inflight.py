"""Prompts this gateway has in flight, per worker: blocks about to be cached there — pure.

The coordinator's route answer counts the blocks a worker holds READY. A burst of requests that
share a new prefix (a system prompt, a few-shot preamble) finds none anywhere, so routing by load
alone spreads it and every worker computes the prefix once. But the worker that got the first of
them is computing those blocks now, and a worker folds requests for blocks being computed into
the one computation (:mod:`worker.inflight`): the later requests wait for it, then read them.
So the router credits a worker with the leading blocks of the prompts in flight on it, as if
already cached (``gateway.route_inflight_prefixes``), weighed against its load as cached blocks are.

Block hashes chain (each commits to every token before it), so a prompt's leading blocks found
among a worker's in-flight hashes are a prefix that worker is computing or holds. Each gateway
sees only its own requests; what another gateway sends shows up once it is committed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence


class InFlightPrefixes:
    """worker id → the block hashes of the prompts in flight on it (a multiset: prompts overlap)."""

    __slots__ = ("_by_worker",)

    def __init__(self) -> None:
        self._by_worker: dict[str, Counter[str]] = {}

    def add(self, worker_id: str, hashes: Sequence[str]) -> None:
        if hashes:
            self._by_worker.setdefault(worker_id, Counter()).update(hashes)

    def remove(self, worker_id: str, hashes: Sequence[str]) -> None:
        """Undo one :meth:`add` of the same ``hashes`` (the request ended, or failed over)."""
        held = self._by_worker.get(worker_id)
        if held is None or not hashes:
            return
        held.subtract(hashes)
        for h in hashes:
            if held[h] <= 0:
                del held[h]
        if not held:
            del self._by_worker[worker_id]

    def leading_blocks(self, worker_id: str, hashes: Sequence[str]) -> int:
        """How many of ``hashes``, from the first, are in flight on ``worker_id``."""
        held = self._by_worker.get(worker_id)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def leading(self, hashes_by_worker: Mapping[str, Sequence[str]]) -> dict[str, int]:
        """:meth:`leading_blocks` of each worker's own hashes (workers of other models hash otherwise);
        workers with none left out."""
        out = {}
        for wid, hashes in hashes_by_worker.items():
            if (n := self.leading_blocks(wid, hashes)):
                out[wid] = n
        return out

    def blocks_held(self) -> int:
        """Distinct (worker, block hash) pairs held: a gauge that returns to 0 when the gateway is idle."""
        return sum(len(c) for c in self._by_worker.values())
