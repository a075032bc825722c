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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvledger.event_view import transition
from shared.config import Config, load_config
from shared.tls import client_context, http_scheme

EXIT_FAILED = 1
EXIT_FOUND_PROBLEMS = 3


class CliError(Exception):
    """One line for stderr, then exit with ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


# --- talking to the coordinator ---------------------------------------------------------------

@dataclass
class AdminClient:
    url: str
    token: str = ""
    timeout_s: float = 10.0
    #: Verifies an ``https`` coordinator (``tls.ca_file``, and ``cert_file`` for mutual TLS); None = system CAs.
    context: Any = None

    def call(self, method: str, path: str, body: dict[str, Any] | None = None,
             query: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        q = {k: v for k, v in (query or {}).items() if v not in (None, "")}
        full = self.url.rstrip("/") + path + (f"?{urllib.parse.urlencode(q)}" if q else "")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(full, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s,  # noqa: S310 - operator's URL
                                        context=self.context) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            raise CliError(self._http_error(e)) from None
        except urllib.error.URLError as e:
            reason = getattr(e.reason, "strerror", None) or str(e.reason)
            raise CliError(f"coordinator not reachable at {self.url} ({reason}); is it running? (kvledger up)") \
                from None
        except TimeoutError:
            raise CliError(f"coordinator at {self.url} did not answer within {timeout_s or self.timeout_s:.0f}s "
                           f"({method} {path})") from None
        except ConnectionError as e:
            raise CliError(f"coordinator not reachable at {self.url} ({e.strerror or e}); is it running? "
                           f"(kvledger up)") from None

    def _http_error(self, e: urllib.error.HTTPError) -> str:
        try:
            err = json.loads(e.read() or b"{}").get("error", {})
            message = err.get("message") or e.reason
        except (ValueError, AttributeError):
            message = e.reason
        if e.code == 401:
            return (f"the coordinator at {self.url} refused the request: {message} "
                    f"(give the admin token with --token, KVL_ADMIN_TOKEN or coordinator.admin_token)")
        if e.code == 503:
            return f"the coordinator at {self.url} is not serving right now: {message}"
        if e.code == 404 and not message:
            return f"not found at {self.url}"
        return f"{message} (HTTP {e.code})"


def coordinator_url(cfg: Config, given: str | None) -> str:
    if given:
        return given.rstrip("/")
    if os.environ.get("KVL_COORDINATOR_URL"):
        return os.environ["KVL_COORDINATOR_URL"].rstrip("/")
    host = cfg.coordinator.host
    if host in ("0.0.0.0", "::", ""):  # listening everywhere: talk to it over loopback
        host = "127.0.0.1"
    return f"{http_scheme(cfg.tls)}://{host}:{cfg.coordinator.port}"


def client_for(args: argparse.Namespace) -> AdminClient:
    from kvledger.discovery import NoStack, find_stack

    cfg = load_config(getattr(args, "config", None))
    url = args.coordinator_url or os.environ.get("KVL_COORDINATOR_URL")
    if not url:
        try:
            stack = find_stack(getattr(args, "state_dir", None), cfg.state_dir)
        except NoStack as e:
            raise CliError(str(e)) from None
        if stack is not None and stack.coordinator_url:
            url = stack.coordinator_url
            if stack.config_path and not getattr(args, "config", None) and not os.environ.get("KVL_CONFIG"):
                cfg = load_config(stack.config_path)   # its admin token and TLS settings
    token = args.token or cfg.coordinator.admin_token or os.environ.get("KVL_ADMIN_TOKEN", "")
    return AdminClient(coordinator_url(cfg, url), token, args.timeout, client_context(cfg.tls))


# --- output -------------------------------------------------------------------------------------

def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, highlight=False, soft_wrap=False, width=None if stream.isatty() else 200)


def _table(title: str | None, columns: list[str], rows: list[list[Any]]) -> Any:
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c, overflow="fold", justify="right" if c.startswith("#") else "left")
    for r in rows:
        t.add_row(*["" if v is None else str(v) for v in r])
    return t


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=False))


def _age(ms: int | None) -> str:
    if not ms:
        return "-"
    s = max(time.time() - ms / 1000, 0.0)
    return f"{s:.1f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.1f}h ago"


def _when(iso: str) -> str:
    return iso[:23].replace("T", " ") if iso else ""


@contextmanager
def progress(description: str, total: int | None, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr (a spinner when ``total`` is unknown); yields ``update(done)``."""
    if not enabled or not sys.stderr.isatty():
        yield lambda done: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns: list[Any] = [SpinnerColumn(), TextColumn("{task.description}")]
    if total:
        columns += [BarColumn(), MofNCompleteColumn()]
    columns.append(TimeElapsedColumn())
    with Progress(*columns, console=_console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total or None)
        yield lambda done: bar.update(task, completed=done)


