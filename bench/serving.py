"""Serving benchmark: a multi-turn agent workload over HTTP, prefix-cache reuse on vs off.

A real coordinator process (PostgreSQL and NATS behind it) and a real worker process
(``python -m worker``: engine + HTTP API, the configuration's defaults for the cache and
the scheduler, so ``cache.chunk_blocks`` = 4) serve streaming ``/v1/chat/completions``
requests sent by this process.

Workload: an *agent* is one conversation of ``turns`` turns. Its first prompt is a system
prompt (the same for every agent of a concurrency level, like an agent framework's
instructions and tool list) plus a task; every later turn appends the model's previous
reply and a new observation (a tool result), so each prompt extends the previous one —
long input, short output. ``c`` agents run at once (one request each in flight), for
``c`` in 1, 8 and 32; at ``c`` = 1 a few agents run one after the other.

Each level runs twice with the same prompts: reuse **on**, then **off** (the request
option ``cache_reuse: false``: no cache reads). The two runs use two API keys of two
tenants, so neither can read what the other wrote and both pay for writing every block
they compute (otherwise the second run would find its blocks already cached and skip the
commits). Greedy decoding, so an exact cache gives the same replies either way
(``outputs_identical``), and the two runs send exactly the same tokens.

What a turn can reuse: every whole block of the previous turns' prompts *and replies*
(the model's ops are batch-invariant, so a block completed by decode steps holds the bits a
prefill computes and is cached at the end of its request; ``next_turn_reuse_ratio`` is what
turn n+1 found cached over turn n's prompt + reply tokens). Requests run concurrently share
model forwards (``worker.stepper``): ``throughput_c8_vs_c1`` and ``throughput_c32_vs_c1``
are the gain of concurrency with reuse on. After the levels, ``bench.serving_bound`` times the
same requests' model work fused as the stepper fuses it, on this machine, and prints
``throughput_aligned_c<N>_vs_c1`` (the ratio were each level's requests fused in aligned groups),
``throughput_ceiling_c<N>_vs_c1`` (their model work spread perfectly over the usable cores: what
no schedule here passes) and ``throughput_c<N>_vs_aligned`` (how close the level came). Each
level also reports the CPU its requests cost, per request and per process of the stack
(``cpu_ms_per_request``: worker, coordinator, postgres, nats, bench — the servers counted by
name, other work on them included) and the model thread's busy time (``model_ms_per_request``);
``throughput_cpu_bound_c<N>_vs_c1`` is what the level's ratio could be at that CPU cost with
every usable core busy.

Per level and mode: ``throughput_tok_s`` (prompt + generated tokens per second of wall
time), ``output_tok_s``, time to first token p50/p99 as the client sees it (request sent →
first streamed chunk), and the fraction of prompt tokens served from cache. Ratios:
``throughput_ratio`` (on / off) and ``ttft_p50_speedup`` / ``ttft_p99_speedup`` (off / on);
``throughput_ratio_reuse_on_vs_off`` is over all levels together (total tokens over total
time, on / off). On a shared machine wall time swings with other load, so each run also
reports the worker process's CPU seconds, and ``cpu_throughput_ratio`` is the same ratio
from them (the model thread is the bottleneck; its CPU time barely depends on others).

    python -m bench.serving            # 4 turns, prompts ~355 → ~830 tokens; a few minutes
    python -m bench.serving --quick    # 2 turns, prompts ~180 → ~240 tokens; about a minute on an idle machine
    python -m bench.serving --long-agent [--quick] [--cache-dtype float8_e4m3fn]

``--model-dir DIR`` (``--dtype``) serves a checkpoint directory (``worker.model_dir``,
``worker.dtype``) instead of the tiny random model, e.g. ``--model-dir "$(kvledger model smollm2)"``:
its prompts are then real text (``bench.realtext``: passages of this repository's docs) and its
sampled API-phase requests ``ignore_eos`` where a pair must generate the same tokens; the
overload phase (the tiny model in this process) does not run, nor may ``--long-agent``.

``--long-agent`` runs seed 003's workload instead (``LongAgent``): one agent at a time reads a
long document (3,072 tokens; quick 768), makes a forced tool call, gets the result, answers in a
few tokens and asks follow-ups — on the built-in hybrid model and on a YOCO checkpoint
(``kvledger model init --family yoco``), reuse on vs off: ``long_agent_<family>_*`` keys
(later turns' TTFT speedup, the cached fraction, whether tool calls parsed and outputs agree).

A burst of agents starting together shares a system prompt nobody has cached: with the worker's
default ``cache.prefix_wait_ms`` one request computes it and the others wait for its commit
(``worker.inflight``; ``prefix_waits`` per level); ``--prefix-wait-ms 0`` makes every one compute it.

Pools: ``--pool-mb`` (default 256) is ``worker.pool_bytes``. The window form (``swa``,
24 KiB per block for the tiny model) is the scarce one: with the config's default 64 MiB,
32 agents evict each other's latest windows and the cached fraction drops (the run
reports ``evictions`` and ``fallbacks_*`` from the worker's counters when they happen).

Goodput under overload (``--overload`` runs only this; the default and ``--api-only`` runs run it
first, before the stack starts): the built-in tiny model's engine and the worker's scheduler in this process
(no HTTP, no coordinator), long prompts (3,072 tokens; quick 2,048) and 16 output tokens. One
request alone takes ``t1``; under a request timeout of ``k`` × ``t1`` (k = 6; quick 5) at most
``k`` requests could finish; 2k are sent at once. ``goodput_ratio_overload`` is those finished
within the timeout ÷ k (goal ≥ 0.8), with the default ``service.admission_prefill_share``;
``goodput_ratio_overload_unbounded`` is the same with it 0 (admission by slots alone, as before
issue 53: every request streamed behind the others' prompts to a 504 together), and
``overload_refused_early`` / ``overload_timed_out`` say how the rest ended.

Services: ``--database-url``/``--nats-url`` (default ``$KVL_DATABASE_URL``/``$KVL_NATS_URL``),
else embedded PostgreSQL and NATS. Progress goes to stderr; the last line printed is one
JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.proc_cpu import cpu_spent, stack_cpu

# the workload, helpers and processes, and the extra phases, live in modules of their own (names kept here)
from bench.serving_common import (
    BLOCK, FULL, KEYS, LEVELS, QUICK, Cluster, Workload, _log, _text, percentile, stop_and_drop,
)
from bench.serving_phases import LONG_FULL, LONG_QUICK, long_agent_phase, overload_phase, structured_phase


@dataclass
class Turn:
    ttft_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    text: str
    #: Seconds between consecutive token chunks of the stream (inter-token latency).
    gaps_s: list[float] = field(default_factory=list)


@dataclass
class Run:
    wall_s: float = 0.0
    #: CPU seconds during the run by role (``bench.proc_cpu.stack_cpu``: worker, coordinator,
    #: postgres, nats, bench), when the run was given the stack's processes.
    cpu_s: dict[str, float] = field(default_factory=dict)
    #: Worker counters that explain the cache fraction: evictions, fallbacks by reason.
    counters: dict[str, float] = field(default_factory=dict)
    turns: list[Turn] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: Reply texts per agent, per turn (to compare on with off).
    replies: dict[int, list[str]] = field(default_factory=dict)
    #: Per later turn: (its cached prompt tokens, the previous turn's prompt tokens, reply tokens).
    next_turn: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def worker_cpu_s(self) -> float:
        """CPU seconds the worker process used during the run (all its threads)."""
        return self.cpu_s.get("worker", 0.0)

    def summary(self) -> dict[str, Any]:
        prompt = sum(t.prompt_tokens for t in self.turns)
        out = sum(t.completion_tokens for t in self.turns)
        ttft = [t.ttft_s * 1000 for t in self.turns]
        gaps = [g * 1000 for t in self.turns for g in t.gaps_s]
        return {"requests": len(self.turns), "errors": len(self.errors), "wall_s": round(self.wall_s, 3),
                "prompt_tokens": prompt, "completion_tokens": out,
                "throughput_tok_s": round((prompt + out) / self.wall_s, 1),
                "worker_cpu_s": round(self.worker_cpu_s, 2),
                "tok_per_worker_cpu_s": round((prompt + out) / self.worker_cpu_s, 1) if self.worker_cpu_s else None,
                "output_tok_s": round(out / self.wall_s, 2),
                "ttft_p50_ms": round(percentile(ttft, 50), 1), "ttft_p99_ms": round(percentile(ttft, 99), 1),
                # None when no turn streamed a second token (--max-tokens 1)
                "itl_p50_ms": round(percentile(gaps, 50), 1) if gaps else None,
                "itl_p99_ms": round(percentile(gaps, 99), 1) if gaps else None,
                "cached_fraction": round(sum(t.cached_tokens for t in self.turns) / max(1, prompt), 3),
                **({"close_ms_mean": round(1000 * self.counters["close_s"] / self.counters["closes"], 2)}
                   if self.counters.get("closes") else {}),
                # the model thread's busy time (forwards and their exports) per request
                **({"model_ms_per_request": round(1000 * self.counters["model_s"] / len(self.turns), 2)}
                   if self.counters.get("model_s") and self.turns else {}),
                **({"cpu_ms_per_request": {k: round(1000 * v / len(self.turns), 2) for k, v in self.cpu_s.items()}}
                   if self.cpu_s and self.turns else {}),
                **{k: round(v) for k, v in sorted(self.counters.items())
                   if v and k not in ("close_s", "closes", "model_s")}}




async def chat(http: Any, url: str, messages: list[dict[str, str]], max_tokens: int, reuse: bool,
               model: str = "kvledger/dsv4-tiny") -> Turn:
    """One streaming chat completion; TTFT = until the first chunk (the role chunk, sent with token 1)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "cache_reuse": reuse}
    t0 = time.perf_counter()
    ttft = None
    last = 0.0
    gaps: list[float] = []
    parts: list[str] = []
    usage: dict[str, Any] = {}
    headers = {"Authorization": f"Bearer {KEYS['on' if reuse else 'off']}"}
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']['message']}")
            if any(ch.get("delta") for ch in chunk.get("choices", [])):
                # a chunk per token (a finish-only chunk has an empty delta): the gap to the
                # previous one is the inter-token latency
                now = time.perf_counter()
                if last:
                    gaps.append(now - last)
                last = now
            for ch in chunk.get("choices", []):
                parts.append(ch["delta"].get("content") or "")
            usage = chunk.get("usage") or usage
    assert ttft is not None and usage, "a stream without chunks or usage"
    return Turn(ttft, usage["prompt_tokens"], usage["completion_tokens"],
                usage["prompt_tokens_details"]["cached_tokens"], "".join(parts), gaps)


