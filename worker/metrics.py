"""The worker's Prometheus metrics, on a registry of its own (the serving layer exposes it).

Tokens are the unit of prefix-cache counters (as in vLLM and SGLang) so hit rates compare
across engines: ``queries`` counts prompt tokens looked up, ``hits`` the tokens the
coordinator offered (a hash hit), ``validated_hits`` the tokens actually reused after hit
validation. The gap between the last two is explained, by layer and form, in
``hit_invalid_total``, and every request that recomputed more than it had to says why in
``fallbacks_total`` — a miss is never silent.

On a CUDA device the worker also reports the device's memory (``kvl_worker_gpu_*``, read at
scrape time by :class:`GpuCollector`); on CPU those series are absent, not zero.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.messages import MAX_FALLBACK_REASONS, CacheCounters

_FAST = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_SLOW = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        p = "kvl_worker_"
        self.queries = Counter(p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r)
        self.hits = Counter(p + "prefix_cache_hits", "Prompt tokens the coordinator offered as reusable (hash hit)",
                            registry=r)
        self.validated_hits = Counter(p + "prefix_cache_validated_hits",
                                      "Prompt tokens reused after hit validation", registry=r)
        self.validations = Counter(p + "hit_validation", "Hit-validation checks by layer and outcome",
                                   ["layer", "outcome"], registry=r)
        self.invalid = Counter(p + "hit_invalid", "Replicas with a hash hit that failed validation",
                               ["layer", "form"], registry=r)
        self.auth_reloads = Counter(p + "auth_reloads", "Reloads of the API keys (SIGHUP or a changed config or keys "
                                    "file; shared.key_rotation), by outcome (ok, failed)", ["outcome"], registry=r)
        self.fallbacks = Counter(p + "fallbacks", "Requests that recomputed more than the cache offered, by reason",
                                 ["reason"], registry=r)
        self.pool_used = Gauge(p + "pool_used_slots", "Pool slots in use per form", ["form"], registry=r)
        self.pool_slots = Gauge(p + "pool_slots", "Pool slots per form (static)", ["form"], registry=r)
        self.pool_bytes = Gauge(p + "pool_bytes", "Bytes the cache pools were sized to at start (worker.pool_bytes, or "
                                "from the memory left after the weights)", registry=r)
        self.pool_max_context_requests = Gauge(
            p + "pool_max_context_requests", "Requests of the maximum context (service.max_context_length, at most "
            "the model's) the pools hold at once; 0: not even one", registry=r)
        self.offload_seconds = Histogram(p + "offload_seconds", "Time to copy one block to the host tier, or one "
                                         "batch of blocks to the disk tier (one fsync)", ["tier"],
                                         buckets=_FAST, registry=r)
        self.reload_seconds = Histogram(p + "reload_seconds", "Time to reload (and verify) a request's blocks "
                                        "from a tier", ["tier"], buckets=_FAST, registry=r)
        self.validation_seconds = Histogram(
            p + "validation_seconds", "Time one request spent validating its reused replicas of a form, by layer "
            "group: metadata (presence, abi, intersection: the record against the lease and the request) or "
            "integrity (the checksum of the bytes; only where it ran)", ["form", "layers"], buckets=_FAST,
            registry=r)
        self.restore_seconds = Histogram(
            p + "restore_seconds", "Time one request's state took to take in a form's validated blocks at its "
            "resume point (on a GPU: to issue the copies)", ["form"], buckets=_FAST, registry=r)
        self.restored_blocks = Counter(p + "restored_blocks", "Blocks requests resumed from, by how their state "
                                       "took them: read where the pool holds them (in_place) or copied "
                                       "(cache.restore_in_place)", ["how"], registry=r)
        self.pinned_slots = Gauge(p + "pinned_slots", "Pool slots running requests read in place now (freed ones "
                                  "among them are handed out when those requests end)", registry=r)
        self.offload_failures = Counter(p + "offload_failures", "Offload writes that failed", ["tier", "reason"],
                                        registry=r)
        self.reload_failures = Counter(p + "reload_failures", "Reloads that failed or failed verification",
                                       ["tier", "reason"], registry=r)
        self.tier_unavailable = Counter(p + "tier_unavailable", "Times a tier was skipped because it could not "
                                        "be used", ["tier"], registry=r)
        self.offloaded_bytes = Counter(p + "offload_bytes", "Bytes copied to a tier", ["tier"], registry=r)
        self.reloaded_bytes = Counter(p + "reload_bytes", "Bytes reloaded from a tier", ["tier"], registry=r)
        self.pre_offloaded = Counter(p + "pre_offloaded_blocks", "Cold GPU replicas copied down a tier above "
                                     "cache.offload_threshold, before an eviction needed them", ["form"], registry=r)
        self.disk_bytes = Gauge(p + "disk_segment_bytes", "Bytes of this worker's own segment files in the "
                                "offload directory (bounded by cache.offload_dir_bytes)", registry=r)
        self.disk_gc = Counter(p + "disk_gc_segments", "This worker's segments the disk GC considered, by outcome "
                               "(deleted: past cache.offload_dir_bytes; expired: older than cache.offload_max_age_s; pinned: a "
                               "live lease pins a replica it holds, kept; no_coordinator: deferred)", ["outcome"],
                               registry=r)
        self.address_refused = Counter(p + "address_refused", "HTTP requests refused (403) because the client's "
                                       "address is outside worker.allowed_networks", registry=r)
        self.disk_bound = Gauge(p + "disk_bound_bytes", "Bytes this worker's segments may take in the offload "
                                "directory (cache.offload_dir_bytes, or cache.offload_dir_share of the file "
                                "system's free space at start)", registry=r)
        self.host_evictions = Counter(p + "host_evictions", "Host-tier LRU victims the coordinator was asked to "
                                      "evict, by outcome (evicted: bytes dropped; pinned: a live lease pins it, "
                                      "kept; deferred: no decision yet, kept and asked again)", ["outcome"], registry=r)
        self.host_evictions_waiting = Gauge(p + "host_evictions_waiting", "Host-tier LRU victims kept in memory "
                                            "until the coordinator decides their eviction", registry=r)
        self.pool_divergences = Counter(p + "pool_divergences", "Granted writes a full GPU pool refused (the "
                                        "ledger's view of the pool diverged from the worker's; each write is "
                                        "aborted and room is made by the coordinator's decision)", ["form"],
                                        registry=r)
        self.pool_room = Counter(p + "pool_room_evictions", "GPU replicas the coordinator was asked to evict to "
                                 "make room in a diverged pool, by outcome (evicted: bytes dropped; pinned: kept; "
                                 "deferred: no decision, asked again at the next refused write)", ["outcome"],
                                 registry=r)
        self.disk_gc_bytes = Counter(p + "disk_gc_bytes", "Bytes of segment files the disk GC deleted", registry=r)
        self.disk_skipped = Gauge(p + "disk_records_skipped", "Segment records the index skipped for a damaged "
                                  "header (each lost alone)", registry=r)
        self.outbox_depth = Gauge(p + "outbox_depth", "Transitions awaiting the coordinator's commit watermark",
                                  registry=r)
        self.releasing = Gauge(p + "releasing_sessions", "Ended requests whose leases are being released in the "
                               "background (after their response; near 0 unless the coordinator is slow)",
                               registry=r)
        self.transitions = Counter(p + "transitions", "Transitions emitted, by kind", ["kind"], registry=r)
        self._transitions_by_kind: dict[str, Any] = {}
        self.publish_failures = Counter(p + "publish_failures", "JetStream publishes that failed", registry=r)
        self.published_messages = Counter(p + "published_messages", "JetStream messages the broker stored, each "
                                          "one transition or a batch of up to worker.publish_batch", registry=r)
        self.degraded = Gauge(p + "degraded", "1 while serving by recomputation only", registry=r)
        self.degraded_entries = Counter(p + "degraded_entries", "Times the worker entered degraded mode",
                                        ["reason"], registry=r)
        self.epoch = Gauge(p + "epoch", "Current registration epoch (0 = unregistered)", registry=r)
        self.resumes = Counter(p + "resumes", "Times the worker kept its epoch and cache after an outage "
                               "(its inventory reconciled by the coordinator)", registry=r)
        self.lease_seconds = Histogram(p + "lease_seconds", "Coordinator round trips", ["op"], buckets=_FAST,
                                       registry=r)
        self.lease_errors = Counter(p + "lease_errors", "Coordinator requests that failed", ["op", "code"],
                                    registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token", buckets=_SLOW, registry=r)
        self.close_seconds = Histogram(p + "request_close_seconds", "From a request's last step to its commits "
                                       "settled: the reply's blocks committed, the commit watermark awaited (a "
                                       "response's last chunk waits for it; served requests release their leases "
                                       "after it, the engine's own generate() before)", buckets=_FAST, registry=r)
        self.requests = Counter(p + "requests", "Requests run through the engine", ["outcome"], registry=r)
        self.prefix_waits = Counter(p + "prefix_waits", "Requests that waited, before their lease, for prompt "
                                    "blocks another request here was computing (worker.inflight), by outcome: "
                                    "committed (then leased), abandoned (the other will not commit one: it "
                                    "closed, or was not granted it), timeout (it leased without them)",
                                    ["outcome"], registry=r)
        self.prefix_wait_seconds = Histogram(p + "prefix_wait_seconds", "How long a request waited, before its "
                                             "lease, for prompt blocks another request here was computing",
                                             buckets=_SLOW, registry=r)
        self.step_requests = Histogram(p + "step_batch_requests", "Requests fused into one model forward",
                                       buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.step_tokens = Histogram(p + "step_batch_tokens", "Tokens (rows) in one model forward",
                                     buckets=(1, 4, 16, 32, 64, 128, 256, 512, 1024), registry=r)
        self.step_seconds = Histogram(p + "step_seconds", "Wall time of one model forward (with its exports)",
                                      buckets=_FAST, registry=r)
        self.reply_blocks = Counter(p + "reply_blocks", "Decode-made reply blocks exported and committed",
                                    registry=r)
        self.fused_checks = Counter(p + "fused_checks", "Fused forwards re-run for one request alone "
                                    "(service.fused_check_every), by outcome: same or differs", ["outcome"],
                                    registry=r)
        self.lane_forwards = Counter(p + "lane_forwards", "Fused forwards split by request into lanes run at "
                                     "once (service.model_lanes)", registry=r)
        self.model_lanes = Gauge(p + "model_lanes", "Forwards this worker runs at once (service.model_lanes, "
                                 "resolved)", registry=r)
        self.batch_invariant = Gauge(p + "batch_invariant", "1 if fused forwards are exact here "
                                     "(the product probe and the whole-forward probe passed, one intra-op thread)",
                                     registry=r)
        self.state_bytes = Gauge(p + "state_bytes", "Bytes of the live request states' buffers (each running "
                                 "request's K/V and the rest of its per-request state; ended ones' kept buffers: "
                                 "kvl_worker_kept_state_bytes)", registry=r)
        self.kept_state_bytes = Gauge(p + "kept_state_bytes", "Bytes of ended requests' K/V buffers kept for "
                                      "the next requests' states (worker.kept_state_bytes)", registry=r)
        self.states_reused = Gauge(p + "states_reused", "Request states made on a kept buffer since start "
                                   "(against kvl_worker_states_made: made afresh)", registry=r)
        self.states_made = Gauge(p + "states_made", "Request states whose buffers were made afresh since start",
                                 registry=r)
        self.disowned_replicas = Counter(p + "disowned_replicas", "Replicas this worker created that the ledger "
                                         "invalidated at its request after a fused forward differed (disk copies "
                                         "included)", registry=r)
        self.refused_copies = Counter(p + "refused_copies", "Copies to the host tier that the ledger refused "
                                      "(the source they named was no longer known, or invalidated), dropped "
                                      "when the commit watermark said so", registry=r)
        self.refused_commits = Counter(p + "refused_commits", "GPU commits the ledger refused (their lease "
                                       "had ended first, its write aborted), their slots freed when the commit "
                                       "watermark said so", registry=r)

    def count_transition(self, kind: str) -> None:
        """One transition emitted. NOTE: the labelled child is kept per kind: ``labels()`` costs
        ~2.7 us against ~1 for the increment, and this runs for every block of every commit."""
        child = self._transitions_by_kind.get(kind)
        if child is None:
            child = self._transitions_by_kind[kind] = self.transitions.labels(kind=kind)
        child.inc()

    def observe_step(self, requests: int, tokens: int, seconds: float) -> None:
        self.step_requests.observe(requests)
        self.step_tokens.observe(tokens)
        self.step_seconds.observe(seconds)

    def watch_gpu(self, device: str, pool_bytes: int,
                  read: Callable[[str], GpuMemory] | None = None) -> bool:
        """Register the GPU memory gauges if ``device`` is a CUDA device (``cuda``, ``cuda:N``);
        on any other device register nothing, so the series are absent rather than zero.
        ``pool_bytes``: the cache pools' storage on it (static: allocated once). ``read``
        replaces :func:`read_cuda` (tests and the metrics reference, where there is no GPU)."""
        if device.split(":", 1)[0] != "cuda":
            return False
        self.registry.register(GpuCollector(device, pool_bytes, read or read_cuda))
        return True

    def cache_counters(self) -> CacheCounters:
        """This process's prefix-cache counters, for its heartbeats (the coordinator's status page)."""
        fallbacks = {}
        for s in _samples(self.fallbacks):
            reason = s.labels["reason"]
            # NOTE: a value the coordinator would refuse must not cost the whole heartbeat.
            if _REASON.fullmatch(reason) and len(fallbacks) < MAX_FALLBACK_REASONS:
                fallbacks[reason] = int(s.value)
        return CacheCounters(queried=_total(self.queries), hits=_total(self.hits),
                             validated=_total(self.validated_hits), fallbacks=fallbacks)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's current value (0 if absent): for tests and the benchmark."""
        v = self.registry.get_sample_value(name, labels or {})
        return 0.0 if v is None else float(v)


