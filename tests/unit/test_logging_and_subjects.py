"""Logs never carry content; subjects live under one validated prefix."""

import io
import json

import pytest

from shared.logging import configure_logging, get_logger
from shared.subjects import Subjects


def test_json_logs_redact_content() -> None:
    buf = io.StringIO()
    configure_logging("json", "debug", stream=buf)
    get_logger("t").info("request done", prompt="secret prompt text", token_ids=[1, 2, 3], tenant="acme",
                         logits=[0.1], messages=[{"role": "user", "content": "hi"}], api_key="sk-123",
                         blob=b"\x00" * 10, long="x" * 5000, many=list(range(100)), n_tokens=3)
    line = json.loads(buf.getvalue().strip())
    for k in ("prompt", "token_ids", "logits", "messages", "api_key"):
        assert line[k] == "<redacted>"
    assert line["blob"] == "<10 bytes>" and line["long"] == "<5000 chars>" and line["many"] == "<list of 100 items>"
    assert line["tenant"] == "acme" and line["n_tokens"] == 3 and line["level"] == "info"
    assert "secret" not in buf.getvalue() and "sk-123" not in buf.getvalue()


def test_console_format_readable() -> None:
    buf = io.StringIO()
    configure_logging("console", "info", stream=buf)
    get_logger("t").info("hello", prompt="hidden")
    out = buf.getvalue()
    assert "hello" in out and "hidden" not in out


def test_subjects_under_prefix() -> None:
    s = Subjects("kvl")
    assert s.request("acquire", "w1") == "kvl.req.w1.acquire" and s.events("w1") == "kvl.events.w1"
    assert s.requests_wildcard("heartbeat") == "kvl.req.*.heartbeat"
    assert s.request_worker("kvl.req.w1.acquire") == "w1"
    assert s.request_worker("kvl.req.w1.steal") is None and s.request_worker("other.req.w1.acquire") is None
    with pytest.raises(ValueError, match="subject token"):
        s.request("acquire", "w.1")
    with pytest.raises(ValueError, match="unknown request"):
        s.request("steal", "w1")
    assert s.stream_name == "KVL_EVENTS" and s.events_wildcard == "kvl.events.>"
    assert s.inventory("w1") == "kvl.worker.w1.inventory" and s.control("w1") == "kvl.worker.w1.control"
    assert Subjects("test.a-1").stream_name == "TEST_A-1_EVENTS"
    with pytest.raises(ValueError, match="subject prefix"):
        Subjects("bad prefix")
    with pytest.raises(ValueError, match="subject token"):
        s.events("w.1")


def test_credentials_in_urls_are_masked() -> None:
    buf = io.StringIO()
    configure_logging("json", "info", stream=buf)
    get_logger("t").warning("cannot connect to nats://kvl:s3cret@nats:4222", url="postgresql://u:pw@db:5432/x",
                            plain="http://127.0.0.1:8400/v1/models")
    out = buf.getvalue()
    line = json.loads(out)
    assert "s3cret" not in out and "pw@" not in out
    assert line["event"] == "cannot connect to nats://kvl:***@nats:4222"
    assert line["url"] == "postgresql://u:***@db:5432/x" and line["plain"] == "http://127.0.0.1:8400/v1/models"
