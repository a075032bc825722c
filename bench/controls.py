"""What telling a worker about an invalidation costs: one control per block against one per
``MAX_CONTROL_BLOCKS`` blocks (``invalidate_blocks``, what the coordinator sends since stop 39).

An operator's worker or namespace invalidation, and a disown, tell every holder each block the
decision covered, with its GPU generations (``coordinator.core.drop_controls``), sent by
``coordinator.controls.send_controls`` (32 in flight). The bench sends ``--blocks`` blocks both
ways over NATS to a responder in a process of its own that decodes each control as a worker's
NATS adapter does (every field validated) and acks it, and reports the seconds each way (median
of ``--reps``). What it leaves out: the worker dropping the bytes, the same per block both ways.

    python -m bench.controls [--blocks 10000] [--reps 3]

``--nats-url`` (default ``$KVL_NATS_URL``), else an embedded NATS is started. The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SUBJECT = "kvl-bench.controls.w1"
#: The forms a tiny-model block has (a control names each one's GPU generation).
FORMS = ("compressed", "swa", "tail", "indexer")

RESPONDER = f"""
import asyncio, sys
import nats
from shared.messages import Control, ControlAck, decode, encode
async def main():
    nc = await nats.connect(sys.argv[1])
    async def on_control(msg):
        c = decode(msg.data, expect=Control)
        await msg.respond(encode(ControlAck(worker_id="w1", affected=len(c.blocks) or 1)))
    await nc.subscribe({SUBJECT!r}, cb=on_control)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def controls(blocks: int) -> dict[str, list[Any]]:
    """The same invalidation both ways: a control per block, and what ``drop_controls`` sends."""
    from coordinator.core.commands import block_controls
    from shared.messages import Control
    named = [(f"{i + 1:032x}", {f: 7 for f in FORMS}) for i in range(blocks)]
    return {"per_block": [Control(action="invalidate_block", block_hash=b, generations=g, reason="bench")
                          for b, g in named],
            "batched": block_controls(named, "bench")}


async def measure(nats_url: str, blocks: int, reps: int) -> dict[str, Any]:
    import nats

    from coordinator.controls import send_controls
    from shared.messages import ControlAck, decode, encode
    responder = subprocess.Popen([sys.executable, "-c", RESPONDER, nats_url], stdout=subprocess.PIPE, text=True,
                                 cwd=Path(__file__).resolve().parent.parent)
    nc = None
    try:
        if responder.stdout is None or responder.stdout.readline().strip() != "ready":
            raise RuntimeError("the responder did not start")
        nc = await nats.connect(nats_url)

        async def control(wid: str, c: Any) -> str:
            r = await nc.request(SUBJECT, encode(c), timeout=30)
            decode(r.data, expect=ControlAck)
            return "acked"
        ways = controls(blocks)
        times: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(reps):
            for way, cs in ways.items():      # alternated: both sample the same machine load
                t0 = time.perf_counter()
                got = await send_controls(control, {"w1": cs})
                times[way].append(time.perf_counter() - t0)
                if got != {"w1": "acked"}:
                    raise RuntimeError(f"{way}: {got}")
        per_block, batched = (statistics.median(times[k]) for k in ("per_block", "batched"))
        _log(f"{blocks:,} blocks: a control per block {per_block:.3f} s ({len(ways['per_block']):,} messages), "
             f"batched {batched:.3f} s ({len(ways['batched'])} messages)")
        return {"blocks": blocks, "forms": len(FORMS), "reps": reps,
                "per_block_messages": len(ways["per_block"]), "batched_messages": len(ways["batched"]),
                "per_block_s": round(per_block, 4), "batched_s": round(batched, 4),
                "batched_speedup": round(per_block / batched, 1) if batched > 0 else None}
    finally:
        if nc is not None:
            await nc.close()
        responder.kill()
        responder.wait()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.nats_url:
        return await measure(args.nats_url, args.blocks, args.reps)
    from shared.embedded import EmbeddedNats
    with tempfile.TemporaryDirectory(prefix="kvl-bench-controls-") as tmp:
        _log("starting an embedded NATS ...")
        server = await asyncio.to_thread(EmbeddedNats(Path(tmp) / "nats").start)
        try:
            return await measure(server.url, args.blocks, args.reps)
        finally:
            await asyncio.to_thread(server.stop)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.controls", description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=10_000, help="blocks the invalidation covers (default 10000)")
    ap.add_argument("--reps", type=int, default=3, help="runs each way; the median is reported (default 3)")
    ap.add_argument("--nats-url", default=os.environ.get("KVL_NATS_URL", ""))
    args = ap.parse_args(argv)
    if args.blocks < 1 or args.reps < 1:
        ap.error("--blocks and --reps must be ≥ 1")
    from bench.cli import run_and_print
    return run_and_print(run(args))


if __name__ == "__main__":
    main()
