"""The audit against a real coordinator covers the host tier (and checks disk files through a
worker): a worker's digest inventory, fetched in pages over NATS, compared tier by tier."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import nats
import pytest

from coordinator.app import COORDINATOR
from shared import messages as m
from shared.hashing import replica_digest, split_digests
from shared.subjects import Subjects
from tests.integration.coordinator_kit import NS, Worker, block, fast_config, running_coordinator
from worker.client.nats_adapter import NatsCoordinatorClient


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVL_ADMIN_TOKEN", raising=False)


def offload(w: Worker, h: str, i: int, location: str) -> m.TransitionEvent:
    w.seq += 1
    return m.TransitionEvent(worker_id=w.worker_id, epoch=w.epoch, seq=w.seq, namespace=NS, block_hash=h,
                             parent_hash=block(i - 1) if i else "0" * 32, token_start=16 * i, token_end=16 * (i + 1),
                             form="compressed", location=location, from_state=None, to_state=m.ReplicaState.READY,
                             generation=0, checksum=f"c{i}")


@pytest.fixture
async def stack(database_url: str, nats_url: str, subjects: Subjects) -> AsyncIterator[dict[str, Any]]:
    """A coordinator; worker w1 with four READY blocks on its GPU, copies of them on its host
    tier and one on disk; a stub of w1's inventory responder behind the worker's NATS client."""
    cfg = fast_config(database_url, nats_url, subjects)
    async with running_coordinator(cfg) as (app, base):
        nc = await nats.connect(nats_url)
        client = NatsCoordinatorClient(nats_url, subjects)
        http = aiohttp.ClientSession()
        try:
            w = Worker(nc, subjects)
            await w.register()
            await w.watch_watermarks()
            hashes = [block(i) for i in range(4)]
            grant = await w.acquire(hashes)
            for i in range(4):
                await w.publish(w.commit(hashes, i, grant.lease_id))
            for i, h in enumerate(hashes):
                await w.publish(offload(w, h, i, "host:w1"))
            await w.publish(offload(w, hashes[0], 0, "disk"))
            await w.wait_watermark(w.seq)
            host = {h: replica_digest(h, "compressed", "host:w1", 0, f"c{i}") for i, h in enumerate(hashes)}
            held = {"gpu:w1": list(w.held.values()), "host:w1": list(host.values())}
            disk_bad: list[str] = []    # block hashes the stub says are missing from the offload directory
            asked: list[m.InventoryRequest] = []

            async def on_inventory(req: m.InventoryRequest) -> m.InventoryReply:
                asked.append(req)
                if req.disk:
                    return m.InventoryReply(worker_id="w1", epoch=1, disk_tier=True, disk_checked=len(req.disk),
                                            disk_missing=[d for d in req.disk if d.block_hash in disk_bad])
                return m.InventoryReply(worker_id="w1", epoch=1, digests=b"".join(d for v in held.values() for d in v),
                                        locations=[(loc, len(v)) for loc, v in held.items()], emitted_seq=w.seq)

            await client.connect()
            await client.listen("w1", lambda wm: None, on_inventory, None)  # type: ignore[arg-type]
            yield {"app": app, "base": base, "http": http, "hashes": hashes, "host": host, "held": held,
                   "disk_bad": disk_bad, "asked": asked}
        finally:
            await http.close()
            await client.close()
            await nc.drain()


async def audit(s: dict[str, Any], **body: Any) -> dict[str, Any]:
    async with s["http"].post(s["base"] + "/v1/audit", json={"confirm_ms": 100, **body}) as r:
        assert r.status == 200
        return await r.json()  # type: ignore[no-any-return]


async def test_the_audit_reports_host_replicas_a_worker_lost(stack: dict[str, Any]) -> None:
    hashes, held = stack["hashes"], stack["held"]
    report = await audit(stack)
    assert report["ok"], report
    assert report["drift"] == {} and report["workers_checked"] == ["w1"]
    assert report["inventory"]["w1"] == {"gpu:w1": {"ledger_ready": 4, "worker": 4},
                                         "host:w1": {"ledger_ready": 4, "worker": 4}}
    assert report["disk"] == {"ledger_ready": 1, "checked": 1, "worker": "w1", "sampled": False}

    # the host tier silently loses two copies, and holds one the ledger never heard of
    forged = replica_digest(block(50), "compressed", "host:w1", 0, "c50")
    held["host:w1"] = [stack["host"][hashes[2]], stack["host"][hashes[3]], forged]
    report = await audit(stack, disk_checks=0)
    assert not report["ok"] and report["hash_match"]
    d = report["drift"]["w1"]
    assert d["tiers"] == {"host:w1": {"ledger_only": 2, "worker_only": 1}}
    assert d["missing_on_worker"] == {"count": 2, "replicas": [[h, "compressed", "host:w1"] for h in sorted(hashes[:2])]}
    assert d["unknown_to_ledger"] == {"count": 1, "digests": [forged.hex()]}
    assert "disk" not in report
    assert all(r.digests and not r.disk for r in stack["asked"][-2:])   # two rounds: the drift was confirmed


async def test_missing_disk_files_are_reported(stack: dict[str, Any]) -> None:
    stack["disk_bad"].append(stack["hashes"][0])
    report = await audit(stack)
    assert not report["ok"] and report["drift"] == {}
    assert report["disk"]["missing"] == {"count": 1, "replicas": [[stack["hashes"][0], "compressed", "disk"]]}
    assert report["disk"]["checked"] == 1


async def test_an_inventory_larger_than_one_nats_message_comes_in_pages(stack: dict[str, Any]) -> None:
    """~150k replicas: 1.2 MB of digests, 1.6 MB as base64 JSON — over NATS's 1 MiB max_payload."""
    service = stack["app"][COORDINATOR].service
    bulk = [os.urandom(8) for _ in range(150_000)]
    stack["held"]["host:w1"] = stack["held"]["host:w1"] + bulk
    whole = b"".join(d for v in stack["held"].values() for d in v)
    reply = await service.inventory("w1", 10, digests=True)
    assert isinstance(reply, m.InventoryReply), reply
    assert reply.digests == whole and reply.pages == 1
    assert [r.page for r in stack["asked"]] == [0] and len(stack["asked"]) == 1   # pages come from one inventory
    small = await service.inventory("w1", 10, digests=True, page_bytes=64 * 1024)
    assert isinstance(small, m.InventoryReply) and small.digests == whole
    assert len(split_digests(small.digests)) == 150_008
    report = await audit(stack, disk_checks=0, timeout_ms=10_000)
    assert report["drift"]["w1"]["tiers"] == {"host:w1": {"ledger_only": 0, "worker_only": 150_000}}
