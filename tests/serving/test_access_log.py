"""The worker's ``access`` line: one JSON line per API request at info level, with its id, tenant,
status, token counts, fallbacks and timings, and never its prompt or completion text."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest
import structlog

from shared.logging import configure_logging
from tests.serving.conftest import MODEL, sha

PROMPT = "Zebra quartz access-line canary, longer than one block."   # 55 bytes: three blocks and a bit
KEYS = [{"key_sha256": sha("key-a"), "tenant": "acme"}]


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    saved = structlog.get_config()
    stream = io.StringIO()
    configure_logging("json", "info", stream=stream)
    yield stream
    structlog.configure(**saved)


def access_lines(stream: io.StringIO) -> list[dict]:
    lines = [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]
    return [doc for doc in lines if doc.get("event") == "access"]


async def test_one_access_line_per_request_with_counts_and_no_content(serve, log_stream: io.StringIO) -> None:
    async with serve(**{"auth.keys": KEYS}) as s:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
        status, doc, headers = await s.post("/v1/completions", body, key="key-a",
                                            headers={"X-Request-Id": "client-id.42"})
        assert status == 200 and headers["X-Request-Id"] == "client-id.42", doc
        status, _, headers = await s.post("/v1/completions", {**body, "stream": True}, key="key-a")
        assert status == 200
        stream_id = headers["X-Request-Id"]
        status, _, bad = await s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, key="key-a")
        assert status == 400
        await s.get("/healthz")                     # probes: no access line
        await s.get("/metrics")

    lines = access_lines(log_stream)
    assert [(a["path"], a["status"]) for a in lines] == [("/v1/completions", 200)] * 2 + [("/v1/completions", 400)]
    plain, streamed, refused = lines
    assert plain["id"] == "client-id.42" and streamed["id"] == stream_id and refused["id"] == bad["X-Request-Id"]
    for a in lines:
        assert a["service"] == "worker" and a["tenant"] == "acme" and a["level"] == "info" and a["method"] == "POST"
        assert a["duration_ms"] >= a["ttfb_ms"] >= 0
    for a in (plain, streamed):
        assert (a["prompt_tokens"], a["completion_tokens"]) == (len(PROMPT.encode()), 3)
        assert isinstance(a["cached_tokens"], int) and isinstance(a["fallbacks"], (int, list, dict))
    assert "prompt_tokens" not in refused
    everything = log_stream.getvalue()
    assert "Zebra" not in everything and "canary" not in everything
    sizes = [len(json.dumps(a)) + 1 for a in lines]
    print(f"access line bytes: {sizes}")
    assert max(sizes) < 600
