"""Prometheus metrics of one coordinator, on its own registry (two in one process never clash)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
#: A snapshot takes ms (a fork, a small state) to tens of seconds (a large state serialised).
SNAPSHOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvl_coordinator_requests", "Request/reply calls by operation and outcome",
                                ["op", "outcome"], registry=r)
        self.auth_reloads = Counter("kvl_coordinator_auth_reloads", "Reloads of the admin token (SIGHUP or a changed "
                                    "config file; shared.key_rotation), by outcome (ok, failed)", ["outcome"], registry=r)
        self.request_latency = Histogram("kvl_coordinator_request_latency_seconds",
                                         "Request/reply latency (decision to durable reply) by operation and outcome",
                                         ["op", "outcome"], buckets=LATENCY_BUCKETS, registry=r)
        self.events_ingested = Counter("kvl_coordinator_transitions", "Worker transitions consumed, by result",
                                       ["result"], registry=r)
        self.append_batch = Histogram("kvl_coordinator_append_batch_events", "Events per append transaction",
                                      buckets=BATCH_BUCKETS, registry=r)
        self.append_latency = Histogram("kvl_coordinator_append_latency_seconds",
                                        "Append transaction latency (group commit)", buckets=LATENCY_BUCKETS,
                                        registry=r)
        self.append_failures = Counter("kvl_coordinator_append_failures", "Failed append transactions", registry=r)
        self.consumer_lag = Gauge("kvl_coordinator_consumer_lag_messages",
                                  "JetStream messages (one transition or a worker's batch) in the stream not yet "
                                  "delivered to the coordinator", registry=r)
        self.stream_purged = Gauge("kvl_coordinator_stream_purged_through",
                                   "Stream sequence through which the leader purged acknowledged (logged) "
                                   "transition messages (nats.stream_purge_interval_s)", registry=r)
        self.stream_replicas = Gauge("kvl_coordinator_stream_replicas",
                                     "Replicas the transitions stream is configured with (nats.stream_replicas)",
                                     registry=r)
        self.stream_replicas_current = Gauge("kvl_coordinator_stream_replicas_current",
                                             "Replicas of the transitions stream that are current: its leader and "
                                             "every follower caught up (below stream_replicas: a NATS node is down "
                                             "or still catching up)", registry=r)
        self.database_standbys = Gauge("kvl_coordinator_database_standbys",
                                       "Standbys streaming from the PostgreSQL server the leader writes to "
                                       "(pg_stat_replication; database.standby_check_interval_s)", registry=r)
        self.database_synchronous = Gauge("kvl_coordinator_database_synchronous",
                                          "1 when that server's commits wait for a standby (synchronous_standby_names "
                                          "set): with no standby streaming, every append stalls", registry=r)
        self.transition_messages = Histogram("kvl_coordinator_transitions_per_message",
                                             "Transitions per JetStream message consumed (a worker's batch; 1 for "
                                             "a lone transition)", buckets=BATCH_BUCKETS, registry=r)
        self.replay_seconds = Gauge("kvl_coordinator_replay_seconds", "Duration of the last replay", registry=r)
        self.replay_events = Gauge("kvl_coordinator_replay_events", "Events folded by the last replay", registry=r)
        self.audits = Counter("kvl_coordinator_audits", "Audits by outcome", ["outcome"], registry=r)
        self.snapshots = Counter("kvl_coordinator_snapshots", "Snapshots saved", registry=r)
        self.snapshot_freeze = Histogram(
            "kvl_coordinator_snapshot_freeze_seconds",
            "How long a snapshot held every decision: a fork when a child serialises the state "
            "(how=fork), the whole hash and encoding otherwise (how=in_process)", ["how"],
            buckets=SNAPSHOT_BUCKETS, registry=r)
        self.snapshot_seconds = Histogram("kvl_coordinator_snapshot_seconds",
                                          "A snapshot from its freeze until it is saved", buckets=SNAPSHOT_BUCKETS,
                                          registry=r)
        self.snapshot_failures = Counter("kvl_coordinator_snapshot_failures",
                                         "Snapshots whose child ended without handing over the state "
                                         "(killed, crashed, past coordinator.snapshot_timeout_s)", registry=r)
        self.leader = Gauge("kvl_coordinator_leader", "1 while this process is the serving leader", registry=r)
        self.leader_epoch = Gauge("kvl_coordinator_leader_epoch", "Leader epoch this process holds (0 = none)",
                                  registry=r)
        self.log_position = Gauge("kvl_coordinator_log_position", "Last committed log position", registry=r)
        self.log_archived = Gauge("kvl_coordinator_log_archived_position",
                                  "Last position moved to an archive file (kvledger log archive); 0 = none. "
                                  "Read at each load, snapshot and /v1/summary", registry=r)
        self.malformed = Counter("kvl_coordinator_malformed_messages", "Malformed NATS messages by subject kind",
                                 ["kind"], registry=r)
        self.forbidden = Counter("kvl_coordinator_forbidden_messages",
                                 "Messages refused because they speak for another worker than their subject's", ["op"],
                                 registry=r)

    def on_batch(self, events: int, seconds: float, ok: bool) -> None:
        if ok:
            self.append_batch.observe(events)
            self.append_latency.observe(seconds)
        else:
            self.append_failures.inc()

    def watch_pools(self, usage: Callable[[], list[tuple[str, str, int, int]]]) -> None:
        """Pool usage per (worker, form), read from the live state at scrape time."""
        self.registry.register(_PoolCollector(usage))


    def watch_workers(self, states: Callable[[], dict[str, int]]) -> None:
        """Worker epochs by state (live, suspended, lost), read from the live state at scrape time."""
        self.registry.register(_WorkerCollector(states))


    def watch_append_paths(self, paths: Callable[[], dict[str, int]]) -> None:
        """Appends by how they were written (the event log's own counters), read at scrape time."""
        self.registry.register(_AppendPathCollector(paths))


class _AppendPathCollector(Collector):
    def __init__(self, paths: Callable[[], dict[str, int]]) -> None:
        self.paths = paths

    def collect(self) -> Iterator[Any]:
        c = CounterMetricFamily("kvl_coordinator_append_path", "Append transactions by how they were written: "
                                "function (one kvl_append call), copy (database.copy_append_min_events or more "
                                "events), copy_refused (a COPY refused for a source id already stored, then "
                                "written by kvl_append)", labels=["path"])
        for path, n in self.paths().items():
            c.add_metric([path], n)
        yield c


class _WorkerCollector(Collector):
    def __init__(self, states: Callable[[], dict[str, int]]) -> None:
        self.states = states

    def collect(self) -> Iterator[Any]:
        g = GaugeMetricFamily("kvl_coordinator_workers", "Workers by the state of their latest epoch "
                              "(live, suspended: silent or awaiting a resume, lost: fenced)", labels=["state"])
        for state, n in self.states().items():
            g.add_metric([state], n)
        yield g


class _PoolCollector(Collector):
    def __init__(self, usage: Callable[[], list[tuple[str, str, int, int]]]) -> None:
        self.usage = usage

    def collect(self) -> Iterator[Any]:
        used = GaugeMetricFamily("kvl_coordinator_pool_used_slots", "ALLOCATED+READY replicas per worker pool",
                                 labels=["worker", "form"])
        limit = GaugeMetricFamily("kvl_coordinator_pool_limit_slots", "Pool slots per worker and form",
                                  labels=["worker", "form"])
        for worker, form, n, cap in self.usage():
            used.add_metric([worker, form], n)
            limit.add_metric([worker, form], cap)
        yield used
        yield limit
