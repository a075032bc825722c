"""The worker's cache engine: the composition root of pools, tiers, leases and transitions.

:class:`Engine` owns

* the model and two single-thread executors (model compute; file I/O), so forwards run off
  the event loop and disk writes are sequential;
* the static per-form pools (:class:`worker.cache.store.CacheStore`), allocated once in the
  constructor, and the host/disk tiers (:class:`worker.cache.tiers.Tiers`);
* the coordinator port (:class:`worker.client.CoordinatorClient`) and the transition
  publisher (:class:`worker.publisher.TransitionPublisher`);
* a supervisor task: register (an epoch), heartbeat, and — whenever the coordinator or
  NATS is unreachable, the epoch is suspended or the outbox is full — *degraded mode*:
  every request is served by full recomputation (no leases, no reuse, no writes), while
  the cache is *kept*. When the coordinator answers again the worker carries on with the
  same epoch: at once if the ledger never suspended it, after a *resume* (its inventory,
  reconciled against the log) if it did. Only a fenced epoch, or an outage longer than the
  coordinator's resume grace period, makes it register a new epoch and drop its GPU and
  host copies (the coordinator has fenced them, or is about to);
* a spill task that moves host-tier victims to the shared offload directory.

Requests run as :class:`worker.session.Session` objects (see there for the life of one).
An engine built without a client is *cache-disabled*: the same schedule of prefill units,
no cache at all — the reference a warm run is compared with, bit for bit.

Every replica state change the engine decides is emitted here (:meth:`Engine.commit`,
:meth:`Engine.invalidate`, offloads and evictions), so the list of what a worker may tell
the ledger is one screen long.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from shared.config import Config
from shared.hashing import namespace_hash, replica_digests, split_digests
from shared.images import PromptImage, check_placement
from shared.logging import get_logger
from shared.messages import (
    MAX_DISK_GC_BLOCKS,
    MAX_HOST_EVICT_BLOCKS,
    CommitWatermark,
    Control,
    ControlAck,
    DiskBlock,
    DiskGc,
    ErrorCode,
    Heartbeat,
    HostEvict,
    InventoryItem,
    InventoryReply,
    InventoryRequest,
    LeaseGrant,
    RegisterReply,
    ReplicaRef,
    ReplicaState,
    ResumeReply,
    TransitionEvent,
    WorkerRegister,
    WorkerResume,
    now_ms,
)
from shared.tenants import salt_secret, tenant_salt
from worker.cache import offload_key as of
from worker.cache.planner import BlockMeta, Switches
from worker.cache.pools import PoolExhausted
from worker.cache.store import CacheStore, Reservation
from worker.cache.tiers import Tiers
from worker.client import CoordinatorClient, CoordinatorRefused, CoordinatorUnavailable
from worker.generation import SamplingParams, generate
from worker.inflight import InFlightBlocks
from worker.metrics import WorkerMetrics
from worker.model import CausalLM, weights_digest
from worker.model.storage import stored_precisions
from worker.model.vision import PromptEmbeds, encode_images
from kernels.invariant import compute_fingerprint
from worker import failpoints
from worker.selfcheck import SelfCheck, self_check
from worker.publisher import OutboxFull, TransitionPublisher
from worker.session import CacheValidationError, Result, Session
from worker.settings import size_pools, worker_id
from worker.startup_checks import check_memory, measure
from worker.stepper import Stepper, largest_forward, resolve_lanes

T = TypeVar("T")
R = ReplicaState
#: Blocks written to the disk tier per batch (one fsync each).
SPILL_BATCH = 256
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


class Engine:
    def __init__(self, model: CausalLM, cfg: Config, client: CoordinatorClient | None = None, *,
                 worker_id_: str | None = None, metrics: WorkerMetrics | None = None, endpoint: str = "") -> None:
        self.cfg = cfg
        self.model = model
        self.log = get_logger("kvl.worker")
        self.block_size = cfg.cache.block_size
        self.chunk_blocks = cfg.cache.chunk_blocks
        #: The storage precision of every form (``worker.model.storage``): this engine's, passed
        #: to every layout and state it makes (other engines may share the model).
        self.cache_dtype = cfg.cache.dtype
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
        self.client = client
        self.cache_enabled = client is not None
        self.switches = Switches.from_config(cfg.cache.hit_validation, self.catalogue)
        self.endpoint = endpoint
        #: (running, queued) requests of the scheduler serving this engine, sent with each
        #: heartbeat (gateways weigh load with it); the scheduler installs its own.
        self.load_probe: Callable[[], tuple[int, int]] = lambda: (0, 0)
        self.settle_timeout_s = 2.0
        #: GPU replicas (block, form, generation) the threshold copied down a tier already.
        self._backed: dict[tuple[str, str, int], None] = {}
        #: Copies to the host tier not yet settled by a watermark: seq → (block, form), the
        #: newest seq of each (block, form), and the epoch they belong to (see _on_watermark).
        self._offers: dict[int, tuple[str, str]] = {}
        self._offer_of: dict[tuple[str, str], int] = {}
        self._offers_epoch = 0
        #: What the start-up self-check found (``worker.selfcheck``; None before start).
        self.checked: SelfCheck | None = None
        #: Validate and restore from the worker's own pools while the lease is in flight.
        self.speculate = True
        #: Prompt blocks live requests will commit, and how long another waits for them
        #: (``worker.inflight``, ``cache.prefix_wait_ms``).
        self.inflight = InFlightBlocks()
        self.prefix_wait_s = cfg.cache.prefix_wait_ms / 1000
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
        self.tiers = Tiers(cfg.cache.host_tier_bytes if self.cache_enabled else 0,
                           cfg.cache.offload_dir if self.cache_enabled else None, host_pins=self._host_pins,
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
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="kvl-model")
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
                               metrics=self.metrics,
                               check_every=cfg.service.fused_check_every, on_mismatch=self._fused_mismatch,
                               lanes=resolve_lanes(cfg.service.model_lanes, str(self.device)),
                               lane_min_rows=cfg.service.lane_min_rows)
        self.metrics.model_lanes.set(self.stepper.lanes)
        self.metrics.batch_invariant.set(1 if self.stepper.fused else 0)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kvl-io")
        self._salts: dict[str, bytes] = {}
        self.epoch = 0
        self.registered = False
        self.draining = False
        self._reason = "not started" if self.cache_enabled else ""
        #: Degraded because the outbox is full (clears by itself once the watermark drains it).
        self._outbox_full = False
        #: A request-path call failed: degraded until a heartbeat says whether the coordinator is
        #: really unreachable or was only slow (then: carry on, same epoch).
        self._suspect = ""
        #: When (monotonic) the coordinator stopped answering (0 = it answers). The cache is kept.
        self._away_since = 0.0
        #: The ledger suspended our epoch: degraded until a resume reconciles our inventory.
        self._suspended = False
        #: A fused forward differed at run time: the next registration disowns what we computed.
        #: Kept on disk until then (``<state_dir>/disown-<worker id>``), so that a process that
        #: stops first (a crash, an operator's restart while the coordinator was away) still does.
        self._disown_marker = Path(cfg.state_dir) / f"disown-{self.worker_id}"
        self._disown = self._disown_marker.exists()
        #: Set while the coordinator answers for our epoch (requests told "suspended" wait on it).
        self._contact = asyncio.Event()
        self.heartbeat_interval_ms = cfg.coordinator.heartbeat_interval_ms
        self.lease_ttl_ms = cfg.coordinator.lease_ttl_ms
        self.resume_grace_ms = cfg.coordinator.resume_grace_ms
        self.sessions: set[Session] = set()
        self._background: set[asyncio.Task] = set()
        #: Closed sessions whose leases are released in the background (see Session.close).
        self.releasing: set[Session] = set()
        self._tasks: list[asyncio.Task] = []
        self._wake_supervisor = asyncio.Event()
        self._wake_spill = asyncio.Event()
        #: Forms whose full pool refused granted writes, and how many, while _make_room runs.
        self._making_room: dict[str, int] = {}
        self._registered_once = asyncio.Event()

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
        self.publisher.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._supervise(), name="kvl-supervisor"),
                       loop.create_task(self._spill_loop(), name="kvl-spill")]
        if wait_s <= 0:
            return
        try:
            await asyncio.wait_for(self._registered_once.wait(), wait_s)
        except asyncio.TimeoutError:
            self.log.warning("not registered yet; serving by recomputation", reason=self._reason)

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
        tasks, self._tasks = self._tasks + list(self._background), []
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
        if self.publisher is not None:
            await self.publisher.stop()
        if self.client is not None:
            await self.client.close()
        self._compute.shutdown(wait=True)
        self.stepper.close()
        self._io.shutdown(wait=True)

    async def flush(self, timeout: float = 5.0) -> bool:
        """Wait until spills are written and every transition is committed (for tests/benchmarks)."""
        deadline = time.monotonic() + timeout
        while self.tiers.spill_depth and time.monotonic() < deadline:
            self._wake_spill.set()
            await asyncio.sleep(0.01)
        if self.publisher is None:
            return True
        return await self.publisher.wait_empty(max(0.0, deadline - time.monotonic()))

    # --- executors ------------------------------------------------------------------------

    async def compute(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn)

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
        """Blocks a resume point must be a multiple of: any block when the ops are batch-invariant
        (every prefill cut gives the same bits), else the ``cache.chunk_blocks`` grid."""
        return 1 if self.stepper.fused else self.chunk_blocks

    @property
    def degraded(self) -> bool:
        return self.cache_enabled and (not self.registered or self._outbox_full or bool(self._suspect)
                                       or bool(self._away_since) or self._suspended)

    @property
    def contact(self) -> str:
        if not self.cache_enabled:
            return "disabled"
        if not self.registered:
            return "unregistered"
        if self._away_since or (self.client is not None and not self.client.connected):
            # NOTE: the bus itself says so at once: a disconnected client is unreachable before
            # any call has failed (readiness must not report "reachable" while NATS is down)
            return "unreachable"
        return "suspended" if self._suspended else "reachable"

    def salt(self, tenant: str) -> bytes:
        s = self._salts.get(tenant)
        if s is None:
            s = self._salts[tenant] = tenant_salt(salt_secret(self.cfg, tenant), tenant)
        return s

    def health(self) -> Health:
        usage = self.store.usage() if self.store is not None else {}
        disk = "off" if self.tiers.disk_root is None else ("up" if self.tiers.disk_available() else "down")
        return Health(worker_id=self.worker_id, cache_enabled=self.cache_enabled, registered=self.registered,
                      degraded=self.degraded, reason=self._reason if self.degraded else "", epoch=self.epoch,
                      pools_allocated=self.store is not None, pool_slots=dict(self.slots),
                      pool_used={f: u for f, (u, _) in usage.items()},
                      outbox_depth=self.publisher.depth if self.publisher else 0, draining=self.draining,
                      host_tier_bytes=self.tiers.host.used_bytes if self.tiers.host else 0, disk_tier=disk,
                      active_sessions=len(self.sessions), contact=self.contact)

    def pool_addresses(self) -> dict[str, int]:
        return self.store.addresses() if self.store is not None else {}

    def _degrade(self, reason: str, *, wake: bool = True) -> None:
        if not self.degraded:
            self.log.warning("degraded: serving by recomputation", reason=reason)
            self.metrics.degraded_entries.labels(reason=reason.split(":", 1)[0][:40]).inc()
        self._reason = reason
        self.metrics.degraded.set(1)
        if wake:
            self._wake_supervisor.set()

    def _fused_mismatch(self, reason: str) -> None:
        """A fused forward differed from a request alone (``worker.stepper``): the ops are not
        batch-invariant here after all. Fusing is already off; what this worker cached may hold
        fused bits, so the cache goes with the epoch (a new one is registered, its GPU and host
        copies dropped, the ledger ends the old epoch's replicas). Its offload copies on the shared
        disk outlive the epoch and other workers may reload them, so the registration also
        disowns every replica this worker created (``WorkerRegister.disown_replicas``)."""
        self.log.error("batch invariance failed at run time: one request per forward, cache dropped",
                       reason=reason[:300])
        self.metrics.batch_invariant.set(0)
        self._disown = True
        try:
            self._disown_marker.parent.mkdir(parents=True, exist_ok=True)
            self._disown_marker.write_text(f"{reason[:300]}\n")
        except OSError as e:
            self.log.warning("cannot keep the disown marker: a restart before registering would not disown",
                             path=str(self._disown_marker), error=str(e))
        if self.registered:
            self._registration_lost(f"batch invariance failed at run time: {reason}"[:300])

    def _lose_contact(self, reason: str) -> None:
        """No answer from the coordinator: recompute everything, keep the cache and the epoch."""
        # NOTE: wake the supervisor on losing contact, not on each failed retry: its own failed
        # heartbeat would cut its backoff short, and it would spin (a "no responders" answer is
        # instant) at full CPU, starving the model thread, for as long as the coordinator is away.
        self._degrade(reason, wake=not self._away_since)
        if not self._away_since:
            self._away_since = time.monotonic()

    def _suspend(self, reason: str) -> None:
        """The ledger suspended our epoch: resume (with our inventory) before reusing anything."""
        self._degrade(reason)
        self._suspended = True
        self._contact.clear()

    def _registration_lost(self, reason: str) -> None:
        """Our epoch is fenced (or unknown): register a new one; the cache goes with the old."""
        self._degrade(reason)
        self.registered = False

    def _suspect_contact(self, reason: str) -> None:
        if not self.degraded:
            self.log.warning("degraded: checking the coordinator", reason=reason)
            self.metrics.degraded_entries.labels(reason=reason.split(":", 1)[0][:40]).inc()
        self._suspect = reason
        self._reason = reason
        self.metrics.degraded.set(1)
        self._wake_supervisor.set()

    def _outbox_overflow(self) -> None:
        """The outbox is full: emit nothing new (never drop what it holds) until it drains."""
        if not self.degraded:
            self.log.warning("degraded: outbox full", depth=self.publisher.depth if self.publisher else 0)
            self.metrics.degraded_entries.labels(reason="outbox full").inc()
            self._reason = "outbox full: transitions await the commit watermark"
        self._outbox_full = True
        self.metrics.degraded.set(1)

    async def call(self, op: str, coro: Awaitable[T]) -> T:
        """A coordinator round trip with latency and error accounting."""
        t0 = time.perf_counter()
        try:
            out = await coro
        except CoordinatorUnavailable as e:
            self.metrics.lease_errors.labels(op=op, code="unavailable").inc()
            if op in ("register", "heartbeat", "resume"):
                self._lose_contact(f"coordinator unreachable: {e}")
            else:
                self._suspect_contact(f"coordinator unreachable: {e}")
            raise
        except CoordinatorRefused as e:
            self.metrics.lease_errors.labels(op=op, code=e.code.value).inc()
            if e.code is ErrorCode.SUSPENDED:
                self._suspend(f"epoch suspended: {e}")
            elif (e.code in (ErrorCode.FENCED, ErrorCode.NOT_FOUND) and op in ("acquire", "heartbeat", "resume")
                  or op == "resume" and e.code is ErrorCode.INVALID):
                self._registration_lost(f"registration lost: {e}")
            raise
        finally:
            self.metrics.lease_seconds.labels(op=op).observe(time.perf_counter() - t0)
        return out

    # --- supervisor -----------------------------------------------------------------------

    async def _supervise(self) -> None:
        backoff = 0.1
        while True:
            if self.registered and self._away_since and self._away_too_long():
                self._registration_lost(f"out of contact for more than the resume grace period "
                                        f"({self.resume_grace_ms} ms): the epoch is fenced by now")
            if not self.registered:
                ok = await self._register()
            elif self._suspended:
                ok = await self._resume()
            else:
                ok = True
            if not ok:
                await self._sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            if self.registered and not self._suspended:
                if self._away_since:
                    await self._sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
                    if self._away_too_long():
                        # NOTE: the grace may have passed while we slept: re-register (the loop's
                        # top) rather than race the coordinator's fence with a heartbeat.
                        continue
                elif not self._suspect:
                    backoff = 0.1
                    await self._sleep(self.heartbeat_interval_ms / 1000)
                await self._heartbeat()

    def _away_too_long(self) -> bool:
        # NOTE: the coordinator fences a silent epoch after the heartbeat timeout plus the grace;
        # past the grace alone a resume would race that decision, and losing it costs only the cache.
        return (time.monotonic() - self._away_since) * 1000 > self.resume_grace_ms

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._wake_supervisor.wait(), seconds)
        except asyncio.TimeoutError:
            pass
        self._wake_supervisor.clear()

    async def _settle_outbox(self, timeout_s: float = 1.0) -> None:
        assert self.publisher is not None
        if self.publisher.depth:
            await self.publisher.publish_due()
            await self.publisher.wait_empty(timeout=timeout_s)

    async def _register(self) -> bool:
        assert self.client is not None and self.publisher is not None and self.store is not None
        try:
            await self.client.connect()
            await self._settle_outbox()   # what the old epoch still owes the ledger, before fencing it
            reply = await self.call("register", self.client.register(WorkerRegister(
                worker_id=self.worker_id, namespace=self.namespace, catalogue=self.catalogue,
                pool_slots=dict(self.slots), endpoint=self.endpoint, disown_replicas=self._disown)))
            await self.client.listen(self.worker_id, self._on_watermark, self.on_inventory,
                                     self.on_control)
        except CoordinatorUnavailable as e:
            self._reason = self._reason or f"coordinator unreachable: {e}"
            self.metrics.degraded.set(1)
            return False
        except CoordinatorRefused as e:
            self._reason = f"registration refused: {e}"
            self.metrics.degraded.set(1)
            return False
        dropped_gpu = self.store.clear()
        dropped_host = self.tiers.host_clear()
        dropped_events = self.publisher.new_epoch(self.worker_id, reply.epoch)
        self.epoch = reply.epoch
        self._timing(reply)
        self.registered = True
        self._outbox_full = False
        self._in_contact()
        self.metrics.epoch.set(self.epoch)
        self._update_pool_metrics()
        self.log.info("registered", worker_id=self.worker_id, epoch=self.epoch, dropped_gpu=dropped_gpu,
                      dropped_host=dropped_host, dropped_events=dropped_events, disowned=reply.disowned)
        if self._disown:
            self._disown = False
            self.metrics.disowned_replicas.inc(reply.disowned)
            with contextlib.suppress(FileNotFoundError):
                self._disown_marker.unlink()
        self._registered_once.set()
        return True

    def _timing(self, reply: RegisterReply | ResumeReply) -> None:
        self.heartbeat_interval_ms = reply.heartbeat_interval_ms
        self.lease_ttl_ms = reply.lease_ttl_ms
        if reply.resume_grace_ms:
            self.resume_grace_ms = reply.resume_grace_ms

    async def wait_resumed(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until the coordinator answers for our epoch again; True if it does."""
        try:
            await asyncio.wait_for(self._contact.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return self.registered and not self._suspended

    def _in_contact(self) -> None:
        """The coordinator answers for our epoch: leave degraded mode (unless the outbox is full)."""
        self._suspect = ""
        self._suspended = False
        self._away_since = 0.0
        self._contact.set()
        if not self._outbox_full:
            self._reason = ""
            self.metrics.degraded.set(0)

    def inventory_digests(self) -> dict[bytes, tuple[str, str, str, int]]:
        """What this worker holds on its GPU and host tier, by :func:`replica_digest`:
        ``digest → (location, form, block_hash, generation)``."""
        rows: list[tuple[str, str, str, int, str]] = []
        if self.store is not None:
            rows.extend((m.block_hash, f, self.gpu, m.generation, m.checksum) for f, _, m in self.store.items())
        # host copies are offloaded as generation 0 (see _offload)
        rows.extend((m.block_hash, m.form, self.host_location, 0, m.checksum) for m in self.tiers.host_items())
        return {d: (loc, f, h, gen) for d, (h, f, loc, gen, _) in zip(replica_digests(rows), rows)}

    async def _resume(self) -> bool:
        """Keep our epoch and cache: settle the outbox, send our inventory, drop what the ledger disowns."""
        assert self.client is not None and self.publisher is not None and self.store is not None
        try:
            await self.client.connect()
            await self._settle_outbox()   # the coordinator reconciles once the log holds all we emitted
            held = self.inventory_digests()
            emitted = self.publisher.outbox.next_seq - 1 if self.publisher.outbox is not None else 0
            t0 = time.perf_counter()
            reply = await self.call("resume", self.client.resume(WorkerResume(
                worker_id=self.worker_id, epoch=self.epoch, namespace=self.namespace, catalogue=self.catalogue,
                pool_slots=dict(self.slots), endpoint=self.endpoint, emitted_seq=emitted, held=b"".join(held))))
            await self.client.listen(self.worker_id, self._on_watermark, self.on_inventory,
                                     self.on_control)
        except (CoordinatorUnavailable, CoordinatorRefused) as e:
            self.log.info("resume not accepted yet", epoch=self.epoch, reason=str(e)[:200])
            return False
        dropped = 0
        for d in split_digests(reply.drop):
            where = held.get(d)
            if where is None:
                continue
            loc, form, block_hash, generation = where
            if loc == self.gpu:
                dropped += self.store.drop(form, block_hash, generation) is not None
            else:
                dropped += self.tiers.host_drop(block_hash, form)
        self._update_pool_metrics()
        self._timing(reply)
        self.publisher.ack(self.epoch, reply.committed_seq)
        self._in_contact()
        self.metrics.resumes.inc()
        self.log.info("resumed", worker_id=self.worker_id, epoch=self.epoch, kept=reply.kept, dropped=dropped,
                      held=len(held), seconds=round(time.perf_counter() - t0, 3))
        return True

    async def _heartbeat(self) -> None:
        assert self.client is not None and self.publisher is not None and self.store is not None
        try:
            running, queued = self.load_probe()
            reply = await self.call("heartbeat", self.client.heartbeat(Heartbeat(
                worker_id=self.worker_id, epoch=self.epoch, ready=self.store.ready_counts(),
                running=running, queued=queued, cache=self.metrics.cache_counters(),
                device=str(self.device), dtype=str(getattr(self.model, "dtype", "")).removeprefix("torch."),
                cache_dtype=self.cache_dtype)))
        except (CoordinatorUnavailable, CoordinatorRefused):
            return
        self.publisher.ack(self.epoch, reply.committed_seq)
        if self._suspect or self._away_since:
            # NOTE: the coordinator answers for this epoch and never suspended it: it was slow or
            # briefly unreachable, not gone; our replicas are still its replicas.
            self.log.info("coordinator answers again; same epoch", epoch=self.epoch,
                          after=self._suspect or self._reason)
            self._in_contact()
        if self._outbox_full and self.publisher.depth <= self.publisher.capacity // 2:
            self._outbox_full = False
            self._reason = ""
            self.metrics.degraded.set(0)
            self.log.info("outbox drained; reuse resumes", epoch=self.epoch)

    # --- transitions ----------------------------------------------------------------------

    def _emit(self, meta: BlockMeta, location: str, frm: ReplicaState | None, to: ReplicaState, generation: int,
              *, kind: str, lease_id: str = "", reason: str = "", checksum: str | None = None) -> int:
        """Queue one transition for the ledger; returns its seq (0 if none could be queued)."""
        if not self.registered or self.publisher is None:
            return 0
        epoch, wid = self.epoch, self.worker_id

        def make(seq: int) -> TransitionEvent:
            return TransitionEvent(
                worker_id=wid, epoch=epoch, seq=seq, namespace=meta.namespace, tenant=meta.tenant,
                block_hash=meta.block_hash, parent_hash=meta.parent_hash, token_start=meta.token_start,
                token_end=meta.token_end, form=meta.form, location=location, from_state=frm, to_state=to,
                generation=generation, checksum=meta.checksum if checksum is None else checksum,
                lease_id=lease_id, reason=reason, block_size=self.block_size, model_name=self.model.cfg.model_id,
                ts_ms=now_ms())

        try:
            ev = self.publisher.emit(make)
        except OutboxFull:
            self._outbox_overflow()
            return 0
        self.metrics.count_transition(kind)
        return ev.seq

    def commit(self, meta: BlockMeta, data: torch.Tensor | memoryview | Reservation, *, lease_id: str) -> int:
        """Fill a granted GPU slot with ``data`` and commit it (ALLOCATED→READY); ``data`` may be
        a slot reserved earlier that already holds the bytes (a disk reload read into it), or a
        host-tier entry's memoryview."""
        assert self.store is not None
        if self.publisher is not None and self.publisher.full:
            # NOTE: no slot without its commit event: the ledger must hear of every READY slot.
            self._outbox_overflow()
            if isinstance(data, Reservation):
                self.store.release(data)
            return 0
        if isinstance(data, Reservation):
            full = self.store.install_reserved(meta, data)
            if full is None:
                # the slot was freed since (a new epoch, or the same block installed by another
                # request): what it holds now is not ours to commit
                return self._emit(meta, self.gpu, R.ALLOCATED, R.EVICTED, 0, kind="abort", lease_id=lease_id,
                                  reason="reserved slot lost")
            return self._emit(full, self.gpu, R.ALLOCATED, R.READY, full.generation, kind="commit", lease_id=lease_id)
        try:
            full = self._install(meta, data)
        except PoolExhausted as e:
            self.log.warning("no free slot for a granted write; aborting it", form=meta.form, error=str(e))
            return self._emit(meta, self.gpu, R.ALLOCATED, R.EVICTED, 0, kind="abort", lease_id=lease_id,
                              reason="pool exhausted")
        return self._emit(full, self.gpu, R.ALLOCATED, R.READY, full.generation, kind="commit", lease_id=lease_id)

    def _install(self, meta: BlockMeta, data: torch.Tensor | memoryview) -> BlockMeta:
        assert self.store is not None
        try:
            return self.store.install(meta, data)
        except PoolExhausted:
            # The ledger thought a slot was free: our view diverged (e.g. a commit the ledger
            # rejected left a slot it does not count). The write is aborted (commit's caller) and
            # the coordinator decides which of our coldest replicas go (_make_room): evicting one
            # here and reporting it after the fact could drop bytes a grant already in flight pins.
            self.metrics.pool_divergences.labels(form=meta.form).inc()
            if self.client is None:
                self._evict_local_lru(meta.form)      # no ledger to ask (an engine without a coordinator)
                return self.store.install(meta, data)
            self._want_room(meta.form, 1)
            raise

    def _want_room(self, form: str, n: int) -> None:
        """``n`` more slots of ``form`` wanted: one request at a time per form asks for all of them."""
        if not self._tasks:                           # stopped (a retry scheduled before stop() fires after it)
            return
        need = self._making_room.get(form)
        self._making_room[form] = (need or 0) + n
        if need is None:
            self.background(self._make_room(form))

    def _pins_at(self, location: str) -> list[ReplicaRef]:
        """The replicas at ``location`` that this worker's live leases pin (sessions releasing in
        the background still hold theirs)."""
        return [r for s in self.sessions | self.releasing for lease in s.leases
                for r in lease.grant.read if r.location == location]

    def _local_gpu_pins(self) -> set[str]:
        """Blocks whose GPU replicas live leases pin."""
        return {r.block_hash for r in self._pins_at(self.gpu)}

    def _evict_local_lru(self, form: str) -> None:
        assert self.store is not None
        victim = self.store.lru_victim(form, self._local_gpu_pins())
        if victim is None:
            return
        dropped = self.store.drop(victim.form, victim.block_hash, victim.generation)
        if dropped is not None:
            self._offload(*dropped)
            self._emit(victim, self.gpu, R.READY, R.EVICTED, victim.generation, kind="evict", reason="local lru")
        self._update_pool_metrics()

    async def _make_room(self, form: str) -> None:
        """Ask the coordinator to evict this form's coldest GPU replicas, one per write the full
        pool refused (``HostEvict``, tier ``gpu``), and drop the bytes of those it evicted or does
        not list as READY — the latter is how a slot the ledger does not count is found and freed.
        Pinned ones stay, and the next coldest are asked about in their place (a slot the ledger
        does not count may sit behind them)."""
        try:
            assert self.store is not None and self.client is not None
            keep = self._local_gpu_pins()
            need = min(self._making_room.get(form, 1), MAX_HOST_EVICT_BLOCKS)
            while need > 0:
                victims = self.store.coldest_metas(form, need, lambda m: m.block_hash not in keep)
                if not victims:
                    break
                try:
                    reply = await self.call("host_evict", self.client.host_evict(HostEvict(
                        worker_id=self.worker_id, epoch=max(1, self.epoch), tier="gpu",
                        blocks=[DiskBlock(block_hash=v.block_hash, form=v.form) for v in victims])))
                except (CoordinatorRefused, CoordinatorUnavailable) as e:
                    # asked again later (or by the next refused write): a lost answer may have evicted
                    # them in the ledger, and until the worker asks again it holds what the ledger does not list
                    self.metrics.pool_room.labels(outcome="deferred").inc(len(victims))
                    self.log.warning("no room made in a diverged GPU pool: the coordinator did not decide",
                                     form=form, error=type(e).__name__, retry_s=self.tiers.retry_s)
                    asyncio.get_running_loop().call_later(self.tiers.retry_s, self._want_room, form, need)
                    return
                pinned = {b.block_hash for b in reply.pinned}
                for v in victims:
                    if v.block_hash in pinned:
                        self.metrics.pool_room.labels(outcome="pinned").inc()
                        keep.add(v.block_hash)
                        continue
                    need -= 1
                    # (the ledger's decision holds for the replica it knew; a slot recycled since then
                    # holds another generation, which drop() leaves alone)
                    dropped = self.store.drop(v.form, v.block_hash, v.generation)
                    if dropped is not None:
                        self._offload(*dropped)
                        self.metrics.pool_room.labels(outcome="evicted").inc()
            self._update_pool_metrics()
        finally:
            self._making_room.pop(form, None)

    def invalidate(self, meta: BlockMeta, ref: ReplicaRef, *, damaged: bool, reason: str) -> int:
        """A replica failed validation: drop our copy, mark it INVALID in the ledger."""
        if ref.location == self.gpu and self.store is not None:
            self.store.drop(ref.form, ref.block_hash, ref.generation)
            self._update_pool_metrics()
        elif ref.location == self.host_location:
            self.tiers.host_drop(ref.block_hash, ref.form)
        elif ref.location == "disk" and damaged:
            self.tiers.disk_drop(meta)
        return self._emit(meta, ref.location, R.READY, R.INVALID, ref.generation, kind="invalidate",
                          reason=reason, checksum=ref.checksum)

    def apply_evictions(self, grant: LeaseGrant) -> None:
        """Drop the LRU victims a grant names (already EVICTED in the log), copying them down a tier first."""
        if self.store is None or not grant.evict:
            return
        for ref in grant.evict:
            if ref.location != self.gpu:
                continue
            dropped = self.store.drop(ref.form, ref.block_hash, ref.generation)
            if dropped is not None:
                self._offload(*dropped)
        self._update_pool_metrics()

    def _host_pins(self) -> set[tuple[str, str]]:
        """(block, form) of this worker's host-tier replicas that live leases pin (sessions
        releasing in the background still hold theirs): the host tier's LRU never drops them."""
        return {(r.block_hash, r.form) for r in self._pins_at(self.host_location)}

    def _offload(self, meta: BlockMeta, data: torch.Tensor) -> None:
        """Copy a block leaving the GPU to the host tier, or queue it for disk (no host tier, or
        one that cannot take it: too large, or full of replicas live leases pin). A block a lower
        tier already holds (the threshold copied it down: :meth:`_pre_offload`) is not copied again."""
        self._backed.pop((meta.block_hash, meta.form, meta.generation), None)
        if not self.tiers.holds(meta):
            self._offload_copy(meta, data)

    def _offload_copy(self, meta: BlockMeta, data: torch.Tensor) -> None:
        to_disk = self.tiers.disk_root is not None
        if self.tiers.host is not None:
            t0 = time.perf_counter()
            if self.tiers.put_host(meta, data):
                self.metrics.offload_seconds.labels(tier="host").observe(time.perf_counter() - t0)
                self.metrics.offloaded_bytes.labels(tier="host").inc(data.numel())
                seq = self._emit(meta, self.host_location, None, R.READY, 0, kind="offload")
                if seq:
                    self._host_offer(seq, (meta.block_hash, meta.form))
                to_disk = False
            else:
                reason = "too_large" if data.numel() > self.tiers.host.capacity_bytes else "pinned"
                self.metrics.offload_failures.labels(tier="host", reason=reason).inc()
        if to_disk:
            self.tiers.spill_direct(meta, data)
        if self.tiers.spill_depth:
            self._wake_spill.set()

    def _host_offer(self, seq: int, key: tuple[str, str]) -> None:
        """A copy to the host tier went out as transition ``seq``; kept until a watermark settles it."""
        if self._offers_epoch != self.epoch:
            self._offers.clear()
            self._offer_of.clear()
            self._offers_epoch = self.epoch
        self._offers[seq] = key
        self._offer_of[key] = seq

    def _on_watermark(self, wm: CommitWatermark) -> None:
        """The ledger's commit watermark: the outbox drops what it covers, and a copy to the host
        tier that the ledger refused goes too (its source was no longer known, or invalidated:
        the ledger does not list these bytes), unless the tier holds a later copy by now."""
        assert self.publisher is not None
        self.publisher.on_watermark(wm)
        if wm.epoch != self._offers_epoch:
            return
        offers, offer_of = self._offers, self._offer_of
        for seq in wm.refused:
            key = offers.pop(seq, None)
            if key is not None and offer_of.get(key) == seq:
                del offer_of[key]
                if self.tiers.host_drop(*key):
                    self.metrics.refused_copies.inc()
        while offers:                                  # settled (seqs increase): forget them
            seq = next(iter(offers))
            if seq > wm.seq:
                break
            key = offers.pop(seq)
            if offer_of.get(key) == seq:
                del offer_of[key]

    async def _spill_loop(self) -> None:
        while True:
            await self._wake_spill.wait()
            self._wake_spill.clear()
            try:
                await self._spill_once()
            except Exception as e:  # noqa: BLE001 - the task must survive a bad block
                self.log.error("spill failed", error=repr(e))

    def _pre_offload(self) -> None:
        """Above ``cache.offload_threshold`` of a form's slots, copy its coldest replicas down a
        tier now (the GPU copy stays READY), so the eviction that comes when the pool runs out
        loses nothing and copies nothing: the lower tier already holds them."""
        th = self.cfg.cache.offload_threshold
        if self.store is None or th >= 1.0 or (self.tiers.host is None and self.tiers.disk_root is None):
            return
        for form, (used, slots) in self.store.usage().items():
            over = used - int(th * slots)
            if over <= 0:
                continue
            def unbacked(meta: BlockMeta) -> bool:
                key = (meta.block_hash, meta.form, meta.generation)
                if key in self._backed:
                    return False
                self._backed[key] = None
                return not self.tiers.holds(meta)
            # NOTE: only the ones not yet below are copied out of the pool (this runs after commits)
            for meta, data in self.store.coldest(form, over, unbacked):
                self._offload_copy(meta, data)
                self.metrics.pre_offloaded.labels(form=form).inc()
        if len(self._backed) > sum(self.slots.values()):
            # forget backings of slots that left the pool some other way (invalidated, fenced):
            # rarely, once there are more of them than slots
            live = {(m.block_hash, f, m.generation) for f, _, m in self.store.items()}
            for key in [k for k in self._backed if k not in live]:
                del self._backed[key]

    async def _spill_once(self) -> None:
        """Write the spill queue to the disk tier in batches (one fsync each), then keep this
        worker's segments within ``cache.offload_dir_bytes``. A block that fails on its own (an
        unsafe key: anything but the tier being unavailable) is logged without content, counted
        in ``offload_failures{reason="error"}`` and dropped from the queue; the others go on."""
        queue = self.tiers.take_spills()
        for i in range(0, len(queue), SPILL_BATCH):
            await self._spill_batch(queue[i:i + SPILL_BATCH])
        if queue:
            await self._collect_disk()

    async def _spill_batch(self, batch: list[tuple[BlockMeta, torch.Tensor, bool]]) -> None:
        good: list[tuple[BlockMeta, torch.Tensor, bool]] = []
        victims: list[BlockMeta] = []   # host-tier victims: their eviction is the coordinator's to decide
        for meta, data, from_host in batch:
            if not self.tiers.needs_disk(meta):
                victims.append(meta)   # written by an earlier pass; still waiting for its eviction
                continue
            try:
                of.BlockKey(meta.namespace, meta.tenant, meta.block_hash, meta.form, meta.spec_digest)
                good.append((meta, data, from_host))
            except ValueError as e:
                self.metrics.offload_failures.labels(tier="disk", reason="error").inc()
                self.log.error("spill_item_failed", block=meta.block_hash[:12], form=meta.form, error=type(e).__name__)
                self._spill_done(meta, from_host, written=False)
                if from_host:
                    victims.append(meta)
        digests: list[str] = []
        if good and self.tiers.disk_available():
            t0 = time.perf_counter()
            try:
                digests = await self.io(lambda: self.tiers.disk_write_many([(m, d) for m, d, _ in good]))
            except of.OffloadUnavailable as e:
                self.tiers.mark_disk_down(str(e))
                self.metrics.offload_failures.labels(tier="disk", reason="unavailable").inc()
                self.metrics.tier_unavailable.labels(tier="disk").inc()
                self.log.warning("disk tier unavailable; serving without it", error=str(e),
                                 retry_s=self.tiers.retry_s)
            else:
                self.metrics.offload_seconds.labels(tier="disk").observe(time.perf_counter() - t0)
                self.metrics.offloaded_bytes.labels(tier="disk").inc(sum(d.numel() for _, d, _ in good))
        elif good and self.tiers.disk_root is not None:
            self.metrics.tier_unavailable.labels(tier="disk").inc()
        for j, (meta, _, from_host) in enumerate(good):
            written = j < len(digests) and digests[j] == meta.checksum
            if j < len(digests) and not written:
                self.metrics.offload_failures.labels(tier="disk", reason="checksum").inc()
            try:
                self._spill_done(meta, from_host, written=written)
            except Exception as e:  # noqa: BLE001 - one bad block must not stop the writer for good
                self.metrics.offload_failures.labels(tier="disk", reason="error").inc()
                self.log.error("spill_item_failed", block=meta.block_hash[:12], form=meta.form,
                               error=type(e).__name__)
            if from_host:
                victims.append(meta)
        if victims:
            await self._evict_host(victims)

    def _spill_done(self, meta: BlockMeta, from_host: bool, *, written: bool) -> None:
        """One queued block's disk copy handled: its disk replica is READY if written. A
        host-tier victim stays queued (and readable) until :meth:`_evict_host` settles it."""
        if not self.tiers.is_spilling(meta):
            return  # put back into the host tier meanwhile: it stays there
        if written:
            self._emit(meta, "disk", None, R.READY, 0, kind="offload")
        if from_host:
            self.tiers.disk_done(meta)
        else:
            self.tiers.spilled(meta)

    async def _evict_host(self, victims: list[BlockMeta]) -> None:
        """Drop host-tier LRU victims' bytes once the coordinator has evicted their replicas
        (``HostEvict``); a victim a live lease pins stays a host replica.

        NOTE: the coordinator decides, in the ledger's order, as it does a grant's GPU victims.
        Dropping first and reporting the eviction after the fact left a window (the transition's
        way to the ledger) in which a grant could pin bytes that were already gone; the ledger
        then refused the eviction and listed a READY replica that existed nowhere. Without an
        answer (coordinator unreachable, epoch suspended) the victims stay queued and readable,
        and are asked about again after ``retry_s``."""
        todo = [m for m in victims if self.tiers.is_spilling(m) and not self.tiers.keep_pinned(m)]
        if todo and self.client is None:
            # no ledger to ask (an engine without a coordinator): report after the fact
            for meta in todo:
                self.tiers.spilled(meta)
                self._emit(meta, self.host_location, R.READY, R.EVICTED, 0, kind="evict", reason="host lru")
            todo = []
        by_key = {(m.block_hash, m.form): m for m in todo}
        blocks = [DiskBlock(block_hash=h, form=f) for h, f in by_key]
        # NOTE: the victims' disk copies must be in the ledger first: an offload is accepted only
        # while a copy it can come from is known (here, the host replica), and until the disk
        # replica is READY the host one is what a reader has.
        timeout_s = self.cfg.nats.request_timeout_ms / 1000
        if blocks and self.publisher is not None and not await self.publisher.wait_empty(timeout_s):
            self._defer_host_evictions(len(blocks), "the victims' offloads are not committed yet")
            blocks = []
        for i in range(0, len(blocks), MAX_HOST_EVICT_BLOCKS):
            chunk = blocks[i:i + MAX_HOST_EVICT_BLOCKS]
            try:
                reply = await self.call("host_evict", self.client.host_evict(HostEvict(
                    worker_id=self.worker_id, epoch=max(1, self.epoch), blocks=chunk)))
            except (CoordinatorRefused, CoordinatorUnavailable) as e:
                self._defer_host_evictions(len(blocks) - i, type(e).__name__)
                break
            pinned = {(b.block_hash, b.form) for b in reply.pinned}
            for b in chunk:
                meta = by_key[(b.block_hash, b.form)]
                if (b.block_hash, b.form) in pinned:
                    # still queued and readable, asked about again once the lease may have ended
                    # (not put back into the host tier: that would push out another entry)
                    self.metrics.host_evictions.labels(outcome="pinned").inc()
                elif self.tiers.is_spilling(meta):   # (else: dropped meanwhile, an invalidation)
                    self.tiers.spilled(meta)   # evicted in the log (or not a live replica): the bytes go
                    self.metrics.host_evictions.labels(outcome="evicted").inc()
            if pinned:
                self._spill_again_later()

    def _defer_host_evictions(self, n: int, why: str) -> None:
        """Host-tier victims stay (queued, readable) without a decision; ask again after ``retry_s``."""
        self.metrics.host_evictions.labels(outcome="deferred").inc(n)
        self.log.warning("host-tier evictions deferred: the coordinator did not decide", victims=n, error=why,
                         retry_s=self.tiers.retry_s)
        self._spill_again_later()

    def _spill_again_later(self) -> None:
        asyncio.get_running_loop().call_later(self.tiers.retry_s, self._wake_spill.set)

    async def _collect_disk(self) -> None:
        """Delete this worker's oldest segments while they exceed ``cache.offload_dir_bytes``,
        each only once the ledger has evicted every replica it holds (``DiskGc``): a segment
        holding a replica a live lease pins is kept for now, and without the coordinator
        nothing is deleted (the bound waits; no READY replica loses its bytes)."""
        bound = self.cfg.cache.offload_dir_bytes
        if not bound or self.client is None or not self.tiers.disk_available():
            return
        try:
            usage = await self.io(self.tiers.disk_usage)
            if usage <= bound:
                return
            candidates = await self.io(self.tiers.disk_collectable)
        except of.OffloadUnavailable as e:
            self.tiers.mark_disk_down(str(e))
            return
        for path, size, metas in candidates:
            if usage <= bound:
                break
            blocks = list(dict.fromkeys(DiskBlock(block_hash=m.block_hash, form=m.form) for m in metas))
            try:
                pinned = False
                for i in range(0, len(blocks), MAX_DISK_GC_BLOCKS):
                    reply = await self.call("disk_gc", self.client.disk_gc(DiskGc(
                        worker_id=self.worker_id, epoch=max(1, self.epoch), blocks=blocks[i:i + MAX_DISK_GC_BLOCKS])))
                    if reply.pinned:
                        pinned = True
                        break
            except (CoordinatorRefused, CoordinatorUnavailable) as e:
                self.metrics.disk_gc.labels(outcome="no_coordinator").inc()
                self.log.warning("disk gc deferred: the coordinator did not decide", error=type(e).__name__)
                return
            if pinned:
                self.metrics.disk_gc.labels(outcome="pinned").inc()
                continue
            try:
                await self.io(lambda p=path: self.tiers.disk_delete(p))
            except of.OffloadUnavailable as e:
                self.tiers.mark_disk_down(str(e))
                return
            usage -= size
            self.metrics.disk_gc.labels(outcome="deleted").inc()
            self.metrics.disk_gc_bytes.inc(size)
        self.metrics.disk_bytes.set(usage)

    def committed(self) -> None:
        """After a session's commits: pool gauges, and the threshold's copies down a tier."""
        self._update_pool_metrics()
        self._pre_offload()

    def pool_metrics(self) -> None:
        self._update_pool_metrics()

    def _update_pool_metrics(self) -> None:
        if self.store is None:
            return
        for form, (used, _) in self.store.usage().items():
            self.metrics.pool_used.labels(form=form).set(used)

    # --- coordinator → worker ------------------------------------------------------------------

    async def on_inventory(self, req: InventoryRequest) -> InventoryReply:
        """What we hold (items, or with ``req.digests`` every replica digest grouped by location,
        whole: the transport pages it), or, for a disk check, the verdicts on ``req.disk``."""
        import msgspec  # noqa: PLC0415

        epoch = max(1, self.epoch)
        if req.disk:
            root = self.tiers.disk_root
            if root is None or not self.tiers.disk_available():
                return InventoryReply(worker_id=self.worker_id, epoch=epoch, disk_tier=False)

            def check() -> tuple[int, list, list]:
                mine = []
                for ref in req.disk[:1024]:   # bounded whatever the request says
                    spec = self.spec_digests.get(ref.form)
                    if spec is None or ref.namespace != self.namespace:
                        continue   # another model's record: this worker cannot name it
                    try:
                        of.check_token("tenant", ref.tenant)
                    except ValueError:
                        continue
                    mine.append((ref, BlockMeta(namespace=ref.namespace, tenant=ref.tenant, block_hash=ref.block_hash,
                                                parent_hash="", token_start=0, token_end=0, form=ref.form,
                                                spec_digest=spec, checksum=ref.checksum)))
                verdicts = self.tiers.disk_check([(meta, ref.checksum) for ref, meta in mine])
                missing = [ref for (ref, _), v in zip(mine, verdicts) if v == "missing"]
                damaged = [msgspec.structs.replace(ref, reason=v[:200]) for (ref, _), v in zip(mine, verdicts)
                           if v and v != "missing"]
                return len(mine), missing, damaged
            try:
                checked, missing, damaged = await self.io(check)
            except of.OffloadUnavailable as e:
                self.log.warning("audit disk check: offload directory unavailable", error=str(e))
                return InventoryReply(worker_id=self.worker_id, epoch=epoch, disk_tier=False)
            return InventoryReply(worker_id=self.worker_id, epoch=epoch, disk_tier=True, disk_checked=checked,
                                  disk_missing=missing, disk_damaged=damaged)
        emitted = self.publisher.outbox.next_seq - 1 \
            if self.publisher is not None and self.publisher.outbox is not None else 0
        if req.digests:
            held = sorted((loc, d) for d, (loc, *_) in self.inventory_digests().items())
            counts: dict[str, int] = {}
            for loc, _ in held:
                counts[loc] = counts.get(loc, 0) + 1
            return InventoryReply(worker_id=self.worker_id, epoch=epoch, digests=b"".join(d for _, d in held),
                                  locations=list(counts.items()), emitted_seq=emitted)
        items: list[InventoryItem] = []
        if self.store is not None:
            items += [InventoryItem(block_hash=m.block_hash, form=f, location=self.gpu, generation=m.generation,
                                    state=R.READY, checksum=m.checksum) for f, _, m in self.store.items()]
        items += [InventoryItem(block_hash=m.block_hash, form=m.form, location=self.host_location, generation=0,
                                state=R.READY, checksum=m.checksum) for m in self.tiers.host_items()]
        return InventoryReply(worker_id=self.worker_id, epoch=epoch, items=items, emitted_seq=emitted)

    def _drop_block(self, block_hash: str, gens: dict[str, int] | None) -> int:
        """Drop an invalidated block's bytes here: of its GPU replicas only the incarnations the
        decision named (``gens``: form → generation; None = every form's; one written since is
        listed READY), and its host-tier copies, queued for the disk writer too."""
        affected = 0
        for form in self.slots:
            if self.store is not None and (gens is None or form in gens):
                affected += self.store.drop(form, block_hash, None if gens is None else gens[form]) is not None
            affected += self.tiers.host_drop(block_hash, form)
        return affected

    async def on_control(self, msg: Control) -> ControlAck:
        """Apply a coordinator decision locally (the ledger already records it: no transitions).

        An invalidation drops the block's bytes wherever this worker holds them, blocks queued for
        the disk writer included; a copy of them whose transition is already on its way is refused
        by the ledger (the invalidation retired its EVICTED source), so neither side keeps it."""
        affected = 0
        if msg.action == "drain":
            self.draining = True
            affected = len(self.sessions)
        elif msg.action == "invalidate_blocks":
            # by key, not by a scan: an invalidated worker is named every block it held
            for b in msg.blocks:
                affected += self._drop_block(b.block_hash, b.generations)
            self._update_pool_metrics()
        elif msg.action == "invalidate_block" and msg.block_hash:
            affected += self._drop_block(msg.block_hash, msg.generations)
            self._update_pool_metrics()
        elif msg.action in ("evict", "invalidate_block", "invalidate_namespace"):
            def hit(m: BlockMeta) -> bool:
                if msg.action == "invalidate_namespace":
                    return m.namespace == msg.namespace
                return not msg.block_hash or m.block_hash == msg.block_hash
            if self.store is not None:
                for form, _, m in list(self.store.items()):
                    if hit(m):
                        affected += self.store.drop(form, m.block_hash, m.generation) is not None
                self._update_pool_metrics()
            queued = [m for m, _, from_host in self.tiers.take_spills()
                      if not from_host and msg.action != "evict"]
            for m in (*self.tiers.host_items(), *queued):
                if hit(m):
                    affected += self.tiers.host_drop(m.block_hash, m.form)
        self.log.info("control", action=msg.action, blocks=len(msg.blocks), affected=affected, reason=msg.reason)
        return ControlAck(worker_id=self.worker_id, affected=affected)

    # --- requests -------------------------------------------------------------------------

    def holds_block(self, block_hash: str) -> bool:
        """Whether this worker's pools hold a READY replica of ``block_hash`` in any form."""
        store = self.store
        return store is not None and any(store.lookup(f, block_hash) is not None for f in self.catalogue.names)

    async def open(self, tokens: Sequence[int], *, tenant: str = "default", reuse: bool = True,
                   max_new_tokens: int = 1, images: Sequence[PromptImage] = ()) -> Session:
        """Lease, validate and restore for ``tokens`` (holding ``images``); the session is ready for
        :meth:`Session.prefill_step`."""
        s = Session(self, tokens, tenant=tenant, reuse=reuse, max_new_tokens=max_new_tokens, images=images)
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


__all__ = ["CacheValidationError", "Engine", "Health", "Result", "SamplingParams", "Session"]
