"""What concurrency can buy here: N requests' model work fused as the stepper fuses it, against one
request's, timed on this machine.

``bench.serving``'s ``throughput_cN_vs_c1`` divides the tokens/s of N concurrent clients by one
client's. This bench runs N requests submitted together through the worker's own stepper and
model (the built-in tiny model bench.serving serves): every prompt packed into
``service.max_batch_tokens``-row forwards (split into lanes from ``service.lane_min_rows`` rows up),
then each decode step one forward for all N — the fewest, fullest forwards it forms.

* ``python -m bench.serving_bound``: ``model_ratio_c<N>_vs_c1`` = N × one request's model time /
  N requests' fused model time (requests of ``--prompt-rows`` uncached prompt tokens and
  ``--decode-tokens`` decode forwards): what fusing buys the model's work alone;
* ``bench.serving`` (after its levels, :func:`for_serving`), from c = 1's measured wall time per
  request and each level's own request shape: ``throughput_aligned_c<N>_vs_c1``, the ratio if the
  level's requests ran in groups of N fused that way (``_any_budget``: with the largest budget the
  config accepts); ``throughput_ceiling_c<N>_vs_c1``, the same with the model's work (one thread,
  fewest forwards) spread perfectly over every usable core, which no schedule on this machine
  passes; and ``throughput_c<N>_vs_aligned``, how close the level came.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

BLOCK = 16


def _log(msg: str) -> None:
    print(f"[bench.serving_bound {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def model_seconds(model: Any, n: int, prompt_rows: int, decode_tokens: int, *, budget: int, lanes: int,
                  lane_min_rows: int, pool: ThreadPoolExecutor, seed: int = 0,
                  cached_rows: int = 0) -> tuple[float, int]:
    """Seconds for ``n`` requests of ``prompt_rows`` prompt tokens and ``decode_tokens`` decode
    tokens each, all submitted at once to one stepper: ``(seconds, forwards)``. Each request's
    state first holds ``cached_rows`` tokens of context, computed before the clock starts (what a
    request restores from the cache: its new rows attend over it)."""
    from worker.stepper import Stepper

    g = torch.Generator().manual_seed(seed)
    vocab = model.cfg.vocab_size
    total = cached_rows + prompt_rows
    prompts = [torch.randint(0, vocab, (total,), generator=g).tolist() for _ in range(n)]
    states = [model.new_state(BLOCK, -(-(total + decode_tokens + 1) // BLOCK) * BLOCK) for _ in range(n)]

    async def feed(st: Stepper, k: int, lo: int, hi: int) -> int:
        """Prompt tokens ``lo:hi`` of request ``k``; its next token."""
        prompt, state, done = prompts[k], states[k], lo

        def plan(allowed: int | None) -> tuple[list[int], list[int]]:
            take = hi - done if allowed is None else min(allowed, hi - done)
            return prompt[done:done + take], []

        r = None
        while done < hi:
            r = await st.prefill(state, plan, (0, k))
            done += r.tokens
        return int(r.logits.argmax()) if r is not None else 0

    async def one(st: Stepper, k: int) -> None:
        token = await feed(st, k, cached_rows, total)
        for _ in range(decode_tokens):
            token = int((await st.decode(states[k], token, (0, k))).logits.argmax())

    async def run() -> tuple[float, int]:
        st = Stepper(model, pool, max_batch_tokens=budget, block_size=BLOCK, lanes=lanes, lane_min_rows=lane_min_rows)
        try:
            if cached_rows:
                await asyncio.gather(*(feed(st, k, 0, cached_rows) for k in range(n)))
            f0 = st.forwards
            t0 = time.perf_counter()
            await asyncio.gather(*(one(st, k) for k in range(n)))
            return time.perf_counter() - t0, st.forwards - f0
        finally:
            st.close()
    return asyncio.run(run())


def fused_ms(model: Any, shapes: dict[int, tuple[int, int, int]], *, budget: int, lanes: int, lane_min_rows: int,
             reps: int) -> dict[int, tuple[float, int]]:
    """For each level ``N: (prompt rows, decode tokens, cached rows)`` of a request, N such
    requests run at once through one stepper: ``N: (median milliseconds, forwards)`` (levels
    alternated)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="kvl-model")
    times: dict[int, list[float]] = {n: [] for n in shapes}
    forwards: dict[int, int] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # batch invariance's rule, as the worker runs
    try:
        for rep in range(reps + 1):                               # the first round warms up
            for n, (rows, decode, cached) in shapes.items():
                dt, forwards[n] = model_seconds(model, n, rows, decode, budget=budget, lanes=lanes,
                                                lane_min_rows=lane_min_rows, pool=pool, seed=rep,
                                                cached_rows=cached)
                if rep:
                    times[n].append(dt)
    finally:
        pool.shutdown()
        torch.set_num_threads(threads)
    return {n: (statistics.median(t) * 1000, forwards[n]) for n, t in times.items()}


