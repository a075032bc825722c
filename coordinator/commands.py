"""``kvledger coordinator`` and ``kvledger db upgrade|downgrade|current`` (loaded by kvledger/cli.py)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from shared.config import Config, load_config


def register(sub: Any) -> None:
    c = sub.add_parser("coordinator", help="run the coordinator (admin REST, NATS service, event log)")
    c.add_argument("--host", help="admin API address (default: coordinator.host)")
    c.add_argument("--port", type=int, help="admin API port (default: coordinator.port)")
    c.set_defaults(func=cmd_coordinator)

    db = sub.add_parser("db", help="the event log's schema (Alembic migrations)")
    dbsub = db.add_subparsers(dest="db_command", metavar="SUBCOMMAND")
    up = dbsub.add_parser("upgrade", help="migrate the event log schema to the latest revision")
    up.add_argument("revision", nargs="?", default="head")
    up.set_defaults(func=cmd_db_upgrade)
    down = dbsub.add_parser("downgrade", help="take the event log schema back to an older revision (a rollback; "
                                              "every coordinator stopped first)",
                            description="Run this release's migrations' downgrades, newest first, down to REVISION "
                                        "(docs/operations.md, 'Releases and rollback'). Refused while a coordinator "
                                        "is connected, and by a migration whose downgrade would lose history.")
    down.add_argument("revision", help="the revision the older release needs (its `kvledger db current` 'latest')")
    down.set_defaults(func=cmd_db_downgrade)
    cur = dbsub.add_parser("current", help="print the schema revision of the database (and the latest)")
    cur.set_defaults(func=cmd_db_current)
    pro = dbsub.add_parser("promote", help="promote the embedded PostgreSQL standby (kvledger up --pg-standby) to "
                                           "primary, after its primary died",
                           description="pg_ctl promote on <state_dir>/postgres-standby: it ends recovery and accepts "
                                       "writes; the coordinators' URL names both servers and follows. Refused while "
                                       "the primary still runs (two primaries), unless --force.")
    pro.add_argument("--state-dir", default=None, help="the stack's state directory (default: state_dir)")
    pro.add_argument("--force", action="store_true",
                     help="promote even though the primary's server still runs (it must never take writes again)")
    pro.set_defaults(func=cmd_db_promote)
    db.set_defaults(func=lambda args: (db.print_help(), 2)[1])


def cmd_coordinator(args: argparse.Namespace) -> int:
    from coordinator.app import run

    path = getattr(args, "config", None)
    return run(load_config(path), host=args.host, port=args.port, config_path=path)


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from coordinator.log.migrate import head_revision, upgrade

    cfg = load_config(getattr(args, "config", None))
    rev = _with_database(cfg, lambda engine: upgrade(engine, args.revision))
    print(f"event log schema at revision {rev} (latest: {head_revision()})")
    return 0


def cmd_db_downgrade(args: argparse.Namespace) -> int:
    from coordinator.log.migrate import DowngradeRefused, downgrade

    cfg = load_config(getattr(args, "config", None))
    try:
        rev = _with_database(cfg, lambda engine: downgrade(engine, args.revision))
    except DowngradeRefused as e:
        print(f"kvledger db downgrade: refused: {e}", file=sys.stderr)
        return 1
    print(f"event log schema at revision {rev}")
    return 0


def cmd_db_current(args: argparse.Namespace) -> int:
    from coordinator.log.migrate import current, head_revision

    cfg = load_config(getattr(args, "config", None))
    rev = _with_database(cfg, current)
    head = head_revision()
    state = "up to date" if rev == head else "not migrated" if rev is None else "behind: run `kvledger db upgrade`"
    print(f"current: {rev or '(none)'}  latest: {head}  ({state})")
    return 0 if rev == head else 1


def cmd_db_promote(args: argparse.Namespace) -> int:
    from shared.pg_standby import StandbyError, promote_in

    cfg = load_config(getattr(args, "config", None))
    try:
        standby = promote_in(args.state_dir or cfg.state_dir, force=args.force)
    except StandbyError as e:
        print(f"kvledger db promote: {e}", file=sys.stderr)
        return 1
    print(f"promoted: {standby.data_dir} is the primary now (it takes writes); the coordinators reconnect to it")
    return 0


def _with_database(cfg: Config, action: Any) -> Any:
    """Run ``action(engine)`` against the configured database as its schema owner
    (``database.owner_url``, else ``database.url``), or the embedded one in state_dir."""
    from coordinator.log.postgres import PgSettings, create_engine, describe
    from shared.embedded import EmbeddedPostgres, EmbeddedServiceError

    embedded = None
    url = cfg.database.owner_url or cfg.database.url
    if not url:  # the same data directory the coordinator's embedded PostgreSQL uses
        try:
            embedded = EmbeddedPostgres(Path(cfg.state_dir) / "postgres").start()
        except EmbeddedServiceError as e:
            raise SystemExit(f"kvledger db: no database.url configured and the embedded PostgreSQL in "
                             f"{cfg.state_dir} did not start (is a coordinator using it?): {e}") from None
        url = embedded.url

    async def go() -> Any:
        engine = create_engine(PgSettings.from_config(url, cfg.database, application_name="kvledger-db", tls=cfg.tls))
        try:
            return await action(engine)
        finally:
            await engine.dispose()

    from coordinator.log.migrate import DowngradeRefused

    try:
        return asyncio.run(go())
    except DowngradeRefused:
        raise
    except Exception as e:  # noqa: BLE001 - one readable line, not a traceback
        print(f"kvledger db: {describe(e)}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        if embedded is not None:
            embedded.stop()
