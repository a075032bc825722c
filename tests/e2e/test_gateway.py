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
from shared.tenant_header import SIGNATURE_HEADER, TENANT_HEADER, sign
from tests.worker.processes import Cluster, Proc, running_cluster
from shared.tenants import key_sha256

KEYS = {"alpha": "sk-alpha-key", "beta": "sk-beta-key", "gamma": "sk-gamma-key"}
#: gamma is rate limited at the door: one request per second, 600 tokens per minute
LIMITS = {"gamma": {"requests_per_second": 1, "tokens_per_minute": 600}}
GATEWAY_SECRET = "gw-s3cret"
AUTH = {"keys": [{"key_sha256": key_sha256(k), "tenant": t, **LIMITS.get(t, {})} for t, k in KEYS.items()],
        "salt_secret": "s3cret", "gateway_secret": GATEWAY_SECRET}


@pytest.fixture
async def cluster(tmp_path, database_url, nats_url, subjects):
    # workers and gateway: the same keys and salt secret
    async with running_cluster(tmp_path, database_url, nats_url, subjects, auth=AUTH) as c:
        yield c


def start_gateway(cluster: Cluster) -> tuple[Proc, str]:
    port = free_port()
    doc = cluster.base()
    doc["gateway"] = {"port": port, "fleet_refresh_ms": 200, "worker_down_ms": 3000}
    cfg = cluster._write("gateway", doc)
    p = Proc("gateway", [sys.executable, "-m", "gateway", "--config", str(cfg)], cluster.tmp / "gateway.log",
             cluster._env())
    cluster.procs.append(p)
    return p, f"http://127.0.0.1:{port}"


async def two_workers_and_a_gateway(cluster: Cluster) -> tuple[Proc, str]:
    """A coordinator, workers ``wa`` and ``wb`` registered, and a gateway started (not yet ready)."""
    cluster.start_coordinator()
    for wid in ("wa", "wb"):
        cluster.start_worker(wid, worker={"port": 0})
    for wid in ("wa", "wb"):
        await cluster.wait_worker(wid)
    return start_gateway(cluster)


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


