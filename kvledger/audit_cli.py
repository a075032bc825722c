"""``kvledger audit`` (the coordinator replays its log and compares it with the live state and the
workers' inventories) and ``kvledger replay`` (the log replayed straight from PostgreSQL, no
coordinator needed): is the ledger sound. Exit 3 when either finds a problem."""

from __future__ import annotations

import argparse
from typing import Any

from kvledger.admin_client import client_for
from kvledger.cli_support import EXIT_FOUND_PROBLEMS, CliError, console, print_json, progress
from shared.config import load_config


def cmd_audit(args: argparse.Namespace) -> int:
    if args.shard_url:
        return _audit_fleet(args)
    client = client_for(args)
    total = None
    status_doc: Any = None
    try:
        status_doc = client.call("GET", "/readyz", timeout_s=3)
    except CliError:
        pass  # the audit call below reports the reason
    if isinstance(status_doc, dict):
        total = status_doc.get("position")
    body = _audit_body(args)
    what = f"auditing: replaying {total:,} events" if total else "auditing"
    with progress(what, None, not args.json):
        report = client.call("POST", "/v1/audit", body=body, timeout_s=max(args.timeout, 600.0))
    if args.json:
        print_json(report)
    else:
        print_audit(report)
    return 0 if report.get("ok") else EXIT_FOUND_PROBLEMS


def _audit_body(args: argparse.Namespace) -> dict[str, Any]:
    body = {"replay_from": args.replay_from, "check_workers": not args.no_workers, "timeout_ms": args.worker_timeout_ms}
    if args.disk_checks is not None:
        body["disk_checks"] = args.disk_checks
    return body


def _audit_fleet(args: argparse.Namespace) -> int:
    """Each shard's audit (its coordinator, by ``--shard-url``), then the fleet's (``coordinator.shard_audit``)."""
    from coordinator.shard_audit import fleet_report

    base = client_for(argparse.Namespace(**{**vars(args), "coordinator_url": args.shard_url[0]}))
    reports: dict[str, Any] = {}
    for url in args.shard_url:
        client = type(base)(url.rstrip("/"), base.token, base.timeout_s, base.context)
        with progress(f"auditing {url}", None, not args.json):
            reports[url] = client.call("POST", "/v1/audit", body=_audit_body(args), timeout_s=max(args.timeout, 600.0))
    fleet = fleet_report(reports)
    if args.json:
        print_json({"ok": fleet["ok"], "fleet": fleet,
                    "shards": {u: {k: v for k, v in r.items() if k != "shard"} | {"shard": _shard_summary(r)}
                               for u, r in reports.items()}})
    else:
        for url, r in reports.items():
            console().print(f"[bold]{url}[/bold] (shard {_shard_summary(r).get('shard', '?')})")
            print_audit(r)
        con = console()
        con.print(("[green]FLEET CLEAN[/green]" if fleet["ok"] else "[red]FLEET PROBLEMS FOUND[/red]")
                  + f": {len(fleet['shards'])} shards, {fleet['live_blocks']} live blocks")
        for line in fleet["problems"]:
            con.print(f"  {line}")
    return 0 if fleet["ok"] else EXIT_FOUND_PROBLEMS


def _shard_summary(r: dict[str, Any]) -> dict[str, Any]:
    """A report's ``shard`` entry without its list of every live block."""
    s = r.get("shard")
    return {k: v for k, v in s.items() if k != "keys"} if isinstance(s, dict) else {}


def print_audit(r: dict[str, Any]) -> None:
    con = console()
    ok = r.get("ok")
    rows = [
        ["result", "CLEAN" if ok else "PROBLEMS FOUND"],
        ["log position", r.get("position")],
        ["replayed from", f"{r.get('replay_from')}" + (f" (snapshot at {r['snapshot_position']})"
                                                       if r.get("snapshot_position") else "")],
        ["events replayed", r.get("replayed_events")],
        ["replay time", f"{r.get('replay_seconds')} s"],
        ["live state hash", r.get("live_hash")],
        ["replayed state hash", f"{r.get('replay_hash')} ({'match' if r.get('hash_match') else 'DIFFERENT'})"],
        ["invariant violations", len(r.get("invariant_violations", [])) + len(r.get("replay_invariant_violations", []))],
        ["log errors", len(r.get("log_errors", []))],
        ["hash chain", _chain(r.get("chain"))],
        ["workers checked", ", ".join(r.get("workers_checked", [])) or "-"],
        ["workers unreachable", ", ".join(f"{w} ({why})" for w, why in r.get("workers_unreachable", {}).items()) or "-"],
        ["workers skipped", ", ".join(f"{w} ({why})" for w, why in (r.get("workers_skipped") or {}).items()) or "-"],
        ["tiers (ledger READY / held)", _tiers(r.get("inventory") or {}) or "-"],
        ["drift", ", ".join(r.get("drift", {})) or "none"],
        ["disk", _disk(r.get("disk"))],
        ["shard", _shard(r.get("shard"))],
        ["took", f"{r.get('duration_ms')} ms"],
    ]
    from rich.table import Table

    t = Table(title="audit", title_justify="left", show_header=False)
    t.add_column(style="bold")
    t.add_column(overflow="fold", style="green" if ok else "red")
    for k, v in rows:
        t.add_row(k, "" if v is None else str(v))
    con.print(t)
    for key in ("log_errors", "invariant_violations", "replay_invariant_violations"):
        for line in r.get(key, [])[:20]:
            con.print(f"  {key}: {line}")
    for wid, d in r.get("drift", {}).items():
        for kind, detail in d.items():
            if kind == "tiers":
                for loc, t in detail.items():
                    con.print(f"  drift on {wid}: {loc}: {t.get('ledger_only', 0)} listed READY but not held, "
                              f"{t.get('worker_only', 0)} held but not listed")
                continue
            count = detail.get("count") if isinstance(detail, dict) and "count" in detail else detail
            con.print(f"  drift on {wid}: {kind}: {count}")
    for block in ((r.get("shard") or {}).get("foreign") or {}).get("listed", [])[:20]:
        con.print(f"  shard: block {block} is of a chain another shard owns")
    disk = r.get("disk") or {}
    for kind in ("missing", "damaged"):
        for ref in (disk.get(kind) or {}).get("replicas", [])[:20]:
            con.print(f"  disk {kind}: {' '.join(map(str, ref))}")


