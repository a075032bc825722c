"""The audit: is the live state what the log says, and what the workers hold? Read-only.

1. Freeze the ledger for a moment (decisions wait, queued events commit), note the live
   state's hash, the log position it corresponds to, its invariant violations and the live
   workers; unfreeze.
2. Replay the log up to that position into a fresh state — from empty by default, or from
   the latest snapshot — checking that positions are dense and each stream's versions run
   1, 2, 3, …; compare the hashes; check the invariants of the replayed state too.
   Then verify the log's hash chain (:mod:`coordinator.log.chain`) from its anchor — the
   start, the newest archive's head, or (``from_snapshot``) the snapshot's head — up to that
   position: an event edited, deleted, inserted or moved is reported with the first position
   where the chain breaks (``chain.first_break``), and the audit is not ok.
3. Ask every live worker for its inventory — the :func:`shared.hashing.replica_digest` of
   every replica it holds on its GPU *and* its host tier, in pages within NATS max_payload —
   and compare it, tier by tier, with the ledger's READY replicas at ``gpu:<worker>`` and
   ``host:<node>``: replicas listed READY that the worker does not hold (``ledger_only``,
   reported as ``missing_on_worker``) and replicas it holds that the ledger does not list
   live (``worker_only``, reported as ``unknown_to_ledger``). Each worker reports the last
   transition seq it had emitted when it took its inventory; the ledger is read once it has
   committed that seq, so a transition in flight is not drift. A difference that can still be
   a moment's (a grant's eviction the worker is applying, a spill under way) must show again
   in a second round ``confirm_s`` later to be reported. A worker whose epoch is suspended
   (a resume in progress) is skipped (``workers_skipped``).
4. The disk tier (files in the shared offload directory, which the coordinator cannot read):
   one live worker with the directory verifies up to ``disk_checks`` of the ledger's READY
   disk replicas (a random sample when there are more): the file exists, its header names
   the block, form and namespace, and its bytes match the checksum recorded at commit.
   Missing or damaged files still READY in the ledger on a second look are reported.
5. A shard of a sharded ledger (``coordinator.shards`` > 1) also checks that every live block
   belongs to a chain its shard map gives it (:mod:`coordinator.shard_audit`; the ``shard``
   entry, which lists the live blocks for the fleet-wide check of ``kvledger audit --shard-url``).

Nothing is appended; the audit never changes the state it checks.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from coordinator.core import check_invariants, state_hash
from coordinator.core.lifecycle import LIVE
from coordinator.core.state import LedgerState
from coordinator.ledger import Ledger
from coordinator.log.chain import ChainCheck
from coordinator.replay import LogCorrupt, load_state
from coordinator.shard_audit import shard_report
from shared.hashing import replica_digests, split_digests
from shared.messages import DiskRef, InventoryReply, ReplicaState

#: Drift entries listed per worker and direction (counts are always complete).
MAX_LISTED = 50
#: Most disk files one audit asks a worker to verify.
MAX_DISK_CHECKS = 1024
#: Events read per page by the chain check.
CHAIN_PAGE = 5000

Key = tuple[str, str, str]


@dataclass
class Tier:
    """One location compared: what the ledger lists and what its worker(s) hold, by an id
    (a replica digest, or ``key + (generation,)`` for an inventory of items)."""

    location: str
    ledger_ready: dict[Any, Key] = field(default_factory=dict)
    ledger_live: set[Any] = field(default_factory=set)
    held: set[Any] = field(default_factory=set)

    @property
    def ledger_only(self) -> set[Any]:
        return set(self.ledger_ready) - self.held

    @property
    def worker_only(self) -> set[Any]:
        return self.held - self.ledger_live


def compare_tiers(live: LedgerState, worker_id: str, reply: InventoryReply) -> dict[str, Tier]:
    """The worker's inventory against the ledger's READY replicas at ``gpu:<worker>`` and
    ``host:<node>`` (and at any other location the worker says it holds)."""
    w = live.workers[worker_id]
    digests = bool(reply.locations) or bool(reply.digests) or not reply.items
    tiers = {loc: Tier(loc) for loc in (w.gpu, w.host)}
    if digests:
        flat = split_digests(reply.digests)
        i = 0
        for loc, n in reply.locations:
            tiers.setdefault(loc, Tier(loc)).held.update(flat[i:i + n])
            i += n
        if i != len(flat):   # counts that do not add up: every digest counts, under "?"
            tiers.setdefault("?", Tier("?")).held.update(flat[i:])
    else:
        for it in reply.items:
            if it.state in LIVE:
                tiers.setdefault(it.location, Tier(it.location)).held.add(
                    (it.block_hash, it.form, it.location, it.generation))
    mine = [(key, r) for key, r in live.replicas.items() if key[2] in tiers and r.state in LIVE]
    idents = (replica_digests((r.block_hash, r.form, r.location, r.generation, r.checksum) for _, r in mine)
              if digests else [(*key, r.generation) for key, r in mine])
    for (key, r), ident in zip(mine, idents):
        t = tiers[key[2]]
        t.ledger_live.add(ident)
        if r.state is ReplicaState.READY:
            t.ledger_ready[ident] = key
    return tiers


def _listed(ids: Iterable[Any], names: dict[Any, Key] | None = None) -> dict[str, Any]:
    ids = list(ids)
    if names is not None:
        return {"count": len(ids), "replicas": [list(k) for k in sorted(names[i] for i in ids)[:MAX_LISTED]]}
    keys = [i for i in ids if isinstance(i, tuple)]
    raw = [i for i in ids if isinstance(i, bytes)]
    out: dict[str, Any] = {"count": len(ids)}
    if keys:
        out["replicas"] = [list(k[:3]) for k in sorted(keys)[:MAX_LISTED]]
    if raw:
        out["digests"] = [d.hex() for d in sorted(raw)[:MAX_LISTED]]
    return out


def drift_entry(tiers: dict[str, Tier], confirmed: dict[str, tuple[set[Any], set[Any]]] | None = None,
                epoch: tuple[int, int] | None = None) -> dict[str, Any]:
    """The JSON drift of one worker (empty: none). ``confirmed`` narrows each tier's
    differences to those seen in an earlier round too."""
    out: dict[str, Any] = {}
    if epoch is not None and epoch[0] != epoch[1]:
        out["epoch"] = {"ledger": epoch[0], "worker": epoch[1]}
    missing: dict[Any, Key] = {}
    unknown: list[Any] = []
    per_tier: dict[str, dict[str, int]] = {}
    for loc, t in sorted(tiers.items()):
        lo, wo = t.ledger_only, t.worker_only
        if confirmed is not None:
            before = confirmed.get(loc, (set(), set()))
            lo, wo = lo & before[0], wo & before[1]
        if lo or wo:
            per_tier[loc] = {"ledger_only": len(lo), "worker_only": len(wo)}
        missing.update((i, t.ledger_ready[i]) for i in lo)
        unknown += wo
    if missing:
        out["missing_on_worker"] = _listed(missing, missing)
    if unknown:
        out["unknown_to_ledger"] = _listed(unknown)
    if per_tier:
        out["tiers"] = per_tier
    return out


async def run_audit(ledger: Ledger, inventory: Any = None, *, from_snapshot: bool = False,
                    check_workers: bool = True, timeout_s: float = 2.0, logger: Any = None,
                    disk_checks: int = 64, confirm_s: float = 0.5) -> dict[str, Any]:
    """The audit report (JSON-ready). ``inventory(worker_id, timeout_s, digests=True)`` asks one
    worker for its digest inventory, ``inventory(worker_id, timeout_s, disk=[DiskRef…])`` for a
    disk check; each returns an :class:`InventoryReply` or why there is none."""
    t0 = time.perf_counter()
    async with ledger.frozen() as live:
        position = ledger.position
        live_hash = state_hash(live)
        live_violations = check_invariants(live)
        shard_map = ledger.params.shard_map
        live_blocks = ({key[0] for key, r in live.replicas.items() if r.state in LIVE}
                       if shard_map is not None else set())
        lease_roots = ([(lease.namespace, lease.block_hashes[0]) for lease in live.leases.values() if lease.block_hashes]
                       if shard_map is not None else [])
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
        if result.from_archive_anchor:
            # the log's oldest events are archived: "from empty" starts at the newest archive's anchor
            report["replay_from"] = "archive_anchor"
        report.update(replay_hash=replay_hash, hash_match=replay_hash == live_hash, log_errors=errors,
                      replayed_events=result.events, snapshot_position=result.snapshot_position,
                      replay_seconds=round(result.seconds, 3))
    report["chain"] = chain = await verify_chain(ledger.log, position, from_snapshot=from_snapshot)
    if not chain["ok"]:
        brk = chain["first_break"]
        report["log_errors"].append(f"hash chain broken at position {brk['position']}: {brk['what']}")
    if shard_map is not None:
        report["shard"] = await shard_report(ledger.log, position, shard_map, ledger.params.shard, live_blocks,
                                             lease_roots)
    report["invariant_violations"] = live_violations
    report["replay_invariant_violations"] = check_invariants(result.state) if result is not None else []
    if check_workers and inventory is not None:
        report.update(await audit_workers(ledger, inventory, timeout_s=timeout_s, disk_checks=disk_checks,
                                          confirm_s=confirm_s))
    else:
        report.update(workers_checked=[], workers_unreachable={}, workers_skipped={}, inventory={}, drift={})
    drift = report["drift"]
    disk = report.get("disk")
    disk_bad = bool(disk and (disk.get("missing", {}).get("count") or disk.get("damaged", {}).get("count")))
    report["ok"] = bool(report.get("hash_match")) and not report["log_errors"] and not live_violations \
        and not report["replay_invariant_violations"] and not drift and not disk_bad \
        and report.get("shard", {}).get("ok", True)
    report["duration_ms"] = round((time.perf_counter() - t0) * 1000, 1)
    return report


async def verify_chain(log: Any, upto: int, *, from_snapshot: bool = False) -> dict[str, Any]:
    """The log's hash chain from its anchor up to ``upto`` (the audit's ``chain`` entry).

    The anchor is the newest archive's head (position 0 and the genesis hash when nothing is
    archived), or with ``from_snapshot`` the latest snapshot's head (itself checked against the
    stored event at its position). Reads the events in pages; stops at the first break."""
    snap = await log.latest_snapshot() if from_snapshot else None
    if snap is not None and snap.chain_hash is not None and 0 < snap.position <= upto:
        check, anchor = ChainCheck(snap.position, bytes(snap.chain_hash)), "snapshot"
        at = await log.read(snap.position, 1)
        if at and at[0].position == snap.position and at[0].chain_hash != snap.chain_hash:
            out = check.report(upto)
            out.update(ok=False, anchor="snapshot", first_break={
                "position": snap.position, "what": "the snapshot's chain head is not the stored event's chain hash"})
            return out
    else:
        position, head = await log.chain_anchor()
        check, anchor = ChainCheck(position, bytes(head)), "archive" if position else "start"
    pos = check.position + 1
    while pos <= upto:
        rows = await log.read(pos, min(CHAIN_PAGE, upto - pos + 1))
        if not rows or not check.feed((r.position, r.stream_id, r.type, r.source_id, r.payload, r.leader_epoch,
                                       r.chain_hash) for r in rows):
            break
        pos = rows[-1].position + 1
    return {**check.report(upto), "anchor": anchor}


async def audit_workers(ledger: Any, inventory: Any, *, timeout_s: float = 2.0, disk_checks: int = 64,
                        confirm_s: float = 0.5) -> dict[str, Any]:
    """The workers' part of the report (see the module doc, 3 and 4). ``ledger`` needs only
    ``frozen()`` and ``state`` (a test may pass a twin's state)."""
    async with ledger.frozen() as live:
        workers = sorted(wid for wid, w in live.workers.items() if w.alive)
        skipped = {wid: "suspended: a resume is in progress" for wid, w in live.workers.items()
                   if w.alive and w.suspended_at_ms}
    drift: dict[str, Any] = {}
    unreachable: dict[str, str] = {}
    checked: list[str] = []
    held: dict[str, Any] = {}
    ask = [w for w in workers if w not in skipped]
    if ask:
        first = await _round(ledger, inventory, ask, timeout_s)
        for wid, why in first.items():
            if isinstance(why, str):
                unreachable[wid] = why
        found = {wid: r for wid, r in first.items() if not isinstance(r, str) and drift_entry(r[0], None, r[1])}
        second: dict[str, Any] = {}
        if found and confirm_s > 0:
            await asyncio.sleep(confirm_s)
            second = await _round(ledger, inventory, sorted(found), timeout_s)
        for wid, r in first.items():
            if isinstance(r, str):
                continue
            tiers, epochs = r
            if wid in found and confirm_s > 0:
                again = second.get(wid)
                if again is None or isinstance(again, str):
                    skipped[wid] = f"changed during the audit ({again or 'gone'})"
                    continue
                before = {loc: (t.ledger_only, t.worker_only) for loc, t in tiers.items()}
                tiers, epochs2 = again
                d = drift_entry(tiers, before, epochs if epochs == epochs2 else None)
            else:
                d = drift_entry(tiers, None, epochs)
            checked.append(wid)
            if d:
                drift[wid] = d
            held[wid] = {loc: {"ledger_ready": len(t.ledger_ready), "worker": len(t.held)}
                         for loc, t in sorted(tiers.items())}
    out: dict[str, Any] = {"workers_checked": sorted(checked), "workers_unreachable": unreachable,
                           "workers_skipped": skipped, "inventory": held, "drift": drift}
    if disk_checks > 0:
        out["disk"] = await _check_disk(ledger, inventory, ask, timeout_s, min(disk_checks, MAX_DISK_CHECKS),
                                        confirm_s)
    return out


async def _round(ledger: Ledger, inventory: Any, ask: list[str], timeout_s: float) -> dict[str, Any]:
    """Ask each worker, wait (≤ ``timeout_s``) until the log holds what each had emitted, then
    compare with the ledger frozen: ``{worker: (tiers, (ledger epoch, worker epoch)) or why not}``."""
    answers = await asyncio.gather(*[inventory(wid, timeout_s, digests=True) for wid in ask],
                                   return_exceptions=True)
    replies = {}
    out: dict[str, Any] = {}
    for wid, a in zip(ask, answers):
        if isinstance(a, InventoryReply):
            replies[wid] = a
        else:
            out[wid] = str(a) or type(a).__name__
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(
            ledger.state.committed_seq(wid, r.epoch) < r.emitted_seq for wid, r in replies.items()):
        await asyncio.sleep(0.02)
    async with ledger.frozen() as live:
        for wid, r in replies.items():
            w = live.workers.get(wid)
            if w is None or not w.alive or w.suspended_at_ms:
                out[wid] = "no longer live, or suspended, during the audit"
                continue
            out[wid] = (compare_tiers(live, wid, r), (w.epoch, r.epoch))
    return out


def _disk_refs(live: LedgerState) -> dict[DiskRef, tuple[str, str]]:
    return {DiskRef(block_hash=r.block_hash, form=r.form, namespace=r.namespace, tenant=r.tenant or "default",
                    checksum=r.checksum): (r.block_hash, r.form)
            for key, r in live.replicas.items()
            if key[2] == "disk" and r.state is ReplicaState.READY and r.namespace}


async def _check_disk(ledger: Ledger, inventory: Any, ask: list[str], timeout_s: float, limit: int,
                      confirm_s: float) -> dict[str, Any]:
    async with ledger.frozen() as live:
        refs = _disk_refs(live)
        spaces = {wid: live.workers[wid].namespace for wid in ask if wid in live.workers}
    out: dict[str, Any] = {"ledger_ready": len(refs), "checked": 0}
    if not refs:
        return out
    tried: dict[str, str] = {}
    for wid in ask:
        mine = [r for r in refs if r.namespace == spaces.get(wid)]
        if not mine:
            continue
        sample = mine if len(mine) <= limit else random.sample(mine, limit)
        reply = await inventory(wid, timeout_s, disk=sample)
        if not isinstance(reply, InventoryReply):
            tried[wid] = str(reply)
            continue
        if not reply.disk_tier:
            tried[wid] = "no offload directory"
            continue
        bad = {"missing": list(reply.disk_missing), "damaged": list(reply.disk_damaged)}
        if bad["missing"] or bad["damaged"]:
            # a file removed or replaced while we looked: only what is still READY, and still bad
            await asyncio.sleep(confirm_s)
            again = await inventory(wid, timeout_s, disk=bad["missing"] + [
                DiskRef(block_hash=d.block_hash, form=d.form, namespace=d.namespace, tenant=d.tenant,
                        checksum=d.checksum) for d in bad["damaged"]])
            async with ledger.frozen() as live:
                still = _disk_refs(live)
            if isinstance(again, InventoryReply) and again.disk_tier:
                worse = {(d.block_hash, d.form) for d in [*again.disk_missing, *again.disk_damaged]}
                bad = {k: [d for d in v if (d.block_hash, d.form) in worse] for k, v in bad.items()}
            bad["missing"] = [d for d in bad["missing"] if d in still]
            ready = {(s.block_hash, s.form, s.checksum) for s in still}
            bad["damaged"] = [d for d in bad["damaged"] if (d.block_hash, d.form, d.checksum) in ready]
        out.update(worker=wid, checked=reply.disk_checked, sampled=len(sample) < len(mine))
        for kind, items in bad.items():
            if items:
                out[kind] = {"count": len(items), "replicas": [
                    [d.block_hash, d.form, "disk"] + ([d.reason] if d.reason else []) for d in items[:MAX_LISTED]]}
        return out
    out["skipped"] = "no live worker with the offload directory answered" + (f" ({tried})" if tried else "")
    return out
