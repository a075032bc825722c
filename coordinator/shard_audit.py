"""The audit of a sharded ledger: does this shard hold only chains its shard map gives it, and do
the shards together hold every key once (docs/architecture.md, "The ledger sharded"). Read-only.

A replica does not carry its chain's root; the grant that reserved its block does: a
``lease.granted`` event names the whole chain (``block_hashes``, the root first), and every block
enters the ledger through a grant (a commit fills a reservation, an offload copies a replica that
a commit made). So the log, read once, attributes each live block to its root. A block whose grant
is in an archive (below the log's oldest stored event) is counted ``unattributed``, not judged.

:func:`shard_report` is this shard's part of :func:`coordinator.audit.run_audit`;
:func:`fleet_report` combines the shards' audit reports (``kvledger audit --shard-url``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from shared.shards import ShardMap

#: Events read per page while attributing blocks to roots.
PAGE = 5000
#: Blocks listed per problem (the counts are always complete).
MAX_LISTED = 50


class _Grant(msgspec.Struct):
    """The part of a ``lease.granted`` payload the attribution reads."""
    namespace: str = ""
    block_hashes: list[str] = []


_grant = msgspec.json.Decoder(_Grant)


async def _roots(log: Any, upto: int, wanted: set[str]) -> dict[str, tuple[str, str]]:
    """``block → (namespace, root)`` for each of ``wanted`` some stored grant named."""
    found: dict[str, tuple[str, str]] = {}
    pos = 1
    while pos <= upto and len(found) < len(wanted):
        rows = await log.read(pos, min(PAGE, upto - pos + 1))
        if not rows:
            break
        for r in rows:
            if r.type != "lease.granted":
                continue
            g = _grant.decode(r.payload)
            if not g.block_hashes:
                continue
            root = g.block_hashes[0]
            for b in g.block_hashes:
                if b in wanted:
                    found.setdefault(b, (g.namespace, root))
        pos = rows[-1].position + 1
    return found


async def shard_report(log: Any, upto: int, shard_map: ShardMap, shard: int, blocks: Iterable[str],
                       lease_roots: Iterable[tuple[str, str]] = ()) -> dict[str, Any]:
    """This shard's check: every live block (``blocks``) whose grant the log holds has a root the
    map gives this shard; ``keys`` lists the live blocks for the fleet's disjointness check.

    ``moving_out``: for each partition frozen on its way from this shard, the leases on it still
    live (``lease_roots``: each live lease's namespace and first hash) and its live blocks — what a
    cold move waits for (the leases to end) and then invalidates (the blocks) before it opens."""
    live = set(blocks)
    roots = await _roots(log, upto, live)
    foreign = sorted(b for b, (ns, root) in roots.items() if shard_map.owner(ns, root) != shard)
    leaving = {mv.partition: mv.target for mv in shard_map.moving if mv.source == shard}
    moving_out: dict[str, Any] = {}
    if leaving:
        leases = [shard_map.partition(ns, root) for ns, root in lease_roots]
        for p, target in sorted(leaving.items()):
            mine = sorted(b for b, (ns, root) in roots.items() if shard_map.partition(ns, root) == p)
            moving_out[str(p)] = {"to": target, "live_leases": leases.count(p), "live_blocks": mine[:MAX_LISTED],
                                  "live_block_count": len(mine)}
    return {"shard": shard, "shards": shard_map.shards, "map_version": shard_map.version,
            "partitions": shard_map.partitions, "owned_partitions": len(shard_map.owned_by(shard)),
            "live_blocks": len(live), "attributed": len(roots), "unattributed": len(live) - len(roots),
            "foreign": {"count": len(foreign), "listed": foreign[:MAX_LISTED]}, "moving_out": moving_out,
            "ok": not foreign, "keys": sorted(live)}


def fleet_report(reports: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The fleet-wide audit from each shard's audit report (by where it came from): every shard
    clean, each the shard it should be (0 … N − 1, once each), all on one map version, and no
    block live on two shards."""
    problems: list[str] = []
    shards: dict[int, str] = {}
    versions: set[Any] = set()
    owner_of: dict[str, int] = {}
    shared: dict[str, list[int]] = {}
    for where, r in reports.items():
        if not r.get("ok"):
            problems.append(f"{where}: its own audit found problems")
        s = r.get("shard")
        if not isinstance(s, Mapping):
            problems.append(f"{where}: not a sharded coordinator (no shard section in its audit)")
            continue
        k = int(s["shard"])
        if k in shards:
            problems.append(f"{where} and {shards[k]} are both shard {k}")
        shards[k] = where
        versions.add((s.get("shards"), s.get("map_version"), s.get("partitions")))
        for b in s.get("keys", ()):
            if b in owner_of and owner_of[b] != k:
                shared.setdefault(b, [owner_of[b]]).append(k)
            owner_of.setdefault(b, k)
    if len(versions) > 1:
        problems.append(f"the shards disagree on the map (shards, version, partitions): {sorted(versions, key=str)}")
    expected = next(iter(versions))[0] if len(versions) == 1 else None
    if isinstance(expected, int) and sorted(shards) != list(range(expected)):
        problems.append(f"shards audited {sorted(shards)}, the map has {expected}")
    if shared:
        problems.append(f"{len(shared)} blocks are live on more than one shard")
    return {"ok": not problems, "problems": problems, "shards": {str(k): w for k, w in sorted(shards.items())},
            "live_blocks": len(owner_of),
            "on_several_shards": {"count": len(shared), "listed": _listed(shared)}}


def _listed(shared: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
    return {b: list(ks) for b, ks in sorted(shared.items())[:MAX_LISTED]}


__all__ = ["fleet_report", "shard_report"]
