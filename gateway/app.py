"""The gateway's HTTP side and its two conversations: with the coordinator (NATS: the fleet and
route queries) and with the workers (HTTP: the requests themselves).

``POST /v1/completions``, ``POST /v1/chat/completions``: authenticated by API key (the workers'
key config), routed (:mod:`gateway.routing`), forwarded with the client's body and
``Authorization`` header; SSE streams pass through chunk by chunk, and every answer names the
worker that served it (``x-kvl-worker``) and why it was chosen (``x-kvl-route``). ``GET
/v1/models`` is answered by a worker. ``/healthz`` (alive), ``/readyz`` (the fleet is known and a
worker usable), ``/metrics`` (Prometheus).

Failover: a worker that refuses the connection, resets it, or answers 429/502/503/504 before any
byte reached the client is skipped (and marked down for ``gateway.worker_down_ms``) for the next
candidate; once bytes have streamed, an error reaches the client as the worker sent it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
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

from gateway.prompt import prompt_tokens
from gateway.routing import Choice, Worker, choose
from shared import messages as m
from shared.config import Config
from shared.hashing import chain_hashes
from shared.logging import get_logger
from shared.subjects import Subjects
from shared.tenants import AuthError, TenantDirectory, salt_secret, tenant_salt
from shared.text.chat_template import ChatTemplate
from shared.text.tokenizer import Tokenizer

log = get_logger("kvl.gateway")
#: Worker answers that mean "not now, try another" when nothing has been sent yet.
RETRY_STATUSES = frozenset({429, 502, 503, 504})
#: Request headers passed to the worker (hop-by-hop and length headers are the proxy's own).
FORWARDED = ("Authorization", "Content-Type", "Accept", "X-Request-Id")
MAX_BODY = 32 * 2**20


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "kvl_gateway_"
        self.requests = Counter(p + "requests", "Requests answered, by path and status", ["path", "status"], registry=r)
        self.decisions = Counter(p + "route_decisions", "Route decisions by reason (cache, load, affinity, "
                                 "no_hint: prompt unreadable or route query failed)", ["reason"], registry=r)
        self.expected = Counter(p + "expected_cached_tokens", "Prompt tokens the route expected cached", registry=r)
        self.realized = Counter(p + "realized_cached_tokens", "Prompt tokens the worker reported cached "
                                "(non-streamed answers)", registry=r)
        self.failovers = Counter(p + "failovers", "Requests moved to the next worker, by why", ["why"], registry=r)
        self.in_flight = Gauge(p + "worker_in_flight", "Requests this gateway has in flight per worker", ["worker"],
                               registry=r)
        self.route_seconds = Histogram(p + "route_seconds", "Tokenize + hash + route query",
                                       buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5), registry=r)
        self.fleet = Gauge(p + "fleet_workers", "Workers in the fleet view, by state", ["state"], registry=r)


def _error(status: int, message: str, type_: str, code: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": type_, "param": None, "code": code}},
                             status=status, headers=headers)


class Gateway:
    def __init__(self, cfg: Config, tokenizer: Tokenizer, template: ChatTemplate, *,
                 nats_kwargs: dict[str, Any] | None = None, client_ssl: Any = None) -> None:
        self.cfg, self.g = cfg, cfg.gateway
        self.tokenizer, self.template = tokenizer, template
        self.subjects = Subjects(cfg.nats.subject_prefix)
        self.tenants = TenantDirectory.from_config(cfg.auth)
        self.metrics = GatewayMetrics()
        self.nats_kwargs = dict(nats_kwargs or {})
        self.client_ssl = client_ssl
        self.fleet: list[Worker] = []
        self.fleet_at = 0.0                      # monotonic time of the last good fleet refresh
        self.in_flight: dict[str, int] = {}
        self.down: dict[str, float] = {}         # worker → monotonic time until which it is skipped
        self._salts: dict[str, bytes] = {}
        self._nc: Any = None
        self._http: aiohttp.ClientSession | None = None
        self._refresher: asyncio.Task[None] | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        import nats
        self._nc = await nats.connect(self.cfg.nats.url, name=f"kvl-gateway-{self.g.gateway_id}",
                                      max_reconnect_attempts=-1, reconnect_time_wait=0.5, **self.nats_kwargs)
        self._http = aiohttp.ClientSession(auto_decompress=False,
                                           connector=aiohttp.TCPConnector(limit=0, ssl=self.client_ssl))
        await self.refresh_fleet()
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop())

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        if self._http is not None:
            await self._http.close()
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.drain()

    # --- the coordinator ----------------------------------------------------------------------

    async def _ask(self, query: m.RouteQuery, timeout_s: float) -> m.RouteReply | None:
        try:
            msg = await self._nc.request(self.subjects.route(self.g.gateway_id), m.encode(query), timeout=timeout_s)
            reply = m.decode(msg.data)
        except Exception as e:  # noqa: BLE001 - timeout, no responders, disconnected: route without a hint
            log.debug("route_query_failed", error=type(e).__name__)
            return None
        return reply if isinstance(reply, m.RouteReply) else None

    async def refresh_fleet(self) -> bool:
        reply = await self._ask(m.RouteQuery(gateway_id=self.g.gateway_id), self.g.fleet_refresh_ms / 1000 * 2)
        if reply is None:
            return False
        self.fleet = [Worker(c.worker_id, c.endpoint, c.namespace, c.block_size, c.draining, c.suspended)
                      for c in reply.workers if c.endpoint]
        self.fleet_at = time.monotonic()
        for state, n in (("usable", sum(1 for w in self.fleet if not (w.draining or w.suspended))),
                         ("draining", sum(1 for w in self.fleet if w.draining)),
                         ("suspended", sum(1 for w in self.fleet if w.suspended))):
            self.metrics.fleet.labels(state=state).set(n)
        return True

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.g.fleet_refresh_ms / 1000)
            await self.refresh_fleet()

    @property
    def ready(self) -> bool:
        fresh = time.monotonic() - self.fleet_at < 3 * self.g.fleet_refresh_ms / 1000 + 1
        return fresh and any(not (w.draining or w.suspended) for w in self.fleet)

    def salt(self, tenant: str) -> bytes:
        s = self._salts.get(tenant)
        if s is None:
            s = self._salts[tenant] = tenant_salt(salt_secret(self.cfg, tenant), tenant)
        return s

    async def route(self, tokens: list[int] | None, tenant: str) -> tuple[list[Choice], str]:
        """Candidates best first, and the affinity key used."""
        now = time.monotonic()
        down = frozenset(w for w, until in self.down.items() if until > now)
        usable: dict[str, int] = {}
        affinity = tenant
        if tokens:
            groups: dict[tuple[str, int], list[Worker]] = {}
            for w in self.fleet:
                groups.setdefault((w.namespace, w.block_size), []).append(w)
            asks = []
            for (ns, bs), _ws in groups.items():
                hashes = chain_hashes(tokens, bs, ns, self.salt(tenant))
                if hashes:
                    affinity = hashes[0]
                    asks.append(self._ask(m.RouteQuery(gateway_id=self.g.gateway_id, namespace=ns,
                                                       block_hashes=hashes), self.g.route_timeout_ms / 1000))
            for reply in await asyncio.gather(*asks):
                if reply is not None:
                    usable.update({c.worker_id: c.usable_blocks for c in reply.workers})
        return choose(self.fleet, usable, self.in_flight, affinity=affinity,
                      load_penalty_tokens=self.g.load_penalty_tokens, down=down), affinity

    # --- HTTP ---------------------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        body = {"status": "ready" if self.ready else "not ready", "workers": len(self.fleet),
                "usable": sum(1 for w in self.fleet if not (w.draining or w.suspended))}
        return web.json_response(body, status=200 if self.ready else 503)

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.StreamResponse:
        choices, _ = await self.route(None, "")
        return await self._forward(request, "GET", b"", choices, "models")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if request.content_length is not None and request.content_length > MAX_BODY:
            return self._count(path, _error(413, f"request body over {MAX_BODY} bytes", "invalid_request_error",
                                            "body_too_large"))
        body = await request.read()
        try:
            tenant = self.tenants.authenticate(request.headers.get("Authorization"))
        except AuthError as e:
            return self._count(path, _error(401, str(e), "authentication_error", "invalid_api_key"))
        t0 = time.perf_counter()
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        tokens = prompt_tokens(path, doc, self.tokenizer, self.template)
        choices, _ = await self.route(tokens, tenant.id)
        self.metrics.route_seconds.observe(time.perf_counter() - t0)
        if choices:
            self.metrics.decisions.labels(reason=choices[0].reason if tokens else "no_hint").inc()
            self.metrics.expected.inc(choices[0].cached_tokens)
        return await self._forward(request, "POST", body, choices, path)

    def _count(self, path: str, resp: web.StreamResponse) -> web.StreamResponse:
        self.metrics.requests.labels(path=path, status=str(resp.status)).inc()
        return resp

    async def _forward(self, request: web.Request, method: str, body: bytes, choices: list[Choice],
                       path: str) -> web.StreamResponse:
        if not choices:
            return self._count(path, _error(503, "no worker can take this request now (none registered, all draining "
                                                 "or down)", "server_error", "no_worker",
                                            {"Retry-After": "1"}))
        headers = {k: v for k in FORWARDED if (v := request.headers.get(k)) is not None}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.g.connect_timeout_ms / 1000)
        last: web.StreamResponse | None = None
        for i, choice in enumerate(choices):
            w = choice.worker
            more = i + 1 < len(choices)
            self.in_flight[w.worker_id] = self.in_flight.get(w.worker_id, 0) + 1
            self.metrics.in_flight.labels(worker=w.worker_id).set(self.in_flight[w.worker_id])
            try:
                async with self._http.request(method, w.endpoint + request.path_qs, data=body or None,
                                              headers=headers, timeout=timeout) as resp:
                    if resp.status in RETRY_STATUSES and more:
                        self.metrics.failovers.labels(why=f"http {resp.status}").inc()
                        if resp.status != 429:
                            self.down[w.worker_id] = time.monotonic() + self.g.worker_down_ms / 1000
                        continue
                    return self._count(path, await self._relay(request, resp, choice))
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                # NOTE: only failures before anything reached the client land here (_relay
                # re-raises nothing once it has prepared the response).
                self.down[w.worker_id] = time.monotonic() + self.g.worker_down_ms / 1000
                why = "connection refused" if isinstance(e, aiohttp.ClientConnectorError) else type(e).__name__
                log.warning("worker_failed", worker_id=w.worker_id, error=why)
                if more:
                    self.metrics.failovers.labels(why=why).inc()
                    continue
                last = _error(502, f"worker {w.worker_id} failed before answering ({why}) and no other worker is "
                                   f"available", "server_error", "worker_failed", {"Retry-After": "1"})
            finally:
                self.in_flight[w.worker_id] -= 1
                self.metrics.in_flight.labels(worker=w.worker_id).set(self.in_flight[w.worker_id])
        return self._count(path, last or _error(503, "no worker took the request", "server_error", "no_worker",
                                                {"Retry-After": "1"}))

    async def _relay(self, request: web.Request, resp: aiohttp.ClientResponse, choice: Choice) -> web.StreamResponse:
        out_headers = {k: v for k, v in resp.headers.items()
                       if k.lower() in ("content-type", "cache-control", "retry-after", "x-request-id")}
        out_headers["x-kvl-worker"] = choice.worker.worker_id
        out_headers["x-kvl-route"] = f"{choice.reason}; expected_cached_tokens={choice.cached_tokens}"
        if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            data = await resp.read()
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                cached = json.loads(data)["usage"]["prompt_tokens_details"]["cached_tokens"]
                self.metrics.realized.inc(int(cached))
            return web.Response(status=resp.status, body=data, headers=out_headers)
        out = web.StreamResponse(status=resp.status, headers=out_headers)
        await out.prepare(request)
        try:
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            # bytes have reached the client: the stream ends as the worker ended it
            log.warning("stream_interrupted", worker_id=choice.worker.worker_id, error=type(e).__name__)
        with contextlib.suppress(ConnectionError):
            await out.write_eof()
        return out


def create_app(gw: Gateway) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_get("/healthz", gw.healthz)
    app.router.add_get("/health", gw.healthz)
    app.router.add_get("/readyz", gw.readyz)
    app.router.add_get("/metrics", gw.metrics_page)
    app.router.add_get("/v1/models", gw.models)
    app.router.add_post("/v1/completions", gw.generate)
    app.router.add_post("/v1/chat/completions", gw.generate)
    return app
