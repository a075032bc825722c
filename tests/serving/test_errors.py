"""Every error a client can cause: its status, an OpenAI-style body naming what was wrong, never a 5xx."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.bad_requests import BAD_CHAT_BODIES, BAD_COMPLETION_BODIES, MALFORMED_BODIES
from tests.serving.conftest import MODEL, until

PROMPT = "sixteen bytes..!" * 2


def err(doc) -> dict:
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}, doc
    return doc["error"]


@pytest.mark.parametrize("body, param, words", BAD_COMPLETION_BODIES)
async def test_bad_completion_bodies_are_400_naming_the_parameter(serve, body, param, words) -> None:
    async with serve() as s:
        status, doc, _ = await s.post("/v1/completions", body)
        e = err(doc)
        assert status == 400 and e["type"] == "invalid_request_error"
        assert e["param"] == param and words in e["message"], e


@pytest.mark.parametrize("body, param, words", BAD_CHAT_BODIES)
async def test_bad_chat_bodies_are_400(serve, body, param, words) -> None:
    async with serve() as s:
        status, doc, _ = await s.post("/v1/chat/completions", body)
        e = err(doc)
        assert status == 400 and e["param"] == param and words in e["message"], e


async def test_malformed_json_and_wrong_shapes(serve) -> None:
    async with serve() as s:
        for raw, words in MALFORMED_BODIES:
            status, doc, _ = await s.post("/v1/completions", raw=raw, headers={"Content-Type": "application/json"})
            assert status == 400 and words in err(doc)["message"], (raw, doc)


async def test_context_limit_is_a_400_naming_the_limit(serve) -> None:
    async with serve(**{"service.max_context_length": 64}) as s:
        status, doc, _ = await s.post("/v1/completions", {"prompt": "x" * 60, "max_tokens": 5})
        e = err(doc)
        assert status == 400 and e["code"] == "context_length_exceeded" and e["param"] == "max_tokens"
        assert "65 tokens" in e["message"] and "maximum context length is 64 tokens" in e["message"]
        # exactly at the limit is fine (never silently truncated, never refused)
        status, doc, _ = await s.post("/v1/completions", {"prompt": "x" * 60, "max_tokens": 4, "temperature": 0})
        assert status == 200 and doc["usage"]["prompt_tokens"] == 60
        with pytest.raises(openai.BadRequestError, match="maximum context length is 64"):
            await s.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 80}])


async def test_body_too_large_is_413(serve) -> None:
    async with serve(**{"service.max_body_bytes": 1000}) as s:
        status, doc, _ = await s.post("/v1/completions", {"prompt": "x" * 2000})
        e = err(doc)
        assert status == 413 and e["code"] == "request_too_large" and "1000 bytes" in e["message"]

        async def chunks():                     # no Content-Length: caught while reading
            for _ in range(4):
                yield b"x" * 400
        async with s.http.post(s.url + "/v1/completions", data=chunks()) as r:
            assert r.status == 413 and err(await r.json())["code"] == "request_too_large"


async def test_unknown_model_route_and_method(serve) -> None:
    async with serve() as s:
        with pytest.raises(openai.NotFoundError) as ei:
            await s.client().completions.create(model="gpt-5", prompt=PROMPT, max_tokens=1)
        assert ei.value.body["code"] == "model_not_found" and "gpt-5" in ei.value.body["message"]
        status, doc, _ = await s.post("/v1/nothing", {})
        assert status == 404 and err(doc)["code"] == "not_found"
        status, doc = await s.get("/v1/completions")
        assert status == 405 and err(doc)["code"] == "method_not_allowed"


async def test_queue_full_is_429_with_retry_after(serve) -> None:
    async with serve(**{"service.max_concurrency": 1, "service.queue_size": 1, "service.batch_window_ms": 0}) as s:
        slow = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0}
        busy = [asyncio.create_task(s.post("/v1/completions", slow)) for _ in range(2)]  # one runs, one waits
        while s.scheduler.running + s.scheduler.queue_depth < 2:
            await asyncio.sleep(0.01)
        status, doc, headers = await s.post("/v1/completions", slow)
        e = err(doc)
        assert status == 429 and e["code"] == "queue_full" and int(headers["Retry-After"]) >= 1
        with pytest.raises(openai.RateLimitError):
            await s.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        assert [(await t)[0] for t in busy] == [200, 200]


async def test_queue_timeout_is_504(serve) -> None:
    async with serve(**{"service.max_concurrency": 1, "service.queue_timeout_ms": 150}) as s:
        slow = asyncio.create_task(s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 25}))
        while s.scheduler.running < 1:
            await asyncio.sleep(0.01)
        status, doc, _ = await s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
        e = err(doc)
        assert status == 504 and e["code"] == "queue_timeout" and "150 ms" in e["message"]
        assert (await slow)[0] == 200


async def test_request_timeout_is_504_and_frees_everything(serve) -> None:
    async with serve(**{"service.request_timeout_ms": 400}) as s:
        status, doc, _ = await s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 100})
        e = err(doc)
        assert status == 504 and e["code"] == "request_timeout" and "400 ms" in e["message"]
        # streaming: the headers went out with the first token, so the timeout is an error event
        async with s.http.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 100,
                                                                 "stream": True}) as r:
            assert r.status == 200
            events = [e for e in (await r.read()).decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "request_timeout"
        with pytest.raises(openai.APIError, match="request_timeout_ms"):
            async for _ in await s.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=100,
                                                               stream=True):
                pass
        await until("a session, lease or request left", lambda: not s.engine.sessions and s.live_leases() == 0
                    and s.scheduler.running == 0)


async def test_no_5xx_for_a_barrage_of_bad_input(serve) -> None:
    bodies = [b"null", b"1", b'"x"', b"{}", b'{"prompt": null}', b'{"prompt": {"a": 1}}', b'{"prompt": [[1, 2]]}',
              b'{"prompt": [true]}', b'{"prompt": "x", "seed": "1"}', b'{"prompt": "x", "seed": -5, "max_tokens": 1}',
              b'{"prompt": "x", "max_tokens": 1e400}', b'{"prompt": "x", "stop": [1]}', b'{"prompt": "x", "priority": 1e9}',
              b'{"prompt": "x", "stream_options": {"include_usage": true}}', b'{"messages": [{"role": "user"}]}']
    async with serve() as s:
        for path in ("/v1/completions", "/v1/chat/completions"):
            for raw in bodies:
                status, doc, _ = await s.post(path, raw=raw)
                assert status < 500, (path, raw, doc)
                if status != 200:
                    err(doc)


def _fused_mismatch() -> Exception:
    from worker.stepper import FusedMismatch
    return FusedMismatch("a fused forward gave request 0 other logits than the same request alone; retry")


@pytest.mark.parametrize("failure, status, code, shown", [
    # a bug: 500, its details logged, never sent
    (lambda: RuntimeError("a bug, with details the client must not see"), 500, "internal_error", None),
    # a step the run-time batch-invariance check failed: not the client's fault and not a bug to
    # hide — 503 with the reason, so a gateway or client retries (this worker now runs one request
    # per forward, exact again)
    (_fused_mismatch, 503, "unavailable", "retry"),
], ids=["bug", "fused-mismatch"])
async def test_an_engine_failure_is_answered_by_kind_and_the_worker_serves_on(serve, monkeypatch, failure, status,
                                                                              code, shown) -> None:
    async with serve() as s:
        real_open = s.engine.open

        async def broken(*a, **kw):
            raise failure()

        monkeypatch.setattr(s.engine, "open", broken)
        got, doc, _ = await s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
        e = err(doc)
        assert got == status and e["code"] == code and "details" not in e["message"]
        assert shown is None or shown in e["message"]
        monkeypatch.setattr(s.engine, "open", real_open)
        got, doc, _ = await s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
        assert got == 200 and s.scheduler.running == 0
