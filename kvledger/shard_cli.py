"""``kvledger shard``: the shard map of a sharded ledger (docs/architecture.md, "The ledger sharded").

``show`` prints the map; ``freeze P --to K`` is a move's first step (no shard leases partition P
until it opens), ``open P`` its last (P owned by the shard it was moving to). Each writes a new
version by compare-and-set on the map's revision, so two operators never overwrite each other, and
each is idempotent: freezing a partition already moving to the same shard, or opening one already
owned by its target, changes nothing. The coordinators and gateways follow each version.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from kvledger.cli_support import CliError, print_json, wrap
from shared.config import load_config, nats_servers
from shared.shards import ShardMap, ShardMapError


async def _change(args: argparse.Namespace, decide: Any) -> dict[str, Any]:
    import nats

    from shared import nats_auth
    from shared.shard_store import ShardMapConflict, ShardMapStore

    cfg = load_config(getattr(args, "config", None))
    c = cfg.coordinator
    if c.shards < 2:
        raise CliError("coordinator.shards is 1: this ledger is not sharded")
    url = args.nats_url or cfg.nats.url
    if not url:
        raise CliError("kvledger shard needs NATS: --nats-url or nats.url / KVL_NATS_URL")
    try:
        nc = await nats.connect(nats_servers(url), connect_timeout=5, allow_reconnect=False,
                                **nats_auth.connect_kwargs(cfg.nats))
    except Exception as e:  # noqa: BLE001 - one readable line
        raise CliError(f"cannot connect to NATS: {type(e).__name__}: {e}") from None
    try:
        store = ShardMapStore(nc.jetstream(), cfg.nats.subject_prefix,
                              replicas=cfg.nats.stream_replicas or len(nats_servers(url)))
        for _ in range(5):
            held, revision = await store.load(ShardMap.uniform(c.shards, c.shard_partitions))
            new = decide(held)
            if new is held:
                return {"changed": False, "map": _doc(held)}
            try:
                await store.replace(new, revision)
            except ShardMapConflict:
                continue        # another writer: read it again, decide again
            return {"changed": True, "map": _doc(new)}
        raise CliError("the shard map kept changing under this command; try again")
    finally:
        await nc.drain()


def _doc(m: ShardMap) -> dict[str, Any]:
    return {"version": m.version, "shards": m.shards, "partitions": m.partitions,
            "owned": {str(k): len(m.owned_by(k)) for k in range(m.shards)},
            "moving": [{"partition": mv.partition, "from": mv.source, "to": mv.target} for mv in m.moving]}


def _run(args: argparse.Namespace, decide: Any) -> int:
    try:
        out = asyncio.run(_change(args, decide))
    except ShardMapError as e:
        raise CliError(str(e)) from None
    if args.json:
        print_json(out)
    else:
        m = out["map"]
        moving = ", ".join(f"{x['partition']} ({x['from']} → {x['to']})" for x in m["moving"]) or "none"
        print(f"shard map version {m['version']}{'' if out['changed'] else ' (unchanged)'}: {m['shards']} shards, "
              f"{m['partitions']} partitions; owned {m['owned']}; moving: {moving}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    return _run(args, lambda held: held)


def cmd_freeze(args: argparse.Namespace) -> int:
    def decide(held: ShardMap) -> ShardMap:
        if any(mv.partition == args.partition and mv.target == args.to for mv in held.moving):
            return held
        return held.freeze(args.partition, args.to)
    return _run(args, decide)


def cmd_open(args: argparse.Namespace) -> int:
    def decide(held: ShardMap) -> ShardMap:
        if not held.frozen(args.partition):
            if 0 <= args.partition < held.partitions:
                return held     # already open (a rerun after the open was stored)
            raise ShardMapError(f"no partition {args.partition} (the map has {held.partitions})")
        return held.open(args.partition)
    return _run(args, decide)


def register(sub: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", "-c", default=argparse.SUPPRESS, help="YAML config file")
    common.add_argument("--nats-url", default="", help="NATS (default: nats.url)")
    common.add_argument("--json", action="store_true", help="print the map as JSON")
    sh = sub.add_parser("shard", help="the shard map of a sharded ledger: show it, freeze and open a partition's move")
    ssub = sh.add_subparsers(dest="shard_command", metavar="SUBCOMMAND")
    p = ssub.add_parser("show", parents=[common], help="the current map")
    p.set_defaults(func=wrap(cmd_show))
    p = ssub.add_parser("freeze", parents=[common], help="a move's first step: no shard leases the partition until it "
                                                          "opens")
    p.add_argument("partition", type=int)
    p.add_argument("--to", type=int, required=True, metavar="SHARD", help="the shard it moves to")
    p.set_defaults(func=wrap(cmd_freeze))
    p = ssub.add_parser("open", parents=[common], help="a move's last step: the partition owned by its new shard")
    p.add_argument("partition", type=int)
    p.set_defaults(func=wrap(cmd_open))
