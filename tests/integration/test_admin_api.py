"""The admin REST API against a running coordinator: auth, every view, operator commands,
the audit's drift report, and the rule that client input never causes a 5xx."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import nats
import pytest

from coordinator.app import COORDINATOR
from shared.messages import (
    BlockDrop, Control, ControlAck, ErrorCode, ErrorReply, InventoryItem, InventoryReply, ReplicaState, decode, encode,
)
from shared.subjects import Subjects
from tests.integration.coordinator_kit import NS, Worker, block, fast_config, running_coordinator

TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def stack(database_url: str, nats_url: str, subjects: Subjects) -> AsyncIterator[dict[str, Any]]:
    """A coordinator with one worker, one lease and four READY blocks."""
    cfg = fast_config(database_url, nats_url, subjects, admin_token=TOKEN)
    async with running_coordinator(cfg) as (app, base):
        nc = await nats.connect(nats_url)
        http = aiohttp.ClientSession(headers=AUTH)
        try:
            w = Worker(nc, subjects)
            await w.register()
            await w.watch_watermarks()
            hashes = [block(i) for i in range(4)]
            grant = await w.fill(hashes)
            reader = await w.acquire(hashes, write=False)  # pins the four READY replicas
            yield {"app": app, "base": base, "http": http, "nc": nc, "worker": w, "hashes": hashes,
                   "lease": reader.lease_id, "subjects": subjects}
        finally:
            await http.close()
            await nc.drain()


async def get(s: dict[str, Any], path: str, **kw: Any) -> tuple[int, Any]:
    async with s["http"].get(s["base"] + path, **kw) as r:
        return r.status, await r.json(content_type=None)


async def post(s: dict[str, Any], path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
    async with s["http"].post(s["base"] + path, json=body, **kw) as r:
        return r.status, await r.json(content_type=None)


async def test_admin_api_requires_the_bearer_token(stack: dict[str, Any]) -> None:
    base = stack["base"]
    async with aiohttp.ClientSession() as anon:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            async with anon.get(f"{base}/v1/workers", headers=headers) as r:
                body = await r.json()
                assert r.status == 401 and body["error"]["code"] == "unauthorized", (headers, body)
        async with anon.post(f"{base}/v1/snapshot") as r:
            assert r.status == 401
        for open_path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
            async with anon.get(base + open_path) as r:
                assert r.status == 200, open_path
    assert (await get(stack, "/v1/workers"))[0] == 200


BAD_REQUESTS = [
    ("GET", "/v1/blocks?limit=0", None, 400),
    ("GET", "/v1/blocks?limit=abc", None, 400),
    ("GET", "/v1/blocks?limit=1001", None, 400),
    ("GET", "/v1/blocks?state=FROZEN", None, 400),
    ("GET", "/v1/blocks?namespace=not-a-hash", None, 400),
    ("GET", "/v1/blocks?cursor=%21%21%21", None, 400),
    ("GET", "/v1/blocks?cursor=WzFd", None, 400),  # base64 of [1]: not one of ours
    ("GET", "/v1/blocks/NOTHEX", None, 400),
    ("GET", "/v1/blocks/" + "f" * 32, None, 404),
    ("GET", "/v1/leases?limit=-5", None, 400),
    ("GET", "/v1/events?after=-1", None, 400),
    ("GET", "/v1/events?limit=5000", None, 400),
    ("GET", "/v1/events?after=1e3", None, 400),
    ("POST", "/v1/invalidate", b"{not json", 400),
    ("POST", "/v1/invalidate", {"scope": "galaxy", "value": "x"}, 400),
    ("POST", "/v1/invalidate", {"scope": "block"}, 400),
    ("POST", "/v1/invalidate", {"scope": "block", "value": "xyz"}, 400),
    ("POST", "/v1/invalidate", {"scope": "block", "value": "a" * 32, "colour": "red"}, 400),
    ("POST", "/v1/invalidate", {"scope": "worker", "value": "nobody"}, 404),
    ("POST", "/v1/invalidate", [1, 2], 400),
    ("POST", "/v1/workers/nobody/drain", None, 404),
    ("POST", "/v1/workers/bad%20id%21/drain", None, 400),
    ("POST", "/v1/workers/w1/drain", {"reason": 5}, 400),
    ("POST", "/v1/audit", {"replay_from": "yesterday"}, 400),
    ("POST", "/v1/audit", {"timeout_ms": 0}, 400),
    ("GET", "/v1/nothing-here", None, 404),
    ("DELETE", "/v1/workers", None, 405),
    ("POST", "/v1/invalidate", b"x" * (2 << 20), 413),
]


async def test_bad_input_is_a_4xx_json_error(stack: dict[str, Any]) -> None:
    """One coordinator, every bad request (a stack per case would cost seconds each)."""
    wrong = []
    for method, path, body, status in BAD_REQUESTS:
        kw: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with stack["http"].request(method, stack["base"] + path, **kw) as r:
            text = await r.text()
        try:
            err = json.loads(text)["error"]
            ok = r.status == status and err["code"] and err["message"]
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            wrong.append(f"{method} {path[:60]}: expected {status}, got {r.status} {text[:200]}")
    assert not wrong, "\n".join(wrong)
    assert (await get(stack, "/readyz"))[0] == 200  # and the service is fine


async def test_openapi_lists_every_route(stack: dict[str, Any]) -> None:
    status, doc = await get(stack, "/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.")
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    routed = {(r.method, r.resource.canonical) for r in stack["app"].router.routes()
              if r.method != "HEAD" and r.resource is not None}
    assert documented == routed
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert ("security" in op) == path.startswith("/v1/")


async def test_views_of_the_live_state(stack: dict[str, Any]) -> None:
    hashes = stack["hashes"]
    status, body = await get(stack, "/v1/workers")
    assert status == 200 and [w["worker_id"] for w in body["workers"]] == ["w1"]
    w = body["workers"][0]
    assert w["alive"] and w["epoch"] == 1 and w["committed_seq"] == 4 and w["gpu_replicas"] == 4

    status, body = await get(stack, "/v1/blocks?state=READY&limit=3")
    assert status == 200 and len(body["replicas"]) == 3 and body["next_cursor"]
    status, rest = await get(stack, f"/v1/blocks?state=READY&limit=3&cursor={body['next_cursor']}")
    assert len(rest["replicas"]) == 1 and rest["next_cursor"] is None
    assert sorted(r["block_hash"] for r in body["replicas"] + rest["replicas"]) == hashes
    assert (await get(stack, f"/v1/blocks?namespace={NS}&form=compressed&location=gpu:w1"))[1]["replicas"]
    assert (await get(stack, "/v1/blocks?tenant=someone-else"))[1]["replicas"] == []

    status, one = await get(stack, f"/v1/blocks/{hashes[2]}")
    assert status == 200 and one["replicas"][0]["state"] == "READY" and one["replicas"][0]["pins"] == 1
    # the grant that allocated it (the lease's own event), then its commit
    assert [e["type"] for e in one["history"]] == ["lease.granted", "transition.applied"]
    assert one["history"][1]["source_id"] == "w1.1.3"
    assert one["streams"] == [f"replica:{hashes[2]}:compressed:gpu:w1", f"lease:{one['replicas'][0]['lease_id']}"]

    status, body = await get(stack, "/v1/leases?worker=w1")
    assert status == 200 and len(body["leases"]) == 2
    assert {lease["pins"] for lease in body["leases"]} == {0, 4}

    status, body = await get(stack, "/v1/pools")
    assert body["pools"][0]["forms"]["compressed"] == {"used": 4, "limit": 1000, "free": 996, "usage": 0.004}

    status, body = await get(stack, "/v1/events?after=0&limit=3")
    assert [e["position"] for e in body["events"]] == [1, 2, 3] and body["next_after"] == 3
    assert body["events"][0]["type"] == "coordinator.resumed"
    status, body = await get(stack, "/v1/events?after=3&limit=1000")
    assert body["events"][0]["position"] == 4

    async with stack["http"].get(stack["base"] + "/metrics") as r:
        text = await r.text()
    for name in ("kvl_coordinator_requests_total", "kvl_coordinator_request_latency_seconds_bucket",
                 "kvl_coordinator_transitions_total", "kvl_coordinator_append_batch_events_bucket",
                 "kvl_coordinator_append_latency_seconds_bucket", "kvl_coordinator_consumer_lag_messages",
                 "kvl_coordinator_replay_seconds", 'kvl_coordinator_pool_used_slots{form="compressed",worker="w1"} 4.0'):
        assert name in text, name


async def answer_controls(stack: dict[str, Any]) -> list[Control]:
    """Answer worker w1's control subject as the worker would; the list fills as controls arrive."""
    controls: list[Control] = []

    async def on_control(msg: Any) -> None:
        controls.append(decode(msg.data, expect=Control))
        await msg.respond(encode(ControlAck(worker_id="w1", affected=1)))
    await stack["nc"].subscribe(stack["subjects"].control("w1"), cb=on_control)
    await stack["nc"].flush()   # the server knows the subscription before the coordinator asks
    return controls


