"""The most concurrency can buy here: N requests' model work fused as well as the stepper can fuse
it, against one request's, timed on this machine.

``bench.serving``'s ``throughput_cN_vs_c1`` divides the tokens/s of N concurrent clients by one
client's. Whatever the scheduler does, N requests in flight cost at least the model time of their
prompts and decode tokens run in the fewest, fullest forwards the stepper forms — every prompt
packed into ``service.max_batch_tokens``-row forwards (split into lanes from
``service.lane_min_rows`` rows up), then each decode step one forward for all N. This bench runs
exactly that through the worker's own stepper and model (the built-in tiny model bench.serving
serves), N requests submitted at once:

* ``python -m bench.serving_bound``: ``model_ratio_c<N>_vs_c1`` = N × one request's model time /
  N requests' fused model time (requests of ``--prompt-rows`` uncached prompt tokens and
  ``--decode-tokens`` decode forwards): what fusing buys the model's work alone;
* ``bench.serving`` (after its levels, :func:`for_serving`): ``throughput_bound_c<N>_vs_c1``, the
  upper bound of its measured ratio given c = 1's measured wall time per request, and
  ``throughput_c<N>_vs_bound``, how close the level came.
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
#: The largest ``service.max_batch_tokens`` the config accepts.
MAX_BUDGET = 65536


def _log(msg: str) -> None:
    print(f"[bench.serving_bound {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def model_seconds(model: Any, n: int, prompt_rows: int, decode_tokens: int, *, budget: int, lanes: int,
                  lane_min_rows: int, pool: ThreadPoolExecutor, seed: int = 0) -> tuple[float, int]:
    """Seconds for ``n`` requests of ``prompt_rows`` prompt tokens and ``decode_tokens`` decode
    tokens each, all submitted at once to one stepper: ``(seconds, forwards)``."""
    from worker.stepper import Stepper

    g = torch.Generator().manual_seed(seed)
    vocab = model.cfg.vocab_size
    prompts = [torch.randint(0, vocab, (prompt_rows,), generator=g).tolist() for _ in range(n)]

    async def one(st: Stepper, k: int, prompt: list[int]) -> None:
        state = model.new_state(BLOCK, -(-(prompt_rows + decode_tokens + 1) // BLOCK) * BLOCK)
        done = 0

        def plan(allowed: int | None) -> tuple[list[int], list[int]]:
            take = len(prompt) - done if allowed is None else min(allowed, len(prompt) - done)
            return prompt[done:done + take], []

        r = None
        while done < len(prompt):
            r = await st.prefill(state, plan, (0, k))
            done += r.tokens
        token = int(r.logits.argmax()) if r is not None else 0
        for _ in range(decode_tokens):
            token = int((await st.decode(state, token, (0, k))).logits.argmax())

    async def run() -> tuple[float, int]:
        st = Stepper(model, pool, max_batch_tokens=budget, block_size=BLOCK, lanes=lanes, lane_min_rows=lane_min_rows)
        try:
            t0 = time.perf_counter()
            await asyncio.gather(*(one(st, k, p) for k, p in enumerate(prompts)))
            return time.perf_counter() - t0, st.forwards
        finally:
            st.close()
    return asyncio.run(run())


def fused_ms(model: Any, shapes: dict[int, tuple[int, int]], *, budget: int, lanes: int, lane_min_rows: int,
             reps: int) -> dict[int, tuple[float, int]]:
    """For each level ``N: (prompt rows, decode tokens)`` of a request, N such requests run at
    once through one stepper: ``N: (median milliseconds, forwards)`` (levels alternated)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="kvl-model")
    times: dict[int, list[float]] = {n: [] for n in shapes}
    forwards: dict[int, int] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # batch invariance's rule, as the worker runs
    try:
        for rep in range(reps + 1):                               # the first round warms up
            for n, (rows, decode) in shapes.items():
                dt, forwards[n] = model_seconds(model, n, rows, decode, budget=budget, lanes=lanes,
                                                lane_min_rows=lane_min_rows, pool=pool, seed=rep)
                if rep:
                    times[n].append(dt)
    finally:
        pool.shutdown()
        torch.set_num_threads(threads)
    return {n: (statistics.median(t) * 1000, forwards[n]) for n, t in times.items()}


def bound(model: Any, levels: list[int], prompt_rows: int, decode_tokens: int, *, budget: int, lanes: int,
          lane_min_rows: int, reps: int) -> dict[str, Any]:
    """``model_ratio_c<N>_vs_c1`` for each level: N × one request's model time / N requests' fused."""
    ms = fused_ms(model, {n: (prompt_rows, decode_tokens) for n in [1, *levels]}, budget=budget, lanes=lanes,
                  lane_min_rows=lane_min_rows, reps=reps)
    out: dict[str, Any] = {"bound_prompt_rows": prompt_rows, "bound_decode_tokens": decode_tokens,
                           "bound_model_ms_c1": round(ms[1][0], 2)}
    for n in levels:
        out[f"bound_model_ms_c{n}"] = round(ms[n][0], 2)
        out[f"bound_forwards_c{n}"] = ms[n][1]
        out[f"model_ratio_c{n}_vs_c1"] = round(n * ms[1][0] / ms[n][0], 3)
    return out


