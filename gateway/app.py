"""The gateway's HTTP side and its two conversations: with the coordinator (NATS: the fleet and
route queries) and with the workers (HTTP: the requests themselves).

``POST /v1/completions``, ``POST /v1/chat/completions``: authenticated by API key (the workers'
key config) before a byte of the body is read, the body read within its cap and timeout and
checked to be a JSON object (:mod:`gateway.intake`; slow headers are closed by the keep-alive
timer, :mod:`shared.http_limits`), admitted by the tenant's rate limits (:mod:`gateway.limits`:
429 + Retry-After), routed (:mod:`gateway.routing`), and forwarded with the client's body —
with the tenant in a signed header (:mod:`shared.tenant_header`) when ``auth.gateway_secret``
is set, else with the client's ``Authorization`` header for the worker to check. SSE streams pass through chunk
by chunk, and every answer names the worker that served it (``x-kvl-worker``) and why it was
chosen (``x-kvl-route``). ``GET /v1/models``, ``/tokenize`` and ``/detokenize`` (with a key
when one is required) are answered by a worker. ``/healthz`` and ``/health`` (alive),
``/readyz`` (the fleet is known and a worker usable), ``/metrics``.

Retries (:mod:`gateway.retry`): a worker that refuses the connection, resets it or dies before
its answer (or a stream's first event) is complete, or answers a status in ``gateway.retry_on``
(503 by default), before any byte reached the client, is marked down for ``gateway.worker_down_ms``
(429 excepted) and the request goes to the next candidate after a backoff, up to
``gateway.retry_attempts`` tries in all; once bytes have streamed, an error reaches the client as
the worker sent it. A client address outside ``gateway.allowed_networks`` gets a 403 before
anything else (:mod:`shared.address_allowlist`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter as Counter_
import dataclasses
import json
import random
import time
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from gateway import intake, retry
from gateway.inflight import InFlightPrefixes
from gateway.limits import Admitted, Refused, TenantLimits
from gateway.prompt import prompt_tokens
from gateway.routing import Choice, Worker, choose
from shared import access_log, tracing
from shared.address_allowlist import allowlist_middleware, parse_networks
from shared import messages as m
from shared.config import Config, nats_servers
from shared.hashing import chain_hashes
from shared.http_limits import handler_args
from shared.images import ImageLimits, PromptImage, image_block_keys
from shared.logging import get_logger
from shared.shard_store import ShardMapReader
from shared.shards import ShardMap, shard_of, shard_subjects
from shared.subjects import Subjects
from shared.tenant_header import SIGNATURE_HEADER, TENANT_HEADER, sign
from shared.tenants import Tenant, TenantDirectory, salt_secret, tenant_salt
from shared.text.generation_config import DEFAULT_MAX_TOKENS
from shared.text.chat_template import ChatTemplate
from shared.text.image_prompt import ImagePrompting
from shared.text.tokenizer import Tokenizer
from shared.versions import package_version

log = get_logger("kvl.gateway")
#: Request headers passed to the worker (hop-by-hop and length headers are the proxy's own;
#: ``Authorization`` only when no gateway secret signs the tenant instead).
FORWARDED = ("Content-Type", "Accept", "X-Request-Id")
#: Routes traced when tracing is on (the ones routed by cache).
TRACED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
#: How much of a stream's end is kept to read its usage chunk (realised cached tokens, refunds).
STREAM_TAIL = 16 * 1024


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "kvl_gateway_"
        self.requests = Counter(p + "requests", "Requests answered, by path and status", ["path", "status"], registry=r)
        self.auth_reloads = Counter(p + "auth_reloads", "Reloads of the API keys (SIGHUP or a changed config or keys "
                                    "file; shared.key_rotation), by outcome (ok, failed)", ["outcome"], registry=r)
        self.decisions = Counter(p + "route_decisions", "Route decisions by reason (cache, inflight: a prefix being "
                                 "computed there, load, affinity, version: drawn by gateway.version_weights, "
                                 "no_hint: prompt unreadable or route query failed)",
                                 ["reason"], registry=r)
        self.expected = Counter(p + "expected_cached_tokens", "Prompt tokens the route expected cached", registry=r)
        self.realized = Counter(p + "realized_cached_tokens", "Prompt tokens the worker reported cached "
                                "(streams only when they carry usage: stream_options.include_usage)", registry=r)
        self.limited = Counter(p + "rate_limited", "Requests refused by a tenant's rate limit, by code",
                               ["tenant", "code"], registry=r)
        self.failovers = Counter(p + "failovers", "Requests moved to the next worker, by why", ["why"], registry=r)
        self.in_flight = Gauge(p + "worker_in_flight", "Requests this gateway has in flight per worker", ["worker"],
                               registry=r)
        self.inflight_blocks = Gauge(p + "inflight_prompt_blocks", "Distinct (worker, block) pairs of the prompts "
                                     "this gateway has in flight (gateway.route_inflight_prefixes; 0 when idle)",
                                     registry=r)
        self.reported_load = Gauge(p + "worker_reported_load", "Running + queued requests per worker, as its last "
                                   "heartbeat told the coordinator (every gateway's traffic)", ["worker"], registry=r)
        self.route_seconds = Histogram(p + "route_seconds", "Tokenize + hash + route query",
                                       buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5), registry=r)
        self.fleet = Gauge(p + "fleet_workers", "Workers in the fleet view, by state (usable, draining, suspended, "
                           "unlisted: gone from the coordinator's answer, kept as a last resort)", ["state"],
                           registry=r)
        self.address_refused = Counter(p + "address_refused", "Requests refused (403) because the client's address "
                                       "is outside gateway.allowed_networks", registry=r)
        self.version_requests = Counter(p + "version_requests", "Requests answered by a worker, by the worker's "
                                        "version (its GET /version: worker.version; unknown until asked) — the "
                                        "rollout's share (gateway.version_weights)", ["version"], registry=r)


def _error(status: int, message: str, type_: str, code: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": type_, "param": None, "code": code}},
                             status=status, headers=headers)


class Gateway:
    def __init__(self, cfg: Config, tokenizer: Tokenizer, template: ChatTemplate, *,
                 nats_kwargs: dict[str, Any] | None = None, client_ssl: Any = None,
                 images: ImagePrompting | None = None) -> None:
        self.cfg, self.g = cfg, cfg.gateway
        self.tokenizer, self.template = tokenizer, template
        #: How the workers' model takes images (None: it takes none); limits as the workers'.
        self.images, self.image_limits = images, ImageLimits.of(cfg.service)
        self.subjects = Subjects(cfg.nats.subject_prefix)
        #: A sharded ledger (docs/architecture.md, "The ledger sharded"): a prefix's route query goes
        #: to the shard that owns its chain by the stored map (read at each fleet refresh); the fleet
        #: view comes from shard 0 (every worker is a member of every shard).
        c = cfg.coordinator
        self.shard_map = ShardMap.uniform(c.shards, c.shard_partitions) if c.shards > 1 else None
        self.shard_subjects = [shard_subjects(cfg.nats.subject_prefix, k) for k in range(c.shards)]
        self._shard_reader: ShardMapReader | None = None
        self.tenants = TenantDirectory.from_config(cfg.auth)
        self.metrics = GatewayMetrics()
        self.limits = TenantLimits()
        self.nats_kwargs = dict(nats_kwargs or {})
        self.client_ssl = client_ssl
        self.fleet: list[Worker] = []
        #: worker → (its last listed record, when): unlisted workers stay a last resort a while
        self._listed_at: dict[str, tuple[Worker, float]] = {}
        self.fleet_at = 0.0                      # monotonic time of the last good fleet refresh
        self.in_flight: dict[str, int] = {}
        self.inflight = InFlightPrefixes()
        self.metrics.inflight_blocks.set_function(self.inflight.blocks_held)     # read at scrape time
        self.down: dict[str, float] = {}         # worker → monotonic time until which it is skipped
        self._salts: dict[str, bytes] = {}
        self._nc: Any = None
        self._http: aiohttp.ClientSession | None = None
        self._refresher: asyncio.Task[None] | None = None
        #: worker → (the endpoint asked, its GET /version answer): gateway.version_weights route by it
        self.versions: dict[str, tuple[str, str]] = {}
        self._version_asks: dict[str, asyncio.Task[None]] = {}
        self._versions_at = 0.0                  # monotonic time every worker was last asked
        #: the rollout: gateway.version_weights and version_prefix_tokens, read again on a reload
        self.version_weights: dict[str, int] = dict(self.g.version_weights)
        self.version_prefix_tokens = self.g.version_prefix_tokens

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        import nats
        self._nc = await nats.connect(nats_servers(self.cfg.nats.url), name=f"kvl-gateway-{self.g.gateway_id}",
                                      max_reconnect_attempts=-1, reconnect_time_wait=0.5, **self.nats_kwargs)
        self._http = aiohttp.ClientSession(auto_decompress=False,
                                           connector=aiohttp.TCPConnector(limit=0, ssl=self.client_ssl))
        await self.refresh_fleet()
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop())

    async def stop(self) -> None:
        for task in [*self._version_asks.values(), *([self._refresher] if self._refresher is not None else [])]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._http is not None:
            await self._http.close()
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.drain()

    # --- the coordinator ----------------------------------------------------------------------

    async def _ask(self, query: m.RouteQuery, timeout_s: float, shard: int = 0) -> m.RouteReply | None:
        try:
            msg = await self._nc.request(self.shard_subjects[shard].route(self.g.gateway_id), m.encode(query),
                                         timeout=timeout_s, headers=tracing.headers())
            reply = m.decode(msg.data)
        except Exception as e:  # noqa: BLE001 - timeout, no responders, disconnected: route without a hint
            log.debug("route_query_failed", error=type(e).__name__)
            return None
        return reply if isinstance(reply, m.RouteReply) else None

    async def refresh_fleet(self) -> bool:
        if self.shard_map is not None:     # a newer stored map, if any (a stale one costs route hints only)
            self._shard_reader = self._shard_reader or ShardMapReader(self._nc.jetstream(), self.cfg, log)
            self.shard_map = await self._shard_reader.newer(self.shard_map)
        reply = await self._ask(m.RouteQuery(gateway_id=self.g.gateway_id), self.g.fleet_refresh_ms / 1000 * 2)
        if reply is None:
            return False
        now = time.monotonic()
        listed = [Worker(c.worker_id, c.endpoint, c.namespace, c.block_size, c.draining, c.suspended,
                         c.running + c.queued, self._version(c.worker_id, c.endpoint))
                  for c in reply.workers if c.endpoint]
        for w in listed:
            self._listed_at[w.worker_id] = (w, now)
            self.metrics.reported_load.labels(worker=w.worker_id).set(w.reported_load)
        # A worker the coordinator stopped listing (its epoch fenced after a long control-plane
        # stall, or it died) may still serve: kept as a last resort for gateway.unlisted_grace_ms;
        # if it is dead, its refused connection marks it down.
        names = {w.worker_id for w in listed}
        grace = self.g.unlisted_grace_ms / 1000
        for wid, (w, at) in list(self._listed_at.items()):
            if wid in names:
                continue
            if now - at > grace:
                del self._listed_at[wid]
                with contextlib.suppress(KeyError):
                    self.metrics.reported_load.remove(wid)
            elif not w.draining:
                listed.append(Worker(w.worker_id, w.endpoint, w.namespace, w.block_size, suspended=True,
                                     version=self._version(w.worker_id, w.endpoint)))
        self.fleet = listed
        self.fleet_at = now
        every = now - self._versions_at >= self.g.version_refresh_ms / 1000
        if every:
            self._versions_at = now
        for w in listed:
            if every or self.versions.get(w.worker_id, ("", ""))[0] != w.endpoint:
                self._ask_version(w)
        for state, n in (("usable", sum(1 for w in self.fleet if not (w.draining or w.suspended))),
                         ("draining", sum(1 for w in self.fleet if w.draining)),
                         ("suspended", sum(1 for w in self.fleet if w.suspended and w.worker_id in names)),
                         ("unlisted", len(self.fleet) - len(names))):
            self.metrics.fleet.labels(state=state).set(n)
        return True

    def reload_rollout(self, cfg: Config) -> None:
        """The rollout's keys from a reloaded config (SIGHUP or a changed file: shared.key_rotation),
        so a rollout's next step needs no restart."""
        weights, prefix = dict(cfg.gateway.version_weights), cfg.gateway.version_prefix_tokens
        if (weights, prefix) != (self.version_weights, self.version_prefix_tokens):
            log.info("rollout_reloaded", version_weights=weights, version_prefix_tokens=prefix)
        self.version_weights, self.version_prefix_tokens = weights, prefix

    def _version(self, worker_id: str, endpoint: str) -> str:
        """The version ``worker_id`` answered at ``endpoint`` ("" when not yet asked there)."""
        at, version = self.versions.get(worker_id, ("", ""))
        return version if at == endpoint else ""

    def _ask_version(self, w: Worker) -> None:
        """Ask ``w`` its ``GET /version`` in the background (one question per worker at a time)."""
        if w.worker_id in self._version_asks or self._http is None:
            return
        task = asyncio.get_running_loop().create_task(self._fetch_version(w))
        self._version_asks[w.worker_id] = task
        task.add_done_callback(lambda _: self._version_asks.pop(w.worker_id, None))

    async def _fetch_version(self, w: Worker) -> None:
        timeout = aiohttp.ClientTimeout(total=self.g.connect_timeout_ms / 1000)
        try:
            async with self._http.get(w.endpoint + "/version", timeout=timeout) as resp:
                doc = await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            log.debug("worker_version_unknown", worker_id=w.worker_id, error=type(e).__name__)
            return
        version = doc.get("version") if isinstance(doc, dict) else None
        if not isinstance(version, str) or len(version) > 64:
            log.warning("worker_version_unreadable", worker_id=w.worker_id, status=resp.status)
            return
        self.versions[w.worker_id] = (w.endpoint, version)
        # at once, not at the next fleet refresh
        self.fleet = [dataclasses.replace(x, version=version) if x.worker_id == w.worker_id and x.endpoint == w.endpoint
                      else x for x in self.fleet]

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.g.fleet_refresh_ms / 1000)
            await self.refresh_fleet()

    @property
    def ready(self) -> bool:
        """A fleet view was ever had and lists a worker that takes requests. A stale view (the
        coordinator unreachable) keeps the gateway ready: it routes by that view and load, as the
        workers keep serving without the coordinator; ``/readyz`` reports the view's age."""
        return bool(self.fleet_at) and any(not w.draining for w in self.fleet)

    def salt(self, tenant: str) -> bytes:
        s = self._salts.get(tenant)
        if s is None:
            s = self._salts[tenant] = tenant_salt(salt_secret(self.cfg, tenant), tenant)
        return s

    async def route(self, tokens: list[int] | None, tenant: str,
                    images: tuple[PromptImage, ...] = ()) -> tuple[list[Choice], dict[str, list[str]]]:
        """Candidates best first, and each worker's block hashes of the prompt (``images``: the
        prompt's, whose content hashes key the blocks they overlap, as on the workers)."""
        now = time.monotonic()
        down = frozenset(w for w, until in self.down.items() if until > now)
        usable: dict[str, int] = {}
        hashes_of: dict[str, list[str]] = {}
        affinity = tenant
        if tokens:
            groups: dict[tuple[str, int], list[Worker]] = {}
            for w in self.fleet:
                groups.setdefault((w.namespace, w.block_size), []).append(w)
            asks = []
            for (ns, bs), ws in groups.items():
                hashes = chain_hashes(tokens, bs, ns, self.salt(tenant), image_block_keys(images, bs))
                if hashes:
                    affinity = hashes[0]
                    if self.g.route_inflight_prefixes:
                        hashes_of.update((w.worker_id, hashes) for w in ws)
                    shard = shard_of(self.shard_map, ns, hashes) or 0    # the workers' rule
                    asks.append(self._ask(m.RouteQuery(gateway_id=self.g.gateway_id, namespace=ns,
                                                       block_hashes=hashes), self.g.route_timeout_ms / 1000, shard))
            # one fleet, one model: await the one query itself (no task for a gather of one)
            replies = [await asks[0]] if len(asks) == 1 else await asyncio.gather(*asks)
            for reply in replies:
                if reply is not None:
                    usable.update({c.worker_id: c.usable_blocks for c in reply.workers})
        # NOTE: no await from here until _try_workers records the chosen worker's share, so a
        # burst's next request, routed after this one, sees it
        return choose(self.fleet, usable, self.in_flight, affinity=affinity,
                      load_penalty_tokens=self.g.load_penalty_tokens, down=down,
                      inflight_blocks=self.inflight.leading(hashes_of), version_weights=self.version_weights,
                      version_prefix_tokens=self.version_prefix_tokens, draw=random.random()), hashes_of

    # --- HTTP ---------------------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        body = {"status": "ready" if self.ready else "not ready", "workers": len(self.fleet),
                "usable": sum(1 for w in self.fleet if not (w.draining or w.suspended)),
                "suspended": sum(1 for w in self.fleet if w.suspended and not w.draining),
                "fleet_age_s": round(time.monotonic() - self.fleet_at, 3) if self.fleet_at else None,
                # usable workers per version (GET /version; "" = not asked yet): the rollout's view
                "versions": dict(Counter_(w.version for w in self.fleet if not (w.draining or w.suspended)))}
        return web.json_response(body, status=200 if self.ready else 503)

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.StreamResponse:
        try:
            tenant = intake.authenticate(self.tenants, request)
        except intake.Refused as e:
            return self._count("/v1/models", e.response())
        choices, _ = await self.route(None, "")
        return await self._forward(request, "GET", b"", choices, "/v1/models", tenant, None)

    async def _intake(self, request: web.Request) -> tuple[Tenant, bytes, dict[str, Any]]:
        """The tenant (before a byte of the body is read), the body within its limits, its JSON
        object (:mod:`gateway.intake`); raises :class:`gateway.intake.Refused`."""
        tenant = intake.authenticate(self.tenants, request)
        body = await intake.read(request, self.cfg)
        return tenant, body, intake.parse(body)

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """``/tokenize``, ``/detokenize`` (vLLM's routes): any usable worker, with a key when
        ``auth.required`` (the workers serve them without one: the gateway is the door)."""
        try:
            tenant, body, _ = await self._intake(request)
        except intake.Refused as e:
            return self._count(request.path, e.response())
        choices, _ = await self.route(None, "")
        return await self._forward(request, request.method, body, choices, request.path, tenant, None)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": package_version()})

    def _headers(self, request: web.Request, method: str, body: bytes, tenant: Tenant) -> dict[str, str]:
        headers = {k: v for k in FORWARDED if (v := request.headers.get(k)) is not None}
        secret = self.cfg.auth.gateway_secret
        if secret:
            # the worker learns the tenant from us, signed, and never sees the client's key
            headers[TENANT_HEADER] = tenant.id
            headers[SIGNATURE_HEADER] = sign(secret, tenant.id, method, request.path_qs, body, time.time())
        elif (a := request.headers.get("Authorization")) is not None:
            headers["Authorization"] = a
        if (rid := access_log.current_id()) is not None:
            headers[access_log.REQUEST_ID_HEADER] = rid   # the worker's access line has the same id
        return headers

    async def generate(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        try:
            tenant, body, doc = await self._intake(request)
        except intake.Refused as e:
            return self._count(path, e.response())
        tracing.current().set_attribute("kvl.tenant", tenant.id)
        access_log.note(tenant=tenant.id)
        t0 = time.perf_counter()
        with tracing.span("gateway.route") as span:     # tokenize + hash + route query (+ the rate limits)
            args = (path, doc, self.tokenizer, self.template, self.images, self.image_limits)
            # NOTE: images are decoded and resized to hash them: CPU work, off the event loop
            prompt = (await asyncio.to_thread(prompt_tokens, *args)
                      if self.images is not None and b'"image_url"' in body else prompt_tokens(*args))
            tokens = prompt.tokens if prompt is not None else None
            admitted = self.limits.admit(tenant, len(tokens or ()) + _max_tokens(doc), time.monotonic())
            if isinstance(admitted, Refused):
                span.set_attribute("kvl.rate_limited", admitted.code)
                self.metrics.limited.labels(tenant=tenant.id, code=admitted.code).inc()
                headers = {"Retry-After": str(admitted.retry_after_s)} if admitted.retry_after_s else None
                return self._count(path, _error(admitted.status, admitted.message, "rate_limit_error"
                                                if admitted.status == 429 else "invalid_request_error", admitted.code,
                                                headers))
            choices, hashes_of = await self.route(tokens, tenant.id, prompt.images if prompt is not None else ())
            self.metrics.route_seconds.observe(time.perf_counter() - t0)
            if choices:
                self.metrics.decisions.labels(reason=choices[0].reason if tokens else "no_hint").inc()
                self.metrics.expected.inc(choices[0].cached_tokens)
            if span.is_recording():
                span.set_attributes({"kvl.prompt_tokens": len(tokens or ()), "kvl.candidates": len(choices),
                                     **({"kvl.worker_id": choices[0].worker.worker_id,
                                         "kvl.route_reason": choices[0].reason if tokens else "no_hint",
                                         "kvl.expected_cached_tokens": choices[0].cached_tokens} if choices else {})})
        return await self._forward(request, "POST", body, choices, path, tenant, admitted, hashes_of)

    def _count(self, path: str, resp: web.StreamResponse) -> web.StreamResponse:
        self.metrics.requests.labels(path=path, status=str(resp.status)).inc()
        return resp

    async def _forward(self, request: web.Request, method: str, body: bytes, choices: list[Choice],
                       path: str, tenant: Tenant, admitted: Admitted | None,
                       hashes_of: dict[str, list[str]] | None = None) -> web.StreamResponse:
        used: int | None = None     # tokens the answer used: the rest is refunded (None: keep the estimate)
        try:
            resp, used = await self._try_workers(request, method, body, choices, tenant, hashes_of or {})
            return self._count(path, resp)
        finally:
            if admitted is not None and used is not None:
                self.limits.refund(admitted, used, time.monotonic())

    async def _try_workers(self, request: web.Request, method: str, body: bytes, choices: list[Choice],
                           tenant: Tenant, hashes_of: dict[str, list[str]]) -> tuple[web.StreamResponse, int | None]:
        if not choices:
            return _error(503, "no worker can take this request now (none registered, all draining or down)",
                          "server_error", "no_worker", {"Retry-After": "1"}), 0
        headers = self._headers(request, method, body, tenant)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.g.connect_timeout_ms / 1000)
        last: web.StreamResponse | None = None
        plan = retry.attempt_order(choices, self.g.retry_attempts)
        for i, choice in enumerate(plan):
            w = choice.worker
            more = i + 1 < len(plan)
            if i:
                await asyncio.sleep(retry.backoff_s(i, self.g.retry_backoff_ms, self.g.retry_backoff_max_ms))
            access_log.note(worker=w.worker_id, failovers=i)   # failovers: workers tried before this one
            self.in_flight[w.worker_id] = self.in_flight.get(w.worker_id, 0) + 1
            self.metrics.in_flight.labels(worker=w.worker_id).set(self.in_flight[w.worker_id])
            hashes = hashes_of.get(w.worker_id, ())
            self.inflight.add(w.worker_id, hashes)
            try:
                with tracing.span("gateway.forward", {"kvl.worker_id": w.worker_id, "kvl.attempt": i},
                                  kind=tracing.CLIENT) as span:   # one per worker tried; its worker.request below
                    async with self._http.request(method, w.endpoint + request.path_qs, data=body or None,
                                                  headers=tracing.headers(headers), timeout=timeout) as resp:
                        span.set_attribute("http.response.status_code", resp.status)
                        if more and retry.status_retried(resp.status, self.g.retry_on):
                            self.metrics.failovers.labels(why=f"http {resp.status}").inc()
                            if resp.status != 429:
                                self.down[w.worker_id] = time.monotonic() + self.g.worker_down_ms / 1000
                            continue
                        # A stream's first bytes are awaited before anything goes to the client: a worker
                        # that dies between its headers and its first event still fails over.
                        first = await resp.content.readany() if _is_stream(resp) else b""
                        return await self._relay(request, resp, choice, first)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                # NOTE: only failures before anything reached the client land here (_relay
                # raises no ClientError once it has prepared the response).
                self.down[w.worker_id] = time.monotonic() + self.g.worker_down_ms / 1000
                self.versions.pop(w.worker_id, None)    # asked again when it is back: it may be a new build
                why = "connection refused" if isinstance(e, aiohttp.ClientConnectorError) else type(e).__name__
                retried = retry.error_retried(e, self.g.retry_on)
                log.warning("worker_failed", worker_id=w.worker_id, error=why, attempt=i + 1, retried=retried and more)
                if more and retried:
                    self.metrics.failovers.labels(why=why).inc()
                    continue
                after = (f"after {i + 1} attempt(s) (gateway.retry_attempts)" if retried else
                         "and such failures are not retried (gateway.retry_on)")
                last = _error(502, f"worker {w.worker_id} failed before answering ({why}) {after}",
                              "server_error", "worker_failed", {"Retry-After": "1"})
                break
            finally:
                self.in_flight[w.worker_id] -= 1
                self.metrics.in_flight.labels(worker=w.worker_id).set(self.in_flight[w.worker_id])
                self.inflight.remove(w.worker_id, hashes)
        return last or _error(503, "no worker took the request", "server_error", "no_worker",
                              {"Retry-After": "1"}), 0

    async def _relay(self, request: web.Request, resp: aiohttp.ClientResponse, choice: Choice,
                     first: bytes) -> tuple[web.StreamResponse, int | None]:
        """The worker's answer passed on, and the tokens it used: its usage's prompt + completion,
        0 for an error answer, None when a 200 says nothing (a stream without ``include_usage``)."""
        out_headers = {k: v for k, v in resp.headers.items()
                       if k.lower() in ("content-type", "cache-control", "retry-after", "x-request-id")}
        out_headers["x-kvl-worker"] = choice.worker.worker_id
        self.metrics.version_requests.labels(version=choice.worker.version or "unknown").inc()
        out_headers["x-kvl-route"] = f"{choice.reason}; expected_cached_tokens={choice.cached_tokens}"
        if not _is_stream(resp):
            data = await resp.read()
            usage = None
            if resp.status == 200:
                with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
                    usage = json.loads(data).get("usage")
            used = self._usage(usage) if resp.status == 200 else 0
            return web.Response(status=resp.status, body=data, headers=out_headers), used
        out = web.StreamResponse(status=resp.status, headers=out_headers)
        await out.prepare(request)
        await out.write(first)
        tail = first[-STREAM_TAIL:]
        try:
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
                tail = (tail + chunk)[-STREAM_TAIL:]
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            # bytes have reached the client: the stream ends as the worker ended it
            log.warning("stream_interrupted", worker_id=choice.worker.worker_id, error=type(e).__name__)
        with contextlib.suppress(ConnectionError):
            await out.write_eof()
        return out, self._usage(_stream_usage(tail)) if resp.status == 200 else 0

    def _usage(self, usage: Any) -> int | None:
        """Count the realised cached tokens of a usage object; its total tokens (None if none)."""
        if not isinstance(usage, dict):
            return None
        access_log.note_usage(usage)
        with contextlib.suppress(TypeError, ValueError, AttributeError):
            self.metrics.realized.inc(int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)))
        try:
            return int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
        except (TypeError, ValueError):
            return None


