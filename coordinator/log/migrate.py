"""Run the Alembic migrations programmatically (``kvledger db upgrade|current``, coordinator start).

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
