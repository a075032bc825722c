"""The serving benchmark's extra phases (:mod:`bench.serving`; its module docstring describes each):
the API features' costs (``structured_phase``: ``n`` = 8 and ``json_schema``), the long-context agent
workload with tool calls (``long_agent_phase``), and goodput under overload (``overload_phase``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.proc_cpu import process_cpu
from bench.serving_common import KEYS, QUICK, Cluster, Workload, _log, _text, percentile, stop_and_drop


#: The structured-output phase's schema: bounded fields, so every document ends well within max_tokens.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 6}}}}


async def structured_phase(url: str, requests: int, w: Workload = QUICK) -> dict[str, Any]:
    """The API features' costs. ``n8_time_ratio_vs_8_requests``: one request with ``n`` = 8
    against 8 concurrent requests of the same (uncached) prompt, median of 3 pairs on fresh
    prompts. Then output tokens per second of sampled chat completions with a ``json_schema`` and without,
    the same prompt, in pairs (one request at a time; the prefix cached after the first pair):
    each unconstrained request generates as many tokens as its constrained twin did, so both
    spread the same per-request costs over the same output. ``json_schema_overhead_pct`` = how
    much slower per output token the constrained ones are. On a real checkpoint (``w.real_text``)
    the requests that must generate a given count (n = 8 and its 8; the unconstrained twin)
    ``ignore_eos``, and the n = 8 prompts are real text."""
    import aiohttp

    from bench.realtext import Passages

    real = {"ignore_eos": True} if w.real_text else {}

    messages = [{"role": "user", "content": "Describe a person as JSON with a name, an age and tags."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    headers = {"Authorization": f"Bearer {KEYS['on']}"}
    spent = {"plain": [0.0, 0], "schema": [0.0, 0]}
    parsed = 0
    async with aiohttp.ClientSession() as http:
        for i in range(requests + 1):
            n = 200
            for kind in ("schema", "plain"):
                body = {"model": w.model, "messages": messages, "max_tokens": n, "temperature": 1.0,
                        "seed": i, **({"response_format": fmt} if kind == "schema" else real)}
                t0 = time.perf_counter()
                async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                    doc = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"structured phase: HTTP {r.status}: {str(doc)[:300]}")
                dt = time.perf_counter() - t0
                if i == 0:
                    n = doc["usage"]["completion_tokens"]
                    continue                                   # the first pair fills the cache
                spent[kind][0] += dt
                spent[kind][1] += doc["usage"]["completion_tokens"]
                n = doc["usage"]["completion_tokens"]
                if kind == "schema":
                    try:
                        json.loads(doc["choices"][0]["message"]["content"])
                        parsed += 1
                    except ValueError:
                        pass
        # n = 8 against 8 separate requests of one prompt, each pair on fresh prompts (cold)
        ratios = []
        for rep in range(3):
            words = Passages(rep).text(360) if w.real_text else " ".join(f"w{rep}x{j}" for j in range(60))
            base = {"model": w.model, "max_tokens": 8, "temperature": 1.0, **real}
            t0 = time.perf_counter()
            async with http.post(url + "/v1/completions", headers=headers,
                                 json={**base, "prompt": f"[n8 {rep}] {words}", "n": 8, "seed": rep}) as r:
                if r.status != 200:
                    raise RuntimeError(f"n=8: HTTP {r.status}: {(await r.text())[:300]}")
                await r.read()
            t_n8 = time.perf_counter() - t0

            async def one(i: int, prompt: str) -> None:
                async with http.post(url + "/v1/completions", headers=headers,
                                     json={**base, "prompt": prompt, "seed": rep * 8 + i}) as r:
                    if r.status != 200:
                        raise RuntimeError(f"8 requests: HTTP {r.status}: {(await r.text())[:300]}")
                    await r.read()
            t0 = time.perf_counter()
            await asyncio.gather(*(one(i, f"[x8 {rep}] {words}") for i in range(8)))
            ratios.append(t_n8 / (time.perf_counter() - t0))
    tps = {k: n / t for k, (t, n) in spent.items()}
    return {"n8_time_ratio_vs_8_requests": round(sorted(ratios)[len(ratios) // 2], 3),
            "structured_requests": requests, "output_tok_s_plain": round(tps["plain"], 1),
            "output_tok_s_json_schema": round(tps["schema"], 1),
            "json_schema_overhead_pct": round((tps["plain"] / tps["schema"] - 1) * 100, 1),
            "json_schema_parsed_fraction": round(parsed / requests, 3)}


# --- the long-context agent workload (seed 003) ------------------------------------------------------

@dataclass(frozen=True)
class LongAgent:
    """Seed 003's workload: long inputs, short outputs, tool-call chains, multi-turn continuation.

    An agent reads a long document (its own, after a system prompt and tool list shared by every
    agent), calls a tool (a forced call: ``tool_choice`` names it, as an agent framework does when
    it needs a lookup), gets the tool's result, answers in a few tokens, then asks ``followups``
    more short questions about the same document — every turn's prompt extends the last."""

    doc_chars: int
    followups: int
    agents: int
    answer_tokens: int = 8