def _shard(s: Any) -> str:
    if not isinstance(s, dict):
        return "-"
    return (f"{s.get('shard')} of {s.get('shards')} (map version {s.get('map_version')}, "
            f"{s.get('owned_partitions')}/{s.get('partitions')} partitions): {s.get('live_blocks')} live blocks, "
            f"{(s.get('foreign') or {}).get('count', 0)} of another shard's chains, "
            f"{s.get('unattributed', 0)} not attributable (grant archived)")


def _chain(c: dict[str, Any] | None) -> str:
    if not c:
        return "-"
    span = f"{c.get('anchor')} {c.get('anchor_position')} → {c.get('head_position')}"
    if c.get("ok"):
        return f"intact ({span}, head {str(c.get('head_hash', ''))[:16]}…)"
    brk = c.get("first_break") or {}
    return f"BROKEN at position {brk.get('position')} ({span})"


def disk_checks(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= 1024:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of files from 0 to 1024")
    return n


def _tiers(inventory: dict[str, Any]) -> str:
    """``worker: gpu:w 71/71, host:w 23/21`` per worker (ledger READY / held by the worker)."""
    return "; ".join(f"{wid}: " + ", ".join(f"{loc} {c.get('ledger_ready', '?')}/{c.get('worker', '?')}"
                                            for loc, c in sorted(tiers.items()))
                     for wid, tiers in sorted(inventory.items()) if isinstance(tiers, dict))


def _disk(disk: Any) -> str:
    if not isinstance(disk, dict) or not disk:
        return "-"
    if disk.get("skipped"):
        return f"not checked: {disk['skipped']}"
    return (f"{disk.get('checked', 0)} of {disk.get('ledger_ready', 0)} READY files verified by "
            f"{disk.get('worker', '-')}{' (a sample)' if disk.get('sampled') else ''}: missing "
            f"{(disk.get('missing') or {}).get('count', 0)}, damaged {(disk.get('damaged') or {}).get('count', 0)}")


def cmd_replay(args: argparse.Namespace) -> int:
    """Replay the log from PostgreSQL (read-only, no coordinator needed), with a progress bar."""
    import asyncio

    from coordinator.core import CoreParams, check_invariants, state_hash
    from coordinator.log.postgres import PgSettings, PostgresEventLog, describe
    from coordinator.replay import LogCorrupt, load_state

    cfg = load_config(getattr(args, "config", None))
    url = args.database_url or cfg.database.url
    if not url:
        raise CliError("kvledger replay needs the database: --database-url or database.url / KVL_DATABASE_URL "
                       "(for a running `kvledger up`, the postgres URL it printed)")

    async def go() -> dict[str, Any]:
        log = PostgresEventLog.connect(PgSettings.from_config(url, cfg.database, application_name="kvledger-replay",
                                                                tls=cfg.tls))
        try:
            head = await log.head()
            with progress(f"replaying the log ({head:,} events)", head, not args.json) as update:
                class Progress:
                    def info(self, event: str, **kw: Any) -> None:
                        if "position" in kw:
                            update(int(kw["position"]))

                    warning = info

                res = await load_state(log, CoreParams.from_config(cfg.coordinator), upto=head,
                                       use_snapshot=args.replay_from == "snapshot", check_streams=True,
                                       progress_every=args.page, page=args.page, logger=Progress())
            violations = check_invariants(res.state)
            return {"ok": not res.stream_errors and not violations, "position": res.position, "head": head,
                    "replay_from": "archive_anchor" if res.from_archive_anchor else args.replay_from,
                    "snapshot_position": res.snapshot_position,
                    "events": res.events, "seconds": round(res.seconds, 3), "state_hash": state_hash(res.state),
                    "replicas": len(res.state.replicas), "workers": len(res.state.workers),
                    "stream_errors": res.stream_errors, "invariant_violations": violations}
        finally:
            await log.close()

    try:
        report = asyncio.run(go())
    except LogCorrupt as e:
        raise CliError(f"the log cannot be replayed: {e}", EXIT_FOUND_PROBLEMS) from None
    except Exception as e:  # noqa: BLE001 - one readable line
        raise CliError(f"replay: {describe(e)}") from None
    if args.json:
        print_json(report)
    else:
        print(f"replayed {report['events']:,} events to position {report['position']} in {report['seconds']} s "
              f"(from {report['replay_from']}"
              + (f", snapshot at {report['snapshot_position']}" if report["snapshot_position"] else "") + ")")
        print(f"state hash {report['state_hash']}: {report['replicas']:,} replicas, {report['workers']} workers")
        for line in report["stream_errors"][:20] + report["invariant_violations"][:20]:
            print(f"  problem: {line}")
        print("log OK" if report["ok"] else "PROBLEMS FOUND")
    return 0 if report["ok"] else EXIT_FOUND_PROBLEMS
