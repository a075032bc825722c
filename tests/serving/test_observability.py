"""/metrics, /healthz and /readyz as an operator sees them, including degraded mode."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from shared.messages import Control
from tests.serving.conftest import MODEL, config
from tests.twin import InProcessCoordinator
from worker.engine import Engine
from worker.http_server import bound_address, start_http

PROMPT = "Observability: three blocks of prompt, then a bit more."   # 55 bytes


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_names_and_values(serve) -> None:
    async with serve() as s:
        c = s.client()
        for _ in range(2):
            await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
        # a replica the coordinator offers but this worker no longer holds: presence fails, the
        # request recomputes that part and says so
        form, _, meta = next(iter(s.engine.store.items()))
        s.engine.store.drop(form, meta.block_hash)
        r = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
        assert r.model_extra["kvl"]["fallbacks"] == ["validation"]
        status, text = await s.get("/metrics")
        assert status == 200
        m = samples(text)
        p = "kvl_worker_"
        assert value(m, p + "time_to_first_token_seconds_count") == 3
        assert value(m, p + "inter_token_latency_seconds_count") == 6
        assert value(m, p + "e2e_request_latency_seconds_count") == 3
        assert value(m, p + "request_close_seconds_count") == 3      # each request's commit, settle and release
        assert value(m, p + "prompt_tokens_total") == 3 * 55
        assert value(m, p + "generation_tokens_total") == 9
        assert value(m, p + "prefix_cache_queries_total") == 3 * 55
        assert value(m, p + "prefix_cache_hits_total") >= 48
        assert value(m, p + "prefix_cache_validated_hits_total") == 48 + r.usage.prompt_tokens_details.cached_tokens
        assert value(m, p + "hit_invalid_total", layer="presence", form=form) == 1
        assert value(m, p + "fallbacks_total", reason="validation") == 1
        assert value(m, p + "queue_depth") == 0 and value(m, p + "requests_running") == 0
        assert value(m, p + "requests_finished_total", reason="length") == 3
        assert value(m, p + "pool_used_slots", form="compressed") > 0
        assert value(m, p + "pool_slots", form="swa") > 0
        assert value(m, p + "http_requests_total", route="/v1/completions", status="200") == 3
        assert value(m, p + "request_queue_time_seconds_count") == 3


async def test_health_and_readiness_through_degraded_mode(serve) -> None:
    async with serve() as s:
        assert await s.get("/healthz") == (200, {"status": "ok"})
        status, body = await s.get("/readyz")
        assert status == 200 and body["status"] == "ready" and body["coordinator"] == "reachable"
        assert body["model_loaded"] and body["pools_allocated"]
        assert body["batching"]["fused"] and body["batching"]["why_not"] == "" and body["batching"]["check_every"] > 0
        s.twin.down = True
        for _ in range(100):
            status, body = await s.get("/readyz")
            if body["status"] == "degraded":
                break
            await asyncio.sleep(0.05)
        assert status == 200 and body["status"] == "degraded" and body["coordinator"] == "unreachable"
        assert "unreachable" in body["reason"]
        r = await s.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens == 0 and r.model_extra["kvl"]["degraded"]
        s.twin.down = False
        for _ in range(100):
            status, body = await s.get("/readyz")
            if body["status"] == "ready":
                break
            await asyncio.sleep(0.05)
        assert status == 200 and body["status"] == "ready"
        await s.twin.control("w1", Control(action="drain", reason="test"))
        status, body = await s.get("/readyz")
        assert status == 503 and body["status"] == "not_ready" and body["draining"]


async def test_not_ready_until_registered_once(model, tmp_path) -> None:
    cfg = config(tmp_path)
    twin = InProcessCoordinator()
    twin.down = True
    engine = Engine(model, cfg, twin)
    runner = await start_http(engine, cfg)
    await engine.start(wait_s=0)
    host, port = bound_address(runner)
    try:
        async with aiohttp.ClientSession() as http:
            async def readyz():
                async with http.get(f"http://{host}:{port}/readyz") as r:
                    return r.status, await r.json()

            status, body = await readyz()
            assert status == 503 and body["status"] == "starting" and body["coordinator"] == "unreachable"
            twin.down = False
            for _ in range(100):
                status, body = await readyz()
                if status == 200:
                    break
                await asyncio.sleep(0.05)
            assert body["status"] == "ready" and body["epoch"] == 1
    finally:
        await runner.cleanup()
        await engine.stop()