def _is_stream(resp: aiohttp.ClientResponse) -> bool:
    return resp.headers.get("Content-Type", "").startswith("text/event-stream")


def _max_tokens(doc: Any) -> int:
    """The completion tokens a request may generate, for its rate-limit estimate (a malformed
    value counts as the default: the worker answers it with a 400)."""
    if isinstance(doc, dict):
        for key in ("max_completion_tokens", "max_tokens"):
            v = doc.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return DEFAULT_MAX_TOKENS


def _stream_usage(tail: bytes) -> Any:
    """The usage object of the last SSE event that carries one, in a stream's last bytes."""
    for event in reversed(tail.split(b"\n\n")):
        line = event.strip()
        if not line.startswith(b"data: {") or b'"usage"' not in line:
            continue
        with contextlib.suppress(ValueError, AttributeError):
            usage = json.loads(line[6:]).get("usage")
            if usage:
                return usage
    return None


def create_app(gw: Gateway) -> web.Application:
    # gateway.request: a generation request's span (the root of its trace, or a child of the client's traceparent)
    traced = ([tracing.http_middleware("gateway.request", TRACED_PATHS, lambda _: {"kvl.gateway_id": gw.g.gateway_id})]
              if tracing.enabled() else [])
    # NOTE: the keep-alive timer also closes a connection whose headers are slower than it; an
    # unread body (a request refused before its body was read) is drained for at most the body
    # timeout before its connection closes (shared.http_limits)
    g = gw.g
    # NOTE: first of all: an address outside gateway.allowed_networks gets a 403 before the key or the body
    allow = allowlist_middleware("gateway.allowed_networks", parse_networks("gateway.allowed_networks",
                                                                            g.allowed_networks),
                                 gw.metrics.address_refused.inc)
    app = web.Application(client_max_size=intake.body_limit(gw.cfg), middlewares=[*([allow] if allow else []),
                                                                                   *traced],
                          handler_args=handler_args(g.keepalive_timeout_ms, lingering_ms=g.body_read_timeout_ms))
    access_log.install(app, "gateway", enabled=gw.cfg.logging.access_log)
    app.router.add_get("/healthz", gw.healthz)
    app.router.add_get("/health", gw.healthz)
    app.router.add_get("/readyz", gw.readyz)
    app.router.add_get("/metrics", gw.metrics_page)
    app.router.add_get("/v1/models", gw.models)
    app.router.add_get("/version", gw.version)
    app.router.add_post("/tokenize", gw.passthrough)
    app.router.add_post("/detokenize", gw.passthrough)
    app.router.add_post("/v1/completions", gw.generate)
    app.router.add_post("/v1/chat/completions", gw.generate)
    return app
