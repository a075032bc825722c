"""Configuration: one YAML file plus ``KVL_*`` environment overrides, validated at load.

Overrides name a key path with ``__`` between levels, e.g. ``KVL_CACHE__BLOCK_SIZE=32`` or
``KVL_CACHE__HIT_VALIDATION__CHECK_TAIL=false``; values are parsed as YAML scalars. Short
forms exist for what operators set most: ``KVL_DATABASE_URL``, ``KVL_NATS_URL`` and
``KVL_STATE_DIR``.

Every error names the key (``cache.block_size``) and what is allowed. An unknown key is an
error, not a silently ignored typo.
"""

from __future__ import annotations

import os
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

# NOTE: the worker's and the gateway's sections live in modules of their own; every name is
# re-exported here, where callers import them from.
from shared.config_gateway import ApiKey, AuthConfig, GatewayConfig
from shared.config_types import Fraction, Port, PosInt, _Section
from shared.config_worker import MAX_BATCH_TOKENS, CacheConfig, HitValidation, ServiceConfig, WorkerConfig
from shared.logging import mask_credentials
from shared.nats_auth import AuthConfigError, Identity


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and what is allowed."""


class DatabaseConfig(_Section):
    #: ``postgresql+asyncpg://…``; empty = start an embedded PostgreSQL (pgserver).
    url: str = ""
    #: URL of the schema owner, used only to migrate (``kvledger up``, ``python -m coordinator.log.roles``);
    #: empty = ``url``. The coordinator itself connects with ``url``, a ``kvledger_writer`` member.
    owner_url: str = ""
    pool_size: PosInt = 5
    connect_timeout_ms: PosInt = 3000
    #: Connect with the ``tls`` section's context (verified TLS, when ``tls.ca_file`` is set); false =
    #: leave it to the URL and ``PGSSLMODE`` (``kvledger up`` sets it false for its embedded PostgreSQL,
    #: whose build has no TLS and which listens on loopback only).
    tls: bool = True
    #: Group commits of at least this many events are written by COPY (the fence, head and stream
    #: versions read first in the same transaction); smaller ones by one ``kvl_append`` call,
    #: a single round trip. 0 = always ``kvl_append``.
    copy_append_min_events: Annotated[int, msgspec.Meta(ge=0)] = 256
    #: ``kvledger up`` runs a streaming standby of its embedded PostgreSQL (as ``--pg-standby``;
    #: ``shared.pg_standby``); the coordinators' URL names both, the one accepting writes is used.
    standby: bool = False
    #: A commit waits until the standby has flushed it (``synchronous_standby_names``): an acknowledged
    #: event survives the primary's loss, and commits stall while the standby is down. False = commits
    #: return at the primary's own flush; a failover may lose the last acknowledged events.
    synchronous_standby: bool = True
    #: ``kvledger up`` promotes the standby once the primary has been dead this many seconds;
    #: 0 = never by itself (``kvledger db promote``).
    failover_after_s: Annotated[float, msgspec.Meta(ge=0)] = 0
    #: How often the leader counts the standbys streaming from its PostgreSQL and reads whether its
    #: commits wait for one (``kvl_coordinator_database_standbys`` / ``_synchronous``); 0 = never.
    standby_check_interval_s: Annotated[float, msgspec.Meta(ge=0)] = 10


def nats_servers(url: str) -> list[str]:
    """The servers of ``nats.url``: one URL, or a cluster's as a comma-separated list (every
    client is given them all, so that it reconnects to another node when its own goes away)."""
    return [u.strip() for u in url.split(",") if u.strip()]


class NatsConfig(_Section):
    #: ``nats://host:port``, or a cluster's servers comma-separated
    #: (``nats://n1:4222,nats://n2:4222,nats://n3:4222``); empty = start an embedded nats-server
    #: with JetStream (``cluster_size`` of them).
    url: str = ""
    #: Embedded NATS only (``nats.url`` empty): how many clustered nats-servers ``kvledger up``
    #: runs (1, or 3 or 5 for a JetStream cluster that survives losing one or two);
    #: ``kvledger up --nats-cluster N`` overrides it.
    cluster_size: Literal[1, 3, 5] = 1
    #: Replicas of the transitions stream (JetStream R1..R5); 0 = one per server in ``nats.url``
    #: (at most 5), so a three-node cluster gets R3. Applied to an existing stream at start.
    stream_replicas: Annotated[int, msgspec.Meta(ge=0, le=5)] = 0
    subject_prefix: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*\Z")] = "kvl"
    request_timeout_ms: PosInt = 2000
    #: This process's NATS user: ``coordinator``, ``worker.<worker id>``, ``operator`` or ``observer``
    #: (``shared.nats_auth``: each is confined to its own subjects); empty = connect without one.
    user: Annotated[str, msgspec.Meta(pattern=r"^([A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)?)?\Z")] = ""
    #: Its password (``KVL_NATS__PASSWORD``); ``password_file`` is preferred.
    password: str = ""
    #: A file holding the password (read at start; 0600). Wins over ``password``.
    password_file: str = ""
    #: JetStream duplicate window: redeliveries inside it are dropped by the broker too.
    duplicate_window_s: PosInt = 120
    stream_max_age_s: PosInt = 7 * 86400
    #: The transitions stream's size cap in bytes; a publish that would pass it is refused (an
    #: error to the worker, which keeps the transitions and retries), never an older one dropped.
    stream_max_bytes: PosInt = 1 << 30
    #: Largest transitions message the stream takes (a worker splits a batch over it).
    stream_max_msg_bytes: PosInt = 1 << 20
    #: Most messages one worker may have stored in the stream (its subject); more are refused to
    #: that worker alone. Needs nats-server ≥ 2.10 (per-subject discard-new); ignored, with a
    #: warning, on an older server.
    stream_max_msgs_per_worker: PosInt = 100_000
    #: Every this many seconds the leader purges the stream's messages it has acknowledged (their
    #: transitions are in the log), so the caps bound the backlog, not history; 0 = never.
    stream_purge_interval_s: Annotated[int, msgspec.Meta(ge=0)] = 10


class CoordinatorConfig(_Section):
    host: str = "127.0.0.1"
    port: Port = 8321
    #: Bearer token for the admin REST API; empty = read KVL_ADMIN_TOKEN, else no auth on loopback only.
    admin_token: str = ""
    #: The status page draws a pool's usage amber from this share of its slots (``coordinator.ui``).
    ui_warn_usage: Fraction = 0.8
    #: The status page draws a pool's usage red from this share (a pool this full refuses leases:
    #: ``over_capacity`` fallbacks).
    ui_critical_usage: Fraction = 0.95
    lease_ttl_ms: PosInt = 30000
    heartbeat_interval_ms: PosInt = 1000
    #: Heartbeats missed before a worker's epoch is suspended (then fenced after ``resume_grace_ms``).
    missed_heartbeats: PosInt = 5
    #: A worker silent past the heartbeat timeout is *suspended* this long (its cache kept,
    #: waiting for it to resume) before its epoch is fenced; at least ``lease_ttl_ms``.
    resume_grace_ms: PosInt = 60000
    #: Group commit: how long a lone submission waits for company before it is committed
    #: (0 = commit at once; while a commit is in flight the next batch fills by itself).
    commit_batch_ms: Annotated[int, msgspec.Meta(ge=0)] = 0
    commit_batch_max: PosInt = 2000
    #: Requests (leases, releases, renewals, …) decided in one pass at most; a larger burst is
    #: decided in several, each submitted for commit as soon as it is decided, so the first
    #: part's append overlaps the deciding of the rest (``coordinator.nats_service``).
    decide_pass_max: PosInt = 32
    snapshot_every_events: PosInt = 100_000
    #: Serialise each snapshot in a forked child, so that decisions wait only for the fork (a
    #: few ms) instead of the whole hash and encoding (~0.5 s for a worker with a 100k-slot
    #: pool, in proportion to the state). false: in the coordinator's process, as before.
    #: Where the OS has no ``fork()`` it is always in process.
    snapshot_fork: bool = True
    #: A snapshot child still running after this long is killed and the snapshot skipped (the
    #: next one is tried after another ``snapshot_every_events``).
    snapshot_timeout_s: Annotated[int, msgspec.Meta(ge=1, le=86_400)] = 300
    #: Refused transitions of one worker epoch and kind of reason are logged at most once per this
    #: interval, as one row with their count (a burst's later refusals wait, at most this long,
    #: for that row); 0 = one row per kind per commit.
    rejection_interval_ms: Annotated[int, msgspec.Meta(ge=0, le=60_000)] = 1000
    #: Per-tenant cap on READY+ALLOCATED replicas across all workers (0 = unlimited).
    tenant_quota_replicas: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: The coordinator process's asyncio event loop: ``uvloop`` (libuv; faster sockets and
    #: scheduling) or ``asyncio`` (the standard library's).
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    #: Allocations between two collections of the garbage collector's youngest generation in the
    #: coordinator process (CPython's default: 700). A lease allocates dozens of objects; at 700
    #: the collector took ~a quarter of a lease's decision time on a large state, with full
    #: collections of tens of ms in the lease p99 (BENCHMARKS.md, Coordinator: "Garbage
    #: collection"). Higher: fewer collections, each of more young objects.
    gc_young_threshold: Annotated[int, msgspec.Meta(ge=100, le=1_000_000)] = 10_000
    #: Collections of the middle generation between two full collections in the coordinator
    #: process (CPython's default: 10). The state loaded at a takeover is frozen out of the
    #: collector's view, which leaves its old generation small, so full collections came every
    #: 10 middle ones — a 30–70 ms pause about every million allocations, which landed in a 20k
    #: lease run's p99 (BENCHMARKS.md, Coordinator). Higher: rarer full collections; cyclic
    #: garbage that survived two collections waits longer to be freed.
    gc_full_threshold: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 100
    #: Coordinator shards the ledger's key space is split between (docs/architecture.md, "The ledger
    #: sharded"): each shard is a leader with its standbys, its own log (its own ``database.url``)
    #: and its own subjects. 1 = one ledger, exactly as unsharded.
    shards: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    #: Which shard this coordinator leads or stands by for (0 to ``shards`` − 1). Shard 0 uses
    #: ``nats.subject_prefix`` itself, shard k ``<prefix>.s<k>``.
    shard: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: Partitions of the key space (a chain's namespace and first block pick one); the shard map
    #: gives each to a shard, partition p to shard p mod ``shards`` until one is moved. The same on
    #: every coordinator, worker and gateway of a deployment, and fixed for its life.
    shard_partitions: Annotated[int, msgspec.Meta(ge=1, le=65_536)] = 256

    def __post_init__(self) -> None:
        if self.shard >= self.shards:
            raise ValueError(f"coordinator.shard is {self.shard}, but shards are numbered 0 to "
                             f"{self.shards - 1} (coordinator.shards: {self.shards})")
        if self.shard_partitions < self.shards:
            raise ValueError(f"coordinator.shard_partitions ({self.shard_partitions}) must be at least "
                             f"coordinator.shards ({self.shards})")


class LoggingConfig(_Section):
    format: Literal["json", "console", "auto"] = "auto"
    level: Literal["debug", "info", "warning", "error"] = "info"
    #: Size at which ``kvledger up`` rotates a ``<state_dir>/logs/<name>.log`` (to ``.log.1``, …).
    max_bytes: Annotated[int, msgspec.Meta(ge=4096)] = 50 * 1024 * 1024
    #: Rotated files kept per log (``.log.1`` … ``.log.N``); the oldest is deleted.
    backups: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 5
    #: One ``access`` line at info level per API request in the worker and the gateway
    #: (``shared.access_log``: id, tenant, status, token counts, timings; never content).
    access_log: bool = True


class TracingConfig(_Section):
    """Request tracing (``shared.tracing``): one OpenTelemetry trace per request, exported over OTLP/HTTP."""
    #: Trace requests across gateway, worker and coordinator (W3C ``traceparent`` in HTTP and NATS
    #: headers) and export the spans. Off: no tracer is created, no span is made, nothing is sent.
    enabled: bool = False
    #: Where spans go: an OTLP/HTTP (protobuf) traces endpoint — an OpenTelemetry Collector, Jaeger
    #: or Tempo. Headers (an API token) and a CA come from ``OTEL_EXPORTER_OTLP_TRACES_HEADERS`` /
    #: ``OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE`` in the environment.
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    #: Each process reports itself as ``<service_name>-gateway``, ``-worker`` or ``-coordinator``.
    service_name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.\-]{1,64}\Z")] = "kvledger"
    #: Fraction of new traces recorded (by trace id). Parent-based: a request arriving with a
    #: ``traceparent`` follows its caller's decision, so a trace is whole or absent.
    sample_ratio: Fraction = 1.0
    #: Time one export request may take; a slower collector loses that batch, never a request's time.
    export_timeout_ms: PosInt = 10000
    #: How often finished spans are sent (in batches, from a background thread).
    schedule_delay_ms: PosInt = 2000
    #: Finished spans kept for export; past it new ones are dropped (the collector is down or slow).
    max_queue_size: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 8192


class TlsConfig(_Section):
    """Optional TLS. Empty files = plain HTTP and the drivers' own URL-driven behaviour."""
    #: PEM server certificate (chain) of this process: the worker HTTP API and the coordinator's admin
    #: API listen with HTTPS (TLS 1.2+) when set; empty = plain HTTP. Also offered as the client
    #: certificate to NATS and PostgreSQL when ``ca_file`` is set and they ask for one.
    cert_file: str = ""
    #: PEM private key of ``cert_file`` (required with it).
    key_file: str = ""
    #: PEM CA bundle that verifies peers. When set, NATS and PostgreSQL connections use TLS
    #: verified against it (hostname checked; a PostgreSQL server without TLS is refused, and
    #: NATS must require TLS or be given a ``tls://`` URL); and clients of the HTTPS listeners
    #: when ``require_client_cert``. Empty = the drivers decide with the system CAs: NATS from a
    #: ``tls://`` URL, PostgreSQL from ``PGSSLMODE``/``PGSSLROOTCERT`` in the environment.
    ca_file: str = ""
    #: Mutual TLS on the HTTPS listeners: refuse clients without a certificate signed by ``ca_file``.
    require_client_cert: bool = False

    def __post_init__(self) -> None:
        if self.cert_file and not self.key_file:
            raise ValueError("tls.cert_file is set but tls.key_file is empty; both are needed to serve HTTPS")
        if self.key_file and not self.cert_file:
            raise ValueError("tls.key_file is set but tls.cert_file is empty; both are needed to serve HTTPS")
        if self.require_client_cert and not self.ca_file:
            raise ValueError("tls.require_client_cert needs tls.ca_file (the CA that signs client certificates)")
        if self.require_client_cert and not self.cert_file:
            raise ValueError("tls.require_client_cert needs tls.cert_file and tls.key_file (an HTTPS listener)")
        for key in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, key)
            if not path:
                continue
            try:
                with open(path, "rb") as f:
                    f.read(1)
            except OSError as e:
                raise ValueError(f"tls.{key}: cannot read {path}: {e.strerror or e}") from None


