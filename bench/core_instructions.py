"""Instructions the coordinator's core spends per unit of its three hot paths, counted by
callgrind: a measure that does not move with this VM's speed (one timed run of the same code
moved by up to a third between minutes here), for A/Bs of a tenth or less.

* ``fold``: a replay's inner loop (``state.fold_rows``, indexes deferred as ``load_state``
  folds), per event of a log the core's own commands built (``bench.coordinator.log_builder.LogBuilder``:
  a 512-slot pool kept full, ~92 % commit transitions);
* ``ingest``: per transition, what the coordinator does with a worker's 256-transition batch
  message once fetched: decode and validate it, judge each transition, apply, encode each
  event for the log (``ledger.to_new_event``);
* ``lease``: per acquire, the bench's lease shape (16 blocks, 12 READY and cached, 4 new, on a
  full pool, so each grant evicts 4): decode the request, decide, apply, encode the event and
  the reply.

Each workload runs in a child process under ``valgrind --tool=callgrind`` twice, once stopping
after its setup; the difference over the units is the figure (the interpreter's start, the
imports and the setup cancel out). Without valgrind (``--no-valgrind``) only the wall time per
unit is reported. ``--repo`` measures another checkout (e.g. a worktree of the parent commit).

    python -m bench.core_instructions [--quick] [--workloads fold,ingest,lease] [--repo DIR]

Needs valgrind (Debian: ``apt-get install valgrind``). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = ("fold", "ingest", "lease")
#: Units per workload (full, quick): events folded, transitions ingested, leases decided.
SIZES = {"fold": (30_000, 10_000), "ingest": (5_120, 2_560), "lease": (1_000, 400)}
UNIT = {"fold": "event", "ingest": "transition", "lease": "acquire"}


def _log(msg: str) -> None:
    print(f"[bench.core_instructions {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- the workloads (run in the child: setup, then the measured part) ----------------------------

def fold_workload(n: int) -> tuple[Callable[[], Any], int]:
    import contextlib

    from bench.coordinator.log_builder import LogBuilder
    from coordinator.core import CoreParams, LedgerState
    from coordinator.core import state as core_state
    from coordinator.ledger import to_new_event

    fold_rows, no_gc = core_state.fold_rows, core_state.no_gc
    # an older checkout (an A/B's parent) kept the indexes while folding
    deferred = getattr(core_state, "indexes_deferred", contextlib.nullcontext)

    b = LogBuilder(CoreParams())
    rows: list[tuple[int, bytes]] = []
    evs = b.start()
    while len(rows) < n:
        rows += [(len(rows) + 1 + i, to_new_event(e).payload) for i, e in enumerate(evs)]   # positions 1, 2, 3, …
        evs = b.request()
    del rows[n:]

    def work() -> Any:
        state = LedgerState.empty(CoreParams())
        with no_gc(), deferred(state):
            for i in range(0, len(rows), 1000):
                fold_rows(state, rows[i:i + 1000])
        return state
    return work, len(rows)


def _worker(slots: int) -> tuple[Any, int, int]:
    """A ledger state with one registered worker of ``slots`` slots: (state, epoch, now)."""
    from bench.coordinator.harness import NS, catalogue
    from coordinator import core
    from shared import messages as m

    state = core.LedgerState.empty(core.CoreParams(lease_ttl_ms=10**9))
    now = 1_800_000_000_000
    reply, evs = core.register_worker(state, m.WorkerRegister(worker_id="corew", namespace=NS, catalogue=catalogue(),
                                                              pool_slots={"compressed": slots}), now)
    for e in evs:
        core.apply(state, e)
    return state, reply.epoch, now


def _grant(state: Any, epoch: int, now: int, hashes: list[str], lease_id: str) -> Any:
    from bench.coordinator.harness import NS
    from coordinator import core
    from shared import messages as m

    g, evs = core.acquire_lease(state, m.LeaseAcquire(worker_id="corew", epoch=epoch, request_id=lease_id, namespace=NS,
                                                      block_hashes=hashes, write_forms=["compressed"], reuse=True),
                                now, lease_id)
    if not isinstance(g, m.LeaseGrant):
        raise RuntimeError(f"setup: acquire refused: {g}")
    for e in evs:
        core.apply(state, e)
    return g


def ingest_workload(n: int) -> tuple[Callable[[], Any], int]:
    from bench.coordinator.harness import h
    from bench.coordinator.synthetic_worker import commit_transition
    from coordinator import core
    from coordinator.ledger import to_new_event
    from shared import messages as m

    state, epoch, now = _worker(2 * n + 256)
    msgs, seq = [], 0
    for k in range(n // 256):
        hashes = [h(1 + 256 * k + i) for i in range(256)]
        g = _grant(state, epoch, now, hashes, f"i{k:015x}")
        ts = []
        for i in g.write["compressed"]:
            seq += 1
            ts.append(commit_transition(epoch, seq, hashes, i, f"i{k:015x}", now, "corew"))
        msgs.append(m.encode(m.TransitionBatch(worker_id="corew", epoch=epoch, events=ts)))

    def work() -> Any:
        out = []
        for data in msgs:
            batch = m.decode(data, expect=(m.TransitionEvent, m.TransitionBatch))
            for t in batch.events:
                evs = core.ingest_transition(state, t, now)
                for e in evs:
                    core.apply(state, e)
                out.extend(to_new_event(e) for e in evs)
        if len(out) != seq or any(o.type != "transition.applied" for o in out):
            raise RuntimeError("ingest: a transition was not applied")
        return out
    return work, seq


def lease_workload(n: int) -> tuple[Callable[[], Any], int]:
    from bench.coordinator.harness import NS, h
    from bench.coordinator.synthetic_worker import commit_transition
    from coordinator import core
    from coordinator.ledger import to_new_event
    from shared import messages as m

    slots = max(4_000, 8 * n)
    state, epoch, now = _worker(slots)
    cached: list[str] = []
    seq = 0
    while len(cached) < slots:                 # fill the pool with READY blocks, then let go of them
        hashes = [h(1 + len(cached) + i) for i in range(min(256, slots - len(cached)))]
        lid = f"f{len(cached):015x}"
        g = _grant(state, epoch, now, hashes, lid)
        for i in g.write["compressed"]:
            seq += 1
            for e in core.ingest_transition(state, commit_transition(epoch, seq, hashes, i, lid, now, "corew"), now):
                core.apply(state, e)
        _, evs = core.release_lease(state, m.LeaseRelease(worker_id="corew", epoch=epoch, lease_id=lid), now)
        for e in evs:
            core.apply(state, e)
        cached += hashes
    rng = random.Random(7)
    fresh = iter(range(10**7, 10**9))
    reqs = []
    for k in range(n):
        # the cached blocks share one last use, so victims go in block-hash order from the
        # bottom: windows from the top half stay READY for the whole run (4 victims per grant)
        s = rng.randrange(len(cached) // 2, len(cached) - 12)
        hashes = cached[s:s + 12] + [h(next(fresh)) for _ in range(4)]
        reqs.append(m.encode(m.LeaseAcquire(worker_id="corew", epoch=epoch, request_id=f"r{k}", namespace=NS,
                                            block_hashes=hashes, write_forms=["compressed"], reuse=True)))

    def work() -> Any:
        grants = 0
        for k, data in enumerate(reqs):
            req = m.decode(data, expect=m.LeaseAcquire)
            g, evs = core.acquire_lease(state, req, now + 1, f"L{k:015x}")
            for e in evs:
                core.apply(state, e)
            [to_new_event(e) for e in evs]
            m.encode(g)
            grants += isinstance(g, m.LeaseGrant) and len(g.evict) == 4
        if grants != len(reqs):
            raise RuntimeError(f"lease: {len(reqs) - grants} of {len(reqs)} acquires were not 4-victim grants")
        return grants
    return work, len(reqs)


BUILD = {"fold": fold_workload, "ingest": ingest_workload, "lease": lease_workload}


def child(workload: str, n: int, setup_only: bool) -> None:
    work, units = BUILD[workload](n)
    if setup_only:
        print(json.dumps({"units": units}))
        return
    t0 = time.perf_counter()
    work()
    print(json.dumps({"units": units, "seconds": time.perf_counter() - t0}))


# --- the parent: run each child under callgrind, or plainly -----------------------------------

_COLLECTED = re.compile(r"Collected : (\d+)")


def _run(repo: Path, workload: str, n: int, setup_only: bool, valgrind: str | None) -> tuple[dict[str, Any], int]:
    """The child's JSON line, and the instructions callgrind collected (0 without valgrind)."""
    # NOTE: this file runs as a script, so the workloads are this build's while everything they
    # import (the core, bench.coordinator's log builder) comes from ``repo``
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", workload, "--units", str(n)]
    if setup_only:
        cmd.append("--setup-only")
    env = {**os.environ, "PYTHONPATH": str(repo)}
    with tempfile.TemporaryDirectory(prefix="kvl-core-ir-") as tmp:
        if valgrind:
            cmd = [valgrind, "--tool=callgrind", f"--callgrind-out-file={tmp}/out"] + cmd
        p = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{workload} child failed ({p.returncode}): {p.stderr[-2000:]}")
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"{workload} child printed no result: {p.stdout[-500:]} {p.stderr[-500:]}")
    ir = 0
    if valgrind:
        found = _COLLECTED.findall(p.stderr)
        if not found:
            raise RuntimeError(f"{workload}: callgrind reported no instruction count: {p.stderr[-500:]}")
        ir = int(found[-1])
    return json.loads(lines[-1]), ir


