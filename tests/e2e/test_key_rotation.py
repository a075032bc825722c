"""Rotating API keys and the admin token without a restart (issue 55, item 8), with real processes:
a coordinator, a worker and a gateway start with key A (and admin token A); their config files
are rewritten to name key B; the worker and the coordinator get SIGHUP, the gateway notices the
file change itself (``auth.reload_check_s``). B works at once, A keeps working within
``auth.rotation_grace_s`` and is refused after it; a config that does not parse changes nothing.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

from shared.subjects import Subjects
from shared.tenants import TenantDirectory, key_sha256
from shared.config import ApiKey
from tests.e2e.test_gateway_limits import start_gateway
from tests.worker.processes import REPO, running_cluster

OLD, NEW = "sk-rotate-old", "sk-rotate-new"
TOKEN_OLD, TOKEN_NEW = "admin-token-old", "admin-token-new"
GRACE_S = 6.0


def auth(key: str, **extra: object) -> dict[str, object]:
    return {"required": True, "keys": [{"key_sha256": key_sha256(key), "tenant": "t1"}], "salt_secret": "s",
            **extra}


def rewrite(path: Path, key: str, token: str | None = None, **extra: object) -> None:
    doc = yaml.safe_load(path.read_text())
    doc["auth"] = {**doc["auth"], "keys": auth(key)["keys"], **extra}
    if token is not None:
        doc["coordinator"]["admin_token"] = token
    path.write_text(yaml.safe_dump(doc))


async def status(http: aiohttp.ClientSession, url: str, key: str) -> int:
    async with http.get(url, headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status


async def until(http: aiohttp.ClientSession, url: str, key: str, ok: bool, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while (await status(http, url, key) != 401) != ok:
        assert time.monotonic() < deadline, f"{url} with {key}: still {'refused' if ok else 'accepted'}"
        await asyncio.sleep(0.1)


def test_a_retired_key_lasts_its_grace_and_no_longer() -> None:
    d = TenantDirectory([ApiKey(key_sha256=key_sha256(OLD), tenant="t1")], required=True)
    assert d.replace(TenantDirectory([ApiKey(key_sha256=key_sha256(NEW), tenant="t1", priority=3)], required=True),
                     grace_s=60) == 1
    assert d.authenticate(f"Bearer {NEW}").id == "t1"
    assert d.authenticate(f"Bearer {OLD}").priority == 3        # the tenant's new limits apply to it too
    d.replace(TenantDirectory([ApiKey(key_sha256=key_sha256(NEW), tenant="t1")], required=True), grace_s=0,
              now=time.monotonic() + 61)
    with pytest.raises(Exception, match="invalid API key"):
        d.authenticate(f"Bearer {OLD}")


async def test_keys_and_admin_token_rotate_on_reload(database_url: str, nats_url: str, subjects: Subjects,
                                                     tmp_path: Path) -> None:
    first = auth(OLD, rotation_grace_s=GRACE_S, reload_check_s=0)
    async with running_cluster(tmp_path, database_url, nats_url, subjects, auth=first) as c:
        base = c.base
        c.base = lambda: {**base(), "coordinator": {**base()["coordinator"], "admin_token": TOKEN_OLD}}  # type: ignore[method-assign]
        coord = c.start_coordinator()
        worker = c.start_worker("w1")
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVL_")}, "PYTHONPATH": str(REPO)}
        gw_doc = {"nats": {"url": nats_url, "subject_prefix": subjects.prefix},
                  "auth": auth(OLD, rotation_grace_s=GRACE_S, reload_check_s=0.2),
                  "logging": {"format": "json", "level": "info"}}
        (tmp_path / "gw").mkdir()
        gw = start_gateway(tmp_path / "gw", gw_doc, env)
        admin = f"http://127.0.0.1:{c.admin_port}/v1/workers"
        w_url = await c.http_url("w1") + "/v1/models"
        g_url = gw.url + "/v1/models"
        async with aiohttp.ClientSession() as http:
            await until(http, admin, TOKEN_OLD, ok=True, timeout_s=60)
            for url, old, new in ((admin, TOKEN_OLD, TOKEN_NEW), (w_url, OLD, NEW), (g_url, OLD, NEW)):
                assert await status(http, url, old) != 401 and await status(http, url, new) == 401, url

            rewrite(tmp_path / "coordinator.yaml", OLD, TOKEN_NEW)
            rewrite(tmp_path / "w1.yaml", NEW)
            rewrite(tmp_path / "gw" / "gateway.yaml", NEW)
            rotated = time.monotonic()
            coord.signal(signal.SIGHUP)
            worker.signal(signal.SIGHUP)            # the gateway sees its file change by itself
            for url, old, new in ((admin, TOKEN_OLD, TOKEN_NEW), (w_url, OLD, NEW), (g_url, OLD, NEW)):
                await until(http, url, new, ok=True)
            assert time.monotonic() - rotated < GRACE_S - 1, "too slow to see the grace (a loaded machine?)"
            for url, old in ((admin, TOKEN_OLD), (w_url, OLD), (g_url, OLD)):
                assert await status(http, url, old) != 401, f"{url}: the old key within its grace"

            # a file that does not parse: the keys in use are kept, and the log says why
            (tmp_path / "w1.yaml").write_text("auth: [not, a, mapping\n")
            worker.signal(signal.SIGHUP)
            await asyncio.sleep(max(0.0, rotated + GRACE_S + 0.5 - time.monotonic()))
            for url, old, new in ((admin, TOKEN_OLD, TOKEN_NEW), (w_url, OLD, NEW), (g_url, OLD, NEW)):
                assert await status(http, url, old) == 401, f"{url}: the old key after its grace"
                assert await status(http, url, new) != 401, url
            # where an operator looks: each process counts its reloads, the failed one too
            for base_url, name, failed in ((f"http://127.0.0.1:{c.admin_port}", "kvl_coordinator", 0),
                                           (w_url.removesuffix("/v1/models"), "kvl_worker", 1),
                                           (gw.url, "kvl_gateway", 0)):
                async with http.get(base_url + "/metrics", headers={"Authorization": f"Bearer {NEW}"}) as r:
                    text = await r.text()
                got = {m[0]: float(m[1]) for m in re.findall(name + r'_auth_reloads_total\{outcome="(\w+)"\} (\S+)', text)}
                assert got.get("ok", 0) >= 1 and got.get("failed", 0) == failed, (name, got)
        assert worker.alive and coord.alive and gw.proc.alive
        assert "auth_reload_failed" in worker.log.read_text()
        gw.proc.stop()
