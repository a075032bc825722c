"""The worker's NATS debug subject: its tenant comes only from an API key, never from a name."""

from __future__ import annotations

import pytest

from shared.config import ApiKey
from shared.subjects import Subjects
from tests.worker.conftest import prompt
from tests.twin import InProcessCoordinator
from worker.engine_main import DebugService
from shared.tenants import TenantDirectory, key_sha256

KEYS = [ApiKey(key_sha256=key_sha256("key-a"), tenant="acme"), ApiKey(key_sha256=key_sha256("key-b"), tenant="bravo")]


async def test_generate_names_its_tenant_by_key_and_never_by_name(make_engine) -> None:
    toks = prompt(48, seed=61)
    async with make_engine(InProcessCoordinator()) as e:
        debug = DebugService(e, "", Subjects("kvlt"), TenantDirectory(KEYS))
        with pytest.raises(ValueError, match="never a tenant name"):
            await debug._generate({"tokens": toks, "max_tokens": 1, "tenant": "acme"})
        assert (await debug._generate({"tokens": toks, "max_tokens": 1, "api_key": "nope"}))["error"].startswith(
            "unauthorized: invalid API key")
        await debug._generate({"tokens": toks, "max_tokens": 1, "api_key": "key-a"})
        await e.flush()
        assert (await debug._generate({"tokens": toks, "max_tokens": 1, "api_key": "key-a"}))["cached_tokens"] == 32
        # another tenant's key: its own (cold) cache, not acme's
        assert (await debug._generate({"tokens": toks, "max_tokens": 1, "api_key": "key-b"}))["cached_tokens"] == 0
        # no key while keys are configured (auth not required): the default tenant, not acme
        assert (await debug._generate({"tokens": toks, "max_tokens": 1}))["cached_tokens"] == 0