def bound(model: Any, levels: list[int], prompt_rows: int, decode_tokens: int, *, budget: int, lanes: int,
          lane_min_rows: int, reps: int, cached_rows: int = 0) -> dict[str, Any]:
    """``model_ratio_c<N>_vs_c1`` for each level: N × one request's model time / N requests' fused."""
    ms = fused_ms(model, {n: (prompt_rows, decode_tokens, cached_rows) for n in [1, *levels]}, budget=budget,
                  lanes=lanes, lane_min_rows=lane_min_rows, reps=reps)
    out: dict[str, Any] = {"bound_prompt_rows": prompt_rows, "bound_decode_tokens": decode_tokens,
                           "bound_cached_rows": cached_rows, "bound_model_ms_c1": round(ms[1][0], 2)}
    for n in levels:
        out[f"bound_model_ms_c{n}"] = round(ms[n][0], 2)
        out[f"bound_forwards_c{n}"] = ms[n][1]
        out[f"model_ratio_c{n}_vs_c1"] = round(n * ms[1][0] / ms[n][0], 3)
    return out


def _shape(run: dict[str, Any]) -> tuple[int, int, int, float]:
    """A level's requests (reuse on), on average: uncached prompt rows, decode tokens, cached
    rows (whole blocks), tokens."""
    r = run["requests"]
    cached = round(run["prompt_tokens"] * run["cached_fraction"] / r / BLOCK) * BLOCK
    return (max(1, round(run["prompt_tokens"] / r) - cached), max(0, round(run["completion_tokens"] / r) - 1),
            cached, (run["prompt_tokens"] + run["completion_tokens"]) / r)


