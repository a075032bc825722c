"""Gradual rollout through a real gateway in front of two real workers of different versions
(``worker.version``), a real coordinator, PostgreSQL and NATS: requests without a cached prefix
go to the versions by ``gateway.version_weights``, a request whose prefix one worker holds still
goes to it whatever its version, ``kvl_gateway_version_requests_total`` counts each version, and
the next step of the rollout is a reload of the gateway's config (SIGHUP), not a restart."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import time

import aiohttp
import pytest

from shared.embedded import free_port
from tests.e2e.test_gateway import AUTH, KEYS, complete, turns, wait_ready
from tests.worker.processes import Cluster, Proc, running_cluster

OLD, NEW = "1.4.0", "1.5.0"


@pytest.fixture
async def cluster(tmp_path, database_url, nats_url, subjects):
    async with running_cluster(tmp_path, database_url, nats_url, subjects, auth=AUTH) as c:
        yield c


def gateway_config(cluster: Cluster, name: str, port: int, weights: dict[str, int]):
    doc = cluster.base()
    doc["gateway"] = {"gateway_id": name, "port": port, "fleet_refresh_ms": 200, "version_weights": weights}
    return cluster._write(name, doc)


def start_gateway(cluster: Cluster, name: str, weights: dict[str, int]) -> tuple[Proc, str]:
    port = free_port()
    p = Proc(name, [sys.executable, "-m", "gateway", "--config", str(gateway_config(cluster, name, port, weights))],
             cluster.tmp / f"{name}.log", cluster._env())
    cluster.procs.append(p)
    return p, f"http://127.0.0.1:{port}"


async def wait_versions(http: aiohttp.ClientSession, url: str, want: dict[str, int], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    body: dict = {}
    while time.monotonic() < deadline:
        async with http.get(url + "/readyz") as r:
            body = await r.json()
        if body.get("versions") == want:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"the gateway never learned the versions {want}: {body}")


async def metric(http: aiohttp.ClientSession, url: str, name: str, label: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    return {v: float(n) for v, n in re.findall(rf'^{name}\{{{label}="([^"]*)"\}} (\S+)$', text, re.M)}


async def version_counts(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    return await metric(http, url, "kvl_gateway_version_requests_total", "version")


async def test_version_weights_share_new_prompts_and_never_move_a_cached_prefix(cluster) -> None:
    cluster.start_coordinator()
    cluster.start_worker("old", worker={"port": 0, "version": OLD})
    cluster.start_worker("new", worker={"port": 0, "version": NEW})
    for wid in ("old", "new"):
        await cluster.wait_worker(wid)
    # step one of a rollout: the new version takes none of the new traffic
    gw, url = start_gateway(cluster, "gw-a", {OLD: 100, NEW: 0})
    async with aiohttp.ClientSession() as http:
        await wait_ready(http, url, gw, usable=2)
        await wait_versions(http, url, {OLD: 1, NEW: 1})
        for i in range(6):
            worker, route, _, _ = await complete(http, url, "alpha", turns(f"fresh {i}", 2)[-1])
            assert (worker, route.split(";")[0]) == ("old", "version"), route
        # a conversation the new worker holds (sent to it directly) stays there through the gateway
        new_url = await cluster.http_url("new")
        prompts = turns("held by the new worker", 3)
        async with http.post(new_url + "/v1/completions", json={"prompt": prompts[0], "max_tokens": 2},
                             headers={"Authorization": f"Bearer {KEYS['alpha']}"}) as r:
            assert r.status == 200, await r.text()
        await asyncio.sleep(0.5)        # its blocks committed to the ledger (the route answer reads them)
        for prompt in prompts[1:]:
            worker, route, cached, _ = await complete(http, url, "alpha", prompt)
            assert (worker, route.split(";")[0]) == ("new", "cache") and cached > 0, route
        assert await version_counts(http, url) == {OLD: 6.0, NEW: 2.0}
        async with http.get(new_url + "/version") as r:
            assert (await r.json())["version"] == NEW
        # the last step, by a reload (SIGHUP) of the same gateway: every new prompt to the new version
        gateway_config(cluster, "gw-a", int(url.rsplit(":", 1)[1]), {OLD: 0, NEW: 1})
        gw.signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while (await metric(http, url, "kvl_gateway_auth_reloads_total", "outcome")).get("ok") != 1.0:
            assert time.monotonic() < deadline and gw.alive, gw.tail()
            await asyncio.sleep(0.1)
        for i in range(4):
            worker, route, _, _ = await complete(http, url, "alpha", turns(f"later {i}", 2)[-1])
            assert (worker, route.split(";")[0]) == ("new", "version"), route
        assert await version_counts(http, url) == {OLD: 6.0, NEW: 6.0}
