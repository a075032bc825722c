"""The gateway's retry settings and address allowlist against real processes (issue 55, item 8):
a coordinator, two workers and gateways, PostgreSQL and NATS. A request whose worker is down
(killed: the connection is refused) is retried on the other worker when ``gateway.retry_on``
holds ``connect``, and answered 502 naming the key when it does not; a gateway whose
``gateway.allowed_networks`` leaves this machine's address out answers 403 before the API key."""

from __future__ import annotations

import asyncio
import sys

import aiohttp
import pytest

from shared.embedded import free_port
from shared.tenants import key_sha256
from tests.e2e.test_gateway import turns, wait_ready
from tests.worker.processes import Cluster, Proc, running_cluster

KEY = "sk-retry-key"
AUTH = {"keys": [{"key_sha256": key_sha256(KEY), "tenant": "alpha"}], "salt_secret": "s3cret"}


@pytest.fixture
async def cluster(tmp_path, database_url, nats_url, subjects):
    async with running_cluster(tmp_path, database_url, nats_url, subjects, auth=AUTH) as c:
        yield c


def start_gateway(cluster: Cluster, name: str, **gateway: object) -> tuple[Proc, str]:
    port = free_port()
    doc = cluster.base()
    doc["gateway"] = {"port": port, "fleet_refresh_ms": 200, "worker_down_ms": 3000, "gateway_id": name, **gateway}
    cfg = cluster._write(name, doc)
    p = Proc(name, [sys.executable, "-m", "gateway", "--config", str(cfg)], cluster.tmp / f"{name}.log", cluster._env())
    cluster.procs.append(p)
    return p, f"http://127.0.0.1:{port}"


async def post(http: aiohttp.ClientSession, url: str, prompt: str, key: str | None = KEY) -> tuple[int, dict, str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0},
                         headers=headers) as r:
        return r.status, await r.json(content_type=None), r.headers.get("x-kvl-worker", "")


async def listening(http: aiohttp.ClientSession, url: str, proc: Proc, timeout_s: float = 60) -> None:
    """Until the gateway at ``url`` answers at all (a refused connection: not started yet). One that
    refuses every address answers 403 and is never ready, so ``wait_ready`` cannot wait for it; on a
    loaded CI machine the first post found it not yet listening."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        assert proc.alive, proc.name
        try:
            async with http.get(url + "/readyz") as r:
                await r.read()
                return
        except aiohttp.ClientConnectorError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


async def metric(http: aiohttp.ClientSession, url: str, line_start: str) -> float:
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(line_start))


async def test_a_down_worker_is_retried_as_configured_and_the_allowlist_refuses_first(cluster) -> None:
    cluster.start_coordinator()
    for wid in ("wa", "wb"):
        cluster.start_worker(wid, worker={"port": 0})
    for wid in ("wa", "wb"):
        await cluster.wait_worker(wid)
    retries, url = start_gateway(cluster, "gw-retry", allowed_networks=["127.0.0.0/8", "::1"], retry_backoff_ms=20)
    strict, strict_url = start_gateway(cluster, "gw-strict", retry_on=[503])
    closed, closed_url = start_gateway(cluster, "gw-closed", allowed_networks=["192.0.2.0/24"])
    async with aiohttp.ClientSession() as http:
        await wait_ready(http, url, retries, usable=2)
        await wait_ready(http, strict_url, strict, usable=2)
        await listening(http, closed_url, closed)

        # outside the list: 403 before anything, with or without a key, probes included
        for key in (KEY, None, "sk-wrong"):
            status, doc, _ = await post(http, closed_url, "hello", key)
            assert status == 403 and doc["error"]["code"] == "address_not_allowed", doc
            assert "gateway.allowed_networks" in doc["error"]["message"]
        async with http.get(closed_url + "/readyz") as r:
            assert r.status == 403
        assert closed.alive

        prompts = turns("retry", 2)
        status, _, home = await post(http, url, prompts[0])
        assert status == 200 and home in ("wa", "wb")
        cluster.workers[home].kill()
        # the coordinator still lists the dead worker and the route prefers its cache: refused.
        # retry_on without `connect`: the client gets the failure, naming the key
        status, doc, _ = await post(http, strict_url, prompts[1])
        assert status == 502 and doc["error"]["code"] == "worker_failed", doc
        assert "connection refused" in doc["error"]["message"] and "gateway.retry_on" in doc["error"]["message"]
        # the default retry_on: the other worker answers
        status, doc, worker = await post(http, url, prompts[1])
        assert status == 200 and worker != home, doc
        assert await metric(http, url, 'kvl_gateway_failovers_total{why="connection refused"}') == 1
        assert await metric(http, strict_url, "kvl_gateway_failovers_total") == 0
    lines = [ln for ln in (cluster.tmp / "gw-strict.log").read_text().splitlines() if "worker_failed" in ln]
    assert lines and '"retried": false' in lines[-1]
