"""Admin REST API: one route table drives both the router and ``/openapi.json``.

Handlers parse, call, serialise. Every error becomes ``{"error": {"code", "message"}}`` in
one place (:func:`.admin_middleware.error_middleware`): bad input is a 4xx naming what was
wrong and what is allowed; 503 means the coordinator cannot answer right now (standby,
replaying, log unavailable); a 500 would be a bug, never a reaction to client input.

Views of the live state may include decisions whose commit is in flight (milliseconds):
each view first waits for everything queued before it to commit, then reads.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from coordinator.admin_context import (
    CURSOR, HEX32, MAX_AFTER, MAX_PAGE, NAME, AdminContext, ApiError, Handler, _ctx, _ledger, _serving_ledger,
)
from coordinator.admin_input import (
    AuditBody, CacheSwitchBody, DrainBody, InvalidateBody, _body, _decode_cursor, _encode_cursor, _int_param,
    _sort_key, _str_param,
)
from coordinator.audit import run_audit
from coordinator.controls import send_controls
from coordinator.core import LedgerState, drain_worker, drop_controls, invalidate, switch_cache
from coordinator.core.events import replica_stream
from coordinator.ledger import Ledger
from coordinator.log.port import LogError, StoredEvent
from coordinator.ui import cache_summary, status_page
from coordinator.unavailable import Unavailable
from shared.messages import Control, ReplicaState, now_ms


# --- serialisation ----------------------------------------------------------------------------

def _replica(r: Any) -> dict[str, Any]:
    return {"block_hash": r.block_hash, "form": r.form, "location": r.location, "state": r.state.value,
            "generation": r.generation, "checksum": r.checksum, "tenant": r.tenant, "namespace": r.namespace,
            "parent_hash": r.parent_hash, "token_start": r.token_start, "token_end": r.token_end, "pins": r.pins,
            "last_used_ms": r.last_used_ms, "owner": r.owner, "owner_epoch": r.owner_epoch, "lease_id": r.lease_id}


def _event(se: StoredEvent) -> dict[str, Any]:
    return {"position": se.position, "stream_id": se.stream_id, "stream_version": se.stream_version,
            "type": se.type, "source_id": se.source_id, "leader_epoch": se.leader_epoch,
            "recorded_at": se.recorded_at.isoformat(), "event": json.loads(se.payload)}


# --- handlers -----------------------------------------------------------------------------------

async def healthz(request: web.Request) -> web.Response:
    """The process is up (it may be a standby or degraded; see readyz)."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    ledger = ctx.ledger
    if ledger is None:
        return web.json_response({"ready": False, "status": "starting", "reason": "starting"}, status=503)
    body = {"ready": ledger.serving, "status": ledger.status, "reason": ledger.reason or None,
            "leader_epoch": ledger.epoch, "position": ledger.position, "last_replay": ledger.last_replay}
    return web.json_response(body, status=200 if ledger.serving else 503)


