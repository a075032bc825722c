"""A request's priority comes from its tenant's configuration; the client may only lower it.

Over real HTTP against a worker with one running slot: requests queued behind a running one are
admitted (and, one at a time, finished) in the order of their *effective* priority — a tenant
configured with a low priority that asks for ``priority: -1000000`` still goes last.
"""

from __future__ import annotations

import asyncio

import pytest

from shared.config import ApiKey, ConfigError
from shared.tenants import Tenant, TenantDirectory, effective_priority
from tests.serving.conftest import MODEL, sha, until

KEYS = [{"key_sha256": sha("key-vip"), "tenant": "vip", "priority": -10},
        {"key_sha256": sha("key-norm"), "tenant": "norm"},
        {"key_sha256": sha("key-bulk"), "tenant": "bulk", "priority": 10}]


def test_effective_priority_is_the_tenants_or_lower() -> None:
    vip, bulk = Tenant("vip", priority=-10), Tenant("bulk", priority=10)
    assert effective_priority(vip, None) == -10          # omitted: the tenant's
    assert effective_priority(vip, 3) == 3               # lowered (a larger number): allowed
    assert effective_priority(bulk, -1_000_000) == 10    # raised: clamped to the tenant's
    assert effective_priority(bulk, 10) == 10
    d = TenantDirectory([ApiKey(key_sha256=sha("k"), tenant="t", priority=7)])
    assert d.authenticate("Bearer k").priority == 7 and d.tenant("t").priority == 7
    assert d.tenant("unknown").priority == 0
    with pytest.raises(ConfigError, match="disagree on its limits.*priority"):
        TenantDirectory([ApiKey(key_sha256=sha("k1"), tenant="t", priority=1),
                         ApiKey(key_sha256=sha("k2"), tenant="t", priority=2)])


async def test_queued_requests_run_in_their_tenants_priority_order_whatever_they_ask(serve) -> None:
    over = {"auth.keys": KEYS, "service.max_concurrency": 1, "service.batch_window_ms": 0}
    async with serve(**over) as s:
        done: list[str] = []

        async def one(label: str, key: str, max_tokens: int, priority: int | None = None) -> None:
            body = {"model": MODEL, "prompt": f"queued request {label}", "max_tokens": max_tokens,
                    "temperature": 0, **({"priority": priority} if priority is not None else {})}
            status, doc, _ = await s.post("/v1/completions", body, key=key)
            assert status == 200, doc
            done.append(label)

        first = asyncio.create_task(one("first", "key-norm", 24))
        await until("the first request running", lambda: s.scheduler.running == 1)
        queued = [asyncio.create_task(one(label, key, 1, prio)) for label, key, prio in (
            ("bulk asking -1000000", "key-bulk", -1_000_000),   # clamped to its tenant's 10
            ("norm lowered to 5", "key-norm", 5),
            ("norm", "key-norm", None),                       # its tenant's 0
            ("vip", "key-vip", None),                         # its tenant's -10
        )]
        await until("four requests queued behind the first", lambda: s.scheduler.queue_depth == 4, timeout_s=10)
        assert s.scheduler.running == 1 and not first.done()
        await asyncio.gather(first, *queued)
        assert done == ["first", "vip", "norm", "norm lowered to 5", "bulk asking -1000000"]