async def test_operator_commands_reach_the_ledger_and_the_worker(stack: dict[str, Any]) -> None:
    hashes = stack["hashes"]
    controls = await answer_controls(stack)

    status, body = await post(stack, "/v1/invalidate", {"scope": "block", "value": hashes[0], "reason": "test"})
    assert status == 200 and body["affected"] == 1 and body["workers_notified"] == {"w1": "acked"}
    _, one = await get(stack, f"/v1/blocks/{hashes[0]}")
    assert one["replicas"][0]["state"] == "INVALID" and one["history"][-1]["type"] == "invalidated"

    status, body = await post(stack, "/v1/workers/w1/drain", {"reason": "maintenance"})
    assert status == 200 and body == {"worker_id": "w1", "draining": True, "changed": True, "control": "acked"}
    assert [(c.action, c.reason) for c in controls] == [("invalidate_blocks", "test"), ("drain", "maintenance")]
    # the GPU replica the decision named
    assert controls[0].blocks == [BlockDrop(block_hash=hashes[0], generations={"compressed": 1})]

    # a worker's scope: one control names every block it held, each with its GPU replica's generation
    status, body = await post(stack, "/v1/invalidate", {"scope": "worker", "value": "w1", "reason": "bad gpu"})
    assert status == 200 and body["affected"] == 3 and body["workers_notified"] == {"w1": "acked"}
    (told,) = [c for c in controls if c.reason == "bad gpu"]
    assert told.action == "invalidate_blocks"
    assert told.blocks == [BlockDrop(block_hash=b, generations={"compressed": 1}) for b in sorted(hashes[1:])]
    _, again = await post(stack, "/v1/workers/w1/drain")
    assert again["changed"] is False
    _, workers = await get(stack, "/v1/workers")
    assert workers["workers"][0]["draining"]

    status, snap = await post(stack, "/v1/snapshot")
    assert status == 200 and snap["position"] > 0 and len(snap["state_hash"]) == 32