_REASON = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")


def _samples(counter: Counter) -> Iterator[Any]:
    """The ``_total`` samples of a counter (one per label set): its own, not the registry's."""
    for family in counter.collect():
        yield from (s for s in family.samples if s.name.endswith("_total"))


def _total(counter: Counter) -> int:
    return int(sum(s.value for s in _samples(counter)))


# --- GPU memory (CUDA only) ------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class GpuMemory:
    """One CUDA device's memory, in bytes, as torch sees it at one moment."""

    #: ``torch.cuda.memory_allocated``: bytes of live tensors of this process (pools included).
    allocated: int
    #: ``torch.cuda.memory_reserved``: what torch's caching allocator holds (allocated + cached).
    reserved: int
    #: ``get_device_properties(d).total_memory``.
    total: int
    #: ``torch.cuda.mem_get_info(d)[0]``: free as the driver sees it (other processes count).
    free: int


def read_cuda(device: str) -> GpuMemory:
    """The CUDA calls, nothing else (the arithmetic is :func:`gpu_families`)."""
    import torch  # here, not at the top: this module is also read by tools that never touch a GPU

    d = torch.device(device)
    return GpuMemory(allocated=torch.cuda.memory_allocated(d), reserved=torch.cuda.memory_reserved(d),
                     total=torch.cuda.get_device_properties(d).total_memory, free=torch.cuda.mem_get_info(d)[0])


