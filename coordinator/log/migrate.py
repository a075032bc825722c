"""Run the Alembic migrations programmatically (``kvledger db upgrade|downgrade|current``, coordinator start).

Migrations run on the caller's async engine, inside one transaction that first takes a
transaction-scoped advisory lock, so two coordinators starting at once cannot both run the
DDL (PostgreSQL DDL is transactional: the loser sees the finished schema and does nothing).
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

import migrations

#: pg_advisory_xact_lock key for "a migration is running" (distinct from the leader lock).
MIGRATION_LOCK_KEY = 0x6B766C_6D6967  # "kvl" "mig"


def alembic_config() -> Config:
    cfg = Config(str(Path(migrations.__file__).parent / "alembic.ini"))
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "migrations/versions holds no revision"
    return head


def _upgrade(conn: Connection, revision: str) -> None:
    cfg = alembic_config()
    cfg.attributes["connection"] = conn
    command.upgrade(cfg, revision)


def known_revisions() -> list[str]:
    """Every revision this release's ``migrations/`` holds, oldest first."""
    return [s.revision for s in reversed(list(ScriptDirectory.from_config(alembic_config()).walk_revisions()))]


def _downgrade(conn: Connection, revision: str) -> None:
    cfg = alembic_config()
    cfg.attributes["connection"] = conn
    command.downgrade(cfg, revision)


#: Sessions of running coordinators (their ``application_name``: ``coordinator.log.leader.make_holder_id``).
COORDINATOR_SESSIONS = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE 'kvl-coord-%' AND pid <> pg_backend_pid()
"""


class DowngradeRefused(RuntimeError):
    """A downgrade that would break a running coordinator or is not a step back; the message says why."""


async def downgrade(engine: AsyncEngine, revision: str) -> str | None:
    """Take the schema back to ``revision`` (each migration's own ``downgrade``, newest first), in
    one transaction behind the migration lock. Refused while a coordinator is connected (it would
    run on a schema it does not know), and when ``revision`` is not an older revision of this
    release; a migration whose downgrade would lose history refuses by itself (0001 keeps a
    non-empty log). Returns the revision now current."""
    known = known_revisions()
    if revision not in known:
        raise DowngradeRefused(f"revision {revision!r} is not one of this release's: {', '.join(known)}")
    async with engine.begin() as conn:
        await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
        running = (await conn.execute(text(COORDINATOR_SESSIONS))).scalar_one()
        if running:
            raise DowngradeRefused(f"{running} coordinator session(s) are connected to this database: stop every "
                                   "coordinator (and standby) before changing the schema under them")
        now = await conn.run_sync(_current)
        if now is None or known.index(revision) >= known.index(now):
            raise DowngradeRefused(f"the schema is at {now or 'no revision'}; {revision} is not older")
        await conn.run_sync(_downgrade, revision)
        return await conn.run_sync(_current)


def _current(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


async def upgrade(engine: AsyncEngine, revision: str = "head") -> str | None:
    """Upgrade the schema to ``revision``; returns the revision now current."""
    async with engine.begin() as conn:
        await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
        await conn.run_sync(_upgrade, revision)
        return await conn.run_sync(_current)


async def current(engine: AsyncEngine) -> str | None:
    """The database's current revision (None = never migrated)."""
    async with engine.connect() as conn:
        return await conn.run_sync(_current)