class Config(_Section):
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    service: ServiceConfig = msgspec.field(default_factory=ServiceConfig)
    database: DatabaseConfig = msgspec.field(default_factory=DatabaseConfig)
    nats: NatsConfig = msgspec.field(default_factory=NatsConfig)
    coordinator: CoordinatorConfig = msgspec.field(default_factory=CoordinatorConfig)
    worker: WorkerConfig = msgspec.field(default_factory=WorkerConfig)
    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    tls: TlsConfig = msgspec.field(default_factory=TlsConfig)
    #: Where embedded services and local state live.
    state_dir: str = ".kvl-state"


_AT = re.compile(r" - at `\$((?:\.[A-Za-z0-9_]+|\[\d+\]|\[\.\.\.\])*)`$")
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]+)`")


def _section_at(path: list[str]) -> type[msgspec.Struct] | None:
    t: Any = Config
    for p in path:
        if p.startswith("["):
            return None
        fields = {f.name: f.type for f in msgspec.structs.fields(t)}
        if p not in fields:
            return None
        t = fields[p]
        if not (isinstance(t, type) and issubclass(t, msgspec.Struct)):
            return None
    return t


#: Keys an earlier release had, and what to do instead (a config naming one is refused with this).
REMOVED_KEYS = {
    "cache.offload_pool_limit": "no pool ever used it: the host tier is sized by cache.host_tier_bytes and "
                                "the disk tier by cache.offload_dir_bytes; delete the key",
}


def _explain(err: msgspec.ValidationError) -> ConfigError:
    msg = str(err)
    m = _AT.search(msg)
    path = [p for p in re.split(r"\.|(?=\[)", m.group(1).replace("[...]", "[*]")) if p] if m else []
    detail = _AT.sub("", msg)
    u = _UNKNOWN.search(detail)
    if u:
        section = _section_at(path)
        allowed = sorted(f.name for f in msgspec.structs.fields(section)) if section else []
        key = ".".join([*path, u.group(1)]).replace(".[", "[")
        if key in REMOVED_KEYS:
            return ConfigError(f"config key {key}: removed; {REMOVED_KEYS[key]}")
        return ConfigError(f"config key {key}: unknown key; allowed here: {', '.join(allowed)}")
    key = ".".join(path).replace(".[", "[") or "(top level)"
    if "Invalid enum value" in detail and path:
        section = _section_at(path[:-1])
        ftype = {f.name: f.type for f in msgspec.structs.fields(section)}.get(path[-1]) if section else None
        if ftype is not None and typing.get_origin(ftype) is Literal:
            detail += f"; allowed: {', '.join(map(str, typing.get_args(ftype)))}"
    return ConfigError(f"config key {key}: {detail}")


def _set_path(doc: dict[str, Any], path: list[str], value: Any, env_name: str) -> None:
    cur = doc
    for p in path[:-1]:
        nxt = cur.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{env_name}: {'.'.join(path[:-1])} is not a section")
        cur = nxt
    cur[path[-1]] = value


def apply_env(doc: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    for name, raw in sorted(env.items()):
        if not name.startswith("KVL_"):
            continue
        if name == "KVL_DATABASE_URL":
            path = ["database", "url"]
        elif name == "KVL_NATS_URL":
            path = ["nats", "url"]
        elif name == "KVL_STATE_DIR":
            path = ["state_dir"]
        elif "__" in name:
            path = [p.lower() for p in name[4:].split("__")]
        else:
            continue  # other KVL_* variables (KVL_TEST_*, KVL_ADMIN_TOKEN, …) are not config keys
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"{name}: value is not a YAML scalar: {e}") from e
        if name.endswith("URL") or path[-1] in ("url", "admin_token", "salt_secret", "offload_dir", "state_dir", "user",
                                                 "password", "password_file", "otlp_endpoint"):
            value = raw  # never reinterpret strings such as URLs or secrets
        _set_path(doc, path, value, name)
    return doc


def load_config(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> Config:
    """Read ``path`` (or ``$KVL_CONFIG``; none = defaults), apply env overrides, validate."""
    env = os.environ if env is None else env
    path = path or env.get("KVL_CONFIG") or None
    doc: dict[str, Any] = {}
    if path:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {p}: {e.strerror}") from e
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p}: the top level must be a mapping of sections")
        doc = loaded
    doc = apply_env(doc, env)
    for dotted, value in (overrides or {}).items():
        _set_path(doc, dotted.split("."), value, dotted)
    return parse_config(doc)


def parse_config(doc: Mapping[str, Any]) -> Config:
    try:
        cfg = msgspec.convert(dict(doc), Config)
    except msgspec.ValidationError as e:
        raise _explain(e) from None
    _cross_check(cfg)
    return cfg


def _cross_check(cfg: Config) -> None:
    c = cfg.cache
    total = c.compressed_pool_limit + c.tail_pool_limit + c.swa_pool_limit
    if total > 1.0 + 1e-9:
        raise ConfigError(
            "config keys cache.*_pool_limit: compressed + tail + swa limits sum to "
            f"{total:.3f}; they are fractions of one pool budget and may sum to at most 1.0")
    if cfg.service.max_context_length % 1 or cfg.service.max_context_length < c.block_size:
        raise ConfigError(f"config key service.max_context_length: must be ≥ cache.block_size ({c.block_size})")
    co = cfg.coordinator
    if co.resume_grace_ms < co.lease_ttl_ms:
        raise ConfigError(f"config key coordinator.resume_grace_ms: {co.resume_grace_ms} is shorter than "
                          f"coordinator.lease_ttl_ms ({co.lease_ttl_ms}); a suspended worker must be able to "
                          "outlive its leases")
    if cfg.database.url and not cfg.database.url.startswith(("postgresql", "postgres")):
        raise ConfigError("config key database.url: expected a postgresql:// or postgresql+asyncpg:// URL")
    if cfg.nats.url and not all(u.startswith(("nats://", "tls://", "ws://", "wss://"))
                                for u in nats_servers(cfg.nats.url)):
        raise ConfigError("config key nats.url: expected a nats:// URL (a cluster's: comma-separated nats:// URLs)")
    if cfg.tracing.enabled and not re.match(r"^https?://[^/\s]+", cfg.tracing.otlp_endpoint):
        raise ConfigError(f"config key tracing.otlp_endpoint: {mask_credentials(cfg.tracing.otlp_endpoint)!r} is not "
                          "an http:// or https:// URL (an OTLP/HTTP traces endpoint, e.g. "
                          "http://127.0.0.1:4318/v1/traces)")
    if cfg.nats.user:
        try:
            ident = Identity.parse(cfg.nats.user)
        except AuthConfigError as e:
            raise ConfigError(f"config key nats.user: {e}") from None
        if ident.role == "worker" and cfg.worker.worker_id and ident.name != cfg.worker.worker_id:
            raise ConfigError(f"config key nats.user: {cfg.nats.user!r} is another worker's identity "
                              f"(worker.worker_id is {cfg.worker.worker_id!r}); it may act only on its own subjects")


def to_dict(cfg: Config) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)