LONG_FULL = LongAgent(doc_chars=3072, followups=2, agents=3)
LONG_QUICK = LongAgent(doc_chars=768, followups=1, agents=2)
#: The tool every agent calls; its argument is an enum so a random-weight model's forced call ends.
LOOKUP = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a term up in the knowledge base.",
    "parameters": {"type": "object", "required": ["term"],
                   "properties": {"term": {"enum": ["ledger", "replica", "lease", "block"]}}}}}]


async def long_agent_run(url: str, model: str, w: LongAgent, reuse: bool, seed: int, worker_pid: int) -> dict[str, Any]:
    """Every agent one after the other (one conversation at a time: the latency of a long input),
    reuse on or off; per turn its TTFT, tokens and cached tokens, and the replies to compare."""
    import aiohttp

    rng = random.Random(seed)
    system = "You answer questions about the document. Call lookup for unknown terms. " + _text(rng, 256)
    headers = {"Authorization": f"Bearer {KEYS['on' if reuse else 'off']}"}
    turns: list[dict[str, Any]] = []
    replies: list[Any] = []
    calls = parsed = 0
    t0, cpu0 = time.perf_counter(), process_cpu(worker_pid)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1200)) as http:
        async def ask(messages, **extra) -> dict[str, Any]:
            body = {"model": model, "messages": messages, "temperature": 0, "cache_reuse": reuse,
                    "max_tokens": w.answer_tokens, "tools": LOOKUP, **extra}
            t = time.perf_counter()
            async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                doc = await r.json()
            if r.status != 200:
                raise RuntimeError(f"long agent: HTTP {r.status}: {str(doc)[:300]}")
            u = doc["usage"]
            turns.append({"s": time.perf_counter() - t, "prompt": u["prompt_tokens"], "out": u["completion_tokens"],
                          "cached": u["prompt_tokens_details"]["cached_tokens"]})
            return doc["choices"][0]

        for a in range(w.agents):
            doc = _text(rng, w.doc_chars)
            messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                              {"role": "user", "content": f"Document:\n{doc}\n\nWhat is it about?"}]
            first = await ask(messages, max_tokens=96, tool_choice={"type": "function", "function": {"name": "lookup"}})
            calls += 1
            tool_calls = first["message"].get("tool_calls") or []
            parsed += bool(tool_calls)
            replies.append(tool_calls[0]["function"]["arguments"] if tool_calls else first["message"]["content"])
            if tool_calls:
                messages += [{"role": "assistant", "content": None, "tool_calls": tool_calls[:1]},
                             {"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": _text(rng, 96)}]
            for k in range(1 + w.followups):
                answer = await ask(messages, tool_choice="none")
                replies.append(answer["message"]["content"])
                messages += [{"role": "assistant", "content": answer["message"]["content"] or ""},
                             {"role": "user", "content": f"And {_text(rng, 24)}?"}]
    wall = time.perf_counter() - t0
    prompt = sum(t["prompt"] for t in turns)
    first_turns = turns[::2 + w.followups]
    later = [t for i, t in enumerate(turns) if i % (2 + w.followups)]
    return {"wall_s": wall, "worker_cpu_s": process_cpu(worker_pid) - cpu0 if worker_pid else 0.0,
            "requests": len(turns), "prompt_tokens": prompt, "completion_tokens": sum(t["out"] for t in turns),
            "ttft_p50_ms": percentile([t["s"] * 1000 for t in turns], 50),
            "later_turn_ttft_p50_ms": percentile([t["s"] * 1000 for t in later], 50),
            "first_turn_ttft_p50_ms": percentile([t["s"] * 1000 for t in first_turns], 50),
            "cached_fraction": sum(t["cached"] for t in turns) / max(1, prompt),
            "later_turn_cached_fraction": sum(t["cached"] for t in later) / max(1, sum(t["prompt"] for t in later)),
            "tool_calls_parsed_fraction": parsed / max(1, calls), "replies": replies}


