"""Hostile input over HTTP fails cleanly: 4xx in the OpenAI error shape, never a 5xx, never a
held slot or connection (issue 12, part 4)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from shared.config import ApiKey, ConfigError
from tests.bad_requests import DEEP_BODIES
from tests.serving.conftest import sha
from shared.tenants import AuthError, TenantDirectory

PROMPT = "sixteen bytes..!" * 2
KEYS = [{"key_sha256": sha("key-a"), "tenant": "acme"}]


def err(doc) -> dict:
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}, doc
    return doc["error"]


async def _raw(url: str, data: bytes, *, wait_s: float = 5.0) -> bytes:
    """Send ``data`` on a fresh connection; everything the server sends until it closes (or ``wait_s``)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        out = b""
        async with asyncio.timeout(wait_s):
            while chunk := await reader.read(65536):
                out += chunk
                if b"\r\n\r\n" in out and b"Content-Length: " in out:
                    head, _, body = out.partition(b"\r\n\r\n")
                    n = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                    if len(body) >= n:
                        break
        return out
    finally:
        writer.close()


# --- 1. nesting -------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw", DEEP_BODIES)
async def test_deeply_nested_json_is_a_400_not_a_recursion_error(serve, raw) -> None:
    async with serve() as s:
        for path in ("/v1/completions", "/v1/chat/completions"):
            status, doc, _ = await s.post(path, raw=raw)
            e = err(doc)
            assert status == 400 and e["type"] == "invalid_request_error" and "nests JSON deeper" in e["message"]
        # brackets inside strings are text, not nesting
        status, doc, _ = await s.post("/v1/completions", {"prompt": "[" * 200, "max_tokens": 1})
        assert status == 200, doc


# --- 2. Authorization header ------------------------------------------------------------------------

async def test_undecodable_authorization_header_is_a_401(serve) -> None:
    async with serve(**{"auth.required": True, "auth.keys": KEYS}) as s:
        body = b'{"prompt": "x", "max_tokens": 1}'
        for auth in (b"Bearer \xff\xfe\x80", b"\xff\xfe key-a", b"Bearer key-a\xc3"):
            raw = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: " + auth
                   + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                   % len(body) + body)
            out = await _raw(s.url, raw)
            assert out.startswith(b"HTTP/1.1 401"), (auth, out[:200])
            assert b'"authentication_error"' in out and b'"invalid_api_key"' in out
        # the scheme in any case, any whitespace after it
        for header in ("bearer key-a", "BEARER key-a", "Bearer\tkey-a", "Bearer   key-a  "):
            status, doc, _ = await s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1},
                                          headers={"Authorization": header})
            assert status == 200, (header, doc)


def test_directory_refuses_a_key_that_is_not_utf8() -> None:
    d = TenantDirectory([ApiKey(key_sha256=sha("k1"), tenant="t1")], required=True)
    with pytest.raises(AuthError, match="not valid UTF-8"):
        d.authenticate("Bearer k\udcff1")       # how aiohttp passes on an undecodable byte
    assert d.authenticate("bearer\tk1").id == "t1"


# --- 3. a refused request never runs ----------------------------------------------------------------

async def test_invalid_requests_never_occupy_a_slot(serve) -> None:
    async with serve(**{"service.max_concurrency": 2, "service.queue_size": 0, "service.batch_window_ms": 0}) as s:
        bad = {"prompt": PROMPT, "max_tokens": 200, "stop": ["a", "b", "c", "d", "e"]}
        results = await asyncio.gather(*(s.post(path, dict(bad, **extra)) for path, extra in
                                         [("/v1/completions", {})] * 20
                                         + [("/v1/chat/completions", {"messages": [{"role": "user",
                                                                                    "content": "hi"}]})] * 20))
        assert [r[0] for r in results] == [400] * 40, [r[1] for r in results if r[0] != 400][:2]
        assert all(err(doc)["param"] == "stop" for _, doc, _ in results)
        assert s.scheduler.running == 0 and s.scheduler.queue_depth == 0
        t0 = time.perf_counter()
        status, doc, _ = await s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
        assert status == 200, doc
        assert time.perf_counter() - t0 < 5


