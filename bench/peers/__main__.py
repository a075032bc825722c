"""python -m bench.peers: kvledger beside real peers on the same model and workload (see __init__)."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.peers import floor
from bench.peers.load import requests_at, run_level
from bench.peers.report import ABSENT, Failed, Levels, cpu_keys, results_keys
from bench.proc_cpu import tree_cpu, tree_spent
from bench.peers.servers import PEERS, SERVERS, Server, ServerFailed, installed

DTYPES = ("float32", "bfloat16")


def log(msg: str) -> None:
    print(f"bench.peers: {msg}", file=sys.stderr, flush=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__)
    p.add_argument("--quick", action="store_true",
                   help="fewer requests per level; default levels 1,8 and dtype float32")
    p.add_argument("--peers", default=",".join(PEERS), help=f"peers to run beside kvledger (default {','.join(PEERS)})")
    p.add_argument("--dtypes", default=None, help="comma-separated (default float32,bfloat16; quick float32)")
    p.add_argument("--concurrency", default=None, help="levels (default 1,8,32; quick 1,8)")
    p.add_argument("--max-seconds", type=int, default=None,
                   help="cap on each level's guidellm run (default 90; quick 120)")
    p.add_argument("--no-kvledger", action="store_true", help="run the peers only (no ratios)")
    p.add_argument("--keep", action="store_true", help="keep the work dir (guidellm reports, server logs)")
    a = p.parse_args(argv)
    a.peers = [x for x in a.peers.split(",") if x]
    unknown = [x for x in a.peers if x not in PEERS]
    if unknown:
        p.error(f"unknown peer(s) {unknown}; known: {PEERS}")
    a.dtypes = (a.dtypes or ("float32" if a.quick else ",".join(DTYPES))).split(",")
    if any(d not in DTYPES for d in a.dtypes):
        p.error(f"--dtypes: {DTYPES} only")
    a.concurrency = [int(c) for c in (a.concurrency or ("1,8" if a.quick else "1,8,32")).split(",")]
    if any(c < 1 for c in a.concurrency):
        p.error("--concurrency: positive integers")
    a.max_seconds = a.max_seconds or (120 if a.quick else 90)
    return a


def measure_server(name: str, work: Path, model_dir: Path, dtype: str, args: argparse.Namespace,
                   guidellm: Path, running: list[Server], cpu: dict[int, dict[str, float]] | None = None) -> Levels | str:
    """Start ``name`` alone, run every level, stop it; its levels (a level guidellm could not run is
    :class:`Failed`), or why the server failed (a string). ``cpu`` gets each level's CPU seconds by
    process role of the server's whole tree (``bench.proc_cpu.tree_cpu``)."""
    server = SERVERS[name](work / f"{name}-{dtype}", model_dir, dtype)
    running.append(server)
    t0 = time.monotonic()
    try:
        log(f"{name} ({dtype}) starting")
        server.start()
        ready = server.wait_ready()
        server.warm()
        log(f"{name} ({dtype}) ready in {ready:.0f} s at {server.url}")
    except (ServerFailed, OSError, ValueError) as e:
        log(f"{name} ({dtype}) failed: {e}")
        stop(server, running, t0)
        return f"failed: {str(e).splitlines()[0][:200]}"
    levels: Levels = []
    try:
        for c in args.concurrency:
            before = tree_cpu(server.proc.pid) if server.proc is not None else {}
            try:
                levels.append(run_level(guidellm, server.url, server.model_name(), model_dir, c,
                                        requests_at(c, args.quick), args.max_seconds, server.work,
                                        f"{name}-{dtype}"))
            except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired) as e:
                log(f"{name} ({dtype}) c={c} failed: {e}")
                levels.append(Failed(c, str(e).strip().splitlines()[-1][:200]))
            if cpu is not None and server.proc is not None:
                cpu[c] = tree_spent(before, tree_cpu(server.proc.pid))
            server.check_alive()
    except ServerFailed as e:
        log(str(e))
        levels += [Failed(c, "the server exited") for c in args.concurrency[len(levels):]]
    finally:
        stop(server, running, t0)
    return levels


def stop(server: Server, running: list[Server], t0: float) -> None:
    server.stop()
    running.remove(server)
    log(f"{server.name} ({server.dtype}) stopped ({time.monotonic() - t0:.0f} s in all)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvledger.models import smollm2_dir

    guidellm_venv = installed("guidellm")
    if guidellm_venv is None:
        raise SystemExit("bench.peers: guidellm is not installed; run bench/peers/setup.sh --only guidellm")
    guidellm = guidellm_venv / "bin" / "guidellm"
    work = Path(tempfile.mkdtemp(prefix="kvl-bench-peers-"))
    running: list[Server] = []
    keys: dict[str, Any] = {"bench": "peers", "model": "SmolLM2-135M-Instruct", "quick": args.quick,
                            "concurrency": args.concurrency, "dtypes": args.dtypes}
    t_start = time.monotonic()
    try:
        bw = floor.bandwidth()
        gbs = max(bw.values())
        keys.update(mem_bw_copy_gbs=round(bw["copy"], 2), mem_bw_matvec_gbs=round(bw["matvec"], 2))
        log(f"memory bandwidth: copy {bw['copy']:.1f} GB/s, matvec {bw['matvec']:.1f} GB/s")
        for dtype in args.dtypes:
            model_dir = smollm2_dir(dtype, say=log)
            results: dict[str, Levels | str] = {}
            cpu: dict[str, dict[int, dict[str, float]]] = {}
            if not args.no_kvledger:
                cpu["kvledger"] = {}
                results["kvledger"] = measure_server("kvledger", work, model_dir, dtype, args, guidellm, running,
                                                     cpu["kvledger"])
            for peer in args.peers:
                if installed(peer) is None:
                    log(f"{peer}: absent (bench/peers/setup.sh --only {peer} installs it)")
                    results[peer] = ABSENT
                    continue
                cpu[peer] = {}
                results[peer] = measure_server(peer, work, model_dir, dtype, args, guidellm, running, cpu[peer])
            wbytes = floor.weight_bytes(model_dir)
            keys.update(results_keys(dtype, args.dtypes, results, floor.floor_ms(wbytes, gbs)))
            keys.update(cpu_keys(dtype, args.dtypes, cpu))
            keys[f"weight_bytes{'' if len(args.dtypes) == 1 else '_' + dtype}"] = wbytes
    finally:
        for server in list(running):
            server.stop()
        if args.keep:
            log(f"work dir kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    keys["wall_s"] = round(time.monotonic() - t_start)
    return keys


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM stops the servers as Ctrl-C does (through the finally blocks)."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    keys = run(args)
    print(json.dumps(keys))
    return keys


if __name__ == "__main__":
    main()