# --- commands -----------------------------------------------------------------------------------

def cmd_workers(args: argparse.Namespace) -> int:
    doc = client_for(args).call("GET", "/v1/workers")
    if args.json:
        _print_json(doc)
        return 0
    rows = [[w["worker_id"], w["epoch"], ("SUSPENDED" if w.get("suspended") else "yes") if w["alive"] else "LOST", "yes" if w["draining"] else "",
             w.get("endpoint") or "", w["model_id"], w["gpu_replicas"], w["leases"],
             _age(w.get("last_heartbeat_ms"))] for w in doc["workers"]]
    _console().print(_table(f"workers ({len(rows)})", ["worker", "#epoch", "alive", "draining", "endpoint", "model",
                                                       "#gpu replicas", "#leases", "last heartbeat"], rows))
    return 0


def _pages(client: AdminClient, path: str, key: str, query: dict[str, Any], follow_all: bool) -> tuple[list[Any], str | None]:
    items: list[Any] = []
    while True:
        doc = client.call("GET", path, query=query)
        items += doc[key]
        cursor = doc.get("next_cursor")
        if not (follow_all and cursor):
            return items, cursor
        query = {**query, "cursor": cursor}


def cmd_blocks(args: argparse.Namespace) -> int:
    client = client_for(args)
    if args.hash:
        doc = client.call("GET", f"/v1/blocks/{urllib.parse.quote(args.hash)}")
        if args.json:
            _print_json(doc)
            return 0
        con = _console()
        con.print(_table(f"block {doc['block_hash']}: replicas", ["form", "location", "state", "#generation",
                                                                   "tenant", "tokens", "#pins", "owner"],
                         [[r["form"], r["location"], r["state"], r["generation"], r["tenant"],
                           f"{r['token_start']}-{r['token_end']}", r["pins"],
                           f"{r['owner']}@{r['owner_epoch']}" if r.get("owner") else ""] for r in doc["replicas"]]))
        con.print(_table("history", ["#position", "recorded", "type", "stream", "source"],
                         [[e["position"], _when(e["recorded_at"]), e["type"], e["stream_id"], e["source_id"] or ""]
                          for e in doc["history"]]))
        return 0
    query = {"namespace": args.namespace, "tenant": args.tenant, "form": args.form, "location": args.location,
             "state": args.state, "limit": args.limit, "cursor": args.cursor}
    items, cursor = _pages(client, "/v1/blocks", "replicas", query, args.all)
    if args.json:
        _print_json({"replicas": items, "next_cursor": cursor})
        return 0
    rows = [[r["block_hash"], r["form"], r["location"], r["state"], r["generation"], r["tenant"],
             f"{r['token_start']}-{r['token_end']}", r["pins"]] for r in items]
    con = _console()
    con.print(_table(f"replicas ({len(rows)}{'+' if cursor else ''})",
                     ["block", "form", "location", "state", "#gen", "tenant", "tokens", "#pins"], rows))
    if cursor:
        con.print(f"more: --cursor {cursor}  (or --all)")
    return 0


def cmd_leases(args: argparse.Namespace) -> int:
    items, cursor = _pages(client_for(args), "/v1/leases", "leases",
                           {"worker": args.worker, "tenant": args.tenant, "limit": args.limit}, args.all)
    if args.json:
        _print_json({"leases": items, "next_cursor": cursor})
        return 0
    now = time.time() * 1000
    rows = [[x["lease_id"], f"{x['worker_id']}@{x['epoch']}", x["tenant"], x["blocks"], x["usable_blocks"], x["pins"],
             ",".join(f"{f}:{n}" for f, n in x["write"].items()), f"{(x['expires_at_ms'] - now) / 1000:.1f}s"]
            for x in items]
    _console().print(_table(f"leases ({len(rows)}{'+' if cursor else ''})",
                            ["lease", "worker", "tenant", "#blocks", "#usable", "#pins", "write", "expires in"], rows))
    return 0


