"""Prompt blocks this worker's live requests are about to compute and commit, by block hash.

A burst of requests that share a prefix nobody has cached yet (an agent framework's system
prompt, the first turn of every conversation) would each compute it: their leases are decided
before any of them commits, so the coordinator gives the first the writes and the others a
miss. A request that opens while another request on this worker holds a claim on some of its
blocks waits (while the worker prefills; ``cache.prefix_wait_ms`` without progress at most) until those blocks are committed — their
commit transitions covered by the watermark, so the ledger lists them READY — and then leases:
it reads them like any cached block, validated and restored. The blocks are computed once.

Block hashes are chained and tenant-salted, so a claim is only ever seen by a request of the
same tenant and namespace with the same prefix. Nothing here decides what a request reads: its
lease and validation do, as for any hit, so exactness does not depend on it. A wait that runs
out (a stuck writer) costs only the time waited; the request then computes the blocks
itself, as it would have.

A claim is made before the claimant's lease (requests arriving together must see each other),
narrowed to the blocks its grant lets it write once the grant is known, resolved block by block
as their commits are covered, and dropped whole when the claimant closes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence


class InFlightBlocks:
    """Claims by block hash: who will commit it, and a future set once it is committed (True)
    or will not be (False). Single-threaded (the worker's event loop)."""

    def __init__(self) -> None:
        self._claims: dict[str, tuple[object, asyncio.Future[bool]]] = {}

    def __len__(self) -> int:
        return len(self._claims)

    def claimed(self, block_hash: str) -> bool:
        """Whether a request here will commit ``block_hash`` (the admission's estimate, ``worker.backlog``)."""
        return block_hash in self._claims

    def others(self, hashes: Sequence[str], owner: object) -> list[asyncio.Future[bool]]:
        """The claims of other owners on any of ``hashes`` (a resolved claim leaves the table)."""
        out = []
        for h in hashes:
            c = self._claims.get(h)
            if c is not None and c[0] is not owner:
                out.append(c[1])
        return out

    def claim(self, owner: object, hashes: Iterable[str]) -> int:
        """Claim every hash of ``hashes`` nobody claims; returns how many were claimed."""
        loop = asyncio.get_running_loop()
        n = 0
        for h in hashes:
            if h not in self._claims:
                self._claims[h] = (owner, loop.create_future())
                n += 1
        return n

    def keep(self, owner: object, hashes: Iterable[str]) -> None:
        """Narrow ``owner``'s claims to ``hashes`` (what its grant lets it write)."""
        keep = set(hashes)
        self._resolve([h for h, (o, _) in self._claims.items() if o is owner and h not in keep], owner, False)

    def committed(self, owner: object, hashes: Iterable[str]) -> None:
        """``owner``'s commits of ``hashes`` are durable: waiters may lease them now."""
        self._resolve(hashes, owner, True)

    def drop(self, owner: object) -> None:
        """Every claim ``owner`` still holds (it closed, or failed before committing)."""
        self._resolve([h for h, (o, _) in self._claims.items() if o is owner], owner, False)

    def _resolve(self, hashes: Iterable[str], owner: object, committed: bool) -> None:
        for h in list(hashes):
            c = self._claims.get(h)
            if c is not None and c[0] is owner:
                del self._claims[h]
                if not c[1].done():
                    c[1].set_result(committed)


async def wait_for(futures: Sequence[asyncio.Future[bool]], stall_s: float,
                   busy: Callable[[], bool] | None = None) -> str:
    """Wait for every one of ``futures`` (shared with other waiters: none is cancelled):
    ``committed`` (every block), ``abandoned`` (a claimant will not commit one: it closed, or
    its grant did not let it write the block) or ``timeout`` (``stall_s`` passed without the
    worker being ``busy`` computing prompts at any look; without ``busy``, ``stall_s`` in all).

    NOTE: a claimant is ahead of its waiters in the forwards' prompt order, so while the worker
    prefills the wait costs a waiter nothing it would not have waited anyway; a fixed bound
    (the first design) made waiters behind a backlog give up and compute the same blocks again."""
    if not futures:
        return "committed"
    loop = asyncio.get_running_loop()
    since = loop.time()
    pending: set = set(futures)
    while pending:
        left = stall_s - (loop.time() - since)
        if left <= 0:
            return "timeout"
        _, pending = await asyncio.wait(pending, timeout=min(left, STALL_POLL_S) if busy else left)
        if busy is not None and busy():
            since = loop.time()
    return "committed" if all(f.result() for f in futures) else "abandoned"


#: How often a waiter looks at the progress count (seconds).
STALL_POLL_S = 0.05


__all__ = ["InFlightBlocks", "wait_for"]
