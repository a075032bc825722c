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

from shared.address_allowlist import parse_networks
from shared.logging import mask_credentials
from shared.nats_auth import AuthConfigError, Identity

Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
PosInt = Annotated[int, msgspec.Meta(gt=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and what is allowed."""


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class HitValidation(_Section):
    """Which forms' reused replicas are validated before a kernel reads them."""
    check_compressed: bool = True
    check_tail: bool = True
    check_swa: bool = True
    check_indexer: bool = True
    check_offload: bool = True
    #: The four layers, each switchable: presence, kernel ABI, form intersection, integrity.
    layers: list[Literal["presence", "abi", "intersection", "integrity"]] = msgspec.field(
        default_factory=lambda: ["presence", "abi", "intersection", "integrity"])


class CacheConfig(_Section):
    block_size: Annotated[int, msgspec.Meta(gt=0, le=4096)] = 16
    compressed_pool_limit: Fraction = 0.7
    tail_pool_limit: Fraction = 0.1
    swa_pool_limit: Fraction = 0.1
    offload_dir: str = ""
    #: Bytes of segment files one worker may keep in ``offload_dir``: past it the worker's oldest
    #: segments are deleted once the ledger has evicted what they hold (a segment holding a replica
    #: a live lease pins waits). Each worker bounds its own. 0 (the default): ``offload_dir_share``
    #: of the file system's free space at start, plus what its segments there already take.
    offload_dir_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: With ``offload_dir_bytes`` 0: the share of the offload file system's free space (at the
    #: worker's start) its segments may take. Each worker on a shared directory takes this share of
    #: the free space it sees: k workers starting together may take k times it (two at 0.5: all of
    #: it; compose gives each 0.25), so give each 1/k of what they may take together, or a byte bound.
    offload_dir_share: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.5
    #: A segment last written longer ago than this is deleted (once the ledger has evicted what it
    #: holds, as for the bound): cache entries that old are rarely reused, and a directory nobody
    #: reads does not keep growing back to its bound. 0: no age limit.
    offload_max_age_s: Annotated[int, msgspec.Meta(ge=0)] = 7 * 86400
    #: How often a worker looks for segments past ``offload_max_age_s``.
    offload_age_check_s: Annotated[float, msgspec.Meta(gt=0.0, le=86_400)] = 60.0
    #: Pool usage (fraction of a form's slots) above which the coldest replicas are copied to the
    #: host or disk tier in the background, before an eviction needs them there (1.0 = only
    #: when evicted).
    offload_threshold: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.9
    #: A worker starts a new segment file once its current one reaches this size.
    offload_segment_bytes: Annotated[int, msgspec.Meta(ge=4096)] = 16 * 2**20
    #: Host-memory tier size in bytes (0 = no host tier).
    host_tier_bytes: Annotated[int, msgspec.Meta(ge=0)] = 256 * 2**20
    #: How long a tier waits before trying again: the disk tier after it failed (I/O error, full
    #: file system), host-tier evictions the coordinator did not decide or refused (a lease pins them).
    tier_retry_ms: Annotated[int, msgspec.Meta(ge=10, le=600_000)] = 5000
    hit_validation: HitValidation = msgspec.field(default_factory=HitValidation)
    on_invalid: Literal["refill", "error"] = "refill"
    #: How long a request waits, before its lease, with no prompt computed on this worker, for
    #: prompt blocks another request here is computing and will commit (``worker.inflight``: a
    #: burst of requests sharing a prefix nobody has cached, such as a system prompt), so that it
    #: reads them once instead of computing them again; while prompts are computed it waits on
    #: (its claimant runs first anyway), and past the bound it computes them itself. 0: never waits. Watch
    #: ``kvl_worker_prefix_waits_total`` and ``kvl_worker_prefix_wait_seconds``.
    prefix_wait_ms: Annotated[int, msgspec.Meta(ge=0, le=60_000)] = 1000
    #: Precision cached state is stored in — pools, host and disk tiers (``worker.model.storage``):
    #: ``auto`` = the model's own (float32 for the DeepSeek-V4 hybrid, the compute dtype for dense
    #: models), ``bfloat16`` / ``float16`` (half the bytes of float32), ``float8_e4m3fn`` (fp8 codes
    #: and one power-of-two scale per 32 values: 0.26 of float32). A request reads its own rows as
    #: stored, so a warm run equals a cold one at the same setting; changing it changes the namespace.
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float8_e4m3fn"] = "auto"
    #: Prefill unit in blocks when the model's ops are NOT batch-invariant (the start-up probe
    #: failed, or more than one torch thread): then a resume must start on this grid to compute
    #: exactly what a cold run computes. With invariant ops (the default here) prompts are cut
    #: by ``service.max_batch_tokens`` and a resume may start at any block.
    chunk_blocks: PosInt = 1


#: The largest ``service.max_batch_tokens`` accepted (benches that sweep it use the same bound).
MAX_BATCH_TOKENS = 65536


class ServiceConfig(_Section):
    max_concurrency: PosInt = 32
    max_context_length: PosInt = 8192
    cache_reserve_ratio: Fraction = 0.7
    batch_window_ms: Annotated[int, msgspec.Meta(ge=0)] = 20
    #: Token budget of one model forward: every decoding request's next token, then prompt
    #: pieces (whole blocks) in priority/arrival order until it is spent (``worker.stepper``).
    #: Larger: more prompts share a forward (throughput and time to first token under load);
    #: smaller: a decode token waits less behind others' prompt rows (inter-token latency).
    #: The start-up probe checks products this large (docs/BENCHMARKS.md, stop 42).
    max_batch_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_BATCH_TOKENS)] = 1024
    #: Most prompt tokens a forward may carry while it also runs decode tokens (rounded to whole
    #: blocks, at least one, so prompts still advance); 0: only ``max_batch_tokens`` bounds them.
    #: Smaller: a decoding request waits less between tokens while others' prompts run, and a
    #: waiting prompt's first token comes later; forwards of prompts alone (a burst of arrivals)
    #: keep the whole budget (``worker.stepper``). At 128 in the serving bench (c = 32): p99 gap
    #: between tokens halved, time to first token doubled, ~10 % fewer tokens/s (BENCHMARKS.md).
    #: Watch ``kvl_worker_inter_token_latency_seconds`` against ``kvl_worker_time_to_first_token_seconds``.
    max_prompt_tokens_with_decodes: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 0
    #: Every this many fused forwards, one of its requests also runs alone on a copy of its
    #: state and must give the same logits bits; a difference turns fusing off and drops the
    #: cache (``worker.stepper``). 0 turns the check off. Costs one request's forward in N.
    fused_check_every: Annotated[int, msgspec.Meta(ge=0)] = 64
    #: Forwards run at once on a CPU worker: a forward of at least ``service.lane_min_rows`` rows
    #: holding two or more requests is split by request into up to this many forwards, each on a
    #: thread of its own with one intra-op thread. Batch invariance gives every request the same
    #: bits in any split, so this is how a CPU worker uses more than one core exactly (more
    #: intra-op threads would not be batch-invariant). 0: automatic, 1 on CUDA (one stream runs
    #: the kernels in turn), 1 where the compiled product (``kernels.cpu_linear``) serves the
    #: products — it runs every core itself (``KVL_LINEAR_THREADS``), so two lanes only contend
    #: (docs/BENCHMARKS.md, issue 53) — and otherwise the usable cores, at most 2 (the most
    #: measured: docs/BENCHMARKS.md, stop 46). 1: every forward on the model thread alone.
    model_lanes: Annotated[int, msgspec.Meta(ge=0, le=16)] = 0
    #: Rows a forward needs before it is split into lanes: a small forward is bound by per-op
    #: overhead under one interpreter lock, and split it runs slower (``python -m bench.lanes``,
    #: 2 cores: 8 decode rows 0.45x on the tiny model, 0.9x 512 wide; 1,024 prompt rows 1.6x on
    #: the tiny model; 512 rows 1.3x 512 wide). Wider models gain from fewer rows.
    lane_min_rows: Annotated[int, msgspec.Meta(ge=2, le=65536)] = 512
    request_timeout_ms: PosInt = 60000
    queue_size: Annotated[int, msgspec.Meta(ge=0)] = 256
    #: Most samples one request may ask for (``n``, ``best_of``): each runs as its own request
    #: in the scheduler; all but the first decode a copy of the state the first one's prompt left.
    max_n: Annotated[int, msgspec.Meta(ge=1, le=128)] = 16
    queue_timeout_ms: PosInt = 30000
    #: Goodput under overload (``worker.scheduler``): a queued request is admitted only while the
    #: prompt tokens admitted but not yet prefilled, plus its own, can be prefilled at the worker's
    #: measured prefill rate within this share of the time each running request (and it) has left
    #: to its deadline after its own remaining tokens — so the first admitted finish instead of
    #: every request streaming behind the others' prompts to a 504 together. A queued request that
    #: could not finish even with all the time left is refused at once (429, Retry-After from the
    #: backlog). Smaller: more margin for a machine slower than measured, fewer prompts at once.
    #: 0: admission by ``max_concurrency`` alone.
    admission_prefill_share: Fraction = 0.5
    max_body_bytes: PosInt = 4 * 2**20
    #: Idle time allowed on a connection between requests, and the longest a client may take to
    #: send a request's headers (slower connections are closed).
    keepalive_timeout_ms: PosInt = 15000
    #: Time allowed to receive a request body once its headers are in; slower is a 408.
    body_read_timeout_ms: PosInt = 10000
    #: How tool calls are read from chat output (``shared.text.tool_calls``): ``auto`` = the syntax the
    #: chat template renders (``<tool_call>`` → hermes, ``[TOOL_CALLS]`` → mistral, Llama 3's
    #: ``"parameters"`` → llama3_json; ``builtin`` for kvledger's own template), or one named; ``none``
    #: = never (``tool_choice`` ``required`` and named functions are then refused).
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral", "builtin", "none"] = "auto"
    #: Largest image a chat request may carry, in bytes of the encoded file (a ``data:`` URL's
    #: decoded payload, checked on its base64 length before decoding; or a fetched file).
    max_image_bytes: PosInt = 4 * 2**20
    #: Most pixels (width × height, read from the image's header before decoding) one image may have.
    max_image_pixels: PosInt = 4096 * 4096
    #: Most images one chat request may carry (each adds the vision encoder's patch count of tokens).
    max_images_per_request: PosInt = 8
    #: Fetch ``http(s)`` image URLs (aiohttp, at most 3 redirects, ``max_image_bytes``, within
    #: ``image_fetch_timeout_ms``). False: only ``data:`` URLs; a remote URL is a 400 saying so. Lets
    #: clients make the worker fetch any URL it can reach: enable only where that is acceptable.
    allow_remote_images: bool = False
    #: Time allowed to fetch one remote image (connect, redirects and body), when allowed.
    image_fetch_timeout_ms: PosInt = 10000
    #: Most bytes one image may take decoded (width × height × channels × bytes per channel after
    #: the mode conversion, per frame): checked from the header before the pixels are decoded.
    max_image_decoded_bytes: PosInt = 64 * 2**20
    #: Most frames an animated GIF / WebP / PNG may declare (only the first is read).
    max_image_frames: PosInt = 256
    #: Structured output (``worker.structured``): most bytes of a grammar, regex, JSON schema or
    #: choice list (all choices together), as sent; more is a 400 naming this key.
    structured_max_bytes: PosInt = 256 * 1024
    #: Most strings a ``structured_outputs.choice`` list may hold.
    structured_max_choices: PosInt = 10000
    #: Most levels of objects / arrays inside each other in a JSON schema (and a tool's parameters).
    structured_max_schema_depth: PosInt = 32
    #: Time one grammar may take to compile (in a child process, off the event loop); past it the
    #: child is killed and the request answered 400 naming this key.
    structured_compile_timeout_ms: PosInt = 5000
    #: Child processes that compile grammars (started on first use; ~30 MB each).
    structured_compile_processes: Annotated[int, msgspec.Meta(ge=1, le=16)] = 2
    #: Address-space limit of each compiler child, MiB (0: none); a grammar past it is a 400.
    structured_compile_memory_mb: Annotated[int, msgspec.Meta(ge=0)] = 1024
    #: Compiled grammars kept by content, measured in their source bytes (a compiled grammar holds
    #: ~100x its source in memory); a repeated grammar is not compiled again.
    structured_cache_bytes: Annotated[int, msgspec.Meta(ge=0)] = 2 * 2**20


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