async def test_a_namespace_invalidation_tells_each_holder_block_by_block(stack: dict[str, Any]) -> None:
    """Block by block, each with the generation the decision covered: a block the worker writes
    after the decision is not in it (a namespace-wide control dropped such a block too)."""
    hashes = stack["hashes"]
    controls = await answer_controls(stack)

    status, body = await post(stack, "/v1/invalidate", {"scope": "namespace", "value": NS, "reason": "upgrade"})
    assert status == 200 and body["affected"] == 4 and body["workers_notified"] == {"w1": "acked"}
    (told,) = controls
    assert (told.action, told.reason) == ("invalidate_blocks", "upgrade")
    assert told.blocks == [BlockDrop(block_hash=b, generations={"compressed": 1}) for b in sorted(hashes)]


async def test_a_worker_of_an_older_release_is_told_one_block_at_a_time(stack: dict[str, Any]) -> None:
    """A worker that does not know ``invalidate_blocks`` refuses it as invalid (its decoder's
    answer); the coordinator sends it the same blocks one ``invalidate_block`` each, and the
    reply counts those acks. A reply that is not this worker's ack is not an ack."""
    hashes = stack["hashes"]
    seen: list[Control] = []

    async def older(msg: Any) -> None:
        c = decode(msg.data, expect=Control)
        seen.append(c)
        reply: Any = ControlAck(worker_id="w1", affected=1)
        if c.action == "invalidate_blocks":
            reply = ErrorReply(code=ErrorCode.INVALID, message="invalid message 'control': Invalid enum value "
                                                               "'invalidate_blocks' - at `$.action`")
        elif c.action == "drain":
            reply = ControlAck(worker_id="w2")
        await msg.respond(encode(reply))
    await stack["nc"].subscribe(stack["subjects"].control("w1"), cb=older)
    await stack["nc"].flush()

    status, body = await post(stack, "/v1/invalidate", {"scope": "namespace", "value": NS, "reason": "upgrade"})
    assert status == 200 and body["workers_notified"] == {"w1": "acked"}
    assert [c.action for c in seen] == ["invalidate_blocks"] + ["invalidate_block"] * len(hashes)
    assert sorted((c.block_hash, c.generations) for c in seen[1:]) == [(b, {"compressed": 1}) for b in sorted(hashes)]
    status, body = await post(stack, "/v1/workers/w1/drain", {"reason": "maintenance"})
    assert status == 200 and body["control"] == "bad reply: an ack from w2"