_COUNTERS = {"evictions": ('kvl_worker_transitions_total', {"kind": "evict"}),
             "fallbacks_grid": ("kvl_worker_fallbacks_total", {"reason": "grid"}),
             "fallbacks_validation": ("kvl_worker_fallbacks_total", {"reason": "validation"}),
             "fallbacks_degraded": ("kvl_worker_fallbacks_total", {"reason": "degraded"}),
             "fallbacks_lease": ("kvl_worker_fallbacks_total", {"reason": "lease:over_capacity"}),
             "forwards": ("kvl_worker_step_batch_tokens_count", {}),
             "lane_forwards": ("kvl_worker_lane_forwards_total", {}),
             # a request's close (reply committed, watermark awaited, leases released): its mean below
             "close_s": ("kvl_worker_request_close_seconds_sum", {}),
             "closes": ("kvl_worker_request_close_seconds_count", {}),
             "model_s": ("kvl_worker_step_seconds_sum", {}),
             # requests that waited for a shared prefix another request was computing (worker.inflight)
             "prefix_waits": ("kvl_worker_prefix_waits_total", {"outcome": "committed"}),
             "prefix_wait_timeouts": ("kvl_worker_prefix_waits_total", {"outcome": "timeout"})}


async def counters(http: Any, url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    async with http.get(url + "/metrics") as r:
        text = await r.text()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    return {k: samples.get((name, tuple(sorted(labels.items()))), 0.0) for k, (name, labels) in _COUNTERS.items()}


async def run_level(url: str, w: Workload, c: int, reuse: bool, seed: int,
                    pids: dict[str, int] | None = None) -> Run:
    """One level: ``c`` agents at once. ``pids`` (role: pid, with ``worker``) turns on the CPU
    accounting of the stack's processes (``Run.cpu_s``)."""
    import aiohttp

    rng = random.Random(seed)
    if w.real_text:
        from bench.realtext import Passages
        passages = Passages(seed)

        def text(_: random.Random, chars: int) -> str:
            return passages.text(chars)
    else:
        text = _text
    system = text(rng, w.system_chars)
    n = w.agents(c)
    tasks = [text(rng, w.task_chars) for _ in range(n)]
    observations = [[text(rng, w.observation_chars) for _ in range(w.turns - 1)] for _ in range(n)]
    run = Run()
    sem = asyncio.Semaphore(c)

    async def agent(i: int, http: Any) -> None:
        async with sem:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": tasks[i]}]
            replies = run.replies.setdefault(i, [])
            prev: Turn | None = None
            for k in range(w.turns):
                try:
                    turn = await chat(http, url, messages, w.max_tokens, reuse, w.model)
                except Exception as e:  # noqa: BLE001 - counted and reported
                    run.errors.append(repr(e))
                    return
                run.turns.append(turn)
                replies.append(turn.text)
                if prev is not None:
                    run.next_turn.append((turn.cached_tokens, prev.prompt_tokens, prev.completion_tokens))
                prev = turn
                if k + 1 < w.turns:
                    messages += [{"role": "assistant", "content": turn.text},
                                 {"role": "user", "content": observations[i][k]}]

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as http:
        before = await counters(http, url)
        cpu0 = stack_cpu(pids) if pids else {}
        t0 = time.perf_counter()
        await asyncio.gather(*(agent(i, http) for i in range(n)))
        run.wall_s = time.perf_counter() - t0
        if pids:
            run.cpu_s = cpu_spent(cpu0, stack_cpu(pids))
        after = await counters(http, url)
        run.counters = {k: after[k] - before[k] for k in after}
    return run


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.worker import _create_db
    from shared.embedded import start_services

    w = QUICK if args.quick else FULL
    if args.max_tokens:
        w = dataclasses.replace(w, max_tokens=args.max_tokens)
    overload = {} if args.long_agent or args.model_dir else await overload_phase(args.quick)
    if args.overload:
        return {"bench": "serving", "mode": "quick" if args.quick else "full", "workload": "overload", **overload,
                "load_average_1m": round(os.getloadavg()[0], 2)}
    tmp = Path(tempfile.mkdtemp(prefix="kvl-bench-serving-"))
    db_url, nats_url = args.database_url, args.nats_url
    services = None
    t_start = time.perf_counter()
    if not (db_url and nats_url):
        _log("starting embedded PostgreSQL and NATS ...")
        services = await asyncio.to_thread(start_services, db_url, nats_url, str(tmp / "services"))
        db_url, nats_url = services.database_url, services.nats_url
    if args.long_agent:
        try:
            w_long = LONG_QUICK if args.quick else LONG_FULL
            result: dict[str, Any] = {"bench": "serving", "mode": "quick" if args.quick else "full",
                                      "workload": "long-agent", "long_agent": dataclasses.asdict(w_long),
                                      "cache_dtype": args.cache_dtype}
            for family in args.families:
                result.update(await long_agent_phase(args, family, db_url, nats_url, tmp, w_long))
            result["load_average_1m"] = round(os.getloadavg()[0], 2)
            result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
            return result
        finally:
            if services is not None:
                await asyncio.to_thread(services.stop)
    bench_db, db_name = await _create_db(db_url)
    cluster = Cluster(tmp, db_url, nats_url, args.pool_mb, cache_dtype=args.cache_dtype, service=_service(args),
                      cache={"prefix_wait_ms": args.prefix_wait_ms} if args.prefix_wait_ms >= 0 else None,
                      model_dir=args.model_dir, dtype=args.dtype)
    try:
        cluster.start(bench_db)
        url = await cluster.wait_ready()
        _log(f"worker ready at {url} after {time.perf_counter() - t_start:.1f} s")
        if args.model_dir:
            w = dataclasses.replace(w, model=await served_model(url), real_text=True)
        # warm-up (first-call costs)
        await run_level(url, dataclasses.replace(w, system_chars=32, task_chars=16, observation_chars=16, turns=1,
                                                 max_tokens=2, serial_agents=1), 1, True, seed=0)
        result: dict[str, Any] = {"bench": "serving", "mode": "quick" if args.quick else "full",
                                  "workload": {**w.__dict__, "levels": list(args.levels)},
                                  **_service_settings(args), **overload,
                                  **({"model_dir": args.model_dir, "dtype": args.dtype} if args.model_dir else {})}
        result.update(await structured_phase(url, 8 if args.quick else 24, w))
        _log(f"structured output: {result['json_schema_overhead_pct']} % slower per output token with a schema")
        if args.api_only:
            result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
            return result
        identical = True
        next_turn = [0, 0, 0, 0]      # cached, previous prompt + reply, cached beyond the prompt, replies
        wall = {"on": 0.0, "off": 0.0}
        cpu = {"on": 0.0, "off": 0.0}
        for c in args.levels:
            level: dict[str, Any] = {}
            runs = {}
            for mode in ("on", "off"):
                r = await run_level(url, w, c, mode == "on", seed=1000 + c, pids=cluster.pids())
                if r.errors:
                    raise RuntimeError(f"c={c} reuse {mode}: {len(r.errors)} failed requests, e.g. {r.errors[0]}")
                runs[mode] = r
                level[mode] = r.summary()
                wall[mode] += r.wall_s
                cpu[mode] += r.worker_cpu_s
                _log(f"c={c:<2} reuse {mode:>3}: {level[mode]}")
            identical &= runs["on"].replies == runs["off"].replies
            for cached, prompt, reply in runs["on"].next_turn:
                next_turn[0] += cached
                next_turn[1] += prompt + reply
                next_turn[2] += max(0, cached - prompt // BLOCK * BLOCK)
                next_turn[3] += reply
            on, off = level["on"], level["off"]
            level["throughput_ratio"] = round(on["throughput_tok_s"] / off["throughput_tok_s"], 3)
            level["ttft_p50_speedup"] = round(off["ttft_p50_ms"] / on["ttft_p50_ms"], 3)
            level["ttft_p99_speedup"] = round(off["ttft_p99_ms"] / on["ttft_p99_ms"], 3)
            if on["worker_cpu_s"] and off["worker_cpu_s"]:
                # the same ratio from the worker's CPU time: less sensitive to other load on the machine
                level["cpu_throughput_ratio"] = round(off["worker_cpu_s"] / on["worker_cpu_s"], 3)
            result[f"c{c}"] = level
            for mode in ("on", "off"):
                for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "throughput_tok_s"):
                    result[f"c{c}_{k}_{mode}"] = level[mode][k]
            result[f"c{c}_throughput_ratio"] = level["throughput_ratio"]
        result["throughput_ratio_reuse_on_vs_off"] = round(wall["off"] / wall["on"], 3)
        base = result.get("c1_throughput_tok_s_on")
        for c in args.levels:
            if base and c != 1:
                # concurrency's gain with reuse on (goals: c8 >= 4, c32 >= 8 on this CPU)
                result[f"throughput_c{c}_vs_c1"] = round(result[f"c{c}_throughput_tok_s_on"] / base, 3)
        # what turn n+1 found cached of turn n's prompt + reply (goal >= 0.9)
        result["next_turn_reuse_ratio"] = round(next_turn[0] / next_turn[1], 3) if next_turn[1] else None
        # of that, the previous *reply*: cached tokens past the previous prompt's whole blocks, per
        # reply token. A reply is reused only as far as its text re-encodes to the same tokens.
        result["next_turn_reply_reuse_ratio"] = round(next_turn[2] / next_turn[3], 3) if next_turn[3] else None
        result["cpu_throughput_ratio_reuse_on_vs_off"] = round(cpu["off"] / cpu["on"], 3) if cpu["on"] else None
        result["load_average_1m"] = round(os.getloadavg()[0], 2)
        result["outputs_identical"] = bool(identical)
        result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        return result
    finally:
        await stop_and_drop(cluster, db_url, db_name)
        if services is not None:
            await asyncio.to_thread(services.stop)


async def served_model(url: str) -> str:
    """The id the worker serves (``/v1/models``), as requests must name it."""
    import aiohttp

    async with aiohttp.ClientSession() as http, \
            http.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEYS['on']}"}) as r:
        return (await r.json())["data"][0]["id"]


