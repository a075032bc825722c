"""Capacity for the configured concurrency (issue 55, item 6): a worker whose pools cannot hold
``service.max_concurrency`` requests warns at start with the key to raise, and, when concurrent
requests are refused their leases ``over_capacity``, counts them and warns while serving. The
requests run over real HTTP against the worker's API; the coordinator is the in-process twin,
which refuses exactly as the coordinator's core does (same functions)."""

from __future__ import annotations

import asyncio

from structlog.testing import capture_logs

from tests.serving.conftest import MODEL, until
from worker.capacity import over_capacity_refusals

KiB = 1024
# 2 MiB: the sliding-window pool holds 5 blocks, one 64-token request's window takes 3
SMALL = {"worker.pool_bytes": 2048 * KiB, "service.max_concurrency": 4, "worker.capacity_check_tokens": 64,
         "worker.capacity_warning_interval_s": 0.2, "cache.host_tier_bytes": 0}


def _prompt(i: int) -> list[int]:
    return [(7 * i + 3 * j) % 250 + 1 for j in range(64)]


async def test_small_pool_warns_at_start_and_while_serving(serve) -> None:
    with capture_logs() as logs:
        async with serve(**SMALL) as s:
            (start,) = [e for e in logs if e["event"] == "pool_capacity_low"]
            assert start["log_level"] == "warning"
            assert start["requests_held"] == 1 and start["max_concurrency"] == 4 and start["limited_by"] == "swa"
            # the fix names the key that sized the pools and a size that holds four
            assert "raise worker.pool_bytes to at least" in start["message"]
            assert start["needed_pool_bytes"] > 2048 * KiB
            assert "lower service.max_concurrency to 1" in start["message"]

            before = over_capacity_refusals(s.engine.metrics)
            fb_before = s.engine.metrics.value("kvl_worker_fallbacks_total", {"reason": "lease:over_capacity"})
            replies = await asyncio.gather(*(
                s.post("/v1/completions", {"model": MODEL, "prompt": _prompt(i), "max_tokens": 8,
                                           "temperature": 0})
                for i in range(4)))
            assert [r[0] for r in replies] == [200] * 4, replies
            fallbacks = [f for _, doc, _ in replies for f in doc["kvl"]["fallbacks"]]
            assert "lease:over_capacity" in fallbacks, fallbacks      # served, uncached
            refused = over_capacity_refusals(s.engine.metrics) - before
            assert refused == fallbacks.count("lease:over_capacity")
            assert s.engine.metrics.value("kvl_worker_fallbacks_total", {"reason": "lease:over_capacity"}) - fb_before >= refused
            # where an operator looks: the scrape, and one warning naming the fix
            status, text = await s.get("/metrics")
            assert status == 200
            line = next(ln for ln in text.splitlines()
                        if ln.startswith("kvl_worker_lease_errors_total") and 'code="over_capacity"' in ln)
            assert float(line.rsplit(" ", 1)[1]) == refused + before
            warned = await until("a cache_over_capacity warning",
                                 lambda: [e for e in logs if e["event"] == "cache_over_capacity"], timeout_s=5)
            assert warned[0]["log_level"] == "warning" and warned[0]["refused_leases"] == refused
            assert "raise worker.pool_bytes" in warned[0]["fix"]
            # one line per interval, not per request: nothing new, nothing said
            await asyncio.sleep(0.5)
            assert len([e for e in logs if e["event"] == "cache_over_capacity"]) == 1


async def test_pool_that_holds_the_concurrency_says_nothing(serve) -> None:
    with capture_logs() as logs:
        async with serve(**{**SMALL, "worker.pool_bytes": 8 * 2**20}) as s:
            r = await s.post("/v1/completions", {"model": MODEL, "prompt": _prompt(0), "max_tokens": 2})
            assert r[0] == 200
            await asyncio.sleep(0.3)
    assert not [e for e in logs if e["event"] in ("pool_capacity_low", "cache_over_capacity")]


async def test_check_off_and_a_memory_sized_cap_raised_to_hold_the_concurrency(serve) -> None:
    """0 turns the start-up check off; a pool sized from memory is not held under the
    concurrency by the CPU cap: the cap rises to what holds it (and says so), so nothing warns."""
    with capture_logs() as logs:
        async with serve(**{**SMALL, "worker.capacity_check_tokens": 0}):
            pass
    assert not [e for e in logs if e["event"] == "pool_capacity_low"]
    with capture_logs() as logs:
        async with serve(**{**SMALL, "worker.pool_bytes": None, "worker.cpu_pool_max_bytes": 2048 * KiB}) as s:
            assert s.engine.sizing.pool_bytes > 2048 * KiB
    assert not [e for e in logs if e["event"] == "pool_capacity_low"]
    (sized,) = [e for e in logs if e["event"] == "pools_sized"]
    assert "to hold 2 × service.max_concurrency 4 requests of 64 tokens" in sized["how"]
