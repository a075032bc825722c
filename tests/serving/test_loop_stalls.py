"""Issue 51: no request stalls a worker's event loop. A real ``python -m worker`` process (with a
real coordinator, PostgreSQL and NATS) is sent the largest grammars and choice lists its caps
allow, while ``/healthz``, a small completion and the coordinator's view of the worker are timed;
over-cap inputs are 400s naming the limit; a grammar that crashes llguidance costs a 400, not the
worker.

Before the fix the compile ran on the event loop: these requests held ``/healthz`` for seconds
(a 1 MB choice list: 32 s) and a chained-rule grammar killed the worker (SIGSEGV).
"""

from __future__ import annotations

import asyncio
import json
import random
import string
import time
from typing import Any

import aiohttp

from shared.config import ServiceConfig
from tests.worker.processes import Cluster

CAPS = ServiceConfig()
#: Generous against a shared CI machine; the loop answered within ~10-50 ms here (the old code: seconds).
MAX_HEALTHZ_S = 1.0
MAX_SMALL_REQUEST_S = 2.0
MAX_HEARTBEAT_AGE_S = 2.0


def max_choices(seed: int) -> list[str]:
    """As many choices as ``structured_max_choices`` allows, as long as ``structured_max_bytes`` allows."""
    rng = random.Random(seed)
    n = CAPS.structured_max_choices
    width = (CAPS.structured_max_bytes - 64) // n
    return ["".join(rng.choices(string.ascii_lowercase, k=width)) for _ in range(n)]


def max_grammar(tag: str) -> str:
    """A Lark grammar of ~23,000 alternatives, just under ``structured_max_bytes``."""
    per = len(f'"{tag}00000" | ')
    n = (CAPS.structured_max_bytes - 64) // per
    g = "start: " + " | ".join(f'"{tag}{i:05d}"' for i in range(n))
    assert len(g.encode()) <= CAPS.structured_max_bytes
    return g


def chained_grammar(n: int = 5000) -> str:
    """Rules that name each other in a chain: llguidance's compiler overflows its stack on it."""
    rules = "\n".join(f'r{i}: "x{i}" r{(i + 1) % n}?' for i in range(n))
    return "start: " + " | ".join(f"r{i}" for i in range(n)) + "\n" + rules


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any, float]:
    t0 = time.perf_counter()
    async with http.post(url + "/v1/completions", json=body) as r:
        doc = await r.json(content_type=None)
        return r.status, doc, time.perf_counter() - t0


class Probes:
    """``/healthz`` every 20 ms, a small completion every 200 ms, and the coordinator's record of
    the worker every 100 ms, until stopped: the worst of each."""

    def __init__(self, cluster: Cluster, http: aiohttp.ClientSession, url: str, worker_id: str) -> None:
        self.cluster, self.http, self.url, self.worker_id = cluster, http, url, worker_id
        self.healthz: list[float] = []
        self.small: list[float] = []
        self.heartbeat_age: list[float] = []
        self.suspended = False
        self.epochs: set[int] = set()
        self._stop = asyncio.Event()

    async def _healthz(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            async with self.http.get(self.url + "/healthz") as r:
                assert r.status == 200
            self.healthz.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)

    async def _small(self) -> None:
        while not self._stop.is_set():
            status, doc, took = await post(self.http, self.url, {"prompt": "kvledger", "max_tokens": 2,
                                                                 "temperature": 0})
            assert status == 200, doc
            self.small.append(took)
            await asyncio.sleep(0.2)

    async def _coordinator(self) -> None:
        while not self._stop.is_set():
            ws = {w["worker_id"]: w for w in (await self.cluster.admin("/v1/workers"))["workers"]}
            w = ws[self.worker_id]
            self.suspended |= bool(w["suspended"])
            self.epochs.add(w["epoch"])
            self.heartbeat_age.append(time.time() - w["last_heartbeat_ms"] / 1000)
            await asyncio.sleep(0.1)

    async def during(self, work: Any) -> Any:
        tasks = [asyncio.create_task(f()) for f in (self._healthz, self._small, self._coordinator)]
        await asyncio.sleep(0.3)
        try:
            return await work
        finally:
            self._stop.set()
            await asyncio.gather(*tasks)

    def summary(self) -> str:
        return (f"healthz max {max(self.healthz) * 1000:.0f} ms (n={len(self.healthz)}), small request max "
                f"{max(self.small) * 1000:.0f} ms (n={len(self.small)}), heartbeat age max "
                f"{max(self.heartbeat_age) * 1000:.0f} ms, suspended={self.suspended}, epochs={sorted(self.epochs)}")


