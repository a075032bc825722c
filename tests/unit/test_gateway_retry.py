"""gateway.retry_*: which failures are retried, in what order, after how long; the config's
checks (issue 55, item 8). The end-to-end test with a real worker process that is down is
tests/e2e/test_gateway_retry_allowlist.py."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from gateway import retry
from shared.config import ConfigError, parse_config


def test_defaults_retry_only_connection_failures_and_503() -> None:
    g = parse_config({}).gateway
    assert (g.retry_attempts, g.retry_on, g.retry_backoff_ms, g.retry_backoff_max_ms) == (3, ["connect", 503], 50, 1000)
    assert retry.status_retried(503, g.retry_on)
    for status in (429, 500, 502, 504, 400):
        assert not retry.status_retried(status, g.retry_on)
    for e in (aiohttp.ServerDisconnectedError(), aiohttp.ClientOSError(), asyncio.TimeoutError(),
              aiohttp.ClientPayloadError("cut")):
        assert retry.error_retried(e, g.retry_on), e
    assert not retry.error_retried(aiohttp.InvalidURL("x"), g.retry_on)      # not the connection's fault
    assert not retry.error_retried(aiohttp.ServerDisconnectedError(), [503])


def test_order_and_backoff() -> None:
    assert retry.attempt_order(["a", "b"], 3) == ["a", "b", "a"]
    assert retry.attempt_order(["a", "b", "c"], 2) == ["a", "b"]
    assert retry.attempt_order([], 3) == []
    assert [retry.backoff_s(i, 50, 1000) for i in range(7)] == [0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.0]
    assert retry.backoff_s(3, 0, 1000) == 0.0


def test_config_checks() -> None:
    g = parse_config({"gateway": {"retry_on": ["connect", 429, 502], "retry_attempts": 1}}).gateway
    assert g.retry_on == ["connect", 429, 502] and g.retry_attempts == 1
    with pytest.raises(ConfigError, match=r"gateway.retry_on\[0\]"):
        parse_config({"gateway": {"retry_on": [500]}})
    with pytest.raises(ConfigError, match="gateway.retry_attempts"):
        parse_config({"gateway": {"retry_attempts": 0}})
    with pytest.raises(ConfigError, match=r"gateway.allowed_networks: '10.0.0.0/33' is not an address"):
        parse_config({"gateway": {"allowed_networks": ["10.0.0.0/33"]}})
    with pytest.raises(ConfigError, match=r"worker.allowed_networks: 'localhost' is not an address"):
        parse_config({"worker": {"allowed_networks": ["localhost"]}})
