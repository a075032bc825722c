"""The coordinator's login role: a member of ``kvledger_writer`` and nothing more.

Migration 0003 creates the NOLOGIN group role ``kvledger_writer`` with exactly the
privileges the coordinator's statements need. A login role needs a password, so it is
made here, by the owner (a role with CREATEROLE), after the migration:

* ``kvledger up`` with its embedded PostgreSQL calls :func:`ensure_login_role` with a
  password kept in the state directory;
* compose's one-shot ``migrate`` runs ``python -m coordinator.log.roles`` after
  ``kvledger db upgrade``, with ``KVL_APP_DB_USER`` / ``KVL_APP_DB_PASSWORD`` from ``.env``.

Every coordinator of one ledger (leader and standbys) must log in as the *same* role: a
takeover terminates the stale leader's sessions with ``pg_terminate_backend``, which a
non-superuser may do only to sessions of a role whose privileges it has.
"""

from __future__ import annotations

import asyncio
import os
import sys
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg

from coordinator.log.schema import WRITER_ROLE


class RoleError(RuntimeError):
    pass


def with_credentials(url: str, user: str, password: str) -> str:
    """``url`` with its user and password replaced (host, port, database and query kept)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _dsn(url: str) -> str:
    for prefix in ("postgresql+asyncpg://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql://" + url[len(prefix):]
    return url


async def ensure_login_role(owner_url: str, name: str, password: str, *, timeout_s: float = 10.0) -> None:
    """Create (or update the password of) LOGIN role ``name``, a member of ``kvledger_writer`` only.

    Refuses a role that is a superuser or may bypass the guard (REPLICATION, BYPASSRLS,
    CREATEROLE, CREATEDB), and the owner's own role: either would defeat the point.
    """
    if not name or not password:
        raise RoleError("the coordinator's database role needs a name and a password")
    conn = await asyncpg.connect(_dsn(owner_url), timeout=timeout_s)
    try:
        if name == await conn.fetchval("SELECT current_user"):
            raise RoleError(f"role {name!r} is the migrating (owner) role; the coordinator needs its own role")
        if await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", WRITER_ROLE) is None:
            raise RoleError(f"role {WRITER_ROLE} is missing: run the migrations (`kvledger db upgrade`) first")
        row = await conn.fetchrow("SELECT rolsuper OR rolreplication OR rolbypassrls OR rolcreaterole OR rolcreatedb "
                                  "FROM pg_roles WHERE rolname = $1", name)
        if row is not None and row[0]:
            raise RoleError(f"role {name!r} exists with SUPERUSER, REPLICATION, BYPASSRLS, CREATEROLE or CREATEDB; "
                            f"the coordinator must use a role without them")
        verb = "ALTER" if row is not None else "CREATE"
        # DDL takes no bind parameters: format() quotes the name and the password.
        sql = await conn.fetchval(f"SELECT format('{verb} ROLE %I LOGIN INHERIT PASSWORD %L', $1::text, $2::text)",
                                  name, password)
        try:
            await conn.execute(sql)
        except asyncpg.DuplicateObjectError:  # created meanwhile by a concurrent run
            await conn.execute(sql.replace("CREATE ROLE", "ALTER ROLE", 1))
        await conn.execute(await conn.fetchval(f"SELECT format('GRANT {WRITER_ROLE} TO %I', $1::text)", name))
    finally:
        await conn.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m coordinator.log.roles``: the login role from ``KVL_APP_DB_USER``/``KVL_APP_DB_PASSWORD``,
    made with ``database.owner_url`` (else ``database.url``) of the kvledger configuration."""
    from shared.config import load_config

    cfg = load_config()
    owner = cfg.database.owner_url or cfg.database.url
    name, password = os.environ.get("KVL_APP_DB_USER", ""), os.environ.get("KVL_APP_DB_PASSWORD", "")
    if not owner:
        print("no database URL: set database.owner_url or KVL_DATABASE_URL", file=sys.stderr)
        return 2
    try:
        asyncio.run(ensure_login_role(owner, name, password))
    except (RoleError, OSError, asyncpg.PostgresError) as e:
        print(f"cannot create the coordinator's database role: {e}", file=sys.stderr)
        return 1
    print(f"database role {name} (member of {WRITER_ROLE}) ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