def _service(args: argparse.Namespace) -> dict[str, int]:
    """The worker's ``service.*`` settings this run asks for (the rest keep the config's defaults)."""
    out = {"max_batch_tokens": args.max_batch_tokens} if args.max_batch_tokens else {}
    if args.max_prompt_tokens_with_decodes >= 0:
        out["max_prompt_tokens_with_decodes"] = args.max_prompt_tokens_with_decodes
    if args.model_lanes >= 0:
        out["model_lanes"] = args.model_lanes
    return out


def _service_settings(args: argparse.Namespace) -> dict[str, int]:
    """The step loop's budgets the worker ran with (result keys), defaults filled in."""
    from shared.config import CacheConfig, ServiceConfig

    from worker.stepper import resolve_lanes

    d = ServiceConfig()
    out = {"max_batch_tokens": d.max_batch_tokens, "max_prompt_tokens_with_decodes": d.max_prompt_tokens_with_decodes,
           "model_lanes": d.model_lanes, "lane_min_rows": d.lane_min_rows, **_service(args)}
    out["model_lanes_resolved"] = resolve_lanes(out["model_lanes"], "cpu")     # the bench's worker runs on the CPU
    out["prefix_wait_ms"] = args.prefix_wait_ms if args.prefix_wait_ms >= 0 else CacheConfig().prefix_wait_ms
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 turns, short prompts; within 60 s")
    ap.add_argument("--max-tokens", type=int, default=0,
                    help="output tokens per turn (default: the workload's, 4 full / 2 quick); more = decode-heavier")
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrency levels (default 1,8,32)")
    ap.add_argument("--pool-mb", type=int, default=256, help="worker.pool_bytes in MiB (default 256)")
    ap.add_argument("--api-only", action="store_true",
                    help="only the API-features phase (structured output), not the concurrency levels")
    ap.add_argument("--long-agent", action="store_true",
                    help="seed 003's long-context agent workload (long documents, a forced tool call, its result, "
                         "short answers, follow-ups) on each of --families, reuse on vs off")
    ap.add_argument("--families", default="hybrid,yoco",
                    help="with --long-agent: hybrid (the built-in DeepSeek-V4-style model) and/or yoco (a seeded "
                         "YOCO checkpoint written by kvledger model init)")
    ap.add_argument("--overload", action="store_true",
                    help="only the goodput-under-overload phase (in this process, no stack): goodput_ratio_overload")
    ap.add_argument("--cache-dtype", default="auto", help="the workers' cache.dtype (default auto)")
    ap.add_argument("--max-batch-tokens", type=int, default=0,
                    help="the worker's service.max_batch_tokens (default: the config's own default)")
    ap.add_argument("--max-prompt-tokens-with-decodes", type=int, default=-1,
                    help="the worker's service.max_prompt_tokens_with_decodes (0: no cap; default: the config's)")
    ap.add_argument("--prefix-wait-ms", type=int, default=-1,
                    help="the worker's cache.prefix_wait_ms (default: the config's; 0: a burst sharing a new prefix "
                         "computes it in every request)")
    ap.add_argument("--model-lanes", type=int, default=-1,
                    help="the worker's service.model_lanes (1: one forward at a time; 0: automatic; default: the "
                         "config's)")
    ap.add_argument("--model-dir", default="",
                    help="serve a checkpoint directory (worker.model_dir) instead of the tiny random model; "
                         "prompts are then real text")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                    help="the worker's worker.dtype (default auto: the checkpoint's own)")
    ap.add_argument("--database-url", default=os.environ.get("KVL_DATABASE_URL", ""))
    ap.add_argument("--nats-url", default=os.environ.get("KVL_NATS_URL", ""))
    args = ap.parse_args(argv)
    if args.model_dir and not Path(args.model_dir).is_dir():
        ap.error(f"--model-dir: {args.model_dir} is not a directory")
    if args.model_dir and (args.long_agent or args.overload):
        ap.error("--model-dir: not with --long-agent or --overload (they run the tiny model and a YOCO checkpoint)")
    args.levels = tuple(int(x) for x in args.levels.split(","))
    from shared.config import MAX_BATCH_TOKENS
    if not 0 <= args.max_batch_tokens <= MAX_BATCH_TOKENS:
        ap.error(f"--max-batch-tokens: 1 to {MAX_BATCH_TOKENS} (0: the config's default)")
    if not -1 <= args.model_lanes <= 16:
        ap.error("--model-lanes: 0 (automatic) to 16 (default: the config's)")
    if not -1 <= args.max_prompt_tokens_with_decodes <= 65536:
        ap.error("--max-prompt-tokens-with-decodes: 0 (no cap) to 65536 (default: the config's)")
    if not -1 <= args.prefix_wait_ms <= 60_000:
        ap.error("--prefix-wait-ms: 0 (never wait) to 60000 (default: the config's)")
    args.families = tuple(f for f in args.families.split(",") if f)
    if bad := [f for f in args.families if f not in ("hybrid", "yoco")]:
        ap.error(f"--families: {bad} not known; use hybrid and/or yoco")
    result = asyncio.run(run(args))
    if not (args.api_only or args.long_agent or args.overload):
        # the most concurrency could buy for these requests on this machine (the stack is stopped)
        from bench.serving_bound import for_serving
        bound = for_serving(result, args.quick)
        result.update(bound)
        result["elapsed_s"] = round(result.get("elapsed_s", 0) + bound.get("bound_s", 0), 1)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