async def test_audit_reports_drift_both_ways(stack: dict[str, Any]) -> None:
    nc, subjects, hashes = stack["nc"], stack["subjects"], stack["hashes"]

    # no inventory responder: the worker is reported unreachable, the log checks still pass
    status, report = await post(stack, "/v1/audit", {"timeout_ms": 300})
    assert status == 200 and report["hash_match"] and report["log_errors"] == []
    assert report["invariant_violations"] == [] and report["workers_unreachable"] == {"w1": "no responders"}

    # the worker lost block 0 and holds a block the ledger never heard of
    async def inventory(msg: Any) -> None:
        items = [InventoryItem(block_hash=h, form="compressed", location="gpu:w1", generation=1,
                               state=ReplicaState.READY) for h in hashes[1:]]
        items.append(InventoryItem(block_hash=block(77), form="compressed", location="gpu:w1", generation=1,
                                   state=ReplicaState.READY))
        await msg.respond(encode(InventoryReply(worker_id="w1", epoch=1, items=items)))
    await nc.subscribe(subjects.inventory("w1"), cb=inventory)
    await nc.flush()   # the server knows the subscription before the coordinator asks
    before = (await get(stack, "/readyz"))[1]["position"]
    status, report = await post(stack, "/v1/audit", {})
    assert status == 200 and not report["ok"] and report["hash_match"]
    drift = report["drift"]["w1"]
    assert drift["missing_on_worker"] == {"count": 1, "replicas": [[hashes[0], "compressed", "gpu:w1"]]}
    assert drift["unknown_to_ledger"] == {"count": 1, "replicas": [[block(77), "compressed", "gpu:w1"]]}
    assert report["workers_checked"] == ["w1"]
    assert (await get(stack, "/readyz"))[1]["position"] == before  # read-only
    ledger = stack["app"][COORDINATOR].ledger
    assert ledger.metrics.audits.labels(outcome="mismatch")._value.get() == 1
