"""The transitions stream (JetStream): created or verified at start with its bounds, and purged
of what the coordinator has acknowledged.

Bounds (``nats.stream_*``; docs/operations.md, "Stream limits and refused transitions"): a byte
cap, a message-size cap and, on a server that can refuse per subject (nats-server ≥ 2.10), a
per-worker message cap, all with the discard policy ``new``: a publish over a cap is refused (the
worker gets an error and keeps its transitions), never an older, possibly unconsumed, message
dropped. The leader purges up to its consumer's ack floor (each message there was acked after
its transitions were committed to the log), so the caps bound the backlog, not history.

Replicas (``nats.stream_replicas``; 0 = one per server in ``nats.url``, at most 5): on a
three-node cluster the stream is R3, so a worker's publish is acknowledged once two nodes hold
it and losing any one node loses nothing acknowledged (docs/architecture.md, "NATS as a
cluster"). An existing stream is scaled to the configured count at start.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import nats.js.errors
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from shared.config import nats_servers
from shared.subjects import Subjects

#: Durable name of the coordinator's pull consumer (shared by leader and standbys; only the leader pulls).
CONSUMER_NAME = "kvl-coordinator"


class StartupError(RuntimeError):
    """The coordinator cannot start; the message is one readable line for an operator."""


class TransitionStream:
    def __init__(self, js: Any, nc: Any, subjects: Subjects, *, config: Any, metrics: Any, logger: Any) -> None:
        self.js = js
        self.nc = nc
        self.subjects = subjects
        self.config = config
        self.metrics = metrics
        self.log = logger
        #: The first stream sequence not yet purged (0: none purged by this process).
        self._purged_below = 0

    def _stream_limits(self) -> dict[str, Any]:
        """The stream's bounds (``nats.stream_*``): a byte cap, a message-size cap and, on a
        server that can refuse per subject (≥ 2.10), a per-worker message cap — all with the
        discard policy ``new``: a publish over a cap is refused (the worker gets an error and
        keeps its transitions), never an older, possibly unconsumed, message dropped."""
        n = self.config.nats
        limits: dict[str, Any] = {"max_bytes": n.stream_max_bytes, "max_msg_size": n.stream_max_msg_bytes,
                                  "discard": DiscardPolicy.NEW, "num_replicas": self.replicas}
        if self.per_subject_discard_new:
            limits.update(max_msgs_per_subject=n.stream_max_msgs_per_worker, discard_new_per_subject=True)
        return limits

    @property
    def replicas(self) -> int:
        """``nats.stream_replicas``, or one per configured server (JetStream allows at most 5)."""
        n = self.config.nats
        return n.stream_replicas or min(5, len(nats_servers(n.url)) or 1)

    @property
    def per_subject_discard_new(self) -> bool:
        """Whether the server refuses a publish over a per-subject limit (instead of dropping the
        subject's oldest message): nats-server 2.10 and later."""
        v = self.nc.connected_server_version
        return (v.major, v.minor) >= (2, 10)

    async def ensure(self) -> None:
        """Create the transitions stream, or verify (and bring up to date) an existing one."""
        n = self.config.nats
        name = self.subjects.stream_name
        limits = self._stream_limits()
        want = StreamConfig(name=name, subjects=[self.subjects.events_wildcard], retention=RetentionPolicy.LIMITS,
                            storage=StorageType.FILE, max_age=float(n.stream_max_age_s),
                            duplicate_window=float(n.duplicate_window_s), **limits)
        if not self.per_subject_discard_new:
            self.log.warning("stream_limit_unsupported", limit="nats.stream_max_msgs_per_worker",
                             server_version=str(self.nc.connected_server_version),
                             reason="needs nats-server >= 2.10 (per-subject discard new); not applied")
        shown = {k: getattr(v, "value", v) for k, v in limits.items()}
        self.metrics.stream_replicas.set(self.replicas)
        try:
            info = await self.js.stream_info(name)
        except nats.js.errors.NotFoundError:
            try:
                await self.js.add_stream(want)
            except nats.js.errors.APIError as e:
                self._replicas_refused(e)
                raise
            self.log.info("stream_created", stream=name, subjects=want.subjects, retention="limits", storage="file",
                          max_age_s=n.stream_max_age_s, duplicate_window_s=n.duplicate_window_s, **shown)
            return
        have = info.config
        if have.storage != StorageType.FILE or have.retention != RetentionPolicy.LIMITS:
            raise StartupError(
                f"JetStream stream {name} exists with storage={getattr(have.storage, 'value', have.storage)} "
                f"retention={getattr(have.retention, 'value', have.retention)}; kvledger needs file storage and "
                "limits retention (these cannot be changed in place: move or delete the stream)")
        if self.subjects.events_wildcard not in (have.subjects or []):
            raise StartupError(f"JetStream stream {name} does not cover {self.subjects.events_wildcard} "
                               f"(it has {have.subjects}); fix its subjects or the subject prefix")
        if (round(have.max_age or 0) != n.stream_max_age_s
                or round(have.duplicate_window or 0) != n.duplicate_window_s
                or any(getattr(have, k) != v for k, v in limits.items())):
            have.max_age = want.max_age
            have.duplicate_window = want.duplicate_window
            for k, v in limits.items():
                setattr(have, k, v)
            try:
                await self.js.update_stream(have)
            except nats.js.errors.APIError as e:
                self._replicas_refused(e)
                raise
            self.log.info("stream_updated", stream=name, max_age_s=n.stream_max_age_s,
                          duplicate_window_s=n.duplicate_window_s, **shown)
        else:
            self.log.info("stream_verified", stream=name)

    def _replicas_refused(self, e: Exception) -> None:
        """A refused stream with replicas: most likely more than the cluster has (one readable line)."""
        if self.replicas > 1:
            raise StartupError(
                f"JetStream refused the stream {self.subjects.stream_name} at {self.replicas} replicas: {e}; a stream "
                "has at most as many replicas as the cluster has JetStream servers (config key "
                "nats.stream_replicas; 0 = one per server in nats.url)") from e

    async def purge_acknowledged(self) -> int:
        """Remove the stream's messages up to the consumer's ack floor: each was acked after its
        transitions were committed to the log (or terminated as malformed), so the log holds
        all they carried and no redelivery can need them (a reclaim restarts above the floor).
        Returns the first sequence kept (0: nothing purged)."""
        stream = self.subjects.stream_name
        info = await self.js.consumer_info(stream, CONSUMER_NAME)
        floor = info.ack_floor.stream_seq if info.ack_floor else 0
        if floor == 0 or floor < self._purged_below:
            return 0   # nothing acknowledged, or nothing since the last purge
        await self.js.purge_stream(stream, seq=floor + 1)
        self._purged_below = floor + 1
        self.metrics.stream_purged.set(floor)
        return floor + 1

    async def observe_replicas(self) -> int:
        """How many of the stream's replicas are current (the leader and each follower caught up),
        into ``kvl_coordinator_stream_replicas_current``: a NATS node that is down or has not yet
        caught up after a restart shows there."""
        info = await self.js.stream_info(self.subjects.stream_name)
        cluster = info.cluster
        peers = (cluster.replicas or []) if cluster is not None else []
        current = (1 if cluster is None or cluster.leader else 0) + sum(1 for p in peers if p.current and not p.offline)
        self.metrics.stream_replicas_current.set(current)
        return current

    async def purge_loop(self, every_s: float, leading: Callable[[], bool]) -> None:
        """Every ``every_s``, while ``leading()`` (the serving leader, its consumer pulling): purge."""
        last_error = ""
        while True:
            await asyncio.sleep(every_s)
            if not leading():
                continue
            try:
                await self.purge_acknowledged()
                await self.observe_replicas()
                last_error = ""
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - broker trouble (or a reclaim between): next round
                if str(e) != last_error:
                    self.log.warning("stream_purge_failed", error=f"{type(e).__name__}: {e}")
                last_error = str(e)