class WorkerConfig(_Section):
    worker_id: str = ""
    host: str = "127.0.0.1"
    port: Port = 8400
    #: The URL the gateway reaches this worker's API at (recorded with its registration), e.g.
    #: ``http://worker-0:8400`` in a container network. Empty: ``http://<host>:<port>`` as bound, or
    #: the machine's host name in place of a wildcard ``host`` (``0.0.0.0``, ``::``), which no
    #: other machine can connect to.
    advertise_url: Annotated[str, msgspec.Meta(pattern=r"^(https?://[^\s/]+)?\Z")] = ""
    #: ``cpu``, ``cuda``, ``cuda:N``.
    device: str = "cpu"
    #: A checkpoint directory as transformers' ``save_pretrained`` writes it (DeepseekV4, Llama,
    #: Qwen2, Qwen3 ForCausalLM; or kvledger's own format); empty = the tiny seeded model.
    model_dir: str = ""
    #: Dtype the weights are loaded and computed in: ``auto`` = the checkpoint config's ``dtype``
    #: (or ``torch_dtype``), float32 for the built-in model.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    #: Refuse to start on a ``model_dir`` without ``kvledger-manifest.json`` (``kvledger model manifest
    #: DIR`` writes it). A manifest that is present is always verified, and any checkpoint's digest
    #: enters the cache namespace.
    require_manifest: bool = False
    #: Memory the pools may take in bytes; cache_reserve_ratio of it goes to cached forms. Unset
    #: (the default): sized at start from the memory left after the weights — free device memory
    #: on a GPU, MemAvailable on a CPU — × ``worker.cache_memory_fraction`` (capped on a CPU by
    #: ``worker.cpu_pool_max_bytes``); the worker logs what that holds (``pools_sized``).
    pool_bytes: PosInt | None = None
    #: When ``pool_bytes`` is unset: the share of the memory left after the weights the pools take
    #: (as vLLM's gpu_memory_utilization, but of what is free once the weights are loaded; the
    #: rest is for activations and everything else). Several workers on one GPU: set pool_bytes.
    cache_memory_fraction: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.8
    #: When ``pool_bytes`` is unset and the device is the CPU: the most the pools take, unless
    #: twice ``service.max_concurrency`` requests of ``capacity_check_tokens`` need more (then that:
    #: a real model's cache holds the requests the worker admits and what they leave for their
    #: next turns). RAM is shared with every other
    #: process (other workers, the test suite's many workers); 0 = no cap.
    cpu_pool_max_bytes: Annotated[int, msgspec.Meta(ge=0)] = 2**30
    outbox_max: PosInt = 100_000
    outbox_resend_ms: PosInt = 2000
    #: Transitions per JetStream message (a ``transitions`` batch, at most 1000); 1 sends one
    #: message per transition, which is what a coordinator older than the batch message reads
    #: (upgrade the coordinators first, or set 1 until they are).
    publish_batch: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 256
    #: Serve the NATS debug subjects (generate with logits, health, metrics, flush) for tests and
    #: operators. Off by default: ``generate`` bypasses the HTTP API's admission control; its
    #: tenant comes only from an API key, as over HTTP.
    debug_subjects: bool = False
    #: Tokens (prompt + output) of a typical request, for the start-up capacity check: a worker whose
    #: pools cannot hold ``service.max_concurrency`` such requests at once warns (``pool_capacity_low``),
    #: naming the key to raise and by how much — past that, requests are refused their leases
    #: (``over_capacity``) and recompute uncached. 0: no check. At most the maximum context.
    capacity_check_tokens: Annotated[int, msgspec.Meta(ge=0)] = 1024
    #: While serving: at most one ``cache_over_capacity`` warning per this many seconds, when leases
    #: were refused ``over_capacity`` since the last one (``worker.capacity``).
    capacity_warning_interval_s: Annotated[float, msgspec.Meta(gt=0, le=86_400)] = 60.0
    #: Client addresses the worker's HTTP API answers, as networks in CIDR form (``10.0.0.0/8``,
    #: ``192.168.1.7``, ``fd00::/8``); anyone else gets a 403 before the API key is looked at
    #: (``shared.address_allowlist``: the TCP peer's address; a gateway or proxy in front must be
    #: listed, forwarded-for headers are not trusted). Empty (the default): every address.
    allowed_networks: list[str] = []
    #: The version this worker reports (``GET /version``), which the gateways' ``gateway.version_weights``
    #: route by during a gradual rollout; empty: the installed kvledger package's version.
    version: Annotated[str, msgspec.Meta(max_length=64, pattern=r"^[A-Za-z0-9._+\-]*\Z")] = ""

    def __post_init__(self) -> None:
        parse_networks("worker.allowed_networks", self.allowed_networks)


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
