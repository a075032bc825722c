"""Tracing benchmark: what request tracing costs on the request path, off and on.

**Requests.** The coordinator, a worker (the tiny model) and the gateway run in this process, one
event loop, on real sockets (PostgreSQL and NATS behind the coordinator); a client sends warm
completions through the gateway one at a time (a 3-block cached prefix, ``max_tokens`` 1: route
query, lease, validation, restore, a one-block prefill, commit, release — the path with the most
spans per millisecond). Blocks of requests alternate between three modes on the same stack:
``off``, ``on`` (every request traced; the OTLP/HTTP exporter sends to a local sink process) and
``unsampled`` (on with ``sample_ratio`` 0: spans exist but record nothing). Per mode: the latency
(client-side wall clock) and the process's CPU time per request — all three services, the model
thread and, for ``on``, the exporter's thread (its batches are flushed inside the block's
window), which is what tracing costs whatever else the machine runs. The stack is built with
tracing on (the HTTP middleware is installed at build) and switched off between blocks, so
``off`` still passes the middleware — one path check and a no-op call per request.

**Off, bounded.** A process built with tracing off runs no middleware and makes no span: what
remains is the helpers' no-op calls, timed in a loop (``span_off_ns``, ``headers_off_ns``) and
counted per request (``spans_per_request``): ``off_bound_us_per_request``.

**Per span.** ``span()`` on (recorded, batched for export, the exporter's thread sharing the
GIL) and unsampled; ``headers()`` (inject) and ``extract()``.

    python -m bench.tracing            # 12 blocks × 40 requests per mode
    python -m bench.tracing --quick    # 4 blocks × 25, within ~60 s

Services: ``--database-url``/``--nats-url`` (default ``$KVL_DATABASE_URL``/``$KVL_NATS_URL``), else
embedded ones are started. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

MODES = ("off", "on", "unsampled")
PROMPT = "the ledger records every state change of every cached block. " * 3

#: A local OTLP/HTTP endpoint: answers 200 to every POST and counts the bytes (run as its own process,
#: as a collector would be, so that it takes nothing from the measured loop).
SINK = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    n = 0
    def do_POST(self):
        H.n += int(self.headers.get("Content-Length", 0)); self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200); self.send_header("Content-Type", "application/x-protobuf"); self.end_headers()
    def do_GET(self):
        b = str(H.n).encode(); self.send_response(200); self.end_headers(); self.wfile.write(b)
    def log_message(self, *a): pass
s = http.server.HTTPServer(("127.0.0.1", 0), H); print(s.server_address[1], flush=True); s.serve_forever()
"""


def _log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


@contextlib.asynccontextmanager
async def stack(database_url: str, nats_url: str, tmp: Path, tracing_doc: dict[str, Any]) -> AsyncIterator[str]:
    """Coordinator, worker and gateway in this loop, on a fresh database and subject prefix; yields the gateway URL."""
    import asyncpg
    from aiohttp import web

    from gateway.app import Gateway
    from gateway.app import create_app as gateway_app
    from shared import tracing
    from shared.config import parse_config
    from shared.subjects import Subjects
    from shared.text.chat_template import load_chat_template
    from shared.text.tokenizer import load_tokenizer
    from worker.client.nats_adapter import NatsCoordinatorClient
    from worker.engine import Engine
    from worker.http_server import bound_address, start_http
    from worker.model import build_model
    from coordinator.app import create_app as coordinator_app

    admin = database_url.replace("postgresql+asyncpg://", "postgresql://")
    name = f"kvl_bench_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(admin)
    await conn.execute(f'CREATE DATABASE "{name}"')
    await conn.close()
    subjects = Subjects(prefix=f"kvlb{uuid.uuid4().hex[:10]}")
    cfg = parse_config({
        "database": {"url": admin.rpartition("/")[0] + "/" + name},
        "nats": {"url": nats_url, "subject_prefix": subjects.prefix},
        "cache": {"chunk_blocks": 1, "host_tier_bytes": 0},
        "worker": {"worker_id": "w1", "pool_bytes": 32 * 2**20, "port": 0},
        "service": {"batch_window_ms": 0}, "logging": {"format": "json", "level": "warning"},
        "tracing": tracing_doc, "state_dir": str(tmp / "state")})
    tracing.setup(cfg.tracing, "bench")
    try:
        async with contextlib.AsyncExitStack() as es:
            runner = web.AppRunner(coordinator_app(cfg), access_log=None)
            es.push_async_callback(runner.cleanup)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            engine = Engine(build_model(seed=0), cfg, NatsCoordinatorClient(nats_url, subjects))
            es.push_async_callback(engine.stop)
            http = await start_http(engine, cfg)
            es.push_async_callback(http.cleanup)
            host, port = bound_address(http)
            engine.endpoint = f"http://{host}:{port}"
            await engine.start(wait_s=30)
            gw = Gateway(cfg, load_tokenizer("", 2**31), load_chat_template(""))
            es.push_async_callback(gw.stop)
            await gw.start()
            gr = web.AppRunner(gateway_app(gw), access_log=None)
            es.push_async_callback(gr.cleanup)
            await gr.setup()
            await web.TCPSite(gr, "127.0.0.1", 0).start()
            host, port = bound_address(gr)
            yield f"http://{host}:{port}"
    finally:
        tracing.shutdown()
        conn = await asyncpg.connect(admin)
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.close()


