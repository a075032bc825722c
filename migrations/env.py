"""Alembic environment for the event log.

Two ways in:

* programmatic (``coordinator.log.migrate``): the caller passes an open synchronous
  ``Connection`` in ``config.attributes["connection"]`` (from ``AsyncConnection.run_sync``),
  so migrations run on the caller's engine and event loop;
* the ``alembic`` command line: the URL comes from ``sqlalchemy.url`` if set, else from the
  kvledger configuration (``KVL_DATABASE_URL`` or the config file); asyncpg is the driver.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import pool
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from coordinator.log.schema import metadata

config = context.config
target_metadata = metadata


def _url() -> str:
    from shared.config import load_config
    from shared.embedded import asyncpg_url

    url = config.get_main_option("sqlalchemy.url") or load_config().database.url
    if not url:
        raise SystemExit("no database URL: set KVL_DATABASE_URL or database.url in the kvledger config")
    return asyncpg_url(url)


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True,
                      dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def do_run_migrations(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata)
    with context.begin_transaction():
        context.run_migrations()


async def _run_async() -> None:
    engine = create_async_engine(_url(), poolclass=pool.NullPool)
    try:
        async with engine.connect() as conn:
            await conn.run_sync(do_run_migrations)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
elif (conn := config.attributes.get("connection")) is not None:
    do_run_migrations(conn)
else:
    asyncio.run(_run_async())
