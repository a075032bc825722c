"""What model lanes (``service.model_lanes``) buy a CPU worker: one fused forward on the model
thread against the same requests split by request into two forwards run at once.

Each case hands a :class:`worker.stepper.Stepper` ``B`` requests of ``P`` prompt tokens each
(one step: every prompt fits the budget), once with ``lanes=1`` and once with ``lanes=2`` and
``lane_min_rows=2`` (always split), alternating, ``--reps`` times, and reports the median wall
time of the step each way and their ratio. Every request's logits must be bit-identical both
ways (``lanes_bit_identical``). Models: the built-in tiny hybrid (64 wide, what
``bench.serving`` runs) and two dense Llama-shaped models 512 and 1,024 wide (4 layers,
random weights: what a larger checkpoint does per row, without loading one).

    python -m bench.lanes [--quick] [--reps 6]

Needs 2 usable cores to mean anything (it says how many it had). The last line printed is one
JSON object.
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

#: (model, requests, prompt tokens each); decode cases have 1 token each.
CASES = [("tiny", 8, 1), ("tiny", 2, 256), ("tiny", 4, 256), ("tiny", 8, 128),
         ("dense512", 8, 1), ("dense512", 4, 64), ("dense512", 8, 64),
         ("dense1024", 8, 1), ("dense1024", 2, 64), ("dense1024", 4, 64)]
QUICK = [("tiny", 8, 1), ("tiny", 4, 256), ("dense512", 8, 1), ("dense512", 8, 64), ("dense1024", 2, 64)]
BLOCK = 16


def _log(msg: str) -> None:
    print(f"[bench.lanes {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build(name: str) -> Any:
    from worker.model import build_model
    from worker.model.dense import DenseConfig, build_dense
    if name == "tiny":
        return build_model(seed=0)
    width = int(name.removeprefix("dense"))
    cfg = DenseConfig(hidden_size=width, intermediate_size=width * 11 // 4, num_attention_heads=width // 64,
                      num_key_value_heads=max(1, width // 256), head_dim=64, vocab_size=4096)
    return build_dense(cfg, seed=0, dtype=torch.float32)


def step_once(model: Any, prompts: list[list[int]], lanes: int, pool: ThreadPoolExecutor) -> tuple[float, list]:
    """One stepper step of every prompt (decode-sized prompts included): seconds, logits."""
    from worker.stepper import Stepper

    async def run() -> tuple[float, list]:
        st = Stepper(model, pool, max_batch_tokens=65536, block_size=BLOCK, lanes=lanes, lane_min_rows=2)
        states = [model.new_state(BLOCK, 512) for _ in prompts]
        try:
            t0 = time.perf_counter()
            got = await asyncio.gather(*(st.prefill(s, lambda _m, p=p: (p, []), (0, k))
                                         for k, (s, p) in enumerate(zip(states, prompts))))
            dt = time.perf_counter() - t0
            if st.forwards != 1 or st.split_forwards != (1 if lanes > 1 else 0):
                raise RuntimeError(f"expected one forward ({st.forwards}), split {st.split_forwards}")
            return dt, [r.logits for r in got]
        finally:
            st.close()
    return asyncio.run(run())


def measure(model: Any, name: str, b: int, p: int, reps: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(b * 1000 + p)
    prompts = [torch.randint(0, model.cfg.vocab_size, (p,), generator=g).tolist() for _ in range(b)]
    pool = ThreadPoolExecutor(1, thread_name_prefix="kvl-model")
    try:
        times: dict[int, list[float]] = {1: [], 2: []}
        outs: dict[int, list] = {}
        for lanes in (1, 2):                                  # warm-up, both ways
            step_once(model, prompts, lanes, pool)
        for _ in range(reps):
            for lanes in (1, 2):
                dt, outs[lanes] = step_once(model, prompts, lanes, pool)
                times[lanes].append(dt)
    finally:
        pool.shutdown()
    one, two = (statistics.median(times[k]) * 1000 for k in (1, 2))
    same = all(torch.equal(a.contiguous().view(torch.uint8), b_.contiguous().view(torch.uint8))
               for a, b_ in zip(outs[1], outs[2]))
    return {"case": f"{name}_{b}x{p}", "rows": b * p, "one_forward_ms": round(one, 2), "two_lanes_ms": round(two, 2),
            "speedup": round(one / two, 3), "bit_identical": same}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.lanes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="five cases, 3 repetitions (within 60 s)")
    ap.add_argument("--reps", type=int, default=0, help="repetitions per case and way (default 6, quick 3)")
    args = ap.parse_args(argv)
    if args.reps < 0:
        ap.error("--reps: a positive count (0: the default)")
    reps = args.reps or (3 if args.quick else 6)
    torch.set_num_threads(1)         # the rule batch invariance needs; lanes are the other way to more cores
    from worker.stepper import usable_cores
    cores = usable_cores()
    t0 = time.perf_counter()
    models: dict[str, Any] = {}
    rows = []
    for name, b, p in (QUICK if args.quick else CASES):
        if name not in models:
            _log(f"building {name} ...")
            models[name] = build(name)
            if failures := models[name].check_invariance(BLOCK):
                raise SystemExit(f"{name}: the batch-invariance probe fails on this machine: {failures[:2]}")
        r = measure(models[name], name, b, p, reps)
        _log(f"{r['case']}: one forward {r['one_forward_ms']} ms, two lanes {r['two_lanes_ms']} ms "
             f"({r['speedup']}x), bits {'same' if r['bit_identical'] else 'DIFFER'}")
        rows.append(r)
    result = {"bench": "lanes", "mode": "quick" if args.quick else "full", "usable_cores": cores,
              "torch_threads": torch.get_num_threads(), "reps": reps, "cases": rows,
              "lanes_bit_identical": all(r["bit_identical"] for r in rows),
              **{f"lane_speedup_{r['case']}": r["speedup"] for r in rows},
              "elapsed_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
