"""The gateway's and the tenants' config sections (gateway, auth, API keys), re-exported by shared.config."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from shared.address_allowlist import parse_networks
from shared.config_types import Port, PosInt, _Section


class ApiKey(_Section):
    #: sha256 hex of the key; keys are never stored in clear.
    key_sha256: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}\Z")]
    tenant: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_\-]{1,64}\Z")]
    max_concurrency: Annotated[int, msgspec.Meta(ge=0)] = 0
    cache_quota_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: Requests per second the gateway admits for this tenant (token bucket, one second of burst;
    #: 0 = no limit). Each gateway counts its own: with k gateways, give each 1/k of the rate.
    requests_per_second: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    #: Tokens per minute (prompt + max_tokens, refunded to what was generated) the gateway admits
    #: for this tenant (token bucket, one minute of burst; 0 = no limit).
    tokens_per_minute: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: This tenant's scheduling priority (lower runs first); a request's ``priority`` may only
    #: lower it (a larger number), never raise it (``shared.tenants``).
    priority: Annotated[int, msgspec.Meta(ge=-1_000_000, le=1_000_000)] = 0


class GatewayConfig(_Section):
    """The gateway (``python -m gateway``): one OpenAI endpoint in front of the workers."""
    #: Its NATS identity is ``gateway.<gateway_id>``; several gateways need distinct ids.
    gateway_id: str = "gateway"
    #: Gateways ``kvledger up`` runs (``--gateways``), each routing by the same view (the ledger's
    #: block locations, asked of the coordinator), so a prefix goes to the same worker whichever
    #: takes it: the first is ``gateway_id`` on ``port``, replica i ``<gateway_id>-<i>`` on ``port + i``.
    replicas: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
    #: Address the gateway's OpenAI endpoint listens on (0 = any free port).
    host: str = "127.0.0.1"
    #: Port of that endpoint; ``kvledger up`` prints it as the stack's endpoint.
    port: Port = 8300
    #: How long a route query to the coordinator may take before the request is routed by load.
    route_timeout_ms: PosInt = 100
    #: How often the gateway refreshes its view of the fleet (endpoints, namespaces, draining).
    fleet_refresh_ms: PosInt = 500
    #: A worker that refused a connection or failed before answering is skipped this long.
    worker_down_ms: PosInt = 2000
    #: One running request on a worker weighs as much as this many prompt tokens served from its
    #: cache: the router picks the worker with the most cached tokens minus this times its load
    #: (bench.gateway: 256 sent a third of the turns away from their cache; 32 kept them home).
    load_penalty_tokens: Annotated[int, msgspec.Meta(ge=0)] = 32
    #: Count the blocks that this gateway's requests in flight on a worker are computing as cached
    #: there: a burst sharing a new prefix goes where the prefix is being computed (and is computed
    #: once, the worker folding the rest into that computation) until the load outweighs it.
    route_inflight_prefixes: bool = True
    #: Time to connect to a worker before the next candidate is tried.
    connect_timeout_ms: PosInt = 5000
    #: A worker the coordinator stops listing (fenced after a long stall, or dead) stays a last-resort
    #: candidate this long: it may still serve, and a dead one's refused connection marks it down.
    unlisted_grace_ms: PosInt = 30_000
    #: The gateway process's event loop: ``uvloop`` (libuv) or ``asyncio`` (the standard library's).
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    #: Largest request body the gateway reads (413 above: before reading when the Content-Length
    #: says so, at the limit for a chunked body); 0 = the workers' ``service.max_body_bytes``.
    max_body_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: Idle time allowed on a client connection between requests, and the longest a client may
    #: take to send a request's headers (slower connections are closed).
    keepalive_timeout_ms: PosInt = 15000
    #: Time allowed to receive a request body once its headers are in (and the API key checked);
    #: slower is a 408 and the connection is closed. Also the longest an unread body is drained.
    body_read_timeout_ms: PosInt = 10000
    #: Client addresses the gateway answers (CIDR networks, as ``worker.allowed_networks``); anyone
    #: else gets a 403 before the API key or the body is read. Empty (the default): every address.
    allowed_networks: list[str] = []
    #: Most workers one request is sent to, the first included: a failure named in ``retry_on``
    #: before any byte reached the client sends it to the next candidate (the same worker again
    #: when it is the only one) after a backoff; past the last attempt the client gets the error.
    retry_attempts: Annotated[int, msgspec.Meta(ge=1, le=16)] = 3
    #: What is retried, only ever before a byte reached the client: ``connect`` (the connection was
    #: refused, reset or closed before the answer was whole, or connecting timed out) and the worker
    #: statuses listed (503: shutting down or not ready; 429: its queue is full, another worker's
    #: may not be; 502, 504). Anything else reaches the client as the worker answered it.
    retry_on: list[Literal["connect", 429, 502, 503, 504]] = msgspec.field(
        default_factory=lambda: ["connect", 503])
    #: Wait before the first retry, doubled before each further one, at most ``retry_backoff_max_ms``
    #: (0: retry at once).
    retry_backoff_ms: Annotated[int, msgspec.Meta(ge=0, le=60_000)] = 50
    #: The longest wait before one retry, however many came before it.
    retry_backoff_max_ms: Annotated[int, msgspec.Meta(ge=0, le=60_000)] = 1000
    #: Gradual rollout: a share of traffic per worker version (``worker.version``, as each worker's
    #: ``GET /version`` says), e.g. ``{"1.4": 90, "1.5": 10}``. A request whose best worker holds at
    #: least ``version_prefix_tokens`` of its prompt cached (or being computed) still goes there,
    #: whatever its version; any other request goes to a version drawn by these weights (among the
    #: versions with a usable worker; a version not listed gets none of that traffic, only cache hits
    #: and failovers). Empty (the default): versions play no part in routing. Read again, with
    #: ``version_prefix_tokens``, on SIGHUP or a change of the config file (``shared.key_rotation``).
    version_weights: dict[Annotated[str, msgspec.Meta(max_length=64)],
                          Annotated[int, msgspec.Meta(ge=0, le=1_000_000)]] = {}
    #: The fewest prompt tokens cached on the best worker for its prefix to win over the version
    #: draw (``version_weights``); 1: any cached block does.
    version_prefix_tokens: PosInt = 1
    #: How often the gateway asks each worker its version again (a worker restarted under the same
    #: id with new code is seen within this).
    version_refresh_ms: PosInt = 5000

    def __post_init__(self) -> None:
        parse_networks("gateway.allowed_networks", self.allowed_networks)


class AuthConfig(_Section):
    #: No keys configured and ``required`` false = every request is tenant ``default``.
    required: bool = False
    keys: list[ApiKey] = []
    #: A YAML file with a ``keys:`` list of the same shape (merged with ``keys``).
    keys_file: str = ""
    #: Secret from which each tenant's hash salt is derived; empty = per-state-dir random.
    salt_secret: str = ""
    #: Shared by gateways and workers: the gateway forwards the tenant it authenticated in a header
    #: signed with it (``shared.tenant_header``) instead of the client's key. Empty = the gateway
    #: passes the client's Authorization header on and the worker checks the key itself.
    gateway_secret: str = ""
    #: How old (either way, for clock skew) a gateway's tenant signature may be.
    gateway_signature_max_age_ms: PosInt = 30_000
    #: Key rotation (``shared.key_rotation``): after a reload (SIGHUP, or a changed config file or
    #: ``keys_file``), an API key or admin token the reload removed is still accepted this long.
    rotation_grace_s: Annotated[float, msgspec.Meta(ge=0, le=30 * 86_400)] = 300.0
    #: How often workers, gateways and the coordinator look at their config file and ``keys_file``
    #: for a change, which reloads ``keys`` and ``coordinator.admin_token`` (0 = on SIGHUP only).
    reload_check_s: Annotated[float, msgspec.Meta(ge=0, le=86_400)] = 5.0
