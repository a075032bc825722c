"""Fixtures for the serving tests: a worker's HTTP API in this process, on a real socket.

``serve(**over)`` starts an engine on the in-process coordinator twin, the scheduler and
the aiohttp app on 127.0.0.1:<free port>, and yields a :class:`Server` with the real
openai client pointed at it. The end-to-end test with real coordinator and worker
processes is ``test_worker_http_process.py``. Prompts are short and ``max_tokens`` small:
the tiny model takes ~35 ms per 16-token block and ~40 ms per token on this CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
import torch
from aiohttp import web

from shared.config import Config, parse_config
from tests.twin import InProcessCoordinator
from worker.engine import Engine
from worker.http_server import bound_address, start_http
from worker.model import build_model

torch.set_num_threads(1)

MODEL = "kvledger/dsv4-tiny"
BS = 16


async def until(what: str, probe: Callable[[], Any], timeout_s: float = 5.0) -> Any:
    """Poll ``probe`` (sync or async) until it returns something true; its value. A served request's
    leases are released after its response, so "nothing leased is left" is a wait, not a check."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        got = probe()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def config(tmp_path: Any, **over: Any) -> Config:
    """A small worker config; ``over`` maps dotted keys (``service.max_concurrency``) to values."""
    doc: dict[str, Any] = {
        "cache": {"chunk_blocks": 1, "host_tier_bytes": 0},
        "worker": {"worker_id": "w1", "pool_bytes": 32 * 2**20, "port": 0, "host": "127.0.0.1"},
        "coordinator": {"heartbeat_interval_ms": 100},
        "service": {"batch_window_ms": 5},
        "state_dir": str(tmp_path / "state"),
    }
    for dotted, value in over.items():
        cur = doc
        *path, last = dotted.split(".")
        for p in path:
            cur = cur.setdefault(p, {})
        cur[last] = value
    return parse_config(doc)


@dataclass
class Server:
    url: str
    engine: Engine
    twin: InProcessCoordinator
    runner: web.AppRunner
    http: aiohttp.ClientSession

    @property
    def scheduler(self):
        from worker.api.keys import SCHEDULER
        return self.runner.app[SCHEDULER]

    def client(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    async def post(self, path: str, body: Any = None, *, raw: bytes | None = None, key: str | None = None,
                   headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
        h = dict(headers or {})
        if key is not None:
            h["Authorization"] = f"Bearer {key}"
        data = raw if raw is not None else None
        kw: dict[str, Any] = {"data": data} if raw is not None else {"json": body}
        async with self.http.post(self.url + path, headers=h, **kw) as r:
            text = await r.text()
            try:
                doc = await r.json(content_type=None)
            except ValueError:
                doc = text
            return r.status, doc, r.headers

    async def get(self, path: str, key: str | None = None) -> tuple[int, Any]:
        h = {"Authorization": f"Bearer {key}"} if key else {}
        async with self.http.get(self.url + path, headers=h) as r:
            if r.content_type == "application/json":
                return r.status, await r.json()
            return r.status, await r.text()

    def live_leases(self) -> int:
        return len(self.twin.state.leases)


@contextlib.asynccontextmanager
async def serving(model: Any, cfg: Config, tokenizer: Any = None) -> AsyncIterator[Server]:
    """``model`` on a fresh engine (the coordinator twin) behind the worker's HTTP API on a free
    port of 127.0.0.1; everything stopped afterwards. What every ``serve`` fixture yields from."""
    twin = InProcessCoordinator()
    engine = Engine(model, cfg, twin)
    await engine.start()
    runner = await start_http(engine, cfg, tokenizer=tokenizer)
    host, port = bound_address(runner)
    http = aiohttp.ClientSession()
    try:
        yield Server(f"http://{host}:{port}", engine, twin, runner, http)
    finally:
        await http.close()
        await runner.cleanup()
        await engine.stop()


@pytest.fixture(scope="session")
def model():
    return build_model(seed=0)


@pytest.fixture
def serve(model, tmp_path):
    """``async with serve(tokenizer=None, **over) as server``: a worker HTTP API on a fresh engine."""

    def make(tokenizer: Any = None, **over: Any) -> contextlib.AbstractAsyncContextManager[Server]:
        return serving(model, config(tmp_path, **over), tokenizer)

    return make


@pytest.fixture
async def reference(model, tmp_path):
    """A cache-disabled engine: the cold run every served output must equal."""
    engine = Engine(model, config(tmp_path), None)
    yield engine
    await engine.stop()
