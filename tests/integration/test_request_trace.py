"""One request, one trace: gateway → worker → coordinator, in this process, on real sockets.

The coordinator (PostgreSQL and NATS behind it), a worker (the tiny model, the real NATS client,
its HTTP API) and the gateway run in this event loop, with tracing on and an in-memory exporter.
Being in one process carries no context between them: each hop's parent travels only as the
W3C ``traceparent`` header of an HTTP request or a NATS message, which is what is under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.app import Gateway
from gateway.app import create_app as gateway_app
from shared import tracing
from shared.config import Config, parse_config
from shared.subjects import Subjects
from shared.text.chat_template import load_chat_template
from shared.text.tokenizer import load_tokenizer
from tests.integration.coordinator_kit import running_coordinator
from worker.client.nats_adapter import NatsCoordinatorClient
from worker.engine import Engine
from worker.http_server import bound_address, start_http
from worker.model import build_model

torch.set_num_threads(1)

PROMPT = "the ledger records every state change of every cached block, " * 2
#: A warm request's trace holds every one of these (a cold one all but validation and restore).
EXPECTED = {
    "gateway.request", "gateway.route", "coordinator.route", "gateway.forward", "worker.request",
    "worker.admission", "worker.lease", "coordinator.acquire", "coordinator.decide", "coordinator.commit",
    "worker.validation", "worker.restore", "worker.prefill", "worker.decode", "worker.commit",
    "worker.release", "coordinator.release",
}


def stack_config(database_url: str, nats_url: str, subjects: Subjects, tmp_path: Any) -> Config:
    return parse_config({
        "database": {"url": database_url, "connect_timeout_ms": 1000},
        "nats": {"url": nats_url, "subject_prefix": subjects.prefix},
        "coordinator": {"heartbeat_interval_ms": 200, "missed_heartbeats": 50},
        "cache": {"chunk_blocks": 1, "host_tier_bytes": 0},
        "worker": {"worker_id": "w1", "pool_bytes": 32 * 2**20, "port": 0},
        "gateway": {"port": 0, "fleet_refresh_ms": 200},
        "service": {"batch_window_ms": 0},
        "logging": {"format": "json"},
        "state_dir": str(tmp_path / "state"),
    })


@pytest.fixture
async def spans(database_url: str, nats_url: str, subjects: Subjects, tmp_path: Any
                ) -> AsyncIterator[tuple[str, InMemorySpanExporter]]:
    """``(gateway URL, exporter)``: the three services running, tracing on."""
    cfg = stack_config(database_url, nats_url, subjects, tmp_path)
    exporter = InMemorySpanExporter()
    assert tracing.setup(cfg.tracing, "test", exporter=exporter)   # before the apps: their middleware
    try:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(running_coordinator(cfg))
            engine = Engine(build_model(seed=0), cfg, NatsCoordinatorClient(nats_url, subjects))
            stack.push_async_callback(engine.stop)
            worker_http = await start_http(engine, cfg)
            stack.push_async_callback(worker_http.cleanup)
            host, port = bound_address(worker_http)
            engine.endpoint = f"http://{host}:{port}"       # bound before registering, as the worker process does
            await engine.start()
            gw = Gateway(cfg, load_tokenizer("", 2**31), load_chat_template(""))
            stack.push_async_callback(gw.stop)
            await gw.start()
            assert [w.worker_id for w in gw.fleet] == ["w1"]
            runner = web.AppRunner(gateway_app(gw), access_log=None)
            stack.push_async_callback(runner.cleanup)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            host, port = bound_address(runner)
            exporter.clear()                                 # nothing so far was a request
            yield f"http://{host}:{port}", exporter
    finally:
        tracing.shutdown()


async def complete(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def traces_of(exporter: InMemorySpanExporter, n: int, timeout_s: float = 10) -> list[list[ReadableSpan]]:
    """The exported spans grouped by trace, once ``n`` traces each hold their root, every span
    its parent (the coordinator ends a span just after its reply is sent) and the release (a
    request's last span: its leases are released after its response)."""
    deadline = time.monotonic() + timeout_s
    while True:
        by_trace: dict[int, list[ReadableSpan]] = defaultdict(list)
        for s in exporter.get_finished_spans():
            by_trace[s.context.trace_id].append(s)
        traces = sorted(by_trace.values(), key=lambda t: min(s.start_time for s in t))
        done = len(traces) >= n and all(_connected(t) and any(s.name == "coordinator.release" for s in t)
                                        for t in traces)
        if done or time.monotonic() > deadline:
            return traces
        await asyncio.sleep(0.05)


def _connected(trace: list[ReadableSpan]) -> bool:
    ids = {s.context.span_id for s in trace}
    roots = [s for s in trace if s.parent is None]
    return len(roots) == 1 and all(s.parent.span_id in ids for s in trace if s.parent is not None)


async def test_one_request_is_one_connected_trace_across_the_three_services(spans) -> None:
    url, exporter = spans
    async with aiohttp.ClientSession() as http:
        cold = await complete(http, url)
        warm = await complete(http, url)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0      # the second one reused the first's
    traces = await traces_of(exporter, 2)
    assert len(traces) == 2, [sorted({s.name for s in t}) for t in traces]  # one trace per request, no strays
    for trace in traces:
        assert _connected(trace), sorted((s.name, s.parent is None) for s in trace)
        root = next(s for s in trace if s.parent is None)
        assert root.name == "gateway.request" and root.attributes["http.response.status_code"] == 200
        parent_of = {s.context.span_id: s.name for s in trace}
        edges = {(parent_of[s.parent.span_id], s.name) for s in trace if s.parent is not None}
        # each hop hangs under the span that made it: HTTP under the forward, NATS under its caller
        assert {("gateway.route", "coordinator.route"), ("gateway.forward", "worker.request"),
                ("worker.request", "worker.lease"), ("worker.lease", "coordinator.acquire"),
                ("coordinator.acquire", "coordinator.decide"), ("coordinator.acquire", "coordinator.commit"),
                ("worker.release", "coordinator.release")} <= edges
    names = [{s.name for s in t} for t in traces]
    assert EXPECTED - {"worker.validation", "worker.restore"} <= names[0], EXPECTED - names[0]
    assert EXPECTED <= names[1], EXPECTED - names[1]
    request = next(s for s in traces[1] if s.name == "worker.request")
    assert request.attributes["kvl.cached_tokens"] == warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert request.attributes["kvl.tenant"] == "default" and request.attributes["kvl.worker_id"] == "w1"
    lease = next(s for s in traces[0] if s.name == "coordinator.acquire")
    assert lease.attributes["kvl.outcome"] == "ok" and lease.attributes["kvl.blocks"] > 0
    # never content: attribute values are ids, counts and outcomes — no prompt text, no token ids
    for s in traces[0] + traces[1]:
        for key, value in s.attributes.items():
            assert not isinstance(value, str) or len(value) <= 64 and "ledger" not in value, (s.name, key)
            assert not isinstance(value, tuple) or all(isinstance(v, str) for v in value), (s.name, key)
    assert cold["choices"][0]["text"] == warm["choices"][0]["text"]


async def test_a_request_that_waits_for_a_shared_prefix_shows_the_wait_in_its_trace(spans) -> None:
    """Three requests at once with the same new prompt: one computes it, the other two wait for
    its commit (worker.inflight) — a ``worker.prefix_wait`` span in each of their traces."""
    url, exporter = spans
    async with aiohttp.ClientSession() as http:
        got = await asyncio.gather(*(complete(http, url) for _ in range(3)))
    assert len({g["choices"][0]["text"] for g in got}) == 1
    assert sorted(g["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for g in got) == [False, True, True]
    traces = await traces_of(exporter, 3)
    assert len(traces) == 3
    waits = [[s for s in t if s.name == "worker.prefix_wait"] for t in traces]
    assert sorted(len(w) for w in waits) == [0, 1, 1]
    for trace, wait in zip(traces, waits):
        for s in wait:
            parent = next(p for p in trace if p.context.span_id == s.parent.span_id)
            assert parent.name == "worker.request"
            assert s.attributes["kvl.outcome"] == "committed" and s.attributes["kvl.blocks"] > 0
