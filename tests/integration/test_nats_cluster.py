"""A three-node embedded NATS cluster (shared/nats_cluster.py) under a real coordinator and PostgreSQL.

* Every node enforces the same identities: each accepts a user's own password and refuses a
  wrong one, and the route user cannot log in as a client.
* The coordinator, given the three servers, makes the transitions stream R3; one node is killed
  (the stream's leader): the coordinator and the worker carry on through the others, every
  transition the watermark acknowledged is in the log, and the node, restarted from its store,
  rejoins and catches up (its replica current again, ``kvl_coordinator_stream_replicas_current``
  back at 3). The audit is clean.
* A stream with more replicas than the cluster has is a readable startup error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest

from coordinator.app import COORDINATOR
from coordinator.stream import StartupError, TransitionStream
from shared.config import nats_servers
from shared.logging import get_logger
from shared.nats_auth import CredentialStore, inbox_prefix, worker
from shared.nats_cluster import ROUTE_PASSWORD_FILE, ROUTE_USER, NatsCluster
from shared.subjects import Subjects
from tests.integration.coordinator_kit import Worker, block, fast_config, running_coordinator


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    c = NatsCluster(tmp_path / "nats", 3).start(60)
    try:
        yield c
    finally:
        c.stop()


async def _connect(url: str, **kw: Any) -> Any:
    return await nats.connect(nats_servers(url), connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0,
                              **kw)


async def test_every_node_knows_the_same_users_a_reload_adds_one_and_no_client_logs_in_as_the_route(tmp_path: Path) -> None:
    store = CredentialStore(tmp_path / "credentials")
    conf = store.write_server_config([worker("w0")], Subjects("kvl"))
    c = NatsCluster(tmp_path / "nats", 3, config_file=str(conf)).start(60)
    try:
        ident = worker("w0")
        for node in c.nodes:
            nc = await _connect(node.url, user=ident.user, password=store.password(ident),
                                inbox_prefix=inbox_prefix(ident.user))
            assert nc.connected_server_version.major >= 2
            await nc.close()
            with pytest.raises(Exception, match="(?i)authorization"):
                await _connect(node.url, user=ident.user, password="wrong")
            route_pw = (c.data_dir / ROUTE_PASSWORD_FILE).read_text().strip()
            with pytest.raises(Exception, match="(?i)authorization"):
                await _connect(node.url, user=ROUTE_USER, password=route_pw)
        # a new identity: the users file rewritten, every node reloaded (each includes the same file)
        late = worker("w9")
        store.write_server_config([worker("w0"), late], Subjects("kvl"))
        c.reload()
        for node in c.nodes:
            deadline = time.monotonic() + 10
            while True:
                try:
                    nc = await _connect(node.url, user=late.user, password=store.password(late),
                                        inbox_prefix=inbox_prefix(late.user))
                    break
                except Exception:  # noqa: BLE001 - the reload is asynchronous
                    assert time.monotonic() < deadline, f"{late.user} not known to {node.url} after a reload"
                    await asyncio.sleep(0.1)
            await nc.close()
        assert oct((c.data_dir / ROUTE_PASSWORD_FILE).stat().st_mode & 0o777) == "0o600"
        assert oct((c.nodes[0].data_dir / "node.conf").stat().st_mode & 0o777) == "0o600"
    finally:
        c.stop()


async def _retrying(op: Any, what: str, timeout_s: float = 30) -> Any:
    """``await op()`` until it succeeds: while a node is down, a client whose node it was reconnects
    and the stream elects a new leader, and a request or publish in between fails or times out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await op()
        except (nats.errors.Error, asyncio.TimeoutError) as e:
            assert time.monotonic() < deadline, f"{what}: no progress on the surviving nodes in {timeout_s} s: {e!r}"
            await asyncio.sleep(0.3)


async def _stream_cluster(js: Any, name: str) -> Any:
    return (await js.stream_info(name)).cluster


async def _audit_clean(base: str) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base}/v1/audit", json={"check_workers": False}) as r:
            report = await r.json()
    assert r.status == 200 and report["ok"], report


