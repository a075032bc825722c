"""The worker's composition root: it builds the parts of a cache-serving worker and wires them.

:class:`Engine` owns

* the model and two single-thread executors (model compute; file I/O), so forwards run off
  the event loop and disk writes are sequential, and the model's stepper (``worker.stepper``);
* the static per-form pools (:class:`worker.cache.store.CacheStore`), allocated once in the
  constructor, and the host/disk tiers (:class:`worker.cache.tiers.Tiers`);
* the coordinator port (:class:`worker.client.CoordinatorClient`) and the transition
  publisher (:class:`worker.publisher.TransitionPublisher`);
* the worker's standing with the coordinator (:class:`worker.contact.Contact`: the epoch,
  degraded mode, accounted calls), the replica writer that emits every transition and moves
  bytes between tiers (:class:`worker.cache.replicas.ReplicaWriter`), and the supervisor that
  registers, heartbeats, resumes, spills and collects the disk tier
  (:class:`worker.supervisor.Supervisor`), which it starts and stops.

Requests run as :class:`worker.cache.manager.Session` objects (see there for the life of one).
An engine built without a client is *cache-disabled*: the same schedule of prefill units,
no cache at all — the reference a warm run is compared with, bit for bit.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from shared.config import Config
from shared.hashing import namespace_hash
from shared.images import PromptImage, check_placement
from shared.logging import get_logger
from shared.messages import Control, ControlAck
from shared.shards import ShardMap
from shared.tenants import salt_secret, tenant_salt
from worker.cache.planner import BlockMeta, Switches
from worker.cache.ports import CacheContext, CacheKnobs, CachePorts, ModelPort
from worker.cache.replicas import ReplicaWriter
from worker.cache.store import CacheStore, Reservation
from worker.cache.tiers import Tiers
from worker.client import CoordinatorClient
from worker.contact import Contact
from worker.generation import SamplingParams, generate
from worker.inflight import InFlightBlocks
from worker.metrics import WorkerMetrics
from worker.model import CausalLM, weights_digest
from worker.model.recycle import BufferRecycler
from worker.model.state import live_state_bytes
from worker.model.storage import stored_precisions
from worker.model.vision import PromptEmbeds, encode_images
from kernels.invariant import compute_fingerprint
from worker import failpoints
from worker.selfcheck import SelfCheck, self_check
from worker.publisher import TransitionPublisher
from worker.shard_links import ShardLink, ShardLinks
from worker.cache.manager import CacheValidationError, Result, Session
from worker.settings import size_pools, worker_id
from worker.startup_checks import check_memory, measure
from worker.runs import ModelExecutor
from worker.stepper import Stepper, largest_forward, resolve_lanes
from worker.supervisor import SPILL_BATCH, Supervisor

T = TypeVar("T")
#: How long stop() lets background work (deferred lease releases) finish before cancelling it.
STOP_GRACE_S = 1.0


@dataclass(frozen=True, slots=True)
class Health:
    worker_id: str
    cache_enabled: bool
    registered: bool
    degraded: bool
    reason: str
    epoch: int
    pools_allocated: bool
    pool_slots: dict[str, int] = field(default_factory=dict)
    pool_used: dict[str, int] = field(default_factory=dict)
    outbox_depth: int = 0
    draining: bool = False
    host_tier_bytes: int = 0
    disk_tier: str = "off"
    active_sessions: int = 0
    #: reachable | unreachable (no answer; the cache is kept) | suspended (resuming) | unregistered
    contact: str = "reachable"

    @property
    def ok(self) -> bool:
        """Serving correctly (degraded still serves, by recomputation)."""
        return self.pools_allocated or not self.cache_enabled


#: A contact's states, worst first (a sharded worker reports its worst shard's).
_STANDING = ("unregistered", "unreachable", "suspended", "reachable", "disabled")


class Engine:
    def __init__(self, model: CausalLM, cfg: Config, client: CoordinatorClient | None = None, *,
                 worker_id_: str | None = None, metrics: WorkerMetrics | None = None, endpoint: str = "",
                 shard_clients: Sequence[CoordinatorClient] = ()) -> None:
        """``client``: the coordinator's (shard 0's, where the ledger is sharded); ``shard_clients``:
        shards 1 … N-1's, one each (``coordinator.shards`` = N; ``worker.shard_links``)."""
        self.cfg = cfg
        self.model = model
        self.log = get_logger("kvl.worker")
        self.block_size = cfg.cache.block_size
        self.chunk_blocks = cfg.cache.chunk_blocks
        #: The storage precision of every form (``worker.model.storage``): this engine's, passed
        #: to every layout and state it makes (other engines may share the model).
        self.cache_dtype = cfg.cache.dtype
        if model.recycler is None and model.device.type == "cpu" and cfg.worker.kept_state_bytes:
            model.recycler = BufferRecycler(cfg.worker.kept_state_bytes)
        self.layouts = model.form_layouts(self.block_size, self.cache_dtype)
        self.catalogue = model.declare_forms(self.block_size, self.cache_dtype)
        self.specs = {n: lay.spec for n, lay in self.layouts.items()}
        self.spec_digests = {n: spec.spec_digest for n, spec in self.specs.items()}
        #: digest → storage precision, for this model's forms at every ``cache.dtype`` it can use
        #: (hit validation names the precision a refused replica was stored in).
        self.stored_as = stored_precisions(model, self.block_size)
        # A checkpoint directory's namespace is its files' digest (shared.manifest) and the
        # dtype it computes in; seeded weights hash their tensors (which covers the dtype). The
        # machine's compute fingerprint goes in too: other CPUs (or thread counts) compute other
        # bits, so their blocks must never be reused here. So does a digest of what this build's
        # model code computes here (below, after the invariance probe).
        self.fingerprint = compute_fingerprint(model.device)
        weights = f"{model.checkpoint_digest}:{model.dtype}" if model.checkpoint_digest else weights_digest(model)
        # A storage precision other than the family's own changes what requests compute (they
        # read their rows back as stored): its blocks must never meet another setting's.
        if self.cache_dtype != "auto":
            weights += f":cache={self.cache_dtype}"
        self.worker_id = worker_id_ or worker_id(cfg)
        self.gpu = f"gpu:{self.worker_id}"
        self.host_location = f"host:{self.worker_id}"
        self.device = model.device
        self.max_context = min(cfg.service.max_context_length, model.cfg.max_position_embeddings)
        self.metrics = metrics or WorkerMetrics()
        self.metrics.state_bytes.set_function(live_state_bytes)
        if (r := model.recycler) is not None:
            self.metrics.kept_state_bytes.set_function(lambda: r.kept_bytes)
            self.metrics.states_reused.set_function(lambda: r.reused)
            self.metrics.states_made.set_function(lambda: r.made)
        self.client = client
        self.cache_enabled = client is not None
        self.switches = Switches.from_config(cfg.cache.hit_validation, self.catalogue)
        #: What the start-up self-check found (``worker.selfcheck``; None before start).
        self.checked: SelfCheck | None = None
        #: speculate, settle_timeout_s, prefix_wait_s (``cache.prefix_wait_ms``): read at each use.
        self.knobs = CacheKnobs(prefix_wait_s=cfg.cache.prefix_wait_ms / 1000,
                                restore_in_place=cfg.cache.restore_in_place)
        #: Prompt blocks live requests will commit (``worker.inflight``).
        self.inflight = InFlightBlocks()
        #: The pools' size and what it holds (``worker.settings.size_pools``; None without a cache).
        self.sizing = size_pools(self.catalogue, cfg, self.device, self.max_context) if self.cache_enabled else None
        self.slots = dict(self.sizing.slots) if self.sizing is not None else {}
        if self.sizing is not None:
            (self.log.info if self.sizing.admitted else self.log.warning)(
                "pools_sized", **self.sizing.log_fields(self.catalogue.forms))
            self.metrics.pool_bytes.set(self.sizing.pool_bytes)
            self.metrics.pool_max_context_requests.set(self.sizing.admitted)
        if self.sizing is not None:   # before allocating: pools past free memory are refused, with the key
            for warning in check_memory(self.sizing.pool_bytes, self.sizing.how, cfg.cache.host_tier_bytes,
                                        measure(self.device)):
                self.log.warning("host_tier_exceeds_memory", fix=warning)
        # NOTE: static topology — the pools are allocated here, once, and never again.
        self.store = CacheStore(self.catalogue, self.slots, self.device) if self.cache_enabled else None
        if self.store is not None:
            self.metrics.pinned_slots.set_function(self.store.pinned_slots)
        self.tiers = Tiers(cfg.cache.host_tier_bytes if self.cache_enabled else 0,
                           cfg.cache.offload_dir if self.cache_enabled else None,
                           host_pins=lambda: self.replicas.host_pins(),
                           writer=self.worker_id, segment_bytes=cfg.cache.offload_segment_bytes,
                           retry_s=cfg.cache.tier_retry_ms / 1000)
        self.metrics.disk_skipped.set_function(lambda: self.tiers.disk_index_skipped)
        self.metrics.host_evictions_waiting.set_function(lambda: self.tiers.evictions_waiting)
        self.metrics.releasing.set_function(lambda: len(self.releasing))
        self.metrics.watch_gpu(str(self.device), self.store.pools.nbytes() if self.store is not None else 0)
        for form, n in self.slots.items():
            self.metrics.pool_slots.labels(form=form).set(n)
            self.metrics.pool_used.labels(form=form).set(0)
        self.publisher = (TransitionPublisher(client, capacity=cfg.worker.outbox_max,
                                              resend_ms=cfg.worker.outbox_resend_ms, metrics=self.metrics,
                                              batch=cfg.worker.publish_batch)
                          if client is not None else None)
        self._compute = ModelExecutor("kvl-model")
        failures = model.check_invariance(self.block_size, self.cache_dtype, reuse=True,
                                          max_rows=largest_forward(cfg.service.max_batch_tokens, self.block_size))
        if failures:
            self.log.error("batch-invariance probe failed: one request per forward, replies not cached",
                           failures=failures[:5])
        # After the probe: its row floor is part of the arithmetic (products pad to it).
        self.arithmetic = model.arithmetic_digest(self.block_size, self.cache_dtype, chunk_blocks=self.chunk_blocks)
        if not self.arithmetic:
            self.log.error("two identical forwards computed different bits: this process's cache namespace "
                           "is its own (no other worker, nor this one after a restart, reuses its blocks)")
        arithmetic = self.arithmetic or f"unrepeatable:{secrets.token_hex(16)}"
        self.namespace = namespace_hash(model.cfg.model_id, weights, compute=f"{self.fingerprint}|{arithmetic}")
        self.stepper = Stepper(model, self._compute, max_batch_tokens=cfg.service.max_batch_tokens,
                               block_size=self.block_size,
                               max_prompt_tokens_with_decodes=cfg.service.max_prompt_tokens_with_decodes,
                               prompt_cap_backlog_share=cfg.service.prompt_cap_backlog_share,
                               metrics=self.metrics,
                               check_every=cfg.service.fused_check_every,
                               on_mismatch=lambda reason: self.supervisor.fused_mismatch(reason),
                               lanes=resolve_lanes(cfg.service.model_lanes, str(self.device)),
                               lane_min_rows=cfg.service.lane_min_rows, runs=cfg.service.request_runs)
        self.metrics.model_lanes.set(self.stepper.lanes)
        self.metrics.batch_invariant.set(1 if self.stepper.fused else 0)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kvl-io")
        self._states = (ThreadPoolExecutor(1, thread_name_prefix="kvl-states")
                        if cfg.service.state_thread and self.device.type != "cuda" else self._compute)
        self._salts: dict[str, bytes] = {}
        self.sessions: set[Session] = set()
        self._background: set[asyncio.Task] = set()
        #: Closed sessions whose leases are released in the background (see Session.close).
        self.releasing: set[Session] = set()
        self._tasks: list[asyncio.Task] = []
        co = cfg.coordinator
        self.contact_state = Contact(client, self.publisher, self.metrics, self.log,
                                     heartbeat_interval_ms=co.heartbeat_interval_ms, lease_ttl_ms=co.lease_ttl_ms,
                                     resume_grace_ms=co.resume_grace_ms)
        #: Every shard's client, outbox and contact (one: the three above).
        self.links = self._shard_links(client, shard_clients) if client is not None else None
        if self.links is not None and self.links.sharded:     # each shard's contact sets it: report them all
            self.metrics.degraded.set_function(lambda: float(self.degraded))
        self.replicas = ReplicaWriter(
            contact=self.contact_state, client=client, publisher=self.publisher, store=self.store, tiers=self.tiers,
            metrics=self.metrics, log=self.log, worker_id=self.worker_id, block_size=self.block_size,
            model_id=model.cfg.model_id, slots=self.slots, offload_threshold=cfg.cache.offload_threshold,
            leases=lambda: (lease.grant for s in self.sessions | self.releasing for lease in s.leases),
            background=self.background, running=lambda: bool(self._tasks), links=self.links)
        self.supervisor = Supervisor(
            cfg=cfg, contact=self.contact_state, replicas=self.replicas, client=client, publisher=self.publisher,
            store=self.store, tiers=self.tiers, metrics=self.metrics, log=self.log, worker_id=self.worker_id,
            namespace=self.namespace, catalogue=self.catalogue, slots=self.slots, spec_digests=self.spec_digests,
            device=str(self.device), dtype=str(getattr(model, "dtype", "")).removeprefix("torch."),
            cache_dtype=self.cache_dtype, io=self.io, active_sessions=lambda: len(self.sessions), links=self.links)
        self.supervisor.endpoint = endpoint
        self.ports = CachePorts(
            ctx=CacheContext(cache_enabled=self.cache_enabled, namespace=self.namespace, block_size=self.block_size,
                             chunk_blocks=self.chunk_blocks, cache_dtype=self.cache_dtype,
                             max_context=self.max_context, catalogue=self.catalogue, layouts=self.layouts,
                             specs=self.specs, spec_digests=self.spec_digests, stored_as=self.stored_as,
                             switches=self.switches, on_invalid=cfg.cache.on_invalid, worker_id=self.worker_id,
                             gpu=self.gpu, host_location=self.host_location),
            knobs=self.knobs, runner=ModelPort(model, self.stepper, self.states, self.compute, self.io),
            contact=self.contact_state, leases=client, outbox=self.publisher, replicas=self.replicas,
            store=self.store, tiers=self.tiers, inflight=self.inflight, metrics=self.metrics, log=self.log,
            salt=self.salt, background=self.background, releasing=self.releasing,
            shards=self.links if self.links is not None and self.links.sharded else None)

    def _shard_links(self, client: CoordinatorClient, others: Sequence[CoordinatorClient]) -> ShardLinks:
        """Shard 0's link (the engine's client, outbox and contact), and one per other shard."""
        cfg, co = self.cfg, self.cfg.coordinator
        assert self.publisher is not None
        links = [ShardLink(0, client, self.publisher, self.contact_state)]
        for k, other in enumerate(others, 1):
            pub = TransitionPublisher(other, capacity=cfg.worker.outbox_max, resend_ms=cfg.worker.outbox_resend_ms,
                                      metrics=self.metrics, batch=cfg.worker.publish_batch)
            links.append(ShardLink(k, other, pub, Contact(
                other, pub, self.metrics, self.log, heartbeat_interval_ms=co.heartbeat_interval_ms,
                lease_ttl_ms=co.lease_ttl_ms, resume_grace_ms=co.resume_grace_ms)))
        shard_map = ShardMap.uniform(co.shards, co.shard_partitions) if others else None
        return ShardLinks(links, self.namespace, shard_map, held=self._held_blocks,
                          roots_limit=4 * sum(self.slots.values()))

    def _held_blocks(self) -> set[str]:
        """Blocks whose chains the worker must still know: held in a tier, or named by a live request."""
        held = self.replicas.held_blocks()
        for s in self.sessions | self.releasing:
            held.update(s.hashes)
        return held

    # --- life cycle -----------------------------------------------------------------------

    async def start(self, wait_s: float = 5.0) -> None:
        """Start the background tasks; wait up to ``wait_s`` for a first registration."""
        if not self.cache_enabled or self._tasks:
            return
        assert self.publisher is not None
        self.checked = await self.io(lambda: self_check(self))
        c = self.checked
        (self.log.info if c.offload in ("ok", "off") else self.log.error)(
            "self_check", offload=c.offload, pools_allocated=c.pools_allocated, pool_slots=c.pool_slots,
            namespace=c.namespace[:16], batch_invariant=c.batch_invariant, row_floor=c.row_floor, compute=c.compute,
            **({"failpoints": sorted(failpoints.active())} if failpoints.active() else {}))
        for link in self.links or ():
            link.publisher.start()
        self.supervisor.start()
        self._tasks = list(self.supervisor.tasks)
        if wait_s <= 0:
            return
        try:
            await asyncio.wait_for(self.supervisor.registered_once.wait(), wait_s)
        except asyncio.TimeoutError:
            self.log.warning("not registered yet; serving by recomputation", reason=self.contact_state.reason)

    def background(self, coro: Awaitable[None]) -> None:
        """Run ``coro`` (e.g. a deferred lease release) as a task the engine owns until stop()."""
        t = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    async def stop(self) -> None:
        if self._background:
            # the releases served requests left behind (Session.close(release_later=True)) take a
            # round trip each: let them finish rather than leave their leases to expire by TTL
            await asyncio.wait(list(self._background), timeout=STOP_GRACE_S)
        self.supervisor.take_tasks()
        tasks, self._tasks = self._tasks + list(self._background), []
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
        for link in self.links or ():
            await link.publisher.stop()
            await link.client.close()
        self._compute.shutdown(wait=True)
        if self._states is not self._compute:
            self._states.shutdown(wait=True)
        self.stepper.close()
        self._io.shutdown(wait=True)

    async def flush(self, timeout: float = 5.0) -> bool:
        """Wait until spills are written and every transition is committed (for tests/benchmarks)."""
        deadline = time.monotonic() + timeout
        while self.tiers.spill_depth and time.monotonic() < deadline:
            self.replicas.spill_due.set()
            await asyncio.sleep(0.01)
        if self.links is None:
            return True
        results = [await link.publisher.wait_empty(max(0.0, deadline - time.monotonic())) for link in self.links]
        return all(results)

    # --- executors ------------------------------------------------------------------------

    async def compute(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn)

    def states(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run ``fn`` — a request state's build and restore — where states are made, starting now.

        The model thread, or with ``service.state_thread`` on a CPU a thread of its own: a restore
        copies cached rows out of the pools into a state no forward reads yet, so it may run beside
        the forwards instead of between them (a c = 8 level of SmolLM2 spent ~9 % of the model
        thread's time in restores; what that trades: docs/BENCHMARKS.md, run O). Either way the
        slots it read are checked unchanged afterwards. On a GPU the model thread (its stream)."""
        return asyncio.get_running_loop().run_in_executor(self._states, fn)

    async def io(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn)

    async def prompt_logits(self, tokens: Sequence[int], images: Sequence[PromptImage] = ()) -> torch.Tensor:
        """The model's logits at every prompt position ``[len, vocab]`` (``echo`` + ``logprobs``),
        from a cold prefill of its own: positions served from cache have no logits, so they are
        recomputed here — on the grid a cold request's prefill follows, so row ``j`` holds the
        bits a cold run computes at position ``j`` (its images encoded as a request's are). No
        cache is read or written."""
        bs = self.block_size
        cap = -(-len(tokens) // bs) * bs
        if images:
            check_placement(images, tokens, getattr(self.model.cfg, "image_token_id", None))

        def work() -> torch.Tensor:
            with torch.inference_mode():
                vectors = encode_images(self.model, [im.pixels for im in images]) if images else []
                embeds = PromptEmbeds([(im.offset, v) for im, v in zip(images, vectors)]) if images else None
                state = self.model.new_state(bs, cap, cache_dtype=self.cache_dtype)
                return self.model.prefill(list(tokens), state, chunk_blocks=self.chunk_blocks, logits="all",
                                          embeds=embeds)

        return await self.compute(work)

    # --- state ----------------------------------------------------------------------------

    @property
    def resume_grid(self) -> int:
        return self.ports.resume_grid

    # Settings requests read at each use (``worker.cache.ports.CacheKnobs``).
    speculate = property(lambda self: self.knobs.speculate,
                         lambda self, v: setattr(self.knobs, "speculate", v))
    settle_timeout_s = property(lambda self: self.knobs.settle_timeout_s,
                                lambda self, v: setattr(self.knobs, "settle_timeout_s", v))
    prefix_wait_s = property(lambda self: self.knobs.prefix_wait_s,
                             lambda self, v: setattr(self.knobs, "prefix_wait_s", v))

    # The coordinator contact's state, as the engine's (``worker.contact``).
    epoch = property(lambda self: self.contact_state.epoch,
                     lambda self, v: setattr(self.contact_state, "epoch", v))
    registered = property(lambda self: self.contact_state.registered,
                          lambda self, v: setattr(self.contact_state, "registered", v))
    draining = property(lambda self: self.contact_state.draining,
                        lambda self, v: setattr(self.contact_state, "draining", v))
    lease_ttl_ms = property(lambda self: self.contact_state.lease_ttl_ms,
                            lambda self, v: setattr(self.contact_state, "lease_ttl_ms", v))
    # What the supervisor sends the coordinator: where gateways reach us, and our load.
    endpoint = property(lambda self: self.supervisor.endpoint,
                        lambda self, v: setattr(self.supervisor, "endpoint", v))
    load_probe = property(lambda self: self.supervisor.load_probe,
                          lambda self, v: setattr(self.supervisor, "load_probe", v))

    def _shard_contacts(self) -> list[tuple[int, Contact]]:
        """Every shard's contact where the ledger is sharded (else the one)."""
        if self.links is None or not self.links.sharded:
            return [(0, self.contact_state)]
        return [(link.shard, link.contact) for link in self.links]

    @property
    def degraded(self) -> bool:
        """Degraded with any shard: some requests are served by recomputation only."""
        return any(c.degraded for _, c in self._shard_contacts())

    @property
    def contact(self) -> str:
        """The worst standing of any shard's (one shard: the coordinator's)."""
        return min((c.state for _, c in self._shard_contacts()), key=_STANDING.index)

    @property
    def degraded_reason(self) -> str:
        sharded = self.links is not None and self.links.sharded
        return next((f"shard {k}: {c.reason}" if sharded else c.reason
                     for k, c in self._shard_contacts() if c.degraded), "")

    def salt(self, tenant: str) -> bytes:
        s = self._salts.get(tenant)
        if s is None:
            s = self._salts[tenant] = tenant_salt(salt_secret(self.cfg, tenant), tenant)
        return s

    def health(self) -> Health:
        usage = self.store.usage() if self.store is not None else {}
        disk = "off" if self.tiers.disk_root is None else ("up" if self.tiers.disk_available() else "down")
        return Health(worker_id=self.worker_id, cache_enabled=self.cache_enabled, registered=self.registered,
                      degraded=self.degraded, reason=self.degraded_reason,
                      epoch=self.epoch, pools_allocated=self.store is not None, pool_slots=dict(self.slots),
                      pool_used={f: u for f, (u, _) in usage.items()},
                      outbox_depth=self.publisher.depth if self.publisher else 0, draining=self.draining,
                      host_tier_bytes=self.tiers.host.used_bytes if self.tiers.host else 0, disk_tier=disk,
                      active_sessions=len(self.sessions), contact=self.contact)

    def pool_addresses(self) -> dict[str, int]:
        return self.store.addresses() if self.store is not None else {}

    async def call(self, op: str, coro: Awaitable[T]) -> T:
        """A coordinator round trip with latency and error accounting (:meth:`Contact.call`)."""
        return await self.contact_state.call(op, coro)

    async def on_control(self, msg: Control) -> ControlAck:
        return await self.supervisor.on_control(msg)

    # --- transitions (``worker.cache.replicas``) ------------------------------------------

    def commit(self, meta: BlockMeta, data: torch.Tensor | memoryview | Reservation, *, lease_id: str) -> int:
        return self.replicas.commit(meta, data, lease_id=lease_id)

    def pool_metrics(self) -> None:
        self.replicas.update_pool_metrics()

    # --- requests -------------------------------------------------------------------------

    def holds_block(self, block_hash: str) -> bool:
        """Whether this worker's pools hold a READY replica of ``block_hash`` in any form."""
        return self.replicas.holds_block(block_hash, self.catalogue.names)

    async def open(self, tokens: Sequence[int], *, tenant: str = "default", reuse: bool = True,
                   max_new_tokens: int = 1, images: Sequence[PromptImage] = ()) -> Session:
        """Lease, validate and restore for ``tokens`` (holding ``images``); the session is ready for
        :meth:`Session.prefill_step`."""
        s = Session(self.ports, tokens, tenant=tenant, reuse=reuse, max_new_tokens=max_new_tokens, images=images)
        self.sessions.add(s)
        try:
            await s.open()
        except BaseException:
            await self.close(s)
            raise
        return s

    async def close(self, s: Session, *, release_later: bool = False) -> None:
        try:
            await s.close(release_later=release_later)
        finally:
            self.sessions.discard(s)

    async def generate(self, tokens: Sequence[int], *, tenant: str = "default", max_tokens: int = 16,
                       reuse: bool = True, sampling: SamplingParams | None = None, return_logits: bool = True,
                       stop_token_ids: Sequence[int] = (), images: Sequence[PromptImage] = ()) -> Result:
        """Run one request to completion: prefill (resuming from validated cache), then decode —
        the serving scheduler's loop (:func:`worker.generation.generate`) without the queue."""
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        t0 = time.perf_counter()
        outcome = "error"
        s = await self.open(tokens, tenant=tenant, reuse=reuse, max_new_tokens=max_tokens, images=images)
        try:
            g = await generate(s, sampling or SamplingParams(), max_tokens=max_tokens,
                               stop_token_ids=frozenset(stop_token_ids), keep_logits=return_logits)
            outcome = "ok"
        finally:
            await self.close(s)
            self.metrics.requests.labels(outcome=outcome).inc()
        ttft = g.first_token_at - t0
        self.metrics.ttft.observe(ttft)
        return s.result(g.tokens, g.logits, ttft)


__all__ = ["SPILL_BATCH", "CacheValidationError", "Engine", "Health", "Result", "SamplingParams", "Session"]