def cmd_pools(args: argparse.Namespace) -> int:
    doc = client_for(args).call("GET", "/v1/pools")
    if args.json:
        _print_json(doc)
        return 0
    rows = []
    for p in doc["pools"]:
        for form, f in p["forms"].items():
            usage = "-" if f["usage"] is None else f"{100 * f['usage']:.1f}%"
            rows.append([p["worker_id"], form, f["used"], f["limit"], f["free"], usage,
                         "yes" if p["draining"] else ""])
    con = _console()
    con.print(_table("pools", ["worker", "form", "#used", "#limit", "#free", "usage", "draining"], rows))
    if doc.get("tenant_replicas"):
        quota = doc.get("tenant_quota")
        con.print(_table("tenants", ["tenant", "#replicas", "#quota"],
                         [[t, n, quota or "unlimited"] for t, n in doc["tenant_replicas"].items()]))
    return 0


def _event_line(e: dict[str, Any]) -> str:
    source = f"  source={e['source_id']}" if e.get("source_id") else ""
    change = transition(e)
    return (f"{e['position']:>8}  {_when(e['recorded_at'])}  {e['type']:<22} {e['stream_id']}"
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
                _console().print(_table(f"events after position {after} ({len(events)})",
                                        ["#position", "recorded", "type", "stream", "change", "source"],
                                        [[e["position"], _when(e["recorded_at"]), e["type"], e["stream_id"],
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


def cmd_audit(args: argparse.Namespace) -> int:
    client = client_for(args)
    total = None
    status_doc: Any = None
    try:
        status_doc = client.call("GET", "/readyz", timeout_s=3)
    except CliError:
        pass  # the audit call below reports the reason
    if isinstance(status_doc, dict):
        total = status_doc.get("position")
    body = {"replay_from": args.replay_from, "check_workers": not args.no_workers, "timeout_ms": args.worker_timeout_ms}
    if args.disk_checks is not None:
        body["disk_checks"] = args.disk_checks
    what = f"auditing: replaying {total:,} events" if total else "auditing"
    with progress(what, None, not args.json):
        report = client.call("POST", "/v1/audit", body=body, timeout_s=max(args.timeout, 600.0))
    if args.json:
        _print_json(report)
    else:
        _print_audit(report)
    return 0 if report.get("ok") else EXIT_FOUND_PROBLEMS


def _print_audit(r: dict[str, Any]) -> None:
    con = _console()
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
    disk = r.get("disk") or {}
    for kind in ("missing", "damaged"):
        for ref in (disk.get(kind) or {}).get("replicas", [])[:20]:
            con.print(f"  disk {kind}: {' '.join(map(str, ref))}")


def _chain(c: dict[str, Any] | None) -> str:
    if not c:
        return "-"
    span = f"{c.get('anchor')} {c.get('anchor_position')} → {c.get('head_position')}"
    if c.get("ok"):
        return f"intact ({span}, head {str(c.get('head_hash', ''))[:16]}…)"
    brk = c.get("first_break") or {}
    return f"BROKEN at position {brk.get('position')} ({span})"


def _disk_checks(text: str) -> int:
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


def cmd_snapshot(args: argparse.Namespace) -> int:
    doc = client_for(args).call("POST", "/v1/snapshot", body={}, timeout_s=max(args.timeout, 120.0))
    if args.json:
        _print_json(doc)
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
        _print_json(doc)
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
        _print_json(doc)
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
        _print_json(doc)
    else:
        print(f"worker {doc['worker_id']} draining (changed: {'yes' if doc['changed'] else 'no, already'}; "
              f"told the worker: {doc['control']})")
    return 0


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
        _print_json(report)
    else:
        print(f"replayed {report['events']:,} events to position {report['position']} in {report['seconds']} s "
              f"(from {report['replay_from']}"
              + (f", snapshot at {report['snapshot_position']}" if report["snapshot_position"] else "") + ")")
        print(f"state hash {report['state_hash']}: {report['replicas']:,} replicas, {report['workers']} workers")
        for line in report["stream_errors"][:20] + report["invariant_violations"][:20]:
            print(f"  problem: {line}")
        print("log OK" if report["ok"] else "PROBLEMS FOUND")
    return 0 if report["ok"] else EXIT_FOUND_PROBLEMS


def cmd_plan(args: argparse.Namespace) -> int:
    from kvledger.plan import run_plan_command

    return run_plan_command(args)


# --- registration -------------------------------------------------------------------------------

def _wrap(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except CliError as e:
            print(f"kvledger: {e}", file=sys.stderr)
            return e.code
        except BrokenPipeError:  # `kvledger events | head`
            return 0
    return run


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
        p.set_defaults(func=_wrap(fn))
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
    p.add_argument("--disk-checks", type=_disk_checks, metavar="N", default=None,
                   help="disk-tier files one worker verifies (a random sample; 0 = none; default: the server's, 64)")

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
