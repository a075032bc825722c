"""The worker process: ``python -m worker [--config FILE] [--worker-id ID]`` (``kvledger worker``).

Runs the cache engine against the coordinator over NATS and serves the OpenAI-compatible
HTTP API on ``worker.host:worker.port`` (:mod:`worker.http_server`). So that tests and
operators can drive the engine directly, it also answers a few NATS request/reply subjects
when ``worker.debug_subjects`` is on (off by default)::

    <prefix>.worker.<id>.debug.generate   {"tokens": [...], "max_tokens": 4, "api_key": "sk-…",
                                           "reuse": true, "return_logits": true}
    <prefix>.worker.<id>.debug.health     {}
    <prefix>.worker.<id>.debug.metrics    {}      (Prometheus text)
    <prefix>.worker.<id>.debug.flush      {"timeout_s": 5}

``generate`` names its tenant the way the HTTP API does, by an API key (none needed when no
keys are configured): a tenant *name* is refused, so the subject cannot read another tenant's
cache. Replies are JSON; logits travel as base64 of little-endian float32 with their shape, so a
test can compare them bit for bit. ``KVL_TORCH_THREADS`` sets torch's intra-op threads
(default 1: the tiny model is overhead-bound, and a fixed count keeps bits reproducible).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import gc
import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch

from shared import nats_auth, tracing
from shared.config import Config, ConfigError, load_config, nats_servers
from shared.key_rotation import KeyReloader, config_loader
from shared.logging import configure_logging, get_logger, mask_credentials
from shared.manifest import ManifestError
from shared.shards import shard_subjects
from shared.subjects import Subjects
from shared.tls import client_context
from shared.text.chat_template import load_chat_template
from shared.text.checkpoint_files import CheckpointFileError
from worker.client.nats_adapter import NatsCoordinatorClient
from worker.engine import Engine
from worker.generation import SamplingParams
from shared.text.generation_config import load_generation_config
from worker.api.keys import TENANTS
from worker.http_server import bound_address, start_http
from worker.model import CausalLM, build_model
from worker.model.checkpoint import DTYPES, CheckpointError, load_checkpoint
from worker.model.storage import StorageError
from worker.model.weights import WeightsError
from worker.settings import PoolSizeError, worker_id
from worker.cache.retention import resolve_at_start
from shared.tenants import AuthError, TenantDirectory
from shared.text.tokenizer import load_tokenizer

log = get_logger("kvl.worker.main")


def load_model(cfg: Config) -> CausalLM:
    """``worker.model_dir`` (a ``save_pretrained`` directory, :mod:`worker.model.checkpoint`), else the
    tiny seeded model. Raises ``CheckpointError`` / ``WeightsError`` / ``ManifestError`` naming what
    is wrong; the caller prints it and exits."""
    if not cfg.worker.model_dir:
        dtype = DTYPES["float32" if cfg.worker.dtype == "auto" else cfg.worker.dtype]
        return build_model(seed=0).to(device=torch.device(cfg.worker.device), dtype=dtype)
    loaded = load_checkpoint(cfg.worker.model_dir, dtype=cfg.worker.dtype, require_manifest=cfg.worker.require_manifest,
                             device=cfg.worker.device)
    log.info("model_loaded", family=loaded.family, model_id=loaded.model.cfg.model_id,
             dtype=str(loaded.dtype).removeprefix("torch."), digest=loaded.model.checkpoint_digest[:16])
    return loaded.model


def advertised_endpoint(worker: Any, host: str, port: int) -> str:
    """The URL the coordinator records for the gateway: ``worker.advertise_url``, else the bound
    address — with the machine's host name for a wildcard bind, which is no address to connect to."""
    if worker.advertise_url:
        return worker.advertise_url
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
        log.warning("advertising_hostname", host=host, port=port,
                    note="worker.host is a wildcard: set worker.advertise_url to the URL the gateway reaches")
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def debug_subject(subjects: Subjects, worker_id: str, what: str) -> str:
    return f"{subjects.prefix}.worker.{worker_id}.debug.{what}"


def encode_logits(t: torch.Tensor | None) -> dict[str, Any]:
    if t is None:
        return {"logits_b64": None, "logits_shape": None}
    x = t.detach().to(torch.float32).contiguous().cpu()
    return {"logits_b64": base64.b64encode(x.numpy().tobytes()).decode(), "logits_shape": list(x.shape)}


def decode_logits(reply: dict[str, Any]) -> torch.Tensor | None:
    if not reply.get("logits_b64"):
        return None
    raw = bytearray(base64.b64decode(reply["logits_b64"]))
    return torch.frombuffer(raw, dtype=torch.float32).reshape(reply["logits_shape"]).clone()


