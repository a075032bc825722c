"""The gateway's door (issue 51, item 5), against a real gateway process: the key before the body,
the body within its cap and its read timeout, slow headers closed, every malformed body a 4xx.

Most tests need no worker — the gateway refuses before it routes — and share one gateway (NATS
only, short timeouts). The bad-input matrix runs through a gateway in front of a real coordinator
and worker: what the gateway forwards, the worker judges, and the answer is a 4xx either way.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from shared.embedded import Services, free_port
from shared.tenants import key_sha256
from tests.bad_requests import BAD_CHAT_BODIES, BAD_COMPLETION_BODIES, DEEP_BODIES, MALFORMED_BODIES
from tests.worker.processes import REPO, Cluster, Proc, running_cluster

KEY = "sk-door-key"
AUTH = {"required": True, "keys": [{"key_sha256": key_sha256(KEY), "tenant": "door"}],
        "gateway_secret": "gw-door-secret", "salt_secret": "s3cret"}
BEARER = {"Authorization": f"Bearer {KEY}"}
#: The door's: short timeouts, so that they can be watched; a 1 MB body cap (the key is checked
#: before it: an unauthenticated body of any size is a 401).
LIMITS = {"keepalive_timeout_ms": 500, "body_read_timeout_ms": 500, "max_body_bytes": 1_000_000}
TIMEOUT_S = 0.5
BIG = 31_000_000


class Gateway:
    def __init__(self, proc: Proc, url: str) -> None:
        self.proc, self.url = proc, url
        self.host, port = url.removeprefix("http://").split(":")
        self.port = int(port)

    def status(self, field: str) -> int:
        """A ``/proc/<pid>/status`` memory figure in bytes (VmRSS, VmHWM: the peak)."""
        for line in Path(f"/proc/{self.proc.popen.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise AssertionError(field)


def start_gateway(tmp: Path, doc: dict, env: dict[str, str], limits: dict | None = None) -> Gateway:
    port = free_port()
    doc = {**doc, "gateway": {"port": port, "fleet_refresh_ms": 200, **(limits or {})}}
    cfg = tmp / "gateway.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    proc = Proc("gateway", [sys.executable, "-m", "gateway", "--config", str(cfg)], tmp / "gateway.log", env)
    deadline = time.monotonic() + 60
    while "listening on" not in (tmp / "gateway.log").read_text(errors="replace"):
        assert proc.alive and time.monotonic() < deadline, proc.tail()
        time.sleep(0.1)
    return Gateway(proc, f"http://127.0.0.1:{port}")


@pytest.fixture(scope="module")
def door(services: Services, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway with no coordinator and no worker: everything it answers, it answers itself."""
    tmp = tmp_path_factory.mktemp("door")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVL_")}, "PYTHONPATH": str(REPO)}
    doc = {"nats": {"url": services.nats_url, "subject_prefix": f"kvlt{uuid.uuid4().hex[:10]}"},
           "auth": AUTH, "logging": {"format": "json", "level": "info"}}
    gw = start_gateway(tmp, doc, env, LIMITS)
    try:
        yield gw
    finally:
        gw.proc.stop()


async def _exchange(gw: Gateway, head: bytes, body_bytes: int = 0, *, wait_s: float = 30) -> tuple[bytes, float]:
    """Send ``head``, then ``body_bytes`` of body while reading; the server's answer (until it
    closes, or its Content-Length is in) and the seconds until the connection closed (inf: open
    after ``wait_s``). Writing stops once an answer has come."""
    reader, writer = await asyncio.open_connection(gw.host, gw.port)
    t0 = time.monotonic()
    writer.write(head)
    answered = asyncio.Event()

    async def pump() -> None:
        chunk = b"x" * 2**20
        sent = 0
        while sent < body_bytes and not answered.is_set():
            writer.write(chunk[:body_bytes - sent])
            sent += min(len(chunk), body_bytes - sent)
            await writer.drain()

    pumping = asyncio.create_task(pump())
    out, closed_after = b"", float("inf")
    try:
        async with asyncio.timeout(wait_s):
            while chunk := await reader.read(65536):
                out += chunk
                answered.set()
            closed_after = time.monotonic() - t0
    except TimeoutError:
        pass
    except ConnectionError:
        closed_after = time.monotonic() - t0
    finally:
        answered.set()
        pumping.cancel()
        await asyncio.gather(pumping, return_exceptions=True)
        writer.close()
    return out, closed_after