def _shape(run: dict[str, Any]) -> tuple[int, int, float]:
    """A level's requests (reuse on), on average: uncached prompt rows, decode tokens, tokens."""
    r = run["requests"]
    return (max(1, round(run["prompt_tokens"] * (1 - run["cached_fraction"]) / r)),
            max(0, round(run["completion_tokens"] / r) - 1), (run["prompt_tokens"] + run["completion_tokens"]) / r)


def for_serving(result: dict[str, Any], quick: bool) -> dict[str, Any]:
    """The bound for ``bench.serving``'s result (empty without c = 1 and another level).

    A level of N clients runs its requests at most N at a time, so its wall time is at least its
    requests' count / N times the model time of N such requests fused (each level's own shape: a
    level's requests find less cached than c = 1's, whose agents run one after another). Hence

        throughput_c<N>_vs_c1 <= N × (tokens per request at N / at 1) × (c = 1's wall ms per
                                 request) / (N requests' fused model ms)  = ``throughput_bound_c<N>_vs_c1``

    with c = 1's wall time as measured (its lease, HTTP and commits included: what concurrency
    can hide). ``c1_model_share``: the model's part of a c = 1 request's wall time.
    ``..._any_budget``: the same bound with the largest token budget the config accepts (fewer,
    fuller forwards), so that no budget setting can pass it either.
    """
    from worker.model import build_model

    c1 = result.get("c1", {}).get("on")
    levels = sorted(int(k[1:]) for k in result if k.startswith("c") and k[1:].isdigit() and k != "c1")
    if not c1 or not c1.get("requests") or not levels:
        return {}
    t0 = time.perf_counter()
    shapes = {1: _shape(c1), **{n: _shape(result[f"c{n}"]["on"]) for n in levels}}
    _log("request shapes (uncached prompt rows, decode tokens): "
         + ", ".join(f"c{n} {r}+{d}" for n, (r, d, _) in shapes.items()) + " ...")
    model = build_model(seed=0)
    kw = {"lanes": result["model_lanes_resolved"], "lane_min_rows": result["lane_min_rows"], "reps": 3 if quick else 5}
    sizes = {n: sh[:2] for n, sh in shapes.items()}
    ms = fused_ms(model, sizes, budget=result["max_batch_tokens"], **kw)
    # the same with the largest budget the config allows: what no setting of it can pass
    ms_any = fused_ms(model, sizes, budget=MAX_BUDGET, **kw) if result["max_batch_tokens"] < MAX_BUDGET else ms
    wall1 = 1000 * c1["wall_s"] / c1["requests"]
    out: dict[str, Any] = {"c1_wall_ms_per_request": round(wall1, 2), "bound_model_ms_c1": round(ms[1][0], 2),
                           "c1_model_share": round(ms[1][0] / wall1, 3)}
    for n in levels:
        out[f"bound_model_ms_c{n}"] = round(ms[n][0], 2)
        out[f"bound_forwards_c{n}"] = ms[n][1]
        tokens = n * shapes[n][2] / shapes[1][2] * wall1
        b = tokens / ms[n][0]
        out[f"throughput_bound_c{n}_vs_c1"] = round(b, 3)
        out[f"throughput_bound_c{n}_vs_c1_any_budget"] = round(tokens / ms_any[n][0], 3)
        measured = result.get(f"throughput_c{n}_vs_c1")
        if measured:
            out[f"throughput_c{n}_vs_bound"] = round(measured / b, 3)
    out["bound_s"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.serving_bound", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 repetitions instead of 5")
    ap.add_argument("--levels", default="8,32", help="concurrency levels (default 8,32)")
    ap.add_argument("--prompt-rows", type=int, default=160,
                    help="uncached prompt tokens per request (default 160: bench.serving's agent workload, reuse on)")
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
    from shared.config import ServiceConfig
    from worker.model import build_model
    from worker.stepper import resolve_lanes

    svc = ServiceConfig()
    budget = args.max_batch_tokens or svc.max_batch_tokens
    lanes = resolve_lanes(svc.model_lanes if args.model_lanes < 0 else args.model_lanes, "cpu")
    t0 = time.perf_counter()
    model = build_model(seed=0)
    _log(f"{len(levels)} levels, {args.prompt_rows} prompt rows + {args.decode_tokens} decode tokens a request, "
         f"budget {budget}, {lanes} lane(s) ...")
    result = {"bench": "serving_bound", "mode": "quick" if args.quick else "full", "max_batch_tokens": budget,
              "model_lanes": lanes, "lane_min_rows": svc.lane_min_rows,
              **bound(model, levels, args.prompt_rows, args.decode_tokens, budget=budget, lanes=lanes,
                      lane_min_rows=svc.lane_min_rows, reps=3 if args.quick else 5),
              "elapsed_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