class DebugService:
    """The worker's debug subjects, on a NATS connection of their own."""

    def __init__(self, engine: Engine, url: str, subjects: Subjects, tenants: TenantDirectory,
                 tls: Any = None, auth: dict[str, Any] | None = None) -> None:
        self.engine = engine
        self.auth = dict(auth or {})
        self.url = url
        self.subjects = subjects
        self.tenants = tenants
        self.tls = tls
        self._nc: Any = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        import nats
        self._nc = await nats.connect(nats_servers(self.url), name=f"kvl-worker-debug-{self.engine.worker_id}",
                                      **({"tls": self.tls} if self.tls is not None else {}),
                                      max_reconnect_attempts=-1, reconnect_time_wait=0.5, **self.auth)
        for what, handler in (("generate", self._generate), ("health", self._health),
                              ("metrics", self._metrics), ("flush", self._flush)):
            await self._nc.subscribe(debug_subject(self.subjects, self.engine.worker_id, what),
                                     cb=self._spawn(handler))

    def _spawn(self, handler):
        async def cb(msg: Any) -> None:
            t = asyncio.get_running_loop().create_task(self._answer(handler, msg))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        return cb

    async def _answer(self, handler, msg: Any) -> None:
        try:
            req = json.loads(msg.data or b"{}")
            out = await handler(req)
        except Exception as e:  # noqa: BLE001 - a debug call reports any failure to its caller
            out = {"error": f"{type(e).__name__}: {e}"}
        if msg.reply:
            body = out if isinstance(out, bytes) else json.dumps(out).encode()
            with contextlib.suppress(Exception):
                await self._nc.publish(msg.reply, body)

    async def _generate(self, req: dict[str, Any]) -> dict[str, Any]:
        if "tenant" in req:
            raise ValueError("the debug subject takes an 'api_key' (as the HTTP API's bearer key), never a tenant name")
        key = req.get("api_key")
        try:
            tenant = self.tenants.authenticate(f"Bearer {key}" if key else None)
        except AuthError as e:
            return {"error": f"unauthorized: {e}"}
        # one trace per request here too: the session's spans need a request span to hang under
        with tracing.span("worker.request", {"kvl.worker_id": self.engine.worker_id, "kvl.tenant": tenant.id,
                                             "kvl.debug_subject": True}, kind=tracing.SERVER):
            r = await self.engine.generate(
                [int(t) for t in req["tokens"]], tenant=tenant.id,
                max_tokens=int(req.get("max_tokens", 16)), reuse=bool(req.get("reuse", True)),
                sampling=SamplingParams(temperature=float(req.get("temperature", 0.0)),
                                        top_k=int(req.get("top_k", 0)), seed=req.get("seed")),
                return_logits=bool(req.get("return_logits", True)))
        out = {k: getattr(r, k) for k in ("tokens", "prompt_tokens", "cached_tokens", "hit_tokens", "validated",
                                          "invalid", "fallbacks", "reloaded", "degraded", "epoch", "ttft_s")}
        out.update(encode_logits(r.logits))
        return out

    async def _health(self, req: dict[str, Any]) -> dict[str, Any]:
        return dataclasses.asdict(self.engine.health())

    async def _metrics(self, req: dict[str, Any]) -> bytes:
        return self.engine.metrics.render()

    async def _flush(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"flushed": await self.engine.flush(float(req.get("timeout_s", 5.0)))}

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._nc.drain(), 2)


def set_switch_interval(cfg: Config) -> None:
    """``worker.gil_switch_interval_ms`` as this process's switch interval: how long the model thread may
    wait for the GIL behind the event loop's Python each time a torch call returns."""
    sys.setswitchinterval(cfg.worker.gil_switch_interval_ms / 1000)