# --- 4. Retry-After from the real queue wait --------------------------------------------------------

async def test_retry_after_reflects_how_long_running_requests_take(serve) -> None:
    async with serve(**{"service.max_concurrency": 1, "service.queue_size": 0, "service.batch_window_ms": 0}) as s:
        slow = asyncio.create_task(s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 400}))
        try:
            while s.scheduler.running < 1:
                await asyncio.sleep(0.01)
            await asyncio.sleep(2.2)
            assert s.scheduler.running == 1, "the slow request ended too soon for this test"
            status, doc, headers = await s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
            assert status == 429 and err(doc)["code"] == "queue_full"
            # it has run 2.2 s and not finished: a retry in 1 s would only be refused again
            assert int(headers["Retry-After"]) >= 2, headers["Retry-After"]
        finally:
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow


async def test_retry_after_estimate(serve) -> None:
    async with serve(**{"service.max_concurrency": 4, "service.queue_size": 100}) as s:
        sched = s.scheduler
        now = 1000.0

        class _Job(SimpleNamespace):
            __hash__ = object.__hash__

        def running(*ages: float) -> set:
            return {_Job(admitted_at=now - a) for a in ages}

        try:
            assert sched._retry_after(now) == 1                 # nothing known: the floor
            # a burst of 40 s requests filling every slot, none finished yet: 4 slots free
            # about every 10 s, and the refused request is next in line
            sched._running = running(40, 40, 40, 40)
            assert sched._retry_after(now) == 10
            sched._waiting = [object()] * 7                    # 8th in line: two rounds
            assert sched._retry_after(now) == 80
            # steady state: finished requests took 30 s on average; ages spread out
            sched._waiting = []
            sched._avg_run_s = 30.0
            sched._running = running(1, 8, 15, 29)
            assert sched._retry_after(now) == 8                 # ceil(30 / 4)
            sched._waiting = [object()] * 1000
            assert sched._retry_after(now) == 300               # clamped
        finally:
            sched._running = set()
            sched._waiting = []
            sched._avg_run_s = None


# --- 5. slow senders --------------------------------------------------------------------------------

async def test_slow_senders_do_not_hold_connections(serve) -> None:
    async with serve(**{"service.keepalive_timeout_ms": 500, "service.body_read_timeout_ms": 500}) as s:
        t0 = time.perf_counter()
        # headers never finished: the connection is closed
        out = await _raw(s.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl", wait_s=5)
        assert out == b"" and time.perf_counter() - t0 < 3
        # headers in, body short of its Content-Length: a 408 in the API's error shape
        t0 = time.perf_counter()
        out = await _raw(s.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                b"Content-Length: 100\r\n\r\n{\"prompt\": ", wait_s=5)
        assert out.startswith(b"HTTP/1.1 408"), out[:200]
        assert b'"timeout_error"' in out and b'"body_timeout"' in out and time.perf_counter() - t0 < 3
        # the worker serves on
        status, doc, _ = await s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
        assert status == 200, doc


# --- 7. tenant names --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["..", ".", "a/b", "../etc", "", "x" * 65, "tab\there", "é"])
def test_unsafe_tenant_names_are_refused_where_keys_are_loaded(name) -> None:
    with pytest.raises(ConfigError, match="tenant name"):
        TenantDirectory([ApiKey(key_sha256=sha("k1"), tenant=name)])


def test_keys_file_tenant_names_are_checked(tmp_path) -> None:
    from shared.config import AuthConfig
    f = tmp_path / "keys.yaml"
    f.write_text(f"keys:\n  - key_sha256: {sha('k')}\n    tenant: '..'\n")
    with pytest.raises(ConfigError, match="auth.keys_file"):
        TenantDirectory.from_config(AuthConfig(keys_file=str(f)))
    f.write_text(f"keys:\n  - key_sha256: {sha('k')}\n    tenant: ok-name_1\n")
    assert TenantDirectory.from_config(AuthConfig(keys_file=str(f), required=True)).authenticate("Bearer k").id \
        == "ok-name_1"
