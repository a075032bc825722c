"""Operator commands: ``kvledger workers|blocks|leases|pools|events|audit|snapshot|invalidate|drain``
call the coordinator's admin REST API; ``kvledger replay`` reads the log straight from PostgreSQL;
``kvledger plan`` is the capacity planner (:mod:`kvledger.plan`).

Tables for people, ``--json`` for scripts (the API's own JSON; ``events --json`` prints one
event per line). Every failure is one line on stderr and a non-zero exit: 1 = the
coordinator said no or could not be reached, 3 = the audit or replay found a problem.

The coordinator is found at ``--coordinator-url``, else ``$KVL_COORDINATOR_URL``, else in the
``stack.json`` of the stack this command belongs to (``--state-dir``, ``$KVLEDGER_STATE_DIR``, or
the nearest ``.kvl-state`` at or above the working directory: :mod:`kvledger.discovery`), else
``http://<coordinator.host>:<coordinator.port>`` of the configuration; the bearer token is
``--token``, else ``coordinator.admin_token``, else ``$KVL_ADMIN_TOKEN``. A discovered stack's
configuration file is read when none is given (``--config``, ``$KVL_CONFIG``).

Here: the REST commands and every command's options (:func:`register`). The API client is
:mod:`kvledger.admin_client`, ``audit`` and ``replay`` are :mod:`kvledger.audit_cli`, the error,
tables and progress bars every command shares :mod:`kvledger.cli_support`.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from kvledger.admin_client import client_for, pages
from kvledger.audit_cli import cmd_audit, cmd_replay, disk_checks
from kvledger.cli_support import CliError, age, console, print_json, table, when, wrap
from kvledger.event_view import transition


# --- commands -----------------------------------------------------------------------------------

def cmd_workers(args: argparse.Namespace) -> int:
    doc = client_for(args).call("GET", "/v1/workers")
    if args.json:
        print_json(doc)
        return 0
    rows = [[w["worker_id"], w["epoch"], ("SUSPENDED" if w.get("suspended") else "yes") if w["alive"] else "LOST", "yes" if w["draining"] else "",
             w.get("endpoint") or "", w["model_id"], w["gpu_replicas"], w["leases"],
             age(w.get("last_heartbeat_ms"))] for w in doc["workers"]]
    console().print(table(f"workers ({len(rows)})", ["worker", "#epoch", "alive", "draining", "endpoint", "model",
                                                       "#gpu replicas", "#leases", "last heartbeat"], rows))
    return 0


def cmd_blocks(args: argparse.Namespace) -> int:
    client = client_for(args)
    if args.hash:
        doc = client.call("GET", f"/v1/blocks/{urllib.parse.quote(args.hash)}")
        if args.json:
            print_json(doc)
            return 0
        con = console()
        con.print(table(f"block {doc['block_hash']}: replicas", ["form", "location", "state", "#generation",
                                                                   "tenant", "tokens", "#pins", "owner"],
                         [[r["form"], r["location"], r["state"], r["generation"], r["tenant"],
                           f"{r['token_start']}-{r['token_end']}", r["pins"],
                           f"{r['owner']}@{r['owner_epoch']}" if r.get("owner") else ""] for r in doc["replicas"]]))
        con.print(table("history", ["#position", "recorded", "type", "stream", "source"],
                         [[e["position"], when(e["recorded_at"]), e["type"], e["stream_id"], e["source_id"] or ""]
                          for e in doc["history"]]))
        return 0
    query = {"namespace": args.namespace, "tenant": args.tenant, "form": args.form, "location": args.location,
             "state": args.state, "limit": args.limit, "cursor": args.cursor}
    items, cursor = pages(client, "/v1/blocks", "replicas", query, args.all)
    if args.json:
        print_json({"replicas": items, "next_cursor": cursor})
        return 0
    rows = [[r["block_hash"], r["form"], r["location"], r["state"], r["generation"], r["tenant"],
             f"{r['token_start']}-{r['token_end']}", r["pins"]] for r in items]
    con = console()
    con.print(table(f"replicas ({len(rows)}{'+' if cursor else ''})",
                     ["block", "form", "location", "state", "#gen", "tenant", "tokens", "#pins"], rows))
    if cursor:
        con.print(f"more: --cursor {cursor}  (or --all)")
    return 0


def cmd_leases(args: argparse.Namespace) -> int:
    items, cursor = pages(client_for(args), "/v1/leases", "leases",
                           {"worker": args.worker, "tenant": args.tenant, "limit": args.limit}, args.all)
    if args.json:
        print_json({"leases": items, "next_cursor": cursor})
        return 0
    now = time.time() * 1000
    rows = [[x["lease_id"], f"{x['worker_id']}@{x['epoch']}", x["tenant"], x["blocks"], x["usable_blocks"], x["pins"],
             ",".join(f"{f}:{n}" for f, n in x["write"].items()), f"{(x['expires_at_ms'] - now) / 1000:.1f}s"]
            for x in items]
    console().print(table(f"leases ({len(rows)}{'+' if cursor else ''})",
                            ["lease", "worker", "tenant", "#blocks", "#usable", "#pins", "write", "expires in"], rows))
    return 0


def cmd_pools(args: argparse.Namespace) -> int:
    doc = client_for(args).call("GET", "/v1/pools")
    if args.json:
        print_json(doc)
        return 0
    rows = []
    for p in doc["pools"]:
        for form, f in p["forms"].items():
            usage = "-" if f["usage"] is None else f"{100 * f['usage']:.1f}%"
            rows.append([p["worker_id"], form, f["used"], f["limit"], f["free"], usage,
                         "yes" if p["draining"] else ""])
    con = console()
    con.print(table("pools", ["worker", "form", "#used", "#limit", "#free", "usage", "draining"], rows))
    if doc.get("tenant_replicas"):
        quota = doc.get("tenant_quota")
        con.print(table("tenants", ["tenant", "#replicas", "#quota"],
                         [[t, n, quota or "unlimited"] for t, n in doc["tenant_replicas"].items()]))
    return 0


def _event_line(e: dict[str, Any]) -> str:
    source = f"  source={e['source_id']}" if e.get("source_id") else ""
    change = transition(e)
    return (f"{e['position']:>8}  {when(e['recorded_at'])}  {e['type']:<22} {e['stream_id']}"
            + (f"  {change}" if change else "") + source)


def cmd_events(args: argparse.Namespace) -> int:
    client = client_for(args)
    after = args.after
    if args.follow and after is None:  # like tail -f: the last few, then whatever comes
        try:
            after = max(int(client.call("GET", "/readyz", timeout_s=3).get("position") or 0) - 10, 0)
        except (CliError, AttributeError, TypeError, ValueError):
            after = 0
    after = after or 0
    first = True
    try:
        while True:
            doc = client.call("GET", "/v1/events", query={"after": after, "limit": args.limit})
            events = doc["events"]
            if args.json:
                for e in events:
                    print(json.dumps(e), flush=True)
            elif events and (first and not args.follow):
                console().print(table(f"events after position {after} ({len(events)})",
                                        ["#position", "recorded", "type", "stream", "change", "source"],
                                        [[e["position"], when(e["recorded_at"]), e["type"], e["stream_id"],
                                          transition(e), e["source_id"] or ""] for e in events]))
            else:
                for e in events:
                    print(_event_line(e), flush=True)
            after = doc["next_after"]
            first = False
            if not args.follow:
                if not events and not args.json:
                    print(f"no events after position {args.after or 0}")
                return 0
            if len(events) < args.limit:
                time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def cmd_snapshot(args: argparse.Namespace) -> int:
    doc = client_for(args).call("POST", "/v1/snapshot", body={}, timeout_s=max(args.timeout, 120.0))
    if args.json:
        print_json(doc)
    else:
        print(f"snapshot saved at log position {doc['position']}: state hash {doc['state_hash']}, "
              f"{doc['bytes']:,} bytes")
    return 0


def cmd_invalidate(args: argparse.Namespace) -> int:
    scope, value = next((s, v) for s, v in (("namespace", args.namespace), ("worker", args.worker),
                                            ("block", args.block)) if v)
    doc = client_for(args).call("POST", "/v1/invalidate", body={"scope": scope, "value": value,
                                                                 "reason": args.reason})
    if args.json:
        print_json(doc)
    else:
        notified = ", ".join(f"{w}: {r}" for w, r in doc["workers_notified"].items()) or "none"
        print(f"invalidated {doc['affected']} replica(s) of {scope} {value}; workers notified: {notified}")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    client = client_for(args)
    if args.action == "status":
        doc = client.call("GET", "/v1/cache")
    else:
        doc = client.call("POST", "/v1/cache", body={"state": "off" if args.action == "disable" else "on",
                                                     "namespace": args.namespace or "", "reason": args.reason})
    if args.json:
        print_json(doc)
        return 0
    print(f"reuse: {doc['reuse']}")
    for off in doc["off"]:
        which = "every namespace" if off["namespace"] == "*" else f"namespace {off['namespace']}"
        print(f"  off for {which}" + (f" ({off['reason']})" if off["reason"] else ""))
    if args.action == "enable" and doc["off"]:
        print("  (each switch is turned on by its own: enable --namespace NS for those still listed)")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    doc = client_for(args).call("POST", f"/v1/workers/{urllib.parse.quote(args.worker_id)}/drain",
                                body={"reason": args.reason})
    if args.json:
        print_json(doc)
    else:
        print(f"worker {doc['worker_id']} draining (changed: {'yes' if doc['changed'] else 'no, already'}; "
              f"told the worker: {doc['control']})")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from kvledger.plan import run_plan_command

    return run_plan_command(args)


# --- registration -------------------------------------------------------------------------------


def register(sub: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", "-c", default=argparse.SUPPRESS, help="YAML config file")
    common.add_argument("--coordinator-url", metavar="URL",
                        help="admin API (default: $KVL_COORDINATOR_URL, else the stack.json of the stack found by "
                             "--state-dir, else coordinator.host:port of the config)")
    common.add_argument("--state-dir", metavar="DIR",
                        help="the state dir of the `kvledger up` to talk to (default: $KVLEDGER_STATE_DIR, else the "
                             "config's state_dir, else the nearest .kvl-state at or above the working directory)")
    common.add_argument("--token", default="", help="admin bearer token (default: coordinator.admin_token, "
                                                     "else $KVL_ADMIN_TOKEN)")
    common.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS", help="per request (default 10)")
    common.add_argument("--json", action="store_true", help="print the API's JSON instead of a table")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help_: str, parents: list[Any] | None = None) -> Any:
        p = sub.add_parser(name, help=help_, description=help_, parents=[common] if parents is None else parents)
        p.set_defaults(func=wrap(fn))
        return p

    add("workers", cmd_workers, "registered workers: epoch, liveness, endpoint, replicas, leases")

    p = add("blocks", cmd_blocks, "replicas in the ledger (filtered, paged), or one block's replicas and history")
    p.add_argument("hash", nargs="?", help="one block (32 hex): its replicas and full event history")
    p.add_argument("--namespace")
    p.add_argument("--tenant")
    p.add_argument("--form")
    p.add_argument("--location", help="gpu:<worker>, host:<node> or disk")
    p.add_argument("--state", help="ALLOCATED, READY, EVICTED, INVALID, LOST")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--cursor")
    p.add_argument("--all", action="store_true", help="follow every page")

    p = add("leases", cmd_leases, "live leases (filtered, paged)")
    p.add_argument("--worker")
    p.add_argument("--tenant")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--all", action="store_true", help="follow every page")

    add("pools", cmd_pools, "pool usage per worker and form against its limits; replicas per tenant")

    p = add("events", cmd_events, "the event log from a position; --follow keeps printing new events")
    p.add_argument("--after", type=int, default=None, help="events with position > AFTER (default 0)")
    p.add_argument("--limit", type=int, default=100, help="events per request (max 1000)")
    p.add_argument("--follow", "-f", action="store_true", help="keep polling for new events (Ctrl-C stops)")
    p.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="poll interval with --follow")

    p = add("audit", cmd_audit, "replay the log and compare it with the live state and the workers (read-only); "
                                "exit 3 when it finds a problem")
    p.add_argument("--from", dest="replay_from", choices=["empty", "snapshot"], default="empty",
                   help="replay from an empty state (default, the strongest check) or the latest snapshot")
    p.add_argument("--no-workers", action="store_true", help="do not ask the workers for their inventories")
    p.add_argument("--worker-timeout-ms", type=int, default=2000, help="how long each worker may take to answer")
    p.add_argument("--disk-checks", type=disk_checks, metavar="N", default=None,
                   help="disk-tier files one worker verifies (a random sample; 0 = none; default: the server's, 64)")
    p.add_argument("--shard-url", action="append", default=[], metavar="URL",
                   help="a sharded ledger: audit the coordinator of every shard (one --shard-url each), then the "
                        "fleet: each shard the one it should be, one map version, no block live on two shards")

    add("snapshot", cmd_snapshot, "save a snapshot of the live state now (replay after a restart starts there)")

    p = add("invalidate", cmd_invalidate, "invalidate every live replica of a namespace, a worker or a block "
                                          "(they are never served again; the next request recomputes)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--namespace", help="32 hex: e.g. after a weights or cache-format change")
    g.add_argument("--worker", help="worker id")
    g.add_argument("--block", help="32 hex block hash")
    p.add_argument("--reason", default="", help="recorded in the event log")

    p = add("cache", cmd_cache, "turn reuse off for the whole fleet (every request recomputes, nothing new is "
                                "cached; the first rollback step) or back on; durable in the event log")
    p.add_argument("action", choices=["disable", "enable", "status"])
    p.add_argument("--namespace", help="32 hex: only this namespace (default: every namespace)")
    p.add_argument("--reason", default="", help="recorded in the event log")

    p = add("drain", cmd_drain, "stop granting writes to a worker and tell it to drain (before taking it away)")
    p.add_argument("worker_id")
    p.add_argument("--reason", default="")

    dbp = argparse.ArgumentParser(add_help=False)
    dbp.add_argument("--config", "-c", default=argparse.SUPPRESS, help="YAML config file")
    dbp.add_argument("--json", action="store_true", help="print the report as JSON")
    p = add("replay", cmd_replay, "replay the event log straight from PostgreSQL (no coordinator needed; read-only): "
                                  "check it folds, report the state hash; exit 3 on a problem", parents=[dbp])
    p.add_argument("--database-url", help="default: database.url / KVL_DATABASE_URL")
    p.add_argument("--from", dest="replay_from", choices=["empty", "snapshot"], default="empty")
    p.add_argument("--page", type=int, default=5000, help="events read per query")

    planp = argparse.ArgumentParser(add_help=False)
    planp.add_argument("--config", "-c", default=argparse.SUPPRESS, help="YAML config file")
    planp.add_argument("--json", action="store_true", help="print the plan as JSON")
    p = add("plan", cmd_plan, "capacity planner: bytes per token of every cache form, and the concurrency x "
                              "context length a memory budget allows", parents=[planp])
    from kvledger.plan import add_arguments as plan_arguments
    plan_arguments(p)
