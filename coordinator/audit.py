"""The audit: is the live state what the log says, and what the workers hold? Read-only.

1. Freeze the ledger for a moment (decisions wait, queued events commit), note the live
   state's hash, the log position it corresponds to, its invariant violations, and what it
   says each live worker holds; unfreeze.
2. Replay the log up to that position into a fresh state — from empty by default, or from
   the latest snapshot — checking that positions are dense and each stream's versions run
   1, 2, 3, …; compare the hashes; check the invariants of the replayed state too.
3. Ask every live worker for its inventory (``InventoryRequest`` → ``InventoryReply``, with
   a timeout) and report drift both ways: replicas the ledger has that the worker does not
   report (or reports differently), and replicas the worker reports that the ledger does
   not have live.

Nothing is appended; the audit never changes the state it checks.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from coordinator.core import check_invariants, state_hash
from coordinator.core.lifecycle import LIVE
from coordinator.ledger import Ledger
from coordinator.replay import LogCorrupt, load_state
from shared.messages import InventoryReply

#: Drift entries listed per worker and direction (counts are always complete).
MAX_LISTED = 50


async def run_audit(ledger: Ledger, inventory: Any = None, *, from_snapshot: bool = False,
                    check_workers: bool = True, timeout_s: float = 2.0, logger: Any = None) -> dict[str, Any]:
    """The audit report (JSON-ready). ``inventory(worker_id, timeout_s)`` asks one worker."""
    t0 = time.perf_counter()
    async with ledger.frozen() as live:
        position = ledger.position
        live_hash = state_hash(live)
        live_violations = check_invariants(live)
        expected: dict[str, tuple[int, dict[tuple[str, str, str], tuple[str, int]]]] = {
            wid: (w.epoch, {}) for wid, w in live.workers.items() if w.alive}
        if check_workers:
            for key, r in live.replicas.items():
                if r.state in LIVE and key[2].startswith("gpu:") and key[2][4:] in expected:
                    expected[key[2][4:]][1][key] = (r.state.value, r.generation)
    report: dict[str, Any] = {"position": position, "live_hash": live_hash,
                              "replay_from": "snapshot" if from_snapshot else "empty"}
    try:
        result = await load_state(ledger.log, ledger.params, upto=position, use_snapshot=from_snapshot,
                                  check_streams=True, logger=logger, what="audit_replay")
    except LogCorrupt as e:
        report.update(replay_hash=None, hash_match=False, log_errors=[str(e)])
        result = None
    else:
        replay_hash = state_hash(result.state)
        errors = list(result.stream_errors)
        if result.position != position:
            errors.append(f"log ends at position {result.position}, the live state is at {position}")
        report.update(replay_hash=replay_hash, hash_match=replay_hash == live_hash, log_errors=errors,
                      replayed_events=result.events, snapshot_position=result.snapshot_position,
                      replay_seconds=round(result.seconds, 3))
    report["invariant_violations"] = live_violations
    report["replay_invariant_violations"] = check_invariants(result.state) if result is not None else []
    drift: dict[str, Any] = {}
    unreachable: dict[str, str] = {}
    if check_workers and inventory is not None and expected:
        answers = await asyncio.gather(*[inventory(wid, timeout_s) for wid in sorted(expected)])
        for wid, answer in zip(sorted(expected), answers):
            if not isinstance(answer, InventoryReply):
                unreachable[wid] = str(answer)
                continue
            d = _drift(wid, *expected[wid], answer)
            if d:
                drift[wid] = d
    report["workers_checked"] = sorted(set(expected) - set(unreachable)) if check_workers else []
    report["workers_unreachable"] = unreachable
    report["drift"] = drift
    report["ok"] = bool(report.get("hash_match")) and not report["log_errors"] and not live_violations \
        and not report["replay_invariant_violations"] and not drift
    report["duration_ms"] = round((time.perf_counter() - t0) * 1000, 1)
    return report


def _drift(worker_id: str, epoch: int, ledger_has: dict[tuple[str, str, str], tuple[str, int]],
           reply: InventoryReply) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if reply.epoch != epoch:
        out["epoch"] = {"ledger": epoch, "worker": reply.epoch}
    gpu = f"gpu:{worker_id}"  # host and disk tiers are shared, not one worker's to report
    worker_has = {(i.block_hash, i.form, i.location): (i.state.value, i.generation) for i in reply.items
                  if i.state in LIVE and i.location == gpu}
    missing = sorted(k for k in ledger_has if k not in worker_has)
    unknown = sorted(k for k in worker_has if k not in ledger_has)
    differ = sorted(k for k in ledger_has if k in worker_has and worker_has[k] != ledger_has[k])
    if missing:
        out["missing_on_worker"] = {"count": len(missing), "replicas": [list(k) for k in missing[:MAX_LISTED]]}
    if unknown:
        out["unknown_to_ledger"] = {"count": len(unknown), "replicas": [list(k) for k in unknown[:MAX_LISTED]]}
    if differ:
        out["state_differs"] = {"count": len(differ), "replicas": [
            {"replica": list(k), "ledger": list(ledger_has[k]), "worker": list(worker_has[k])}
            for k in differ[:MAX_LISTED]]}
    return out