async def test_maximal_grammars_do_not_stall_the_loop_and_over_cap_ones_are_400s(cluster) -> None:
    cluster.start_coordinator()
    # a budget no maximal grammar reaches on a loaded machine: this test is about the loop
    cluster.start_worker("ws", worker={"port": 0, "host": "127.0.0.1"},
                         service={"structured_compile_timeout_ms": 60000})
    await cluster.wait_coordinator()
    await cluster.wait_worker("ws")
    url = await cluster.http_url("ws")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
        status, doc, _ = await post(http, url, {"prompt": "warm", "max_tokens": 2})
        assert status == 200, doc

        # --- the largest inputs the caps allow, three of each kind at once, each distinct --------
        heavy = [{"prompt": "pick one", "max_tokens": 4, "structured_outputs": {"choice": max_choices(seed)}}
                 for seed in range(3)]
        heavy += [{"prompt": "say", "max_tokens": 4, "structured_outputs": {"grammar": max_grammar(tag)}}
                  for tag in ("a", "b", "c")]
        probes = Probes(cluster, http, url, "ws")
        t0 = time.perf_counter()
        results = await probes.during(asyncio.gather(*(post(http, url, b) for b in heavy)))
        took = time.perf_counter() - t0
        print(f"\n6 maximal grammars in {took:.1f} s; {probes.summary()}")
        for (status, doc, _), body in zip(results, heavy, strict=True):
            assert status == 200, doc
            so = body["structured_outputs"]
            if "choice" in so:    # the output is (a prefix of, within max_tokens) one of the choices
                assert any(c.startswith(doc["choices"][0]["text"]) for c in so["choice"]), doc["choices"][0]["text"]
        assert max(probes.healthz) < MAX_HEALTHZ_S, probes.summary()
        assert max(probes.small) < MAX_SMALL_REQUEST_S, probes.summary()
        assert max(probes.heartbeat_age) < MAX_HEARTBEAT_AGE_S, probes.summary()
        assert not probes.suspended and len(probes.epochs) == 1, probes.summary()

        # --- again: compiled once, now a cache hit ---------------------------------------------
        status, doc, again = await post(http, url, heavy[0])
        assert status == 200 and again < 1.0, (status, again)

        # --- over the caps: 400s naming the limit, before anything is compiled -------------------
        over = [
            ({"choice": max_choices(9) + ["one-more"]}, "structured_max_choices"),
            ({"grammar": max_grammar("d") + ' | "overflow-the-byte-cap"' * 200}, "structured_max_bytes"),
            ({"regex": "a" * (CAPS.structured_max_bytes + 1)}, "structured_max_bytes"),
            ({"json": _nested(CAPS.structured_max_schema_depth + 1)}, "structured_max_schema_depth"),
        ]
        for so, key in over:
            status, doc, took = await post(http, url, {"prompt": "x", "max_tokens": 2, "structured_outputs": so})
            err = doc["error"]
            assert status == 400 and err["code"] == key and f"service.{key}" in err["message"], doc
            assert err["param"] == "structured_outputs"
            assert took < 1.0, took

        # --- a grammar that crashes the compiler: a 400, and the worker lives on -----------------
        status, doc, _ = await post(http, url, {"prompt": "x", "max_tokens": 2,
                                                "structured_outputs": {"grammar": chained_grammar()}})
        assert status == 400 and doc["error"]["code"] == "grammar_crashed", doc
        assert cluster.workers["ws"].alive
        status, doc, _ = await post(http, url, {"prompt": "x", "max_tokens": 4,
                                                "structured_outputs": {"choice": ["yes", "no"]}})
        assert status == 200 and doc["choices"][0]["text"] in ("yes", "no", "y", "ye", "n"), doc

        async with http.get(url + "/metrics") as r:
            text = await r.text()
        assert 'kvl_worker_grammar_refused_total{reason="grammar_crashed"} 1.0' in text
        assert 'kvl_worker_grammar_refused_total{reason="structured_max_choices"} 1.0' in text
        assert 'kvl_worker_grammar_compiles_total{outcome="cached"}' in text
    w = {w["worker_id"]: w for w in (await cluster.admin("/v1/workers"))["workers"]}["ws"]
    assert not w["suspended"] and w["epoch"] in probes.epochs


def _nested(depth: int) -> str:
    """A JSON schema whose objects nest ``depth`` deep."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return json.dumps(schema)
