"""The URL a worker registers for the gateway: ``worker.advertise_url``, else the bound address —
never a wildcard address, which no other machine can connect to (a compose stack's gateway got
"connection refused" from http://0.0.0.0:8400 until this existed)."""

from __future__ import annotations

import socket

import pytest

from shared.config import ConfigError, parse_config
from worker.engine_main import advertised_endpoint


def worker(**kw):
    return parse_config({"worker": kw}).worker


def test_the_configured_url_wins() -> None:
    assert advertised_endpoint(worker(advertise_url="http://worker-0:8400"), "0.0.0.0", 8400) == "http://worker-0:8400"


def test_a_wildcard_bind_advertises_the_host_name_and_a_specific_one_itself() -> None:
    assert advertised_endpoint(worker(), "0.0.0.0", 8400) == f"http://{socket.gethostname()}:8400"
    assert advertised_endpoint(worker(), "::", 8400) == f"http://{socket.gethostname()}:8400"
    assert advertised_endpoint(worker(), "127.0.0.1", 8401) == "http://127.0.0.1:8401"
    assert advertised_endpoint(worker(), "::1", 8401) == "http://[::1]:8401"


@pytest.mark.parametrize("bad", ["worker-0:8400", "ftp://w:1", "http://w:1/path", "http:// w"])
def test_a_url_that_is_not_an_http_origin_is_refused_by_name(bad) -> None:
    with pytest.raises(ConfigError, match="worker.advertise_url"):
        worker(advertise_url=bad)