def _post(path: str, length: int | None, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: gw", "Content-Type: application/json"]
    lines += [f"Content-Length: {length}"] if length is not None else ["Transfer-Encoding: chunked"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _err(doc: dict) -> dict:
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}, doc
    return doc["error"]


# --- the key before the body --------------------------------------------------------------------

async def test_an_unauthenticated_body_is_refused_unread(door: Gateway) -> None:
    """20 unauthenticated 31 MB bodies at once: each a 401 at once, the gateway's peak memory
    barely moved (it read the bodies before checking the key: +300 MB)."""
    for auth in ({}, {"Authorization": "Bearer wrong"}):                   # a first request's own costs
        out, _ = await _exchange(door, _post("/v1/completions", 10, auth), 10)
        assert out.startswith(b"HTTP/1.1 401"), out[:300]
    peak0, rss0 = door.status("VmHWM"), door.status("VmRSS")
    results = await asyncio.gather(*(_exchange(door, _post("/v1/completions", BIG, auth), BIG, wait_s=20)
                                     for auth in [{}] * 10 + [{"Authorization": "Bearer wrong"}] * 10))
    for out, _ in results:
        assert out.startswith(b"HTTP/1.1 401"), out[:300]
        assert b'"invalid_api_key"' in out
    grown = door.status("VmHWM") - peak0
    print(f"gateway RSS {rss0 / 2**20:.0f} MiB before, peak +{grown / 2**20:.1f} MiB for 20 x {BIG / 1e6:.0f} MB")
    # NOTE: not zero: aiohttp drains each refused body (discarding it) for body_read_timeout_ms
    # before closing, so that the client reads its 401 rather than a reset; ~0.5 MB per connection
    assert grown < BIG // 2, f"the gateway's peak RSS grew {grown / 2**20:.0f} MiB"
    assert door.proc.alive


async def test_a_declared_body_over_the_cap_is_a_413_before_reading(door: Gateway) -> None:
    peak0 = door.status("VmHWM")
    out, _ = await _exchange(door, _post("/v1/completions", BIG, BEARER), BIG)
    assert out.startswith(b"HTTP/1.1 413") and b'"body_too_large"' in out and b"gateway.max_body_bytes" in out, \
        out[:300]
    assert door.status("VmHWM") - peak0 < BIG // 3


async def test_a_chunked_body_is_cut_at_the_cap(door: Gateway) -> None:
    cap = LIMITS["max_body_bytes"]

    async def chunks():
        for _ in range(cap // 2**16 + 2):
            yield b" " * 2**16
    async with aiohttp.ClientSession() as http:
        async with http.post(door.url + "/v1/completions", data=chunks(), headers=BEARER) as r:
            assert r.status == 413 and _err(await r.json())["code"] == "body_too_large"


# --- slow clients ---------------------------------------------------------------------------------

async def test_slow_headers_and_slow_bodies_are_closed_after_the_timeout(door: Gateway) -> None:
    partial_head = b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: appl"
    slow_body = _post("/v1/completions", 100, BEARER) + b'{"prompt": '
    results = await asyncio.gather(*(_exchange(door, partial_head, wait_s=10) for _ in range(25)),
                                   *(_exchange(door, slow_body, wait_s=10) for _ in range(25)))
    heads, bodies = results[:25], results[25:]
    for out, closed in heads:
        assert out == b"" and closed < TIMEOUT_S + 3, (out[:200], closed)
    for out, closed in bodies:
        assert out.startswith(b"HTTP/1.1 408"), out[:300]
        assert b'"timeout_error"' in out and b'"body_timeout"' in out and closed < 2 * TIMEOUT_S + 3, closed
    # and it serves on
    async with aiohttp.ClientSession() as http, http.get(door.url + "/healthz") as r:
        assert r.status == 200


async def test_a_slow_unauthenticated_body_is_a_401_at_once(door: Gateway) -> None:
    t0 = time.monotonic()
    out, _ = await _exchange(door, _post("/v1/completions", 100) + b'{"prompt": ', wait_s=10)
    assert out.startswith(b"HTTP/1.1 401") and time.monotonic() - t0 < TIMEOUT_S + 3, out[:200]


# --- malformed bodies -----------------------------------------------------------------------------

@pytest.mark.parametrize("raw", DEEP_BODIES + [b"\xff\xfe{}", b'{"prompt": "\xc3"}', b"[]", b"1", b"null",
                                               b'"x"', b"", b"{", b'{"prompt": "x"} trailing'])
async def test_a_malformed_body_is_a_400_from_the_gateway(door: Gateway, raw: bytes) -> None:
    async with aiohttp.ClientSession() as http:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            async with http.post(door.url + path, data=raw,
                                 headers={**BEARER, "Content-Type": "application/json"}) as r:
                e = _err(await r.json())
                assert r.status == 400 and e["type"] == "invalid_request_error", (path, raw[:40], e)
                assert "request body" in e["message"], e


# --- /tokenize and /detokenize -------------------------------------------------------------------

async def test_tokenize_and_detokenize_need_a_key(door: Gateway) -> None:
    async with aiohttp.ClientSession() as http:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                async with http.post(door.url + path, json=body, headers=headers) as r:
                    assert r.status == 401 and _err(await r.json())["code"] == "invalid_api_key", path
            async with http.post(door.url + path, json=body, headers=BEARER) as r:
                assert r.status == 503, path          # the key is good; no worker behind this gateway


# --- the worker's bad-input matrix, through the gateway --------------------------------------------

@pytest.fixture
async def stack(tmp_path, database_url, nats_url, subjects) -> AsyncIterator[tuple[Cluster, Gateway]]:
    async with running_cluster(tmp_path, database_url, nats_url, subjects, auth=AUTH) as c:
        c.start_coordinator()
        c.start_worker("w1", worker={"port": 0})
        await c.wait_worker("w1")
        gw = start_gateway(tmp_path, c.base(), c._env())
        c.procs.append(gw.proc)
        yield c, gw


async def test_the_workers_bad_input_matrix_through_the_gateway_is_all_4xx(stack) -> None:
    cluster, gw = stack
    cases = ([("/v1/completions", body, None) for body, _, _ in BAD_COMPLETION_BODIES]
             + [("/v1/chat/completions", body, None) for body, _, _ in BAD_CHAT_BODIES]
             + [(p, None, raw) for p in ("/v1/completions", "/v1/chat/completions") for raw, _ in MALFORMED_BODIES]
             + [(p, None, raw) for p in ("/v1/completions", "/v1/chat/completions") for raw in DEEP_BODIES]
             + [("/tokenize", {"prompt": 5}, None), ("/detokenize", {"tokens": "x"}, None),
                ("/detokenize", {"tokens": [1, 2**40]}, None)])
    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + 60
        while True:                                   # the gateway has seen the worker
            async with http.get(gw.url + "/readyz") as r:
                if r.status == 200:
                    break
            assert time.monotonic() < deadline, gw.proc.tail()
            await asyncio.sleep(0.2)
        statuses = {}
        for path, body, raw in cases:
            kw = {"json": body} if raw is None else {"data": raw, "headers": {"Content-Type": "application/json"}}
            kw["headers"] = {**kw.get("headers", {}), **BEARER}
            async with http.post(gw.url + path, **kw) as r:
                text = await r.text()
                statuses[r.status] = statuses.get(r.status, 0) + 1
                assert 400 <= r.status < 500, (path, body or raw[:60], r.status, text[:300])
                _err(json.loads(text))
        # what reached the worker came back from it: its 400s passed through
        async with http.post(gw.url + "/v1/completions", json=BAD_COMPLETION_BODIES[0][0], headers=BEARER) as r:
            assert r.status == 400 and r.headers["x-kvl-worker"] == "w1"
            assert _err(await r.json())["param"] == BAD_COMPLETION_BODIES[0][1]
        print(f"{len(cases)} bad inputs through the gateway: {statuses}")
    assert gw.proc.alive and cluster.workers["w1"].alive