async def long_agent_phase(args: argparse.Namespace, family: str, db_url: str, nats_url: str, tmp: Path,
                           w: LongAgent) -> dict[str, Any]:
    """The long-context agent workload on one family (its own worker), reuse on and off."""
    from bench.worker import _create_db

    model_dir = ""
    if family == "yoco":
        from kvledger.cli import main as kvledger
        model_dir = str(tmp / "yoco-model")
        if kvledger(["model", "init", model_dir, "--family", "yoco"]) != 0:
            raise RuntimeError("kvledger model init --family yoco failed")
    bench_db, db_name = await _create_db(db_url)
    sub = tmp / f"long-{family}"
    sub.mkdir()
    cluster = Cluster(sub, db_url, nats_url, args.pool_mb, model_dir=model_dir, cache_dtype=args.cache_dtype)
    try:
        cluster.start(bench_db)
        url = await cluster.wait_ready()
        model = "yoco-model" if family == "yoco" else "kvledger/dsv4-tiny"
        await long_agent_run(url, model, dataclasses.replace(w, doc_chars=64, followups=0, agents=1), True, 0, 0)
        out: dict[str, Any] = {}
        for mode in ("on", "off"):
            out[mode] = await long_agent_run(url, model, w, mode == "on", 7, cluster.worker.pid)
            _log(f"long agent, {family}, reuse {mode}: " + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in out[mode].items() if k != "replies"))
        on, off = out["on"], out["off"]
        p = f"long_agent_{family}_"
        return {p + "requests": on["requests"], p + "prompt_tokens": on["prompt_tokens"],
                p + "ttft_p50_ms_on": round(on["ttft_p50_ms"], 1), p + "ttft_p50_ms_off": round(off["ttft_p50_ms"], 1),
                p + "later_turn_ttft_p50_ms_on": round(on["later_turn_ttft_p50_ms"], 1),
                p + "later_turn_ttft_p50_ms_off": round(off["later_turn_ttft_p50_ms"], 1),
                p + "later_turn_ttft_speedup": round(off["later_turn_ttft_p50_ms"] / on["later_turn_ttft_p50_ms"], 3),
                p + "cached_fraction": round(on["cached_fraction"], 3),
                p + "later_turn_cached_fraction": round(on["later_turn_cached_fraction"], 3),
                p + "throughput_ratio_on_vs_off": round(off["wall_s"] / on["wall_s"], 3),
                p + "cpu_ratio_on_vs_off": round(off["worker_cpu_s"] / on["worker_cpu_s"], 3) if on["worker_cpu_s"] else None,
                p + "tool_calls_parsed_fraction": round(on["tool_calls_parsed_fraction"], 3),
                p + "outputs_identical": on["replies"] == off["replies"]}
    finally:
        await stop_and_drop(cluster, db_url, db_name)


async def overload_phase(quick: bool) -> dict[str, Any]:
    """Goodput under overload (see the module docstring): default admission vs slots alone."""
    import msgspec
    import torch

    from shared.config import parse_config
    from shared.tenants import Tenant
    from worker.engine import Engine
    from worker.model import build_model
    from worker.scheduler import GenRequest, Overloaded, QueueTimeout, RequestTimeout, SamplingParams, Scheduler

    torch.set_num_threads(1)
    prompt, max_tokens, k = (2048, 16, 5) if quick else (3072, 16, 6)
    model = build_model(seed=0)
    rng = random.Random(53)
    out: dict[str, Any] = {}
    for share in (0.5, 0.0):
        tmp = Path(tempfile.mkdtemp(prefix="kvl-bench-overload-"))
        cfg = parse_config({"cache": {"host_tier_bytes": 0, "offload_dir": ""},
                            "worker": {"worker_id": "bench-overload", "pool_bytes": 128 * 2**20},
                            "service": {"admission_prefill_share": share, "request_timeout_ms": 600_000},
                            "state_dir": str(tmp)})
        engine = Engine(model, cfg, None)
        await engine.start()
        try:
            def req() -> GenRequest:
                return GenRequest(tokens=[rng.randrange(1, model.cfg.vocab_size) for _ in range(prompt)],
                                  max_tokens=max_tokens, tenant=Tenant(id="bench"), sampling=SamplingParams())
            t0 = time.perf_counter()
            await Scheduler(engine, cfg.service).submit(req()).wait()      # c = 1 (the rates measured too)
            t1 = time.perf_counter() - t0
            timeout_s = k * t1
            sch = Scheduler(engine, msgspec.structs.replace(cfg.service, request_timeout_ms=round(timeout_s * 1000)))

            async def one() -> str:
                try:
                    await sch.submit(req()).wait()
                    return "ok"
                except (Overloaded, QueueTimeout) as e:
                    return "refused" if isinstance(e, Overloaded) else "queue_timeout"
                except RequestTimeout:
                    return "timeout"

            ends = await asyncio.gather(*(one() for _ in range(2 * k)))
        finally:
            await engine.stop()
        tag = "" if share else "_unbounded"
        out[f"goodput_ratio_overload{tag}"] = round(ends.count("ok") / k, 3)
        out[f"overload_refused_early{tag}"] = ends.count("refused")
        out[f"overload_timed_out{tag}"] = ends.count("timeout") + ends.count("queue_timeout")
        out[f"overload_c1_s{tag}"] = round(t1, 3)
        _log(f"overload (admission_prefill_share {share}): c=1 {t1:.2f} s, timeout {timeout_s:.2f} s, "
             f"{2 * k} sent: {ends}")
    out["overload_workload"] = {"prompt_tokens": prompt, "max_tokens": max_tokens, "timeout_x_c1": k}
    return out


__all__ = ["LONG_FULL", "LONG_QUICK", "LongAgent", "long_agent_phase", "long_agent_run", "overload_phase",
           "structured_phase"]
