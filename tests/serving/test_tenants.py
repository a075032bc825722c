"""API keys, tenants and their isolation, limits and quotas."""

from __future__ import annotations

import asyncio

import openai
import pytest

from shared.config import ApiKey, AuthConfig, ConfigError
from tests.serving.conftest import MODEL, sha
from shared.tenants import AuthError, Tenant, TenantDirectory

PROMPT = "A tenant's prompt, three blocks long, or a little more."   # 55 bytes

KEYS = [{"key_sha256": sha("key-a"), "tenant": "acme"},
        {"key_sha256": sha("key-b"), "tenant": "bravo", "max_concurrency": 1, "cache_quota_blocks": 2}]


def test_directory_looks_up_hashes_and_refuses_bad_keys(tmp_path) -> None:
    d = TenantDirectory([ApiKey(key_sha256=sha("k1"), tenant="t1", max_concurrency=2)], required=True)
    assert d.authenticate("Bearer k1") == Tenant("t1", 2, 0)
    assert d.authenticate("bearer  k1 ") == Tenant("t1", 2, 0)
    for bad, words in ((None, "required"), ("", "required"), ("Bearer k2", "invalid API key"),
                       ("Basic k1", "Bearer"), ("Bearer ", "Bearer")):
        with pytest.raises(AuthError, match=words):
            d.authenticate(bad)
    open_ = TenantDirectory([], required=False)
    assert open_.authenticate("Bearer anything").id == "default"
    mixed = TenantDirectory([ApiKey(key_sha256=sha("k1"), tenant="t1")], required=False)
    assert mixed.authenticate(None).id == "default"
    with pytest.raises(AuthError):
        mixed.authenticate("Bearer typo")
    with pytest.raises(ConfigError, match="disagree on its limits"):
        TenantDirectory([ApiKey(key_sha256=sha("k1"), tenant="t1"),
                         ApiKey(key_sha256=sha("k2"), tenant="t1", max_concurrency=3)])
    # keys file
    f = tmp_path / "keys.yaml"
    f.write_text(f"keys:\n  - key_sha256: {sha('filed')}\n    tenant: fromfile\n    cache_quota_blocks: 7\n")
    d = TenantDirectory.from_config(AuthConfig(required=True, keys_file=str(f)))
    assert d.authenticate("Bearer filed") == Tenant("fromfile", 0, 7)
    f.write_text("keys:\n  - key_sha256: nothex\n    tenant: x\n")
    with pytest.raises(ConfigError, match="auth.keys_file"):
        TenantDirectory.from_config(AuthConfig(keys_file=str(f)))


async def test_401_without_a_valid_key(serve) -> None:
    async with serve(**{"auth.required": True, "auth.keys": KEYS}) as s:
        for key in (None, "wrong"):
            status, doc, headers = await s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}, key=key)
            assert status == 401 and doc["error"]["type"] == "authentication_error"
            assert doc["error"]["code"] == "invalid_api_key" and headers["WWW-Authenticate"] == "Bearer"
        with pytest.raises(openai.AuthenticationError, match="invalid API key"):
            await s.client("nope").models.list()
        assert (await s.client("key-a").models.list()).data[0].id == MODEL
        # probes and metrics need no key
        assert (await s.get("/healthz"))[0] == 200 and (await s.get("/metrics"))[0] == 200


async def test_tenant_b_never_gets_tenant_a_cached_tokens(serve) -> None:
    async with serve(**{"auth.required": True, "auth.keys": KEYS, "auth.salt_secret": "s3cret"}) as s:
        a, b = s.client("key-a"), s.client("key-b")

        async def run(c, **kw):
            return await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, **kw)

        a1 = await run(a)
        b1 = await run(b)
        assert a1.usage.prompt_tokens_details.cached_tokens == 0
        assert b1.usage.prompt_tokens_details.cached_tokens == 0          # A's blocks are not B's
        assert b1.choices[0].text == a1.choices[0].text                   # same model, same text
        assert (await run(a)).usage.prompt_tokens_details.cached_tokens == 48
        # B's own repeat reuses, within its quota of 2 blocks
        assert (await run(b)).usage.prompt_tokens_details.cached_tokens == 32
        tenants = {m.tenant for _, _, m in s.engine.store.items()}
        assert tenants == {"acme", "bravo"}
        bravo_blocks = {m.block_hash for _, _, m in s.engine.store.items() if m.tenant == "bravo"}
        assert len(bravo_blocks) == 2                                     # cache_quota_blocks
        assert s.engine.salt("acme") != s.engine.salt("bravo")


async def test_per_tenant_concurrency(serve) -> None:
    async with serve(**{"auth.keys": KEYS, "service.batch_window_ms": 0}) as s:
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        b_reqs = [asyncio.create_task(s.post("/v1/completions", body, key="key-b")) for _ in range(3)]
        a_req = asyncio.create_task(s.post("/v1/completions", body, key="key-a"))
        peak_b = peak_total = 0
        while not all(t.done() for t in (*b_reqs, a_req)):
            running = [j.req.tenant.id for j in s.scheduler._running]
            peak_b = max(peak_b, running.count("bravo"))
            peak_total = max(peak_total, len(running))
            await asyncio.sleep(0.005)
        assert peak_b == 1 and peak_total == 2     # bravo one at a time; acme went ahead of its queue
        assert [(await t)[0] for t in (*b_reqs, a_req)] == [200] * 4