async def metrics(request: web.Request) -> web.Response:
    data = generate_latest(_ctx(request).metrics.registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


async def list_workers(request: web.Request) -> web.Response:
    ledger = await _serving_ledger(request)
    s = ledger.state
    workers = [{"worker_id": w.worker_id, "epoch": w.epoch, "alive": w.alive, "draining": w.draining,
                "suspended": w.suspended, "suspended_at_ms": w.suspended_at_ms or None,
                "namespace": w.namespace, "model_id": w.catalogue.model_id, "forms": list(w.catalogue.names),
                "block_size": w.catalogue.block_size,
                "endpoint": w.endpoint, "node": w.node, "registered_at_ms": w.registered_at_ms,
                # soft state: heartbeats are not logged; registration and resume times are
                "last_heartbeat_ms": max(w.last_heartbeat_ms, ledger.seen.get((w.worker_id, w.epoch), 0)),
                **_serving(ledger, w.worker_id, w.epoch),
                "pool_slots": dict(w.pool_slots),
                "gpu_replicas": sum(s.pool_used(w.worker_id, f) for f in w.catalogue.names) if w.alive else 0,
                "leases": len(w.leases),
                "committed_seq": s.committed_seq(w.worker_id, w.epoch)}
               for _, w in sorted(s.workers.items())]
    return web.json_response({"workers": workers})


async def list_blocks(request: web.Request) -> web.Response:
    ns = _str_param(request, "namespace", HEX32)
    tenant = _str_param(request, "tenant", NAME)
    form = _str_param(request, "form", NAME)
    location = _str_param(request, "location", NAME)
    state = _str_param(request, "state", allowed=[s.value for s in ReplicaState])
    limit = _int_param(request, "limit", 100, 1, MAX_PAGE)
    after = _decode_cursor(request)
    s = (await _serving_ledger(request)).state
    out: list[dict[str, Any]] = []
    more = False
    for key in sorted(s.replicas):
        if after is not None and _sort_key(*key) <= after:
            continue
        r = s.replicas[key]
        if ((ns and r.namespace != ns) or (tenant and r.tenant != tenant) or (form and r.form != form)
                or (location and r.location != location) or (state and r.state.value != state)):
            continue
        if len(out) == limit:
            more = True
            break
        out.append(_replica(r))
    last = out[-1] if out else None
    cursor = _encode_cursor(last["block_hash"], last["form"], last["location"]) if more and last else None
    return web.json_response({"replicas": out, "next_cursor": cursor})


async def get_block(request: web.Request) -> web.Response:
    block = request.match_info["hash"]
    if not HEX32.fullmatch(block):
        raise ApiError(400, "invalid", "block hash must be 32 lowercase hex characters")
    ledger = await _serving_ledger(request)
    s = ledger.state
    keys = sorted(k for k in s.replicas if k[0] == block)
    replicas = [_replica(s.replicas[k]) for k in keys]
    # Replicas that ended long ago have left the state (docs/architecture.md, "Retention"); their
    # streams are looked up at every location a registered worker could have held them.
    known = set(keys) | {(block, f.name, loc) for w in s.workers.values() for f in w.catalogue.forms
                         for loc in (w.gpu, w.host, "disk")}
    # NOTE: events that change many replicas at once are kept in their own streams: a block
    # invalidation is included, a worker loss or a namespace/worker invalidation is not (see
    # worker:<id> and invalidation:* in /v1/events); the replicas' current state reflects them.
    # A grant reserves its writes and evicts its victims within the lease's own event, so the
    # lease that allocated each live replica is included too.
    leases = sorted({f"lease:{s.replicas[k].lease_id}" for k in keys if s.replicas[k].lease_id})
    names = [replica_stream(*k) for k in sorted(known)] + [f"invalidation:block:{block}"] + leases
    try:
        history = await ledger.log.read_streams(names)   # one query, in position order
    except LogError as e:
        raise Unavailable(f"event log unavailable: {e}") from e
    if not keys and not history:
        raise ApiError(404, "not_found", f"block {block} has no replica in the ledger and no history in the log")
    found = {se.stream_id for se in history}
    return web.json_response({"block_hash": block, "replicas": replicas, "streams": [n for n in names if n in found],
                              "history": [_event(e) for e in history]})


async def list_leases(request: web.Request) -> web.Response:
    worker = _str_param(request, "worker", NAME)
    tenant = _str_param(request, "tenant", NAME)
    limit = _int_param(request, "limit", 100, 1, MAX_PAGE)
    after = _decode_cursor(request)
    s = (await _serving_ledger(request)).state
    out: list[dict[str, Any]] = []
    more = False
    for lid in sorted(s.leases):
        if after is not None and _sort_key(lid) <= after:
            continue
        lease = s.leases[lid]
        if (worker and lease.worker_id != worker) or (tenant and lease.tenant != tenant):
            continue
        if len(out) == limit:
            more = True
            break
        out.append({"lease_id": lid, "worker_id": lease.worker_id, "epoch": lease.epoch, "tenant": lease.tenant,
                    "namespace": lease.namespace, "request_id": lease.request_id,
                    "blocks": len(lease.block_hashes), "usable_blocks": lease.usable_blocks,
                    "pins": len(lease.pins), "write": {f: len(ix) for f, ix in lease.write.items()},
                    "granted_at_ms": lease.granted_at_ms, "expires_at_ms": lease.expires_at_ms})
    cursor = _encode_cursor(out[-1]["lease_id"]) if more and out else None
    return web.json_response({"leases": out, "next_cursor": cursor})


def _serving(ledger: Ledger, worker_id: str, epoch: int) -> dict[str, str | None]:
    """Device and dtypes from the epoch's heartbeats (soft state; None until one arrived)."""
    e, device, dtype, cache_dtype = ledger.devices.get(worker_id, (0, None, None, None))
    if e != epoch:
        return {"device": None, "dtype": None, "cache_dtype": None}
    return {"device": device, "dtype": dtype or None, "cache_dtype": cache_dtype or None}


#: How long ``/v1/pools``' tier counts are reused: the host and disk counts walk every offloaded
#: replica (a million on a big disk tier is ~0.1 s of the event loop), the page asks every 2 s.
TIERS_MAX_AGE_S = 5.0


def _tiers(ctx: AdminContext, s: LedgerState) -> dict[str, dict[str, int]]:
    """Live replicas of the live workers per tier and place: ``device`` (each worker's pools),
    ``host`` (each node's host memory), ``disk`` (the shared offload directory)."""
    now = time.monotonic()
    if ctx.tiers_memo is not None and now - ctx.tiers_memo[0] < TIERS_MAX_AGE_S:
        return ctx.tiers_memo[1]
    out: dict[str, dict[str, int]] = {"device": {}, "host": {}, "disk": {}}
    for wid, w in s.workers.items():
        if not w.alive:
            continue
        if n := sum(s.pool_used(wid, f) for f in w.catalogue.names):
            out["device"][wid] = n
        for key in w.offloaded:
            tier, _, place = key[2].partition(":")
            if tier in ("host", "disk"):
                out[tier][place or tier] = out[tier].get(place or tier, 0) + 1
    ctx.tiers_memo = (now, out)
    return out


async def list_pools(request: web.Request) -> web.Response:
    s = (await _serving_ledger(request)).state
    pools = []
    for wid, w in sorted(s.workers.items()):
        if not w.alive:
            continue
        forms = {}
        for form in w.catalogue.names:
            limit = w.pool_slots.get(form, 0)
            used = s.pool_used(wid, form)
            forms[form] = {"used": used, "limit": limit, "free": max(limit - used, 0),
                           "usage": round(used / limit, 4) if limit else None}
        pools.append({"worker_id": wid, "epoch": w.epoch, "draining": w.draining, "forms": forms})
    tenants = dict(sorted(s.tenant_used.items()))
    return web.json_response({"pools": pools, "tiers": _tiers(_ctx(request), s), "tenant_replicas": tenants,
                              "tenant_quota": s.params.tenant_quota_replicas or None})


async def summary(request: web.Request) -> web.Response:
    """What the status page shows beside the other views: where the log is, and the workers'
    prefix-cache counters from their heartbeats (soft state; see ``coordinator.ui``)."""
    ledger = await _serving_ledger(request)
    await ledger.read_archived()  # an operator archives without the coordinator: ask the log
    s = ledger.state
    return web.json_response({"now_ms": now_ms(), "leader_epoch": ledger.epoch, "position": ledger.position,
                              "archived_upto": ledger.archived_upto,
                              "reuse": cache_status(s)["reuse"], "cache": cache_summary(s, ledger.cache_counters),
                              "thresholds": _ctx(request).ui_thresholds,
                              "gateways": [{"gateway_id": g, "last_route_ms": t}
                                           for g, t in sorted(ledger.gateways.items())]})


async def list_events(request: web.Request) -> web.Response:
    after = _int_param(request, "after", 0, 0, MAX_AFTER)
    limit = _int_param(request, "limit", 100, 1, MAX_PAGE)
    try:
        events = await _ledger(request).log.read(after + 1, limit)
    except LogError as e:
        raise Unavailable(f"event log unavailable: {e}") from e
    return web.json_response({"events": [_event(e) for e in events],
                              "next_after": events[-1].position if events else after})


async def audit(request: web.Request) -> web.Response:
    body = await _body(request, AuditBody)
    ctx = _ctx(request)
    ledger = _ledger(request)
    report = await run_audit(ledger, ctx.inventory, from_snapshot=body.replay_from == "snapshot",
                             check_workers=body.check_workers, timeout_s=body.timeout_ms / 1000,
                             disk_checks=body.disk_checks, confirm_s=body.confirm_ms / 1000)
    ctx.metrics.audits.labels(outcome="ok" if report["ok"] else "mismatch").inc()
    return web.json_response(report)


async def snapshot(request: web.Request) -> web.Response:
    snap = await _ledger(request).snapshot()
    return web.json_response({"position": snap.position, "state_hash": snap.state_hash, "bytes": len(snap.state)})


async def post_invalidate(request: web.Request) -> web.Response:
    body = await _body(request, InvalidateBody)
    scope: str = type(body).__struct_config__.tag
    if scope in ("namespace", "block") and not HEX32.fullmatch(body.value):
        raise ApiError(400, "invalid", f"a {scope} is 32 lowercase hex characters")
    if scope == "worker" and not NAME.fullmatch(body.value):
        raise ApiError(400, "invalid", "a worker id is letters, digits, '_', '.', ':' or '-'")
    ledger = _ledger(request)
    events = await ledger.execute(
        lambda s: ((evs := invalidate(s, scope, body.value, body.reason, now_ms())), evs))
    affected = events[0].affected if events else []
    notified: dict[str, str] = {}
    ctx = _ctx(request)
    if ctx.control is not None and events:
        # every worker whose GPU or host tier held a replica of the scope, live or retired: it
        # drops its bytes, and with them a copy of them it is about to make. NOTE: block by
        # block, for a namespace too: each block is named with the generations of the GPU
        # replicas the decision covered at that worker, so a block the worker wrote after the
        # decision (READY in the ledger) stays; a namespace-wide control dropped it too, and the
        # ledger kept it READY until a lease found it missing.
        notified = await send_controls(ctx.control, drop_controls(ledger.state, events[0]))
    return web.json_response({"scope": scope, "value": body.value, "affected": len(affected),
                              "workers_notified": notified})


async def cache_switch(request: web.Request) -> web.Response:
    body = await _body(request, CacheSwitchBody)
    enabled = body.state == "on"
    await _ledger(request).execute(
        lambda s: ((evs := switch_cache(s, body.namespace, enabled, body.reason, now_ms())), evs))
    return web.json_response(cache_status(_ledger(request).state))


def cache_status(s: Any) -> dict[str, Any]:
    return {"reuse": "off" if "" in s.reuse_off else ("partly off" if s.reuse_off else "on"),
            "off": [{"namespace": ns or "*", "reason": why} for ns, why in sorted(s.reuse_off.items())]}


async def get_cache(request: web.Request) -> web.Response:
    return web.json_response(cache_status(_ledger(request).state))


async def drain(request: web.Request) -> web.Response:
    worker = request.match_info["worker_id"]
    if not NAME.fullmatch(worker):
        raise ApiError(400, "invalid", "a worker id is letters, digits, '_', '.', ':' or '-' (at most 128)")
    body = await _body(request, DrainBody)
    ledger = _ledger(request)
    events = await ledger.execute(
        lambda s: ((evs := drain_worker(s, worker, now_ms(), body.reason)), evs))
    ctx = _ctx(request)
    control = "not sent"
    if ctx.control is not None:
        control = await ctx.control(worker, Control(action="drain", reason=body.reason))
    return web.json_response({"worker_id": worker, "draining": True, "changed": bool(events), "control": control})


# --- the route table (router + OpenAPI) ---------------------------------------------------------

def _q(name: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "description": description, "schema": schema}


def _p(name: str, description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "description": description, "schema": schema}


# What the handlers enforce, declared as such (an empty value is a value, and is refused).
_HEX32 = {"type": "string", "pattern": HEX32.pattern}
_NAME = {"type": "string", "pattern": NAME.pattern}
_CURSOR = {"type": "string", "pattern": CURSOR.pattern}
PAGE = [_q("limit", "page size", {"type": "integer", "minimum": 1, "maximum": MAX_PAGE, "default": 100}),
        _q("cursor", "next_cursor of the previous page (the position after which this page starts)", _CURSOR)]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    summary: str
    auth: bool = True
    params: list[dict[str, Any]] = field(default_factory=list)
    body: Any = None
    #: Whether a request must carry a body (one whose fields all have defaults may be left out).
    body_required: bool = False
    content_type: str = "application/json"
    #: Error statuses this route answers besides 400/401/503 of every /v1/ route (404: what the
    #: path or body names does not exist).
    errors: tuple[int, ...] = ()
    #: OpenAPI links from the 200 response: what a client may call next with what it returned.
    links: dict[str, Any] = field(default_factory=dict)


ROUTES: list[Route] = [
    Route("GET", "/healthz", healthz, "Liveness: the process is up", auth=False),
    Route("GET", "/readyz", readyz, "Readiness: leader, replay done, log writable (503 otherwise)", auth=False,
          errors=(503,)),
    Route("GET", "/metrics", metrics, "Prometheus metrics", auth=False, content_type=CONTENT_TYPE_LATEST),
    Route("GET", "/openapi.json", openapi, "This document", auth=False),
    # The page is static and holds no data: it asks for the token and sends it with each /v1/ call
    # (a browser cannot send a bearer header when it opens a page). Without a configured token
    # it is served to loopback clients only, as the API is.
    Route("GET", "/ui", status_page, "Status page (HTML; its data comes from the /v1/ calls, under their token)",
          auth=False, content_type="text/html", errors=(401,)),
    Route("GET", "/v1/workers", list_workers, "Registered workers, their epochs and liveness", links={
        "DrainWorker": {"operationId": "drain",
                        "parameters": {"worker_id": "$response.body#/workers/0/worker_id"}}}),
    Route("GET", "/v1/blocks", list_blocks, "Replicas, filtered and paged", params=[
        _q("namespace", "namespace hash", _HEX32),
        _q("tenant", "tenant id", _NAME),
        _q("form", "cache form", _NAME),
        _q("location", "gpu:<worker>, host:<node> or disk", _NAME),
        _q("state", "replica state", {"type": "string", "enum": [s.value for s in ReplicaState]}),
        *PAGE], links={
        "GetBlock": {"operationId": "get_block", "parameters": {"hash": "$response.body#/replicas/0/block_hash"}}}),
    Route("GET", "/v1/blocks/{hash}", get_block, "One block's replicas and their full event history",
          params=[_p("hash", "block hash", _HEX32)], errors=(404,)),
    Route("GET", "/v1/leases", list_leases, "Live leases, filtered and paged", params=[
        _q("worker", "holder worker id", _NAME), _q("tenant", "tenant id", _NAME), *PAGE]),
    Route("GET", "/v1/pools", list_pools, "Pool usage per worker and form against its limits"),
    Route("GET", "/v1/summary", summary, "Log position, leader epoch, reuse switch and the workers' prefix-cache "
          "counters (hit and validated-hit rates, fallbacks by reason) from their latest heartbeats"),
    Route("GET", "/v1/events", list_events, "The event log from a position", params=[
        _q("after", "return events with position > after",
           {"type": "integer", "minimum": 0, "maximum": MAX_AFTER, "default": 0}),
        _q("limit", "page size", {"type": "integer", "minimum": 1, "maximum": MAX_PAGE, "default": 100})]),
    Route("POST", "/v1/audit", audit, "Replay the log and compare with the live state and the workers (read-only)",
          body=AuditBody),
    Route("POST", "/v1/snapshot", snapshot, "Save a snapshot of the live state now"),
    Route("POST", "/v1/invalidate", post_invalidate, "Invalidate every live replica of a namespace, worker or block",
          body=InvalidateBody, body_required=True, errors=(404,)),
    Route("GET", "/v1/cache", get_cache, "Whether reuse is on, and every namespace an operator turned it off for"),
    Route("POST", "/v1/cache", cache_switch, "Turn reuse off (every request recomputes, nothing new is cached) or "
          "back on, for one namespace or all; durable in the log", body=CacheSwitchBody, body_required=True),
    Route("POST", "/v1/workers/{worker_id}/drain", drain, "Stop granting writes to a worker; tell it to drain",
          params=[_p("worker_id", "worker id", _NAME)], body=DrainBody, errors=(404,)),
]


def add_routes(app: web.Application) -> None:
    for r in ROUTES:
        app.router.add_route(r.method, r.path, r.handler)


_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["code", "message"],
    "properties": {"code": {"type": "string"}, "message": {"type": "string"}}}}}
