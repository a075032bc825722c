"""What a busy event loop costs the model thread at each switch interval (``worker.gil_switch_interval_ms``).

The worker runs forwards on one thread and its event loop (HTTP, NATS, chat templates,
detokenising, JSON) on another, in one process. The model thread calls torch from Python, and
every call releases the GIL and takes it back; when the loop thread holds it at that moment, the
model thread waits until the loop lets go or CPython's switch interval forces it to (5 ms by
default). So any Python work on the loop is charged to the forwards in slices of up to that long.

Each case runs ``--steps`` fused decode forwards of ``--batch`` requests (each ``--history``
tokens deep) on a worker thread, as the stepper does, and times them:

* ``alone`` — the main thread asleep;
* ``busy`` — the main thread running pure Python, without pause (the worst loop: every
  reacquire waits), for each switch interval in ``--intervals``;
* ``bursts`` — the main thread busy 2 ms of every 10 (a loop at 20 %: requests arriving,
  templates rendered), for the same intervals.

Keys: ``step_ms_alone``, ``step_ms_<case>_<interval>``, ``slowdown_<case>_<interval>`` (÷ alone)
and ``loop_share_<case>_<interval>`` (the busy thread's Python work done while the forwards ran ÷
what it does alone in the same time: what a shorter interval takes from the loop).

    python -m bench.model_thread [--quick] [--model-dir DIR] [--dtype float32]

Needs the cores it is given (it says how many it had). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

import torch


def _log(msg: str) -> None:
    print(f"[bench.model_thread {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _model(args: argparse.Namespace) -> Any:
    """``--model-dir`` in ``--dtype``, else a random Llama-shaped model ``--width`` wide (1,024: what
    a small checkpoint does per row, without loading one)."""
    if args.model_dir:
        from worker.model.checkpoint import load_checkpoint
        return load_checkpoint(args.model_dir, dtype=args.dtype).model
    from worker.model.dense import DenseConfig, build_dense
    from worker.model.dense.config import FULL
    w = args.width
    cfg = DenseConfig(hidden_size=w, intermediate_size=w * 11 // 4, num_attention_heads=w // 64,
                      num_key_value_heads=max(1, w // 256), head_dim=64, vocab_size=8192, num_hidden_layers=8,
                      layer_types=(FULL,) * 8)
    return build_dense(cfg, seed=0, dtype=torch.float32)


def _spin(stop: threading.Event, duty: float, counter: list[int]) -> None:
    """Pure Python work (the GIL held throughout) until ``stop``; with ``duty`` < 1, busy
    ``duty`` of every 10 ms and asleep the rest."""
    n = 0
    period = 0.010
    while not stop.is_set():
        end = time.perf_counter() + period * duty
        while time.perf_counter() < end:
            for _ in range(200):
                n += 1
        if duty < 1.0:
            time.sleep(period * (1.0 - duty))
    counter[0] = n


def _spin_rate(duty: float, seconds: float) -> float:
    """Iterations per second of :func:`_spin` with nothing else running."""
    stop, counter = threading.Event(), [0]
    t = threading.Thread(target=_spin, args=(stop, duty, counter))
    t0 = time.perf_counter()
    t.start()
    time.sleep(seconds)
    stop.set()
    t.join()
    return counter[0] / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.model_thread", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and intervals")
    ap.add_argument("--model-dir", default="", help="a checkpoint directory (as worker.model_dir)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--width", type=int, default=1024, help="the random model's width without --model-dir (a multiple of 256)")
    ap.add_argument("--batch", type=int, default=8, help="requests per fused decode forward (default 8)")
    ap.add_argument("--history", type=int, default=256, help="tokens each request holds (default 256)")
    ap.add_argument("--steps", type=int, help="forwards timed per case (default 24, quick 10)")
    ap.add_argument("--intervals", default="", help="switch intervals in ms (default 5,1,0.5,0.2; quick 5,0.5)")
    args = ap.parse_args(argv)
    steps = args.steps or (10 if args.quick else 24)
    intervals = [float(x) for x in (args.intervals or ("5,0.5" if args.quick else "5,1,0.5,0.2")).split(",")]
    cores = len(os.sched_getaffinity(0))
    _log(f"{cores} usable cores; intervals {intervals} ms; {steps} forwards of {args.batch} a case")

    torch.set_num_threads(1)   # batch invariance's rule, as the worker runs (the compiled product has its own threads)
    model = _model(args)
    torch.manual_seed(0)
    block = 16
    capacity = args.history + steps * (1 + 2 * len(intervals)) + 2 * block
    states = [model.new_state(block, -(-capacity // block) * block) for _ in range(args.batch)]
    vocab = model.cfg.vocab_size
    with torch.inference_mode():
        for s in states:
            model.prefill(torch.randint(0, vocab, (args.history,)).tolist(), s)
    tokens = torch.randint(0, vocab, (args.batch,)).tolist()

    def forwards() -> list[float]:
        out = []
        with torch.inference_mode():
            for _ in range(steps):
                t = time.perf_counter()
                model.forward_batch([([tok], s) for tok, s in zip(tokens, states)])
                out.append(time.perf_counter() - t)
        return out

    def on_thread(duty: float | None) -> tuple[float, float]:
        """Median forward ms on a model thread; the loop's share of its solo work rate (or 0)."""
        result: list[list[float]] = []
        model_thread = threading.Thread(target=lambda: result.append(forwards()))
        stop, counter = threading.Event(), [0]
        spinner = threading.Thread(target=_spin, args=(stop, duty, counter)) if duty is not None else None
        if spinner is not None:
            spinner.start()
            time.sleep(0.05)
        t0 = time.perf_counter()
        model_thread.start()
        model_thread.join()
        wall = time.perf_counter() - t0
        share = 0.0
        if spinner is not None:
            stop.set()
            spinner.join()
            share = counter[0] / (_spin_rate(duty, 1.0) * (wall + 0.05))
        return statistics.median(result[0]) * 1e3, share

    before = sys.getswitchinterval()
    keys: dict[str, Any] = {"cores": cores, "batch": args.batch, "history": args.history,
                            "model": args.model_dir or f"dense{args.width} (random, 8 layers)", "dtype": args.dtype}
    try:
        forwards()   # warm
        alone, _ = on_thread(None)
        keys["step_ms_alone"] = round(alone, 2)
        _log(f"alone: {alone:.1f} ms a forward")
        for ms in intervals:
            sys.setswitchinterval(ms / 1000)
            for case, duty in (("busy", 1.0), ("bursts", 0.2)):
                step, share = on_thread(duty)
                tag = f"{case}_{ms:g}ms"
                keys[f"step_ms_{tag}"] = round(step, 2)
                keys[f"slowdown_{tag}"] = round(step / alone, 2)
                keys[f"loop_share_{tag}"] = round(share, 2)
                _log(f"{tag}: {step:.1f} ms a forward ({step / alone:.2f}x alone), the loop kept {share:.0%} of its work")
    finally:
        sys.setswitchinterval(before)
    print(json.dumps(keys))
    return keys


if __name__ == "__main__":
    main()