def run(workloads: list[str], quick: bool, repo: Path, use_valgrind: bool) -> dict[str, Any]:
    valgrind = shutil.which("valgrind") if use_valgrind else None
    if use_valgrind and valgrind is None:
        raise SystemExit("bench.core_instructions: valgrind is not installed (Debian: apt-get install valgrind); "
                         "--no-valgrind reports wall times only")
    out: dict[str, Any] = {"bench": "core_instructions", "repo": str(repo), "quick": quick,
                           "counted_by": "callgrind" if valgrind else "none"}
    for w in workloads:
        n = SIZES[w][1 if quick else 0]
        _log(f"{w}: {n:,} {UNIT[w]}s{' under callgrind (setup, then setup + work)' if valgrind else ''} ...")
        plain, _ = _run(repo, w, n, False, None)
        units = plain["units"]
        out[f"{w}_units"] = units
        out[f"{w}_us_per_{UNIT[w]}"] = round(plain["seconds"] / units * 1e6, 2)
        if valgrind:
            _, base = _run(repo, w, n, True, valgrind)
            _, total = _run(repo, w, n, False, valgrind)
            out[f"{w}_instructions_per_{UNIT[w]}"] = round((total - base) / units)
        _log(f"{w}: " + ", ".join(f"{k} {v}" for k, v in out.items() if k.startswith(w + "_")))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    ap = argparse.ArgumentParser(prog="python -m bench.core_instructions", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer units per workload (a third to a half)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}")
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout to measure (default: this one)")
    ap.add_argument("--no-valgrind", action="store_true", help="wall time per unit only")
    ap.add_argument("--child", choices=WORKLOADS, help=argparse.SUPPRESS)
    ap.add_argument("--units", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--setup-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        # run as a script: its own folder first on sys.path would make bench/coordinator.py
        # shadow the coordinator package
        here = Path(__file__).resolve().parent
        sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != here]
        child(args.child, args.units, args.setup_only)
        return None
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or not workloads:
        ap.error(f"--workloads: expected a subset of {','.join(WORKLOADS)}, got {args.workloads!r}")
    repo = args.repo.resolve()
    if not (repo / "coordinator" / "core" / "state.py").is_file():
        ap.error(f"--repo: {repo} is not a kvledger checkout")
    result = run(workloads, args.quick, repo, not args.no_valgrind)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