def gpu_families(device: str, mem: GpuMemory, pool_bytes: int) -> list[GaugeMetricFamily]:
    """The ``kvl_worker_gpu_*`` families for one device: memory as read, the pools' bytes, and
    their share of what this process allocated and of the device (0 where a divisor is 0)."""
    p = "kvl_worker_gpu_"
    rows = [
        ("memory_allocated_bytes", "Bytes of this worker's live tensors on its CUDA device, pools included "
         "(torch.cuda.memory_allocated)", mem.allocated),
        ("memory_reserved_bytes", "Bytes torch's caching allocator holds on the CUDA device: allocated + cached "
         "(torch.cuda.memory_reserved)", mem.reserved),
        ("memory_total_bytes", "The CUDA device's memory (torch.cuda.get_device_properties)", mem.total),
        ("memory_free_bytes", "Free memory of the CUDA device as the driver reports it, other processes "
         "included (torch.cuda.mem_get_info)", mem.free),
        ("pool_bytes", "Bytes of the cache pools' storage on the CUDA device (allocated once, at start)", pool_bytes),
        ("pool_share_of_allocated", "Cache pools' bytes / memory_allocated: the cache's part of this worker's "
         "tensors on the CUDA device (the rest: weights, activations)",
         pool_bytes / mem.allocated if mem.allocated else 0.0),
        ("pool_share_of_device", "Cache pools' bytes / the CUDA device's memory",
         pool_bytes / mem.total if mem.total else 0.0),
    ]
    out = []
    for name, doc, value in rows:
        g = GaugeMetricFamily(p + name, doc, labels=["device"])
        g.add_metric([device], value)
        out.append(g)
    return out


class GpuCollector(Collector):
    """Reads the device at scrape time (a gauge set on a timer would be stale or cost a thread)."""

    def __init__(self, device: str, pool_bytes: int, read: Callable[[str], GpuMemory]) -> None:
        self.device = device
        self.pool_bytes = pool_bytes
        self.read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from gpu_families(self.device, self.read(self.device), self.pool_bytes)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # the names, without touching the device at registration
        yield from gpu_families(self.device, GpuMemory(0, 0, 0, 0), 0)