async def test_the_stream_is_r3_and_a_killed_node_loses_nothing_and_catches_up(
        cluster: NatsCluster, database_url: str) -> None:
    subjects = Subjects("kvlc")
    cfg = fast_config(database_url, cluster.url, subjects)
    nc = await nats.connect(nats_servers(cluster.url), max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    try:
        async with running_coordinator(cfg) as (app, base):
            js = nc.jetstream(timeout=5)
            info = await js.stream_info(subjects.stream_name)
            assert info.config.num_replicas == 3
            assert len(info.cluster.replicas) == 2 and info.cluster.leader in cluster.names
            stream = app[COORDINATOR].service.stream
            assert await stream.observe_replicas() == 3

            w = Worker(nc, subjects, "w1")
            await w.register()
            await w.watch_watermarks()
            await w.fill([block(i) for i in range(4)])

            # kill -9 the node that leads the stream: a new leader is elected from the other two
            victim = cluster.names.index((await _stream_cluster(js, subjects.stream_name)).leader)
            cluster.nodes[victim].kill()
            hashes = [block(100 + i) for i in range(4)]
            grant = await _retrying(lambda: w.acquire(hashes), "a lease")
            assert hasattr(grant, "lease_id"), grant
            for i in range(len(hashes)):
                t = w.commit(hashes, i, grant.lease_id)
                await _retrying(lambda: w.publish(t), "a publish")   # the same Nats-Msg-Id: stored once
            await w.wait_watermark(w.seq, 30)
            during = await _stream_cluster(js, subjects.stream_name)
            assert during.leader != cluster.names[victim]
            assert await stream.observe_replicas() == 2

            # every acknowledged commit (the watermark covers it) is in the log
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{base}/v1/events", params={"after": 0, "limit": 1000}) as r:
                    events = (await r.json())["events"]
            logged = {e["source_id"] for e in events if e["type"].startswith("transition.")}
            acked = {f"w1.{w.epoch}.{s}" for s in range(1, w.watermark + 1)}
            assert acked and acked <= logged, sorted(acked - logged)

            # the node rejoins from its store and catches up: its replica current again
            cluster.nodes[victim].start(30)
            deadline = time.monotonic() + 60
            while await stream.observe_replicas() < 3:
                assert time.monotonic() < deadline, await _stream_cluster(js, subjects.stream_name)
                await asyncio.sleep(0.2)
            after = await _stream_cluster(js, subjects.stream_name)
            assert {p.name for p in after.replicas} | {after.leader} == set(cluster.names)
            assert all(p.current and not p.offline for p in after.replicas)
            cluster.wait_healthy(victim, 30)
            assert cluster.jetstream(victim).get("streams") == 1   # it holds its replica again
            await _audit_clean(base)
    finally:
        await nc.close()


async def test_a_cluster_restarted_from_its_stores_serves_its_stream_as_soon_as_it_is_started(tmp_path: Path) -> None:
    """What a second `kvledger up` does (new ports, the same stores): once ``start`` returns, the
    stream and its consumer answer at once — not only the meta group (``/healthz``) has a leader."""
    from nats.js.api import ConsumerConfig, StreamConfig

    c = NatsCluster(tmp_path / "nats", 3).start(60)
    try:
        nc = await _connect(c.url)
        js = nc.jetstream(timeout=2)
        await js.add_stream(StreamConfig(name="KVL_R", subjects=["r.>"], num_replicas=3))
        await js.add_consumer("KVL_R", ConsumerConfig(durable_name="d"))
        await js.publish("r.1", b"x")
        await nc.close()
    finally:
        c.stop()
    for _ in range(2):
        c = NatsCluster(tmp_path / "nats", 3).start(60)
        try:
            nc = await _connect(c.url)
            js = nc.jetstream(timeout=2)
            assert (await js.stream_info("KVL_R")).state.messages == 1
            assert (await js.consumer_info("KVL_R", "d")).config.durable_name == "d"
            await nc.close()
        finally:
            c.stop()


async def test_more_replicas_than_the_cluster_has_is_a_readable_error(nats_url: str, subjects: Subjects) -> None:
    """The test NATS is one server: R3 cannot be placed there."""
    cfg = fast_config("postgresql://unused@127.0.0.1/none", nats_url, subjects)
    cfg.nats.stream_replicas = 3
    nc = await nats.connect(nats_url)
    try:
        from coordinator.metrics import CoordinatorMetrics
        stream = TransitionStream(nc.jetstream(), nc, subjects, config=cfg, metrics=CoordinatorMetrics(),
                                  logger=get_logger("test"))
        with pytest.raises(StartupError, match="nats.stream_replicas"):
            await stream.ensure()
    finally:
        await nc.close()

