"""The worker's config sections (cache, service, worker): most of the keys, re-exported by shared.config."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from shared.address_allowlist import parse_networks
from shared.config_types import Fraction, Port, PosInt, _Section


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
    #: How a request's state takes a validated hit: ``always`` reads each block where the pool holds
    #: it — its slot pinned while the request runs (freed only after it ends, if evicted meanwhile),
    #: attention reading the blocks in place — instead of copying it; ``never`` copies; ``auto``
    #: reads in place when the state's buffers are new (a copy would first have the kernel fault in
    #: and zero every page it writes: ~80 ms a restore under load) and copies into buffers kept from
    #: an ended request (resident: a copy is cheap, and attention over one buffer is ~20 % faster than
    #: over 16-token blocks). Another family, rows stored rounded from the compute dtype, or no
    #: compiled attention: copied. Watch ``kvl_worker_restored_blocks_total`` and ``kvl_worker_pinned_slots``.
    restore_in_place: Literal["auto", "always", "never"] = "auto"


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
    #: Smaller: a decoding request waits less between tokens while others' prompts run, and the
    #: waiting prompts finish one after another, oldest first, instead of together at the end of
    #: one large forward; forwards of prompts alone (a burst of arrivals) keep the whole budget
    #: (``worker.stepper``). SmolLM2 on 2 cores, c = 8 chat turns: 256 cut the time to first token
    #: by a third against no cap at the same tokens/s (docs/BENCHMARKS.md, issue 53). Watch
    #: ``kvl_worker_inter_token_latency_seconds`` against ``kvl_worker_time_to_first_token_seconds``.
    max_prompt_tokens_with_decodes: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 256
    #: The cap above follows the load: it rises to this share of the prompt tokens waiting
    #: (``worker.stepper``), so a few prompts beside decodes run in pieces and a deep backlog in
    #: large forwards, whose decode rows cost less of the machine (a fixed 256 cost c = 32
    #: 5-16 % of its tokens/s; 0.25 did not). 0: a fixed cap.
    prompt_cap_backlog_share: Fraction = 0.25
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
    #: A request's prompt and decode loop as runs the stepper advances on the model thread
    #: (``worker.runs.PrefillRun``, ``worker.generation.DecodeRun``: the next piece planned and
    #: the next token sampled there, forward after forward, the event loop only streaming), instead
    #: of one step per forward handed in by the request's coroutine (false). On SmolLM2 on 2 cores
    #: (docs/BENCHMARKS.md, run O) runs cut the time to first token at c = 8 by about a third,
    #: at ~6 % fewer tokens/s and a longer gap between tokens (every forward carries the prompts'
    #: next pieces); at c = 32 the same tokens/s with fewer requests refused. Requests with a
    #: grammar always decode step by step.
    request_runs: bool = True
    #: On a CPU worker: build and restore each request's state on a thread of its own, beside the
    #: forwards, instead of on the model thread between them (a GPU worker always uses the model
    #: thread, its stream). On SmolLM2 on 2 cores at c = 8 (docs/BENCHMARKS.md, run O) it gave
    #: 7.5 % more tokens/s and a 25 % shorter gap between tokens, but a 35 % longer time to first
    #: token (a restore that shares the cores with the forward takes twice as long, and its request
    #: waits for it); at c = 32 no difference. Where cores sit idle beside the forward's it may gain
    #: more (not measured: every machine here has 2).
    state_thread: bool = False
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
    #: On a CPU: the most bytes of ended requests' K/V buffers kept for the next requests' states
    #: (``worker.model.recycle``), so a new state writes into pages already resident instead of
    #: pages the kernel must fault in and zero first (SmolLM2 at c = 32: a restore ~80 ms fresh,
    #: docs/BENCHMARKS.md). Held beside the pools; ``kvl_worker_kept_state_bytes`` shows it. 0: none.
    kept_state_bytes: Annotated[int, msgspec.Meta(ge=0)] = 2**30
    #: CPython's switch interval in the worker process (``sys.setswitchinterval``), in ms: how long a
    #: thread that wants the GIL waits before the holder is made to let go. The model thread takes
    #: the GIL back after every torch call, so Python on the event loop delays forwards by up to
    #: this much each time — but every forced switch also costs a wait for the other thread to be
    #: scheduled. Measured on 2 cores (docs/BENCHMARKS.md, run S): SmolLM2 at c = 1 served with a
    #: 0.5 ms interval had a 45 % longer gap between tokens than at 5 ms; 20 ms was level with 5;
    #: beside a loop running Python without pause a fused forward took 26x its time at 5 ms, 3.8x
    #: at 0.5 (``python -m bench.model_thread``). The default stays CPython's.
    gil_switch_interval_ms: Annotated[float, msgspec.Meta(ge=0.05, le=100.0)] = 5.0
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
