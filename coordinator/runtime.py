"""The coordinator process's moving parts and their life cycle: one composition root.

::

    start:  NATS connect → stream + consumer verified → leadership loop, expiry loop
    loop:   schema at head → wait for the lock (standby) → epoch bump → replay → serve
            … until the lock session is lost or an append says NotLeader → stand down → loop
    stop:   stop taking requests → answer those in flight → flush commits → release the lock
            → drain NATS → close the pool

A coordinator that loses its lock because PostgreSQL went away keeps its request
subscription and answers UNAVAILABLE until it is leader again (workers get a fast, clear
answer and serve by recomputation). One that finds another live leader holding the lock
unsubscribes, so requests reach the leader only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import time
from typing import Any

from nats.aio.client import Client as NatsClient

from coordinator.aio import bounded
from coordinator.core import CoreParams, expire
from coordinator.ledger import Ledger
from coordinator.log.chain_metrics import ChainHeadCollector
from coordinator.log.leader import LeaderElection, make_holder_id
from coordinator.log.port import LogError, LogUnavailable
from coordinator.log.postgres import PgSettings, PostgresEventLog, describe, is_unavailable
from coordinator.metrics import CoordinatorMetrics
from coordinator.nats_service import NatsService, StartupError
from coordinator.replay import LogCorrupt
from coordinator.unavailable import Unavailable
from shared import nats_auth
from shared.logging import mask_credentials
from shared.config import Config, nats_servers
from shared.messages import now_ms
from shared.shards import shard_subjects
from shared.tls import nats_tls_kwargs


class Coordinator:
    def __init__(self, config: Config, *, database_url: str, nats_url: str, logger: Any,
                 metrics: CoordinatorMetrics | None = None, holder: str | None = None,
                 freeze_gc: bool = False) -> None:
        self.config = config
        #: Tune this process's garbage collector: ``coordinator.gc_young_threshold`` and
        #: ``gc_full_threshold``, and its view frozen after each takeover (see ``_lead_once``).
        self.freeze_gc = freeze_gc
        if freeze_gc:
            _, older, _ = gc.get_threshold()
            gc.set_threshold(config.coordinator.gc_young_threshold, older, config.coordinator.gc_full_threshold)
        self.database_url = database_url
        self.nats_url = nats_url
        self.log = logger
        self.metrics = metrics or CoordinatorMetrics()
        self.holder = holder or make_holder_id()
        c = config.coordinator
        self.subjects = shard_subjects(config.nats.subject_prefix, c.shard)
        self.pg = PgSettings.from_config(database_url, config.database, application_name=self.holder, tls=config.tls)
        self.event_log = PostgresEventLog.connect(self.pg)
        self.election = LeaderElection(
            self.pg, self.holder, renew_interval_s=c.heartbeat_interval_ms / 1000,
            takeover_after_s=c.missed_heartbeats * c.heartbeat_interval_ms / 1000, logger=logger)
        self.ledger = Ledger(self.event_log, CoreParams.from_config(c), batch_ms=c.commit_batch_ms,
                             batch_max=c.commit_batch_max, snapshot_every=c.snapshot_every_events,
                             metrics=self.metrics, logger=logger, on_not_leader=self._not_leader,
                             snapshot_fork=c.snapshot_fork, snapshot_timeout_s=c.snapshot_timeout_s,
                             rejection_interval_ms=c.rejection_interval_ms)
        self.ledger.leadership_confirmed = self.election.confirmed
        self.metrics.watch_pools(self.pool_usage)
        self.metrics.watch_workers(self.worker_states)
        self.metrics.watch_append_paths(lambda: dict(self.event_log.append_paths))
        self.metrics.registry.register(ChainHeadCollector(lambda: self.event_log.chain_head))
        self.nc: NatsClient | None = None
        self.service: NatsService | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._stepped_down = asyncio.Event()
        #: Resolves (with the reason) if the coordinator cannot go on; the process exits on it.
        self.fatal: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._step_reason = ""
        self._stopping = False
        self._last_nats_error = ""
        self._nats_down = False
        #: While standby: the task folding the leader's events (see ``Ledger.follow``).
        self._follower: asyncio.Task[None] | None = None
        self._follow_stop = asyncio.Event()
        self._reclaim: asyncio.Task[None] | None = None
        #: The shard map's store, when sharded (its versions are followed: ``_follow_shard_map``).
        self.shard_store: Any = None

    # --- start / stop ----------------------------------------------------------------------

    async def start(self) -> None:
        timeout = max(self.config.nats.request_timeout_ms / 1000, 2.0)
        user = self.config.nats.user
        own = nats_auth.coordinator(self.config.coordinator.shard).user
        if user and nats_auth.Identity.parse(user).user != own:
            raise StartupError(f"config key nats.user: the coordinator of shard {self.config.coordinator.shard} connects "
                               f"as {own!r}, not {user!r} (each identity may act only on its own subjects)")
        nc = NatsClient()
        try:
            # NOTE: with unlimited reconnects nats-py retries the *first* connection forever too;
            # at start an unreachable NATS is a configuration problem, so bound it.
            await asyncio.wait_for(nc.connect(
                nats_servers(self.nats_url), name=f"kvl-coordinator {self.holder}", connect_timeout=timeout,
                allow_reconnect=True, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                error_cb=self._nats_error, disconnected_cb=self._nats_disconnected,
                reconnected_cb=self._nats_reconnected, **nats_tls_kwargs(self.config.tls),
                **nats_auth.connect_kwargs(self.config.nats)), timeout=2 * timeout)
        except Exception as e:  # noqa: BLE001 - one readable line for the operator
            await bounded(nc.close(), 2)
            why = self._last_nats_error or f"{type(e).__name__}: {e}"
            raise StartupError(f"cannot connect to NATS at {mask_credentials(self.nats_url)}: {why}") from e
        self.nc = nc
        self.service = NatsService(self.nc, self.subjects, self.ledger, config=self.config, metrics=self.metrics,
                                   logger=self.log)
        self.ledger.on_watermarks = self.service.publish_watermarks
        try:
            await self.service.ensure_stream()
            await self.service.start_consumer()
        except StartupError:
            raise
        except Exception as e:  # noqa: BLE001
            raise StartupError(f"cannot set up the JetStream stream {self.subjects.stream_name}: "
                               f"{type(e).__name__}: {e}") from e
        await self._check_database()
        if self.ledger.params.shard_map is not None:
            await self._load_shard_map()
        self._tasks = [asyncio.create_task(self._leadership_loop(), name="leadership"),
                       asyncio.create_task(self._expire_loop(), name="expiry"),
                       asyncio.create_task(self._replication_loop(), name="replication")]
        if self.shard_store is not None:
            self._tasks.append(asyncio.create_task(self._follow_shard_map(), name="shard-map"))
        self.log.info("coordinator_started", holder=self.holder, prefix=self.subjects.prefix,
                      stream=self.subjects.stream_name, shard=self.config.coordinator.shard,
                      shards=self.config.coordinator.shards)

    # --- the shard map (a sharded ledger: docs/architecture.md, "The ledger sharded") ----------

    async def _load_shard_map(self) -> None:
        """The deployment's map before anything is decided: the config's static map is only the
        first version, and a moved partition must never be leased by its old owner."""
        assert self.nc is not None
        from shared.shard_store import ShardMapStore

        self.shard_store = ShardMapStore(self.nc.jetstream(), self.config.nats.subject_prefix,
                                         replicas=self.config.nats.stream_replicas or len(nats_servers(self.nats_url)))
        try:
            stored, _ = await self.shard_store.load(self.ledger.params.shard_map)
        except Exception as e:  # noqa: BLE001 - one readable line for the operator
            raise StartupError(f"cannot read the shard map ({self.shard_store.bucket}): {type(e).__name__}: {e}") from e
        if (why := self._take_shard_map(stored, initial=True)):
            raise StartupError(f"the shard map in {self.shard_store.bucket} does not fit this coordinator: {why}")

    def _take_shard_map(self, new: Any, *, initial: bool = False) -> str:
        """Decide by ``new`` from now on, if it is this deployment's and newer; why not otherwise."""
        from shared.shard_store import accepts

        c = self.config.coordinator
        held = self.ledger.params.shard_map
        why = accepts(None if initial else held, new, c.shards, c.shard_partitions)
        if why:
            return why
        params = dataclasses.replace(self.ledger.params, shard_map=new)
        # NOTE: both, in one step of the loop: the live state decides by its params, and a rebuild
        # (takeover, failed append) starts from the ledger's
        self.ledger.params = params
        self.ledger.state.params = params
        self.log.info("shard_map", version=new.version, owned=len(new.owned_by(c.shard)),
                      moving=[mv.partition for mv in new.moving])
        return ""

    async def _follow_shard_map(self) -> None:
        """Read the stored map every heartbeat interval and take a newer one. NOTE: a read, not a
        KV watch: a watch's consumer lost with a NATS server would stop the updates without a
        word, and a freeze missed is a partition still leased by the shard it is leaving (the move
        waits for each shard's ``map_version``, but this keeps the wait short)."""
        assert self.shard_store is not None
        interval = self.config.coordinator.heartbeat_interval_ms / 1000
        failing = False
        while True:
            await asyncio.sleep(interval)
            try:
                stored = await self.shard_store.get()
            except Exception as e:  # noqa: BLE001 - NATS away: read again at the next interval
                if not failing:
                    self.log.warning("shard_map_unreadable", error=f"{type(e).__name__}: {e}")
                failing = True
                continue
            if failing:
                self.log.info("shard_map_readable")
            failing = False
            held = self.ledger.params.shard_map
            if stored is None or held is None or stored.version <= held.version:
                continue
            if (why := self._take_shard_map(stored)):
                self.log.error("shard_map_refused", version=stored.version, why=why)

    async def _check_database(self) -> None:
        """Fail fast on a database that can never work (bad credentials, no such database);
        an unreachable one is waited for by the leadership loop."""
        try:
            await self.event_log.ping()
        except LogUnavailable as e:
            self.log.warning("database_unreachable", error=str(e), action="waiting for it")
        except LogError as e:
            raise StartupError(f"PostgreSQL at {self.pg.url.split('@')[-1]}: {e}") from e

    async def stop(self) -> None:
        """Graceful: stop taking work, answer what was taken, flush, release the lock, drain NATS.

        Every step is bounded, so a dead PostgreSQL or NATS cannot make shutdown hang.
        """
        self._stopping = True
        steps: dict[str, float] = {}
        t = time.perf_counter()

        def step(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            steps[name] = round((now - t) * 1000, 1)
            t = now

        if self.service is not None:
            await bounded(self.service.stop_requests(), 5)
            self.service.pause_consumer()
            await self.service.wait_in_flight(timeout_s=10)
        step("requests")
        await self._stop_following()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            await bounded(task, 5)
        step("tasks")
        await bounded(self.ledger.stand_down("shutting down", flush=True), 15)
        self.ledger.set_status("stopped", "shut down")
        step("flush")
        await self.election.release()
        step("lock")
        if self.service is not None:
            await bounded(self.service.stop_consumer(), 5)
        step("consumer")
        if self.nc is not None and not await bounded(self.nc.drain(), 5):
            await bounded(self.nc.close(), 2)
        step("nats")
        await bounded(self.event_log.close(), 5)
        step("pool")
        self.log.info("coordinator_stopped", holder=self.holder, steps_ms=steps)

    # --- leadership -------------------------------------------------------------------------

    def _not_leader(self, reason: str) -> None:
        self._step_reason = f"fenced: {reason}"
        self._stepped_down.set()

    async def _ensure_schema(self) -> None:
        """Migrate the schema to head if it is behind. The coordinator's own role (a member of
        ``kvledger_writer``, migration 0003) may not migrate: then it waits, saying so, for the
        owner to run ``kvledger db upgrade`` (``database.owner_url``), and leads once that is done."""
        from coordinator.log.postgres import SCHEMA_REVISION, sqlstate

        head = SCHEMA_REVISION
        delay, last, rev = 0.1, "", None
        while True:
            try:
                rev = await self.event_log.schema_revision()
                if rev == head:
                    return
                from coordinator.log.migrate import known_revisions, upgrade  # only when not at head (slow import)

                if rev is not None and rev not in known_revisions():
                    raise StartupError(
                        f"the event log's schema is at revision {rev}, which this coordinator (schema {head}) does not "
                        f"know: a newer release migrated it. Run that release, or roll the schema back with its "
                        f"`kvledger db downgrade {head}` first (docs/operations.md, 'Releases and rollback')")
                await upgrade(self.event_log.engine)
                return
            except StartupError:
                raise
            except Exception as e:  # noqa: BLE001 - waits for an unreachable database; anything else is fatal
                if sqlstate(e) == "42501":  # insufficient_privilege: not the owner
                    why = f"schema at revision {rev or 'none'}, this coordinator needs {head}: {describe(e)}"
                    if why != last:
                        self.log.warning("event_log_schema_behind", error=why, action=(
                            "waiting: this role may not migrate; run `kvledger db upgrade` as the schema owner "
                            "(database.owner_url)"))
                    last = why
                    await asyncio.sleep(1.0)
                    continue
                if not (isinstance(e, LogUnavailable) or is_unavailable(e)):
                    raise StartupError(f"cannot migrate the event log schema: {describe(e)}") from e
                if describe(e) != last:
                    self.log.warning("database_unreachable", error=describe(e), action="retrying")
                last = describe(e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _leadership_loop(self) -> None:
        try:
            while not self._stopping:
                try:
                    await self._lead_once()
                except (StartupError, asyncio.CancelledError):
                    raise
                except Exception as e:  # noqa: BLE001 - never let leadership die silently
                    self.log.error("leadership_loop_error", error=f"{type(e).__name__}: {e}", exc_info=True)
                    await asyncio.sleep(1.0)
        except StartupError as e:
            self.log.error("coordinator_cannot_continue", error=str(e))
            if not self.fatal.done():
                self.fatal.set_result(str(e))

    async def _lead_once(self) -> None:
        assert self.service is not None
        await self._ensure_schema()
        # NOTE: a standby polls the lock often: a killed leader's lock is free at once, and a
        # takeover within a second or two is what keeps workers' leases and epochs alive.
        epoch = await self.election.acquire(poll_s=min(self.election.renew_interval_s, 0.25),
                                            on_wait=self._waiting_for_lock)
        await self._stop_following()
        self._stepped_down.clear()
        self.log.info("leader_elected", leader_epoch=epoch, holder=self.holder)
        try:
            await self.service.start_requests()
            await self.ledger.take_over(epoch)
            try:
                await self.service.reclaim_in_flight()
            except Exception as e:  # noqa: BLE001 - only a delay: un-acked messages come back after ack_wait
                self.log.warning("consumer_reclaim_failed", error=f"{type(e).__name__}: {e}")
            if self.freeze_gc:
                # NOTE: what exists now — every library's modules, classes and functions (the
                # migration's too), the state just loaded — lives on: the cyclic collector need
                # not walk it again. Without this each full collection walked ~100k such objects,
                # a 30-80 ms pause while serving (a lease's p99 at 64 in flight: ~100 ms, with it
                # ~20-40 ms). Frozen objects are still freed by reference counting.
                gc.collect()
                gc.freeze()
            self.service.resume_consumer()
        except (LogError, LogCorrupt, Unavailable) as e:
            self.log.error("takeover_failed", error=str(e), leader_epoch=epoch)
            await self._stand_down(f"takeover failed: {e}", still_ours=not self._stepped_down.is_set())
            await asyncio.sleep(1.0)
            return
        lost = asyncio.create_task(self.election.lost())
        stepped = asyncio.create_task(self._stepped_down.wait())
        try:
            await asyncio.wait({lost, stepped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (lost, stepped):
                t.cancel()
        fenced = self._stepped_down.is_set()
        reason = self._step_reason if fenced else (lost.result() if lost.done() and not lost.cancelled()
                                                   else "stopping")
        fenced = fenced or reason.startswith("fenced")
        self.log.warning("leadership_lost", reason=reason, leader_epoch=epoch)
        await self._stand_down(reason, still_ours=not fenced)

    async def _waiting_for_lock(self, why: str) -> None:
        """While waiting for the lock: another live leader holds it → leave the queue group to it."""
        assert self.service is not None
        if why == "held" and self.service.subscribed:
            await self.service.stop_requests()
            self.ledger.set_status("standby", "another coordinator is the leader")
            self.log.info("standing_by", reason="another coordinator holds the leader lock")
        if why == "held" and self._follower is None:
            self._follow_stop = asyncio.Event()
            self._follower = asyncio.create_task(self.ledger.follow(self._follow_stop), name="follow-log")

    async def _stop_following(self) -> None:
        """Let the follower finish the catch-up under way (a takeover continues from it rather
        than reloading), then stop it; cancelled if it does not end within a few seconds."""
        task, self._follower = self._follower, None
        if task is None:
            return
        self._follow_stop.set()
        if not await bounded(task, 5):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _stand_down(self, reason: str, *, still_ours: bool) -> None:
        """Stop serving. ``still_ours``: nobody else is known to lead (e.g. PostgreSQL went away)."""
        assert self.service is not None
        self.service.pause_consumer()
        # still ours: keep answering (UNAVAILABLE) until we lead again
        await self.ledger.stand_down(reason, flush=False, status="degraded" if still_ours else "standby")
        if not still_ours:
            await self.service.stop_requests()
        await self.election.release()

    async def _reclaim_in_flight(self) -> None:
        assert self.service is not None
        # NOTE: tried again: a reclaim cut short after its delete leaves no consumer until one succeeds
        for attempt in range(5):
            try:
                await self.service.reclaim_in_flight()
                return
            except Exception as e:  # noqa: BLE001 - only a delay while a later attempt can succeed
                self.log.warning("consumer_reclaim_failed", error=f"{type(e).__name__}: {e}", attempt=attempt + 1)
                await asyncio.sleep(0.5 * 2 ** attempt)

    async def _expire_loop(self) -> None:
        """Liveness and lease decisions once per heartbeat interval.

        Silence is blamed on a worker only while this coordinator could have heard it: a
        stalled event loop (SIGSTOP, CPU starvation) or a lost NATS connection moves the
        liveness floor to now, so workers get a full heartbeat timeout from then on.
        """
        interval = max(self.config.coordinator.heartbeat_interval_ms, 100) / 1000
        floor = 0
        last = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            t = time.monotonic()
            if t - last > 2 * interval or self._nats_down:
                floor = now_ms()
                if t - last > 2 * interval:
                    self.log.warning("coordinator_stalled", seconds=round(t - last - interval, 2),
                                     action="liveness clocks restart now; un-acked transitions redelivered")
                    # NOTE: pull requests that expired while we were stopped leave their messages
                    # un-acked until ack_wait (10 s): watermarks, and so reuse, would stall that long.
                    if t - last > 1.0 and self.service is not None and self.ledger.serving:
                        self._reclaim = asyncio.create_task(self._reclaim_in_flight())
            last = t
            if self.ledger.serving:
                seen = self.ledger.seen
                with contextlib.suppress(Unavailable):
                    await self.ledger.execute(lambda s: (None, expire(s, now_ms(), seen, floor)))

    async def _replication_loop(self) -> None:
        """While serving, every ``database.standby_check_interval_s``: the standbys of the server the
        log is written to, into ``kvl_coordinator_database_standbys`` / ``_synchronous`` (a
        synchronous server with none streaming stalls every append; alert KvlDatabaseStandbyMissing)."""
        every = self.config.database.standby_check_interval_s
        while every:
            await asyncio.sleep(every)
            if not self.ledger.serving:
                continue
            with contextlib.suppress(LogError):  # PostgreSQL away: the append path reports it
                standbys, synchronous = await self.event_log.replication()
                self.metrics.database_standbys.set(standbys)
                self.metrics.database_synchronous.set(int(synchronous))

    # --- views ---------------------------------------------------------------------------

    def worker_states(self) -> dict[str, int]:
        out = {"live": 0, "suspended": 0, "lost": 0}
        for w in self.ledger.state.workers.values():
            out["lost" if not w.alive else "suspended" if w.suspended else "live"] += 1
        return out

    def pool_usage(self) -> list[tuple[str, str, int, int]]:
        s = self.ledger.state
        return [(wid, form, s.pool_used(wid, form), cap)
                for wid, w in sorted(s.workers.items()) if w.alive
                for form, cap in sorted(w.pool_slots.items())]

    # --- NATS connection events --------------------------------------------------------------

    async def _nats_error(self, e: Exception) -> None:
        self._last_nats_error = f"{type(e).__name__}: {e}"
        if self.nc is not None:  # during the first connect, the caller reports it once
            self.log.warning("nats_error", error=self._last_nats_error)

    async def _nats_disconnected(self) -> None:
        self._nats_down = True
        if not self._stopping:
            self.log.warning("nats_disconnected")

    async def _nats_reconnected(self) -> None:
        self._nats_down = False
        self.log.info("nats_reconnected")
