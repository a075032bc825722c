"""What a request's cache manager (``worker.cache.manager``) is given: narrow ports, never the engine.

* :class:`CacheContext` — the cache's fixed context, the same for the worker's life: the
  namespace, the block size and prefill grid, the forms (catalogue, layouts, specs, their
  digests and storage precisions), the validation switches, this worker's locations.
* :class:`CacheKnobs` — the few settings a test or an operator may change while it runs.
* :class:`ModelPort` — the model, its stepper (fused forwards) and the two executors (the
  model thread, the file I/O thread).
* :class:`CachePorts` — the above, and the worker's parts a request uses: the lease client and
  the worker's standing with the coordinator (``worker.contact``), the replica writer and the
  outbox (``worker.cache.replicas``, ``worker.publisher``), the store and tiers, the prefix
  claims (``worker.inflight``), metrics and the log.

The engine builds one :class:`CachePorts` and hands it to every request. Where the ledger is
sharded (``worker.shard_links``), a request takes the ports of its chain's shard
(:meth:`CachePorts.for_chain`: that shard's lease client, standing and outbox) once it knows its
chain; unsharded, those are the engine's own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from shared.forms import FormCatalogue
from worker.cache.planner import Switches

if TYPE_CHECKING:
    from worker.cache.replicas import ReplicaWriter
    from worker.cache.store import CacheStore
    from worker.cache.tiers import Tiers
    from worker.client import CoordinatorClient
    from worker.contact import Contact
    from worker.inflight import InFlightBlocks
    from worker.metrics import WorkerMetrics
    from worker.model import CausalLM
    from worker.publisher import TransitionPublisher
    from worker.shard_links import ShardLinks
    from worker.stepper import Stepper

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CacheContext:
    """The cache's fixed context (see the module's docstring)."""

    cache_enabled: bool
    namespace: str
    block_size: int
    #: The prefill grid (``cache.chunk_blocks``) where the ops are not batch-invariant.
    chunk_blocks: int
    #: The storage precision of every form (``cache.dtype``).
    cache_dtype: str
    max_context: int
    catalogue: FormCatalogue
    layouts: dict[str, Any]
    specs: dict[str, Any]
    spec_digests: dict[str, str]
    #: digest → storage precision (hit validation names a refused replica's).
    stored_as: dict[str, str]
    switches: Switches
    #: ``cache.on_invalid``: "recompute" or "error".
    on_invalid: str
    worker_id: str
    gpu: str
    host_location: str


@dataclass(slots=True)
class CacheKnobs:
    """Settings read at each use (tests and operators may change them on a live engine)."""

    #: Validate and restore from the worker's own pools while the lease is in flight.
    speculate: bool = True
    #: How long a close waits for the commit watermark before releasing in the background.
    settle_timeout_s: float = 2.0
    #: How long a request waits without progress for blocks another request here computes.
    prefix_wait_s: float = 0.0
    #: When restored blocks are read where the pool holds them (``cache.restore_in_place``).
    restore_in_place: str = "auto"


@dataclass(frozen=True, slots=True)
class ModelPort:
    """The model, its stepper and the executors a request's work runs on."""

    model: CausalLM
    stepper: Stepper
    #: Builds and restores a request's state, started at once (a future): on the model thread, or
    #: on a CPU with ``service.state_thread`` on a thread of its own (``Engine.states``).
    states: Callable[[Callable[[], Any]], Awaitable[Any]]
    compute: Callable[[Callable[[], Any]], Awaitable[Any]]
    io: Callable[[Callable[[], Any]], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class CachePorts:
    """Everything a request's cache manager uses (see the module's docstring)."""

    ctx: CacheContext
    knobs: CacheKnobs
    runner: ModelPort
    #: The epoch, degraded mode and accounted coordinator calls.
    contact: Contact
    #: The lease client (acquire, renew, release).
    leases: CoordinatorClient | None
    #: The outbox: a request waits on its commit watermark (None without a coordinator).
    outbox: TransitionPublisher | None
    replicas: ReplicaWriter
    store: CacheStore | None
    tiers: Tiers
    inflight: InFlightBlocks
    metrics: WorkerMetrics
    log: Any
    #: tenant → its salt for block hashes (``shared.tenants``).
    salt: Callable[[str], bytes]
    #: Runs a coroutine as a task the engine owns until it stops (deferred releases).
    background: Callable[[Coroutine[Any, Any, None]], None]
    #: Closed requests whose leases are released in the background (their leases still pin).
    releasing: set
    #: Every shard's link where the ledger is sharded (None: one coordinator, the ports' own).
    shards: ShardLinks | None = None

    def for_chain(self, hashes: list[str]) -> CachePorts:
        """The ports a request on this chain uses: its shard's lease client, standing and outbox
        (these very ports unless the ledger is sharded)."""
        shards = self.shards
        if shards is None or not shards.sharded or not hashes:
            return self
        link = shards.for_chain(hashes)
        if link.contact is self.contact:
            return self
        return replace(self, contact=link.contact, leases=link.client, outbox=link.publisher)

    @property
    def resume_grid(self) -> int:
        """Blocks a resume point must be a multiple of: any block when the ops are batch-invariant
        (every prefill cut gives the same bits), else the ``cache.chunk_blocks`` grid."""
        return 1 if self.runner.stepper.fused else self.ctx.chunk_blocks

    def holds_block(self, block_hash: str) -> bool:
        """Whether this worker's pools hold a READY replica of ``block_hash`` in any form."""
        return self.replicas.holds_block(block_hash, self.ctx.catalogue.names)


__all__ = ["CacheContext", "CacheKnobs", "CachePorts", "ModelPort"]