async def serve(cfg: Config, reload: Callable[[], Config] | None = None, config_path: str | None = None) -> int:
    if not cfg.nats.url:
        print("kvledger worker: config key nats.url is required (the coordinator's NATS server)", file=sys.stderr)
        return 2
    torch.set_num_threads(int(os.environ.get("KVL_TORCH_THREADS", "1")))
    set_switch_interval(cfg)
    try:
        # The checkpoint's text side first: a bad template or generation config refuses in
        # milliseconds, not after the weights have been read and hashed.
        chat_template = load_chat_template(cfg.worker.model_dir)
        sampling = load_generation_config(cfg.worker.model_dir).sampling_defaults()
        model = load_model(cfg)
        tokenizer = load_tokenizer(cfg.worker.model_dir, model.cfg.vocab_size)
    except (CheckpointError, CheckpointFileError, WeightsError, ManifestError) as e:
        print(f"kvledger worker: cannot load the model: {e}", file=sys.stderr, flush=True)
        return 2
    subjects = Subjects(cfg.nats.subject_prefix)
    try:
        auth = nats_auth.connect_kwargs(cfg.nats)
    except nats_auth.AuthConfigError as e:
        print(f"kvledger worker: {e}", file=sys.stderr)
        return 2
    client = NatsCoordinatorClient(cfg.nats.url, subjects, timeout_s=cfg.nats.request_timeout_ms / 1000,
                                   tls=client_context(cfg.tls), auth=auth)
    # a sharded ledger: one client per other shard, on its subjects (worker.shard_links)
    shard_clients = [NatsCoordinatorClient(cfg.nats.url, shard_subjects(cfg.nats.subject_prefix, k),
                                           timeout_s=cfg.nats.request_timeout_ms / 1000, tls=client_context(cfg.tls),
                                           auth=auth) for k in range(1, cfg.coordinator.shards)]
    # the disk tier's bound: cache.offload_dir_bytes, else a share of the file system's free space
    cfg = resolve_at_start(cfg, worker_id(cfg), log)
    try:
        engine = Engine(model, cfg, client, shard_clients=shard_clients)
    except StorageError as e:   # cache.dtype this model's forms cannot be stored in
        print(f"kvledger worker: config key cache.dtype: {e}", file=sys.stderr, flush=True)
        return 2
    except PoolSizeError as e:  # pools sized from memory too small for one request of the maximum context
        print(f"kvledger worker: {e}", file=sys.stderr, flush=True)
        return 2
    if cfg.nats.user and cfg.nats.user != nats_auth.worker(engine.worker_id).user:
        print(f"kvledger worker: config key nats.user: worker {engine.worker_id} connects as "
              f"{nats_auth.worker(engine.worker_id).user!r}, not {cfg.nats.user!r} (NATS lets each identity act "
              "only on its own subjects)", file=sys.stderr)
        return 2
    client.name = f"kvl-worker-{engine.worker_id}"
    for k, other in enumerate(shard_clients, 1):
        other.name = f"kvl-worker-{engine.worker_id}-s{k}"
    tracing.setup(cfg.tracing, "worker", instance=engine.worker_id)     # before the app: its middleware
    debug = DebugService(engine, cfg.nats.url, subjects, TenantDirectory.from_config(cfg.auth),
                         client_context(cfg.tls), auth) if cfg.worker.debug_subjects else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # NOTE: bind HTTP before registering, so the endpoint the coordinator records is the
    # bound one (worker.port 0 = any free port); /readyz says "not ready" until registered.
    try:
        http = await start_http(engine, cfg, tokenizer=tokenizer, chat_template=chat_template, sampling=sampling)
    except (OSError, ValueError) as e:  # port taken, unusable tokenizer or API keys
        print(f"kvledger worker: cannot serve HTTP on {cfg.worker.host}:{cfg.worker.port}: {e}", file=sys.stderr,
              flush=True)
        return 2
    engine.endpoint = advertised_endpoint(cfg.worker, *bound_address(http))
    # SIGHUP or a changed file: the API keys are read again (old ones kept for auth.rotation_grace_s).
    # NOTE: installed before the first await after "listening on": the API answers from then on,
    # and a SIGHUP that came during registration was lost (ignored under nohup, else it killed
    # the worker), so a key rotated then was never picked up (a CI failure of test_key_rotation)
    reloader = KeyReloader(reload, cfg, log, path=config_path or os.environ.get("KVL_CONFIG"),
                           directories=(http.app[TENANTS], *((debug.tenants,) if debug else ())),
                           counter=engine.metrics.auth_reloads) if reload else None
    if reloader is not None:
        reloader.start()
    await engine.start(wait_s=0)
    try:
        if debug is not None:
            await debug.start()
            log.warning("debug_subjects_enabled", subject=debug_subject(subjects, engine.worker_id, "*"),
                        note="anyone who may publish there can run requests (API keys still apply)")
    except Exception as e:  # noqa: BLE001 - NATS unreachable at start
        print(f"kvledger worker: cannot reach NATS at {mask_credentials(cfg.nats.url)}: {e}", file=sys.stderr, flush=True)
        if reloader is not None:
            await reloader.stop()
        await http.cleanup()
        await engine.stop()
        return 2
    # NOTE: what exists now — the model's modules and parameters, torch's and every library's
    # modules, the engine — lives until exit: the cyclic collector need not walk it again. Left
    # in, its collections were ~2 % of a prefill's samples (gc_collect_main) on SmolLM2. Frozen
    # objects are still freed by reference counting.
    gc.collect()
    gc.freeze()
    log.info("worker_started", worker_id=engine.worker_id, namespace=engine.namespace, pools=engine.slots,
             gil_switch_interval_ms=round(sys.getswitchinterval() * 1000, 3),
             device=str(engine.device))
    print(f"kvledger worker {engine.worker_id} running", flush=True)
    await stop.wait()
    log.info("worker_stopping")
    if reloader is not None:
        await reloader.stop()
    await http.cleanup()
    if debug is not None:
        await debug.stop()
    await engine.stop()
    tracing.shutdown()      # the last spans flushed
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker", description="run a kvledger worker (cache engine)")
    p.add_argument("--config", "-c", help="YAML config file (default: $KVL_CONFIG, else built-in defaults)")
    p.add_argument("--worker-id", help="worker id (default: worker.worker_id, else <host>-<pid>)")
    args = p.parse_args(argv)
    try:
        overrides = {"worker.worker_id": args.worker_id} if args.worker_id else None
        cfg = load_config(args.config, overrides=overrides)
        configure_logging(cfg.logging.format, cfg.logging.level)
        return asyncio.run(serve(cfg, config_loader(args.config, overrides), args.config))
    except ConfigError as e:
        print(f"kvledger: configuration error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
