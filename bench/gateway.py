"""Gateway benchmark: KV-aware routing vs round robin vs one worker holding everything.

Runs ``kvledger up --workers 3`` (embedded PostgreSQL and NATS, fresh state dir, the gateway
in front) and drives multi-turn agent conversations — each turn is the previous prompt, the
previous answer and new text; streamed, greedy — three ways in the same run, each with its
own conversations (so no mode finds another's cache):

* ``kv``: every request to the gateway;
* ``round_robin``: request *i* straight to worker *i mod 3*;
* ``single``: every request straight to one worker (the reuse ceiling: it holds everything).

Reported: the fraction of prompt tokens served from cache per mode and
``reuse_ratio_vs_single`` (kv / single, goal ≥ 0.9); time to first token p50 per mode and
``ttft_p50_ratio_vs_round_robin`` (kv / round robin, goal ≤ 0.5); and
``gateway_overhead_ms_p50``: the same one-token request sent through the gateway and straight
to the worker it routes to, interleaved, the median of the paired differences (goal ≤ 2 ms); and
``proxy_hop_ms_p50``, the same for ``GET /v1/models`` (the bare second HTTP hop: no prompt, no route query), and
``route_step_ms_mean``, the gateway's own timing of tokenize + hash + route query over those requests.

Then bursts: each a new shared prefix (~16 blocks, nothing cached anywhere) and distinct tails,
all sent at once, through the gateway (``burst_*_kv``) and round robin (``burst_*_round_robin``),
alternating: ``burst_prefix_computes_kv`` / ``_round_robin`` is how many requests of a burst
computed the prefix (found less of it cached than its whole blocks), on average; ``burst_wall_ms_*``
a burst's wall time (median) and ``burst_wall_ratio_vs_round_robin`` kv ÷ round robin;
``burst_ttft_p50_ms_*`` its requests' time to first token. ``--no-inflight-routing`` runs the
stack with ``gateway.route_inflight_prefixes: false`` (the A/B of that setting). ``--replicas 2``
runs two gateways (``gateway.replicas``) and sends the ``kv`` requests, the overhead pairs and each
burst's requests to them in turn: every key above then measures the replicated gateway, which
routes by the ledger's view whichever replica takes a request (a burst's in-flight prefix is known
only to the replica that sent it).

    python -m bench.gateway            # 24 conversations × 4 turns per mode
    python -m bench.gateway --quick    # 9 × 3, within ~90 s
    python -m bench.gateway --quick --replicas 2

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.tiny_stack import launch_up
from shared.config import CacheConfig

WORDS = ("ledger", "block", "replica", "lease", "worker", "tenant", "prefix", "cache", "commit", "token",
         "window", "entry", "audit", "epoch", "offload", "validate")


def user_text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + ". "


#: A burst: this many requests at once, sharing a new prefix of this many words (~16 blocks).
BURST, BURST_PREFIX_WORDS = 6, 36
#: The stack's block size (its kvledger.yaml leaves cache.block_size at the default).
BLOCK = CacheConfig().block_size


def start_stack(d: Path, inflight_routing: bool = True, replicas: int = 1) -> tuple[subprocess.Popen, dict]:
    gateway = f"gateway:\n  replicas: {replicas}\n" + ("" if inflight_routing else "  route_inflight_prefixes: false\n")
    (d / "kvledger.yaml").write_text("state_dir: state\nworker:\n  pool_bytes: 33554432\n" + gateway)
    return launch_up(d, 3)


async def turn(http: aiohttp.ClientSession, url: str, prompt: str) -> tuple[float, int, int, str]:
    """(TTFT s, prompt tokens, cached tokens, reply text) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    async with http.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:200]}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            if doc.get("choices"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(doc["choices"][0]["text"])
            if doc.get("usage"):
                usage = doc["usage"]
    return ttft or (time.perf_counter() - t0), usage["prompt_tokens"], \
        usage["prompt_tokens_details"]["cached_tokens"], "".join(text)


async def run_mode(http, targets, mode: str, conversations: int, turns: int, concurrency: int) -> dict:
    rng = random.Random(f"bench-gateway-{mode}")
    counter = 0
    sem = asyncio.Semaphore(concurrency)
    ttfts, prompt_tokens, cached = [], 0, 0

    async def conversation(c: int) -> None:
        nonlocal counter, prompt_tokens, cached
        prompt = f"[{mode} conversation {c}] " + user_text(rng, 40)
        for _ in range(turns):
            async with sem:
                url = targets(counter)
                counter += 1
                t, n, k, reply = await turn(http, url, prompt)
            ttfts.append(t)
            prompt_tokens += n
            cached += k
            prompt += reply + user_text(rng, 12)

    await asyncio.gather(*(conversation(c) for c in range(conversations)))
    return {"reuse": cached / prompt_tokens, "ttft_p50_ms": statistics.median(ttfts) * 1000,
            "requests": len(ttfts), "prompt_tokens": prompt_tokens, "cached_tokens": cached}


async def prompt_blocks(http: aiohttp.ClientSession, worker: str, prompt: str) -> int:
    """Whole blocks of ``prompt`` (less its last token, which may merge with what follows)."""
    async with http.post(worker + "/tokenize", json={"prompt": prompt}) as r:
        return (int((await r.json())["count"]) - 1) // BLOCK


async def bursts(http: aiohttp.ClientSession, gateways: list[str], workers: list[str], rounds: int) -> dict:
    """``rounds`` bursts per mode, alternating kv and round robin, each with a prefix of its own."""
    rng = random.Random("bench-gateway-bursts")
    got: dict[str, dict[str, list[float]]] = {m: {"computes": [], "wall": [], "ttft": []} for m in ("kv", "rr")}
    for r in range(rounds):
        for mode in (("kv", "rr") if r % 2 == 0 else ("rr", "kv")):
            shared = f"[burst {mode} {r}] " + user_text(rng, BURST_PREFIX_WORDS)
            whole = BLOCK * await prompt_blocks(http, workers[0], shared)
            urls = [(gateways if mode == "kv" else workers)[i % len(gateways if mode == "kv" else workers)]
                    for i in range(BURST)]
            t0 = time.perf_counter()
            res = await asyncio.gather(*(turn(http, u, shared + user_text(rng, 6)) for u in urls))
            got[mode]["wall"].append(time.perf_counter() - t0)
            got[mode]["computes"].append(sum(1 for _, _, cached, _ in res if cached < whole))
            got[mode]["ttft"] += [t for t, _, _, _ in res]
    return {m: {"computes": statistics.mean(g["computes"]), "wall_ms": statistics.median(g["wall"]) * 1000,
                "ttft_p50_ms": statistics.median(g["ttft"]) * 1000} for m, g in got.items()}


async def route_seconds(http: aiohttp.ClientSession, gateway: str) -> tuple[float, float]:
    """(sum, count) of the gateway's ``kvl_gateway_route_seconds``: tokenize + hash + route query."""
    async with http.get(gateway + "/metrics") as r:
        text = await r.text()
    got = {}
    for line in text.splitlines():
        for key in ("kvl_gateway_route_seconds_sum", "kvl_gateway_route_seconds_count"):
            if line.startswith(key + " "):
                got[key] = float(line.split()[1])
    return got.get("kvl_gateway_route_seconds_sum", 0.0), got.get("kvl_gateway_route_seconds_count", 0.0)


async def route_seconds_all(http: aiohttp.ClientSession, gateways: list[str]) -> tuple[float, float]:
    got = [await route_seconds(http, g) for g in gateways]
    return sum(s for s, _ in got), sum(n for _, n in got)


async def measure(stack: dict, conversations: int, turns: int, reps: int, burst_rounds: int) -> dict:
    gateway, workers = stack["gateway_url"], stack["worker_urls"]
    gateways = stack.get("gateway_urls") or [gateway]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        out = {"kv": await run_mode(http, lambda i: gateways[i % len(gateways)], "kv", conversations, turns, 8),
               "round_robin": await run_mode(http, lambda i: workers[i % len(workers)], "round_robin",
                                             conversations, turns, 8),
               "single": await run_mode(http, lambda i: workers[0], "single", conversations, turns, 8)}
        # the gateway's own cost: one-token requests, gateway and direct interleaved
        body = {"prompt": "one short request to measure what the gateway adds. ", "max_tokens": 1, "temperature": 0}
        async with http.post(gateway + "/v1/completions", json=body) as r:
            await r.read()
            direct = next(u for u, w in zip(workers, ("worker-0", "worker-1", "worker-2"))
                          if w == r.headers["x-kvl-worker"])
        route0 = await route_seconds_all(http, gateways)
        via, straight = [], []
        for i in range(reps):
            for url, sink in ((gateways[i % len(gateways)], via), (direct, straight)):
                t0 = time.perf_counter()
                async with http.post(url + "/v1/completions", json=body) as r:
                    await r.read()
                sink.append(time.perf_counter() - t0)
        route1 = await route_seconds_all(http, gateways)
        # the bare proxy hop: GET /v1/models (no prompt, no route query), interleaved the same way
        hop_via, hop_direct = [], []
        for _ in range(reps):
            for url, sink in ((gateway, hop_via), (direct, hop_direct)):
                t0 = time.perf_counter()
                async with http.get(url + "/v1/models") as r:
                    await r.read()
                sink.append(time.perf_counter() - t0)
        # NOTE: medians of paired differences (each gateway request against the direct one sent
        # right after it): the machine's drift over the run cancels within a pair
        out["overhead"] = {"via_gateway_ms_p50": statistics.median(via) * 1000,
                           "direct_ms_p50": statistics.median(straight) * 1000,
                           "diff_ms_p50": statistics.median(a - b for a, b in zip(via, straight)) * 1000,
                           "hop_ms_p50": statistics.median(a - b for a, b in zip(hop_via, hop_direct)) * 1000,
                           "route_ms_mean": (route1[0] - route0[0]) / max(1, route1[1] - route0[1]) * 1000}
        out["bursts"] = await bursts(http, gateways, workers, burst_rounds)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="9 conversations × 3 turns per mode, 4 bursts")
    ap.add_argument("--no-inflight-routing", action="store_true",
                    help="gateway.route_inflight_prefixes: false (the A/B of the burst keys)")
    ap.add_argument("--replicas", type=int, choices=(1, 2, 3, 4), default=1,
                    help="gateway replicas (gateway.replicas); the gateway's requests go to them in turn")
    args = ap.parse_args(argv)
    conversations, turns, reps, burst_rounds = (9, 3, 30, 4) if args.quick else (24, 4, 100, 12)
    d = Path(tempfile.mkdtemp(prefix="kvl-bench-gateway-"))
    p = None
    try:
        p, stack = start_stack(d, inflight_routing=not args.no_inflight_routing, replicas=args.replicas)
        r = asyncio.run(measure(stack, conversations, turns, reps, burst_rounds))
    finally:
        if p is not None:
            p.send_signal(signal.SIGTERM)
            with __import__("contextlib").suppress(Exception):
                p.wait(60)
        shutil.rmtree(d, ignore_errors=True)
    kv, rr, single, b = r["kv"], r["round_robin"], r["single"], r["bursts"]
    result = {
        "workers": 3, "gateway_replicas": args.replicas, "conversations": conversations, "turns": turns,
        "reuse_kv": round(kv["reuse"], 3), "reuse_round_robin": round(rr["reuse"], 3),
        "reuse_single": round(single["reuse"], 3),
        "reuse_ratio_vs_single": round(kv["reuse"] / single["reuse"], 3) if single["reuse"] else None,
        "ttft_p50_ms_kv": round(kv["ttft_p50_ms"], 1), "ttft_p50_ms_round_robin": round(rr["ttft_p50_ms"], 1),
        "ttft_p50_ms_single": round(single["ttft_p50_ms"], 1),
        "ttft_p50_ratio_vs_round_robin": round(kv["ttft_p50_ms"] / rr["ttft_p50_ms"], 3),
        "gateway_overhead_ms_p50": round(r["overhead"]["diff_ms_p50"], 2),
        "one_token_request_ms_p50_direct": round(r["overhead"]["direct_ms_p50"], 2),
        "proxy_hop_ms_p50": round(r["overhead"]["hop_ms_p50"], 2),
        "route_step_ms_mean": round(r["overhead"]["route_ms_mean"], 2),
        "burst_size": BURST, "burst_rounds": burst_rounds,
        "burst_prefix_computes_kv": round(b["kv"]["computes"], 2),
        "burst_prefix_computes_round_robin": round(b["rr"]["computes"], 2),
        "burst_wall_ms_kv": round(b["kv"]["wall_ms"], 1), "burst_wall_ms_round_robin": round(b["rr"]["wall_ms"], 1),
        "burst_wall_ratio_vs_round_robin": round(b["kv"]["wall_ms"] / b["rr"]["wall_ms"], 3),
        "burst_ttft_p50_ms_kv": round(b["kv"]["ttft_p50_ms"], 1),
        "burst_ttft_p50_ms_round_robin": round(b["rr"]["ttft_p50_ms"], 1),
        "route_inflight_prefixes": not args.no_inflight_routing,
        "mode": "quick" if args.quick else "full",
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
