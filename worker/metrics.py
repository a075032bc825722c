"""The worker's Prometheus metrics, on a registry of its own (the serving layer exposes it).

Tokens are the unit of prefix-cache counters (as in vLLM and SGLang) so hit rates compare
across engines: ``queries`` counts prompt tokens looked up, ``hits`` the tokens the
coordinator offered (a hash hit), ``validated_hits`` the tokens actually reused after hit
validation. The gap between the last two is explained, by layer and form, in
``hit_invalid_total``, and every request that recomputed more than it had to says why in
``fallbacks_total`` — a miss is never silent.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
        self.fallbacks = Counter(p + "fallbacks", "Requests that recomputed more than the cache offered, by reason",
                                 ["reason"], registry=r)
        self.pool_used = Gauge(p + "pool_used_slots", "Pool slots in use per form", ["form"], registry=r)
        self.pool_slots = Gauge(p + "pool_slots", "Pool slots per form (static)", ["form"], registry=r)
        self.offload_seconds = Histogram(p + "offload_seconds", "Time to copy one block to the host tier, or one "
                                         "batch of blocks to the disk tier (one fsync)", ["tier"],
                                         buckets=_FAST, registry=r)
        self.reload_seconds = Histogram(p + "reload_seconds", "Time to reload (and verify) a request's blocks "
                                        "from a tier", ["tier"], buckets=_FAST, registry=r)
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
                               "(deleted; pinned: a live lease pins a replica it holds, kept; no_coordinator: "
                               "deferred)", ["outcome"], registry=r)
        self.disk_gc_bytes = Counter(p + "disk_gc_bytes", "Bytes of segment files the disk GC deleted", registry=r)
        self.disk_skipped = Gauge(p + "disk_records_skipped", "Segment records the index skipped for a damaged "
                                  "header (each lost alone)", registry=r)
        self.outbox_depth = Gauge(p + "outbox_depth", "Transitions awaiting the coordinator's commit watermark",
                                  registry=r)
        self.transitions = Counter(p + "transitions", "Transitions emitted, by kind", ["kind"], registry=r)
        self.publish_failures = Counter(p + "publish_failures", "JetStream publishes that failed", registry=r)
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
        self.requests = Counter(p + "requests", "Requests run through the engine", ["outcome"], registry=r)
        self.step_requests = Histogram(p + "step_batch_requests", "Requests fused into one model forward",
                                       buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.step_tokens = Histogram(p + "step_batch_tokens", "Tokens (rows) in one model forward",
                                     buckets=(1, 4, 16, 32, 64, 128, 256, 512, 1024), registry=r)
        self.step_seconds = Histogram(p + "step_seconds", "Wall time of one model forward (with its exports)",
                                      buckets=_FAST, registry=r)
        self.reply_blocks = Counter(p + "reply_blocks", "Decode-made reply blocks exported and committed",
                                    registry=r)
        self.batch_invariant = Gauge(p + "batch_invariant", "1 if fused forwards are exact here "
                                     "(kernels.invariant.probe passed, one intra-op thread)", registry=r)

    def observe_step(self, requests: int, tokens: int, seconds: float) -> None:
        self.step_requests.observe(requests)
        self.step_tokens.observe(tokens)
        self.step_seconds.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample's current value (0 if absent): for tests and the benchmark."""
        v = self.registry.get_sample_value(name, labels or {})
        return 0.0 if v is None else float(v)
