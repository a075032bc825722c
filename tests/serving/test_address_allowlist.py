"""worker.allowed_networks over real HTTP (issue 55, item 8): a client outside the list gets a
403 before its API key is looked at; inside it, the API answers as always (401 without a key);
an IPv4 peer on a dual-stack socket matches as IPv4."""

from __future__ import annotations

import ipaddress

import aiohttp

from shared.address_allowlist import allowed, parse_networks
from tests.serving.conftest import MODEL, sha

KEY = "sk-allow"
AUTH = {"auth.required": True, "auth.keys": [{"key_sha256": sha(KEY), "tenant": "acme"}]}


async def test_outside_the_list_is_refused_before_auth(serve) -> None:
    async with serve(**AUTH, **{"worker.allowed_networks": ["192.0.2.0/24", "2001:db8::/32"]}) as s:
        for key in (KEY, None, "sk-wrong"):
            status, doc, headers = await s.post("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3],
                                                                     "max_tokens": 1}, key=key)
            assert status == 403 and doc["error"]["code"] == "address_not_allowed", doc
            assert "worker.allowed_networks" in doc["error"]["message"]
        assert (await s.get("/healthz"))[0] == 403
        assert s.engine.metrics.value("kvl_worker_address_refused_total") == 4
        # a body is never read: a huge one is refused as fast as a small one, the connection closed
        async with aiohttp.ClientSession() as http:
            async with http.post(s.url + "/v1/completions", data=b"x" * (8 * 2**20),
                                 headers={"Authorization": f"Bearer {KEY}"}) as r:
                assert r.status == 403 and r.headers.get("Connection", "").lower() == "close"


async def test_inside_the_list_the_api_answers_as_always(serve) -> None:
    async with serve(**AUTH, **{"worker.allowed_networks": ["127.0.0.0/8", "::1"]}) as s:
        status, doc, _ = await s.post("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1})
        assert status == 401, doc
        status, doc, _ = await s.post("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1},
                                      key=KEY)
        assert status == 200, doc
        assert s.engine.metrics.value("kvl_worker_address_refused_total") == 0


def test_matching() -> None:
    nets = parse_networks("k", ["10.0.0.0/8", "192.168.1.7", "fd00::/8"])
    assert nets[1] == ipaddress.ip_network("192.168.1.7/32")
    assert allowed(nets, "10.2.3.4") and allowed(nets, "192.168.1.7") and allowed(nets, "fd00::1")
    assert allowed(nets, "::ffff:10.9.9.9")                       # IPv4 on a dual-stack socket
    assert not allowed(nets, "192.168.1.8") and not allowed(nets, "11.0.0.1") and not allowed(nets, "fe80::1%eth0")
    assert not allowed(nets, None) and not allowed(nets, "garbage")
    assert allowed((), None) and allowed((), "203.0.113.9")          # no list: everyone
