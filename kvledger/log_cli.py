"""``kvledger log archive|archives|verify``: retention of the event log (``coordinator.log.archive``).

They talk to PostgreSQL directly (no coordinator needed) as the schema owner
(``database.owner_url``, else ``database.url``): the coordinator's own role may not delete.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kvledger.cli_support import EXIT_FOUND_PROBLEMS, CliError, print_json, progress, wrap
from shared.config import load_config


def _owner_url(args: argparse.Namespace) -> tuple[Any, str]:
    cfg = load_config(getattr(args, "config", None))
    url = args.database_url or cfg.database.owner_url or cfg.database.url
    if not url:
        raise CliError("kvledger log needs the database as its schema owner: --database-url, or database.owner_url "
                       "/ database.url (KVL_DATABASE__OWNER_URL / KVL_DATABASE_URL)")
    return cfg, url


def _with_connection(args: argparse.Namespace, work: Callable[[Any, Any], Awaitable[Any]]) -> Any:
    import asyncpg

    from coordinator.log.archive import ArchiveError
    from coordinator.log.postgres import PgSettings, describe

    cfg, url = _owner_url(args)
    settings = PgSettings.from_config(url, cfg.database, application_name="kvledger-log", tls=cfg.tls)

    async def go() -> Any:
        # NOTE: no statement timeout: deleting a million archived rows takes longer than an append may
        conn = await asyncpg.connect(settings.dsn, ssl=settings.ssl, timeout=settings.connect_timeout_s,
                                     server_settings={"application_name": settings.application_name,
                                                      "statement_timeout": "0"})
        try:
            if await conn.fetchval("SELECT to_regclass('log_archives') IS NULL"):
                raise CliError("this database has no log_archives table: run `kvledger db upgrade` first")
            return await work(conn, cfg)
        finally:
            await conn.close()

    try:
        return asyncio.run(go())
    except (CliError, KeyboardInterrupt):
        raise
    except ArchiveError as e:
        raise CliError(str(e), EXIT_FOUND_PROBLEMS) from None
    except Exception as e:  # noqa: BLE001 - one readable line
        raise CliError(f"log: {describe(e)}") from None


def cmd_archive(args: argparse.Namespace) -> int:
    from coordinator.core import CoreParams
    from coordinator.log import archive as ar

    if args.before is not None and args.before < 1:
        raise CliError("--before must be a position (≥ 1)")
    if args.keep_events is not None and args.keep_events < 0:
        raise CliError("--keep-events must be ≥ 0")
    if args.page < 1:
        raise CliError("--page must be ≥ 1")

    async def work(conn: Any, cfg: Any) -> dict[str, Any]:
        before = args.before if args.before is not None else int(await conn.fetchval(ar.HEAD)) - args.keep_events
        if before < 1:
            raise ar.ArchiveError(f"the log holds no more than --keep-events {args.keep_events} events: nothing "
                                  f"to archive")
        p = await ar.plan(conn, before)
        if args.dry_run:
            return {**p, "dry_run": True}
        with progress(f"archiving positions {p['first_position']:,}..{p['last_position']:,}", p["events"],
                      not args.json) as update:
            return await ar.archive(conn, Path(args.out), before, CoreParams.from_config(cfg.coordinator),
                                    page=args.page, progress=update)

    report = _with_connection(args, work)
    if args.json:
        print_json(report)
    elif report.get("dry_run"):
        print(f"would archive positions {report['first_position']:,}..{report['last_position']:,} "
              f"({report['events']:,} events; anchor snapshot at {report['last_position']:,}, state hash "
              f"{report['anchor_hash']}); the log's head is {report['head']:,}")
    else:
        print(f"archived positions {report['first_position']:,}..{report['last_position']:,} ({report['events']:,} "
              f"events, {report['bytes']:,} bytes) to {report['file']}\nsha256 {report['sha256']}; replays and the "
              f"audit start at the anchor snapshot at {report['last_position']:,} from now on")
    return 0


def cmd_archives(args: argparse.Namespace) -> int:
    from coordinator.log import archive as ar

    async def work(conn: Any, cfg: Any) -> list[dict[str, Any]]:
        return await ar.list_archives(conn)

    rows = _with_connection(args, work)
    if args.json:
        print_json({"archives": rows})
    elif not rows:
        print("nothing archived: the log is whole from position 1")
    else:
        for r in rows:
            print(f"{r['first_position']:>12,}..{r['last_position']:<12,} {r['events']:>10,} events  {r['file']}  "
                  f"sha256 {r['sha256'][:16]}…  {r['archived_at']}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from coordinator.core import CoreParams
    from coordinator.log import archive as ar

    cfg = load_config(getattr(args, "config", None))
    paths = [Path(p) for p in args.files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise CliError(f"no such file: {', '.join(missing)}")
    try:
        with progress("folding the archives", None, not args.json) as update:
            report = ar.verify_archives(paths, CoreParams.from_config(cfg.coordinator), progress=update)
    except ar.ArchiveError as e:
        if args.json:
            print_json({"ok": False, "error": str(e)})
        else:
            print(f"PROBLEM: {e}")
        return EXIT_FOUND_PROBLEMS
    if args.database_url:
        async def recorded(conn: Any, cfg: Any) -> list[dict[str, Any]]:
            return await ar.list_archives(conn)

        problems = ar.match_recorded(report["files"], _with_connection(args, recorded))
        report.update(ok=not problems, database_problems=problems)
    if args.json:
        print_json(report)
    else:
        for line in report.get("database_problems", []):
            print(f"PROBLEM: {line}")
        for f in report["files"]:
            print(f"{f['file']}: positions {f['first_position']:,}..{f['last_position']:,} fold to the anchor's "
                  f"state hash {f['anchor_hash']} (sha256 {f['sha256']})")
        if report["ok"]:
            print(f"archives OK: the history up to position {report['position']:,} is whole"
                  + (" and every file is the one the database recorded" if args.database_url else ""))
    return 0 if report["ok"] else EXIT_FOUND_PROBLEMS


def register(sub: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", "-c", default=argparse.SUPPRESS, help="YAML config file")
    common.add_argument("--json", action="store_true", help="print the report as JSON")
    db = argparse.ArgumentParser(add_help=False, parents=[common])
    db.add_argument("--database-url", help="the schema owner's URL (default: database.owner_url, else database.url)")

    log = sub.add_parser("log", help="retention of the event log: archive its oldest events, list and verify "
                                     "archives")
    logsub = log.add_subparsers(dest="log_command", metavar="SUBCOMMAND")
    p = logsub.add_parser("archive", parents=[db], help="move the events up to a snapshot into an archive file",
                          description="Write the events up to the newest snapshot at or before --before (or "
                                      "head - --keep-events) to a file "
                                      "in --out, prove that they fold to that snapshot's state hash, then delete "
                                      "them from the database. Replays and the audit start at that snapshot "
                                      "afterwards; `kvledger log verify` re-checks the files offline.")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--before", type=int, metavar="POSITION",
                       help="archive up to the newest snapshot at or before this position")
    which.add_argument("--keep-events", type=int, metavar="N",
                       help="keep at least the last N events in the database: archive up to the newest snapshot "
                            "at or before head - N")
    p.add_argument("--out", required=True, metavar="DIR", help="directory of the archive files (created if missing)")
    p.add_argument("--page", type=int, default=10_000, help="events read per query")
    p.add_argument("--dry-run", action="store_true", help="say what would be archived; write and delete nothing")
    p.set_defaults(func=wrap(cmd_archive))
    p = logsub.add_parser("archives", parents=[db], help="the archives this database has made")
    p.set_defaults(func=wrap(cmd_archives))
    p = logsub.add_parser("verify", parents=[common], help="fold archive files from position 1 and check every "
                                                           "anchor (offline; exit 3 on a problem)")
    p.add_argument("--database-url", help="also check each file's SHA-256 against the archive the database "
                                          "recorded, and that no recorded archive is missing")
    p.add_argument("files", nargs="+", metavar="FILE", help="every archive file from position 1 on")
    p.set_defaults(func=wrap(cmd_verify))
    log.set_defaults(func=lambda args: (log.print_help(), 2)[1])