def for_serving(result: dict[str, Any], quick: bool) -> dict[str, Any]:
    """Where ``bench.serving``'s concurrency ratios stand against this machine (empty without
    c = 1 and another level).

    A level of N clients has at most N requests in flight. Were they aligned (arriving together,
    fused as :func:`model_seconds` runs them), the level would take its requests' count / N times
    T_N, the model time of N such requests (each level's own shape: its requests find less cached
    than c = 1's, whose agents run one after another), hence

        throughput_aligned_c<N>_vs_c1 = N × (tokens per request at N / at 1) × (c = 1's wall ms
                                        per request) / T_N

    with c = 1's wall time as measured (its lease, HTTP and close included: what concurrency can
    hide; ``c1_model_share`` is the model's part). Staggered requests can do a little better (one's
    small decode forward beside another's prompt on the second core), so the ceiling replaces T_N
    with W_N / cores, W_N being the same work on one thread in the fewest forwards (the largest
    budget): ``throughput_ceiling_c<N>_vs_c1``. Each timed request's new rows attend over its
    cached rows (restored context), as the level's did.

    Both count the model alone. What the level's requests cost in CPU, every process of the stack
    together (the worker's model and request path, the coordinator, PostgreSQL, NATS, the client:
    ``cpu_ms_per_request`` of the level, measured), bounds it too: no schedule on ``cores`` cores
    passes

        throughput_cpu_bound_c<N>_vs_c1 = cores × (tokens per request at N / at 1) × (c = 1's wall
                                          ms per request) / (CPU ms per request at N)

    at this build's cost per request (a schedule that made requests cheaper would raise it).
    """
    from shared.config import MAX_BATCH_TOKENS
    from worker.model import build_model
    from worker.stepper import usable_cores

    c1 = result.get("c1", {}).get("on")
    levels = sorted(n for n in result.get("workload", {}).get("levels", ()) if n != 1)
    if not c1 or not c1.get("requests") or not levels:
        return {}
    t0 = time.perf_counter()
    shapes = {1: _shape(c1), **{n: _shape(result[f"c{n}"]["on"]) for n in levels}}
    _log("request shapes (uncached prompt rows + decode tokens, over cached rows): "
         + ", ".join(f"c{n} {r}+{d}/{k}" for n, (r, d, k, _) in shapes.items()) + " ...")
    if result.get("model_dir"):     # bench.serving --model-dir: the checkpoint its worker served
        from worker.model.checkpoint import load_checkpoint
        model = load_checkpoint(result["model_dir"], dtype=result.get("dtype", "auto")).model
    else:
        model = build_model(seed=0)
    reps = 3 if quick else 5
    lanes, floor = result["model_lanes_resolved"], result["lane_min_rows"]
    sizes = {n: sh[:3] for n, sh in shapes.items()}
    ms = fused_ms(model, sizes, budget=result["max_batch_tokens"], lanes=lanes, lane_min_rows=floor, reps=reps)
    # the other two need only the levels above c = 1 (whose figure is its measured wall time)
    above = {n: sizes[n] for n in levels}
    ms_any = (fused_ms(model, above, budget=MAX_BATCH_TOKENS, lanes=lanes, lane_min_rows=floor, reps=reps)
              if result["max_batch_tokens"] < MAX_BATCH_TOKENS else ms)
    work = fused_ms(model, above, budget=MAX_BATCH_TOKENS, lanes=1, lane_min_rows=floor, reps=reps)
    cores = usable_cores()
    wall1 = 1000 * c1["wall_s"] / c1["requests"]
    out: dict[str, Any] = {"c1_wall_ms_per_request": round(wall1, 2), "bound_model_ms_c1": round(ms[1][0], 2),
                           "c1_model_share": round(ms[1][0] / wall1, 3), "bound_cores": cores}
    for n in levels:
        out[f"bound_model_ms_c{n}"] = round(ms[n][0], 2)
        out[f"bound_forwards_c{n}"] = ms[n][1]
        out[f"bound_work_ms_c{n}"] = round(work[n][0], 2)
        tokens = n * shapes[n][3] / shapes[1][3] * wall1
        aligned = tokens / ms[n][0]
        out[f"throughput_aligned_c{n}_vs_c1"] = round(aligned, 3)
        out[f"throughput_aligned_c{n}_vs_c1_any_budget"] = round(tokens / ms_any[n][0], 3)
        out[f"throughput_ceiling_c{n}_vs_c1"] = round(tokens * cores / work[n][0], 3)
        measured = result.get(f"throughput_c{n}_vs_c1")
        if measured:
            out[f"throughput_c{n}_vs_aligned"] = round(measured / aligned, 3)
        cpu = sum(result[f"c{n}"]["on"].get("cpu_ms_per_request", {}).values())
        if cpu:
            out[f"cpu_ms_per_request_c{n}"] = round(cpu, 2)
            out[f"throughput_cpu_bound_c{n}_vs_c1"] = round(tokens / n * cores / cpu, 3)   # per request, not per N
    out["bound_s"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.serving_bound", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 repetitions instead of 5")
    ap.add_argument("--levels", default="8,32", help="concurrency levels (default 8,32)")
    ap.add_argument("--prompt-rows", type=int, default=160,
                    help="uncached prompt tokens per request (default 160: bench.serving's agent workload, reuse on)")
    ap.add_argument("--cached-rows", type=int, default=432,
                    help="cached prompt tokens each request's new rows attend over, whole blocks (default 432: "
                         "bench.serving's agent workload at c = 1)")
    ap.add_argument("--decode-tokens", type=int, default=3,
                    help="decode forwards per request after the prefill's token (default 3: max_tokens 4)")
    ap.add_argument("--max-batch-tokens", type=int, default=0, help="service.max_batch_tokens (default: the config's)")
    ap.add_argument("--model-lanes", type=int, default=-1, help="service.model_lanes (default: the config's)")
    args = ap.parse_args(argv)
    try:
        levels = [int(x) for x in args.levels.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--levels: comma-separated integers, got {args.levels!r}")
    if not levels or min(levels) < 2:
        ap.error("--levels: concurrency levels of 2 or more")
    if args.prompt_rows < 1 or args.decode_tokens < 0:
        ap.error("--prompt-rows: 1 or more; --decode-tokens: 0 or more")
    if args.cached_rows < 0 or args.cached_rows % BLOCK:
        ap.error(f"--cached-rows: 0 or more, a multiple of the block size ({BLOCK})")
    from shared.config import MAX_BATCH_TOKENS, ServiceConfig
    if not 0 <= args.max_batch_tokens <= MAX_BATCH_TOKENS:
        ap.error(f"--max-batch-tokens: 1 to {MAX_BATCH_TOKENS} (0: the config's default)")
    if not -1 <= args.model_lanes <= 16:
        ap.error("--model-lanes: 0 (automatic) to 16 (default: the config's)")
    from worker.model import build_model
    from worker.stepper import resolve_lanes

    svc = ServiceConfig()
    budget = args.max_batch_tokens or svc.max_batch_tokens
    lanes = resolve_lanes(svc.model_lanes if args.model_lanes < 0 else args.model_lanes, "cpu")
    t0 = time.perf_counter()
    model = build_model(seed=0)
    _log(f"{len(levels)} levels, {args.prompt_rows} prompt rows + {args.decode_tokens} decode tokens a request over "
         f"{args.cached_rows} cached rows, budget {budget}, {lanes} lane(s) ...")
    result = {"bench": "serving_bound", "mode": "quick" if args.quick else "full", "max_batch_tokens": budget,
              "model_lanes": lanes, "lane_min_rows": svc.lane_min_rows,
              **bound(model, levels, args.prompt_rows, args.decode_tokens, budget=budget, lanes=lanes,
                      lane_min_rows=svc.lane_min_rows, reps=3 if args.quick else 5, cached_rows=args.cached_rows),
              "elapsed_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