async def complete(http, url: str, tenant: str, prompt: str, stream: bool = False,
                   max_tokens: int = 2) -> tuple[str, str, int, str]:
    """(worker, route header, cached tokens, text) of one completion through the gateway."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
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
    gw, url = await two_workers_and_a_gateway(cluster)
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
    gw, url = await two_workers_and_a_gateway(cluster)
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


async def test_a_burst_sharing_a_new_prefix_goes_where_it_is_being_computed(cluster) -> None:
    """Nothing cached anywhere, four requests at once with one long new prefix: routed by load alone
    they would spread and each worker would compute it; the gateway counts what its first request
    is computing, so they all go there, and the worker computes the prefix once for all four."""
    gw, url = await two_workers_and_a_gateway(cluster)
    # ~10 blocks: more than the three requests ahead of the last one weigh (3 × 32 tokens), and
    # within what the test workers' small pools take from one prompt
    shared = "".join(f"rule {i}: every cached block of every tenant is validated before a kernel reads it. "
                     for i in range(2))
    async with aiohttp.ClientSession() as http:
        await wait_ready(http, url, gw, usable=2)
        got = await asyncio.gather(*(complete(http, url, "alpha", shared + f"question {i}: why?", stream=True)
                                     for i in range(4)))
        async with http.post(url + "/tokenize", json={"prompt": shared}) as r:
            shared_tokens = (await r.json())["count"]
        whole = (shared_tokens - 1) // 16 * 16             # its whole blocks (the last token may merge)
        assert whole > 3 * 32, shared_tokens             # the prefix outweighs the burst's load
        assert len({w for w, _, _, _ in got}) == 1, got  # one worker took the whole burst
        computed = [c for _, _, c, _ in got if c < whole]
        assert len(computed) <= 1, got                   # and computed the prefix once
        assert sum(r.startswith(("inflight", "cache")) for _, r, _, _ in got) >= 3, got
        async with http.get(url + "/metrics") as r:
            text = await r.text()
        assert "kvl_gateway_inflight_prompt_blocks 0.0" in text     # every request ended: nothing held


async def test_tenants_at_the_door_signed_tenant_and_rate_limits(cluster) -> None:
    cluster.start_coordinator()
    port = free_port()
    cluster.start_worker("wa", worker={"port": port})
    await cluster.wait_worker("wa")
    worker_url = f"http://127.0.0.1:{port}"
    gw, url = start_gateway(cluster)
    prompt = turns("door", 2)[-1]
    async with aiohttp.ClientSession() as http:
        await wait_ready(http, url, gw, usable=1)
        # through the gateway the worker gets alpha as a signed header, not alpha's key, and salts
        # with alpha's salt: alpha's own key, sent to the worker directly, finds the same blocks
        await complete(http, url, "alpha", prompt)
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        async with http.post(worker_url + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {KEYS['alpha']}"}) as r:
            assert r.status == 200 and (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        # a client cannot name a tenant at the worker: unsigned, badly signed, or signed for another body
        raw = b'{"prompt": "forged", "max_tokens": 1}'
        good_for_other = sign(GATEWAY_SECRET, "alpha", "POST", "/v1/completions", b"{}", time.time())
        for sig in (None, sign("guess", "alpha", "POST", "/v1/completions", raw, time.time()), good_for_other,
                    sign(GATEWAY_SECRET, "alpha", "POST", "/v1/completions", raw, time.time() - 120)):
            headers = {TENANT_HEADER: "alpha", "Content-Type": "application/json",
                       **({SIGNATURE_HEADER: sig} if sig else {})}
            async with http.post(worker_url + "/v1/completions", data=raw, headers=headers) as r:
                assert r.status == 401, (sig, await r.text())
                assert (await r.json())["error"]["type"] == "authentication_error"
        # the real signature, made as the gateway makes it, is accepted
        headers = {TENANT_HEADER: "alpha", "Content-Type": "application/json",
                   SIGNATURE_HEADER: sign(GATEWAY_SECRET, "alpha", "POST", "/v1/completions", raw, time.time())}
        async with http.post(worker_url + "/v1/completions", data=raw, headers=headers) as r:
            assert r.status == 200, await r.text()
        # a wrong key stops at the gateway
        async with http.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}) as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        # gamma: one request per second, a burst of one
        statuses, retry = [], None
        for _ in range(3):
            async with http.post(url + "/v1/completions", json={"prompt": "gamma asks", "max_tokens": 1},
                                 headers={"Authorization": f"Bearer {KEYS['gamma']}"}) as r:
                statuses.append(r.status)
                if r.status == 429:
                    retry = r.headers.get("Retry-After")
                    assert (await r.json())["error"]["code"] == "rate_limit_exceeded"
        assert statuses[0] == 200 and 429 in statuses and retry is not None and int(retry) >= 1, statuses
        # other tenants are not held back by gamma's limit
        await complete(http, url, "beta", "beta is not limited")
        # more tokens than a whole minute allows can never pass: a 400, not a 429 to retry forever
        await asyncio.sleep(1.1)
        async with http.post(url + "/v1/completions", json={"prompt": "gamma asks", "max_tokens": 700},
                             headers={"Authorization": f"Bearer {KEYS['gamma']}"}) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "tokens_over_rate_limit"
        async with http.get(url + "/metrics") as r:
            assert 'kvl_gateway_rate_limited_total{code="rate_limit_exceeded",tenant="gamma"}' in await r.text()
        # the routes vLLM's tools expect work through the gateway too
        async with http.post(url + "/tokenize", json={"prompt": "abc"}) as r:
            assert r.status == 200 and (await r.json())["tokens"] == [97, 98, 99], await r.text()
        async with http.post(url + "/detokenize", json={"tokens": [97, 98, 99]}) as r:
            assert r.status == 200 and (await r.json())["prompt"] == "abc"
        for path in ("/health", "/version"):
            async with http.get(url + path) as r:
                assert r.status == 200, path


async def test_killing_a_worker_mid_run_costs_no_request_that_had_not_streamed(cluster) -> None:
    gw, url = await two_workers_and_a_gateway(cluster)
    async with aiohttp.ClientSession() as http:
        await wait_ready(http, url, gw, usable=2)
        prompt = turns("midrun", 2)[-1]
        home, _, _, _ = await complete(http, url, "alpha", prompt)
        # many non-streamed requests for the cached prefix: most go to its home; kill it meanwhile
        jobs = [asyncio.create_task(complete(http, url, "alpha", prompt + f" variant {i}", max_tokens=48))
                for i in range(8)]
        await asyncio.sleep(0.4)
        cluster.workers[home].kill()
        results = await asyncio.gather(*jobs)                    # each one a 200 (complete asserts it)
        assert {w for w, *_ in results} - {home}, "nothing moved to the surviving worker"
        async with http.get(url + "/metrics") as r:
            text = await r.text()
        failovers = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("kvl_gateway_failovers_total{"))
        assert failovers >= 1, text
        # and the dead worker receives nothing new: the next requests all go to the survivor
        for i in range(3):
            worker, *_ = await complete(http, url, "alpha", prompt + f" after {i}")
            assert worker != home