async def requests(http: Any, url: str, n: int) -> list[float]:
    """Latency (ms) of ``n`` warm completions through the gateway."""
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    out: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        async with http.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            doc = await r.json()
        assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def per_span_ns(loops: int, endpoint: str) -> dict[str, float]:
    """The helpers' own cost (ns per call), off, on (recorded, batched to ``endpoint``) and unsampled."""
    from shared import tracing
    from shared.config import TracingConfig

    def timed(fn: Any) -> float:
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for _ in range(loops):
                fn()
            best = min(best, (time.perf_counter_ns() - t0) / loops)
        return round(best, 1)

    def one_span() -> None:
        with tracing.span("worker.lease", {"kvl.blocks": 3}) as s:
            s.set_attribute("kvl.usable_blocks", 3)

    carrier = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}
    out = {"span_off_ns": timed(one_span), "headers_off_ns": timed(tracing.headers)}

    for mode, ratio in (("on", 1.0), ("unsampled", 0.0)):
        # as a process runs it (batch processor, OTLP exporter), with room for every span of the loop
        tracing.setup(TracingConfig(enabled=True, otlp_endpoint=endpoint, sample_ratio=ratio,
                                    max_queue_size=10 * loops, schedule_delay_ms=200), "bench")
        out[f"span_{mode}_ns"] = timed(one_span)
        with tracing.span("worker.request"):
            out[f"headers_{mode}_ns"] = timed(tracing.headers)
        out[f"extract_{mode}_ns"] = timed(lambda: tracing.extract(carrier))
        tracing.shutdown()
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from shared import tracing
    from shared.config import TracingConfig
    from shared.embedded import start_services

    svc = None
    database_url, nats_url = args.database_url, args.nats_url
    tmp = Path(tempfile.mkdtemp(prefix="kvl-bench-tracing-"))
    if not (database_url and nats_url):
        svc = await asyncio.to_thread(start_services, database_url, nats_url, str(tmp / "services"))
        database_url, nats_url = svc.database_url, svc.nats_url
    sink = subprocess.Popen([sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
    assert sink.stdout is not None
    endpoint = f"http://127.0.0.1:{sink.stdout.readline().strip()}/v1/traces"
    configs = {"on": TracingConfig(enabled=True, otlp_endpoint=endpoint),
               "unsampled": TracingConfig(enabled=True, otlp_endpoint=endpoint, sample_ratio=0.0)}
    lat: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}     # per block: CPU ms per request
    gcs: dict[str, list[int]] = {m: [] for m in MODES}       # per block: generation-1 and -2 collections
    try:
        async with stack(database_url, nats_url, tmp, {"enabled": True, "otlp_endpoint": endpoint}) as url, \
                aiohttp.ClientSession() as http:
            tracing.shutdown()
            body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
            for _ in range(2):                                  # fill the cache
                async with http.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
            await requests(http, url, 5)                        # warm up
            for b in range(args.blocks):
                for mode in (MODES if b % 2 == 0 else tuple(reversed(MODES))):
                    if mode != "off":
                        tracing.setup(configs[mode], "bench")
                    c0, g0 = time.process_time(), gc.get_stats()
                    got = await requests(http, url, args.requests)
                    tracing.shutdown()                          # flushes the block's spans: in its CPU window
                    cpu[mode].append((time.process_time() - c0) * 1e3 / args.requests)
                    gcs[mode] += [b["collections"] - a["collections"] for a, b in zip(g0, gc.get_stats())][1:]
                    lat[mode] += got
                _log(f"block {b}: " + ", ".join(f"{m} {statistics.median(lat[m][-args.requests:]):.2f} ms "
                                                f"{cpu[m][-1]:.2f} cpu-ms" for m in MODES))
            kept = InMemorySpanExporter()                       # how many spans one request makes
            tracing.setup(TracingConfig(), "bench", exporter=kept)
            await requests(http, url, 1)
            await asyncio.sleep(0.2)                            # the coordinator ends a span after its reply
            tracing.shutdown()
            spans_per_request = len(kept.get_finished_spans())
        import urllib.request
        exported = int(urllib.request.urlopen(endpoint).read())
        spans = per_span_ns(args.loops, endpoint)
    finally:
        sink.terminate()
        if svc is not None:
            await asyncio.to_thread(svc.stop)
        shutil.rmtree(tmp, ignore_errors=True)

    out: dict[str, Any] = {"bench": "tracing", "requests_per_mode": len(lat["off"]), "blocks": args.blocks,
                           "otlp_bytes_exported": exported, "spans_per_request": spans_per_request}
    for m in MODES:
        out[f"{m}_p50_ms"] = round(statistics.median(lat[m]), 3)
        out[f"{m}_p90_ms"] = round(statistics.quantiles(lat[m], n=10)[8], 3)
        out[f"{m}_cpu_ms_per_request"] = round(statistics.median(cpu[m]), 3)
        # the garbage collector's older generations, per 1000 requests (spans are objects too)
        out[f"{m}_gc_gen2_per_1000"] = round(1000 * sum(gcs[m][1::2]) / len(lat[m]), 1)
    for m in ("on", "unsampled"):
        # per block pair: this mode's CPU per request minus off's, measured back to back
        diffs = [a - b for a, b in zip(cpu[m], cpu["off"])]
        out[f"{m}_minus_off_cpu_ms"] = round(statistics.median(diffs), 3)
        q = statistics.quantiles(diffs, n=4)
        out[f"{m}_minus_off_cpu_ms_iqr"] = [round(q[0], 3), round(q[2], 3)]
        out[f"{m}_minus_off_cpu_pct"] = round(100 * statistics.median(diffs) / statistics.median(cpu["off"]), 2)
        out[f"{m}_minus_off_p50_ms"] = round(statistics.median(lat[m]) - statistics.median(lat["off"]), 3)
    out.update(spans)
    # NOTE: the helpers' no-op calls a request makes with tracing off: one span() per span it
    # would have made (the gateway's and the worker's; the coordinator's make none) and a
    # headers() per NATS request or forward — generously, as many as spans.
    out["off_bound_us_per_request"] = round(spans_per_request * (spans["span_off_ns"] + spans["headers_off_ns"]) / 1e3,
                                            2)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.tracing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 blocks × 25 requests per mode")
    ap.add_argument("--blocks", type=int, help="blocks per mode (default 12, quick 4)")
    ap.add_argument("--requests", type=int, help="requests per block (default 40, quick 25)")
    ap.add_argument("--loops", type=int, default=20000, help="calls per per-span timing")
    ap.add_argument("--database-url", default=os.environ.get("KVL_DATABASE_URL", ""))
    ap.add_argument("--nats-url", default=os.environ.get("KVL_NATS_URL", ""))
    args = ap.parse_args(argv)
    args.blocks = args.blocks or (4 if args.quick else 12)
    args.requests = args.requests or (25 if args.quick else 40)
    import torch

    from shared.logging import configure_logging
    torch.set_num_threads(1)
    configure_logging("json", "warning", stream=sys.stderr)
    out = asyncio.run(run(args))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
