"""The gateway in front of two real workers, a real coordinator, PostgreSQL and NATS.

Each turn of a conversation lands on the worker holding its prefix (the route query's answer,
realised by the worker's own lease); tenants do not share hashes, so one tenant's prefix
never routes another's request; a drained worker receives nothing new; a killed worker's
requests go to the other one without a client error.
"""

from __future__ import annotations

import asyncio
import sys
import time

import aiohttp
import pytest

from shared.embedded import free_port
from tests.worker.processes import Cluster, Proc
from shared.tenants import key_sha256

KEYS = {"alpha": "sk-alpha-key", "beta": "sk-beta-key"}
AUTH = {"keys": [{"key_sha256": key_sha256(k), "tenant": t} for t, k in KEYS.items()], "salt_secret": "s3cret"}


@pytest.fixture
async def cluster(tmp_path, database_url, nats_url, subjects):
    c = Cluster(tmp_path, database_url, nats_url, subjects)
    base = c.base
    c.base = lambda: {**base(), "auth": AUTH}    # workers and gateway: the same keys and salt secret
    await c.connect()
    try:
        yield c
    finally:
        c.stop_all()
        await c.close()


def start_gateway(cluster: Cluster) -> tuple[Proc, str]:
    port = free_port()
    doc = cluster.base()
    doc["gateway"] = {"port": port, "fleet_refresh_ms": 200, "worker_down_ms": 3000}
    cfg = cluster._write("gateway", doc)
    p = Proc("gateway", [sys.executable, "-m", "gateway", "--config", str(cfg)], cluster.tmp / "gateway.log",
             cluster._env())
    cluster.procs.append(p)
    return p, f"http://127.0.0.1:{port}"


async def wait_ready(http: aiohttp.ClientSession, url: str, proc: Proc, usable: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.alive, proc.tail()
        try:
            async with http.get(url + "/readyz") as r:
                body = await r.json()
                if r.status == 200 and body["usable"] >= usable:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"gateway not ready: {proc.tail()}")


async def complete(http, url: str, tenant: str, prompt: str, stream: bool = False) -> tuple[str, str, int, str]:
    """(worker, route header, cached tokens, text) of one completion through the gateway."""
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with http.post(url + "/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as r:
        assert r.status == 200, await r.text()
        worker, route = r.headers["x-kvl-worker"], r.headers["x-kvl-route"]
        if not stream:
            doc = await r.json()
            return worker, route, doc["usage"]["prompt_tokens_details"]["cached_tokens"], doc["choices"][0]["text"]
        raw = (await r.read()).decode()
    chunks = [line[6:] for line in raw.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    import json
    docs = [json.loads(c) for c in chunks]
    usage = next(d["usage"] for d in reversed(docs) if d.get("usage"))
    return worker, route, usage["prompt_tokens_details"]["cached_tokens"], "".join(
        d["choices"][0]["text"] for d in docs if d.get("choices"))


def turns(seed: str, n: int) -> list[str]:
    out, text = [], ""
    for i in range(n):
        text += f"{seed} turn {i}: the ledger records every state change of every cached block. "
        out.append(text)
    return out


async def test_turns_follow_their_cache_tenants_stay_apart_drain_and_kill(cluster) -> None:
    cluster.start_coordinator()
    for wid in ("wa", "wb"):
        cluster.start_worker(wid, worker={"port": 0}, )
    for wid in ("wa", "wb"):
        await cluster.wait_worker(wid)
    gw, url = start_gateway(cluster)
    async with aiohttp.ClientSession() as http:
        await wait_ready(http, url, gw, usable=2)
        # two conversations of tenant alpha: every later turn lands where the earlier ones are cached
        homes: dict[str, str] = {}
        for conv in ("first", "second", "third"):
            for i, prompt in enumerate(turns(conv, 3)):
                worker, route, cached, _ = await complete(http, url, "alpha", prompt)
                if i == 0:
                    homes[conv] = worker
                else:
                    assert worker == homes[conv], (conv, i, route)
                    assert route.startswith("cache") and cached > 0, (conv, i, route, cached)
        # tenant beta sends alpha's exact prompt: its salt makes other hashes, so no cache route
        worker, route, cached, _ = await complete(http, url, "beta", turns("first", 3)[-1])
        assert cached == 0 and not route.startswith("cache"), route
        # streamed through unbuffered, still routed by cache
        worker, route, cached, text = await complete(http, url, "alpha", turns("first", 4)[-1], stream=True)
        assert worker == homes["first"] and cached > 0 and text
        # drain the home of "first": its next turn goes to the other worker
        home = homes["first"]
        other = "wb" if home == "wa" else "wa"
        async with http.post(f"http://127.0.0.1:{cluster.admin_port}/v1/workers/{home}/drain",
                             json={"reason": "test"}) as r:
            assert r.status == 200, await r.text()
        await asyncio.sleep(0.6)                                   # one fleet refresh or more
        worker, route, _, _ = await complete(http, url, "alpha", turns("first", 5)[-1])
        assert worker == other, route
        # kill the other one: nothing usable is left
        cluster.workers[other].kill()
        for k in range(3):
            async with http.post(url + "/v1/completions", json={"prompt": f"after the kill {k}", "max_tokens": 1},
                                 headers={"Authorization": f"Bearer {KEYS['alpha']}"}) as r:
                # the only usable worker is gone and the drained one takes nothing new: a clear
                # 502 (the request that found it dead) or 503 (it is marked down), never a hang
                assert r.status in (502, 503), await r.text()
                if r.status in (502, 503):
                    assert (await r.json())["error"]["code"] in ("no_worker", "worker_failed")
                    assert r.headers.get("Retry-After")
        async with http.get(url + "/metrics") as r:
            text = await r.text()
        assert 'kvl_gateway_route_decisions_total{reason="cache"}' in text
        assert "kvl_gateway_failovers_total" in text or "worker_failed" in text


async def test_failover_to_the_next_worker_when_the_first_is_dead(cluster) -> None:
    cluster.start_coordinator()
    for wid in ("wa", "wb"):
        cluster.start_worker(wid, worker={"port": 0})
    for wid in ("wa", "wb"):
        await cluster.wait_worker(wid)
    gw, url = start_gateway(cluster)
    async with aiohttp.ClientSession() as http:
        await wait_ready(http, url, gw, usable=2)
        prompts = turns("failover", 2)
        home, _, _, _ = await complete(http, url, "alpha", prompts[0])
        cluster.workers[home].kill()
        # the coordinator still lists the dead worker (its heartbeats are not overdue yet) and the
        # route still prefers its cache: the connection is refused, the next worker answers
        worker, _, _, text = await complete(http, url, "alpha", prompts[1])
        assert worker != home and text is not None
        async with http.get(url + "/metrics") as r:
            assert 'kvl_gateway_failovers_total{why="connection refused"} 1.0' in await r.text()