_ERROR_TEXT = {400: "Bad input (the message names what was wrong and what is allowed)",
               401: "Missing or wrong bearer token (without a configured token: a client not on loopback)",
               404: "What the path or body names does not exist",
               413: "Request body too large",
               503: "Not serving (starting, standby, replaying, log unavailable)"}


def openapi_document() -> dict[str, Any]:
    """The document for :data:`ROUTES`; request bodies' schemas live in ``components/schemas``."""
    bodies = [r.body for r in ROUTES if r.body is not None]
    body_schemas, components = msgspec.json.schema_components(bodies, ref_template="#/components/schemas/{name}")
    body_schema = dict(zip(map(id, bodies), body_schemas))
    ref = {"$ref": "#/components/schemas/Error"}
    paths: dict[str, Any] = {}
    for r in ROUTES:
        errors = set(r.errors)
        if r.auth:
            errors |= {400, 401, 503}
        if r.body is not None:
            errors |= {400, 413}
        body_type = "object" if r.content_type == "application/json" else "string"  # text: metrics, the page
        responses: dict[str, Any] = {"200": {"description": "OK", "content": {r.content_type: {"schema": {
            "type": body_type}}}}}
        if r.links:
            responses["200"]["links"] = r.links
        for status in sorted(errors):
            # /readyz answers 503 with its own (readiness) body, not an error
            schema = {"type": "object"} if r.handler is readyz else ref
            responses[str(status)] = {"description": _ERROR_TEXT[status],
                                      "content": {"application/json": {"schema": schema}}}
        op: dict[str, Any] = {"summary": r.summary, "operationId": r.handler.__name__, "parameters": r.params,
                              "responses": responses}
        if r.auth:
            op["security"] = [{"bearer": []}]
        if r.body is not None:
            op["requestBody"] = {"required": r.body_required,
                                 "content": {"application/json": {"schema": body_schema[id(r.body)]}}}
        paths.setdefault(r.path, {})[r.method.lower()] = op
    return _ecma_patterns({"openapi": "3.1.0",
                           "info": {"title": "kvledger coordinator admin API", "version": "1"},
                           "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
                                          "schemas": {"Error": _ERROR_SCHEMA, **components}},
                           "paths": paths})


def _ecma_patterns(doc: Any) -> Any:
    """``doc`` with each ``pattern`` ending in ``$`` where this module's end in ``\\Z``.

    NOTE: the same anchor in each dialect. A JSON Schema pattern is an ECMA-262 regex, where
    ``$`` (no multiline flag) matches only at the end of the input and ``\\Z`` is not an anchor;
    in Python's ``re``, which validates here, ``$`` also matches before a trailing newline."""
    if isinstance(doc, dict):
        return {k: v[:-2] + "$" if k == "pattern" and isinstance(v, str) and v.endswith("\\Z")
                else _ecma_patterns(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_ecma_patterns(v) for v in doc]
    return doc
