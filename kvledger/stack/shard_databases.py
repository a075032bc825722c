"""Each ledger shard's database on the embedded PostgreSQL (``kvledger up --shards N``).

Shard 0 keeps the stack's database, so one shard is exactly the unsharded stack; shard k ≥ 1 gets
``<database>_s<k>`` on the same server, made on the first start and migrated like the first. A
shard's log must be its own (architecture.md, "The ledger sharded": the ``leader`` row and the
advisory locks are per database, so each shard elects its own leader).
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def shard_database(url: str, shard: int) -> str:
    """The name of shard ``shard``'s database, beside the one ``url`` names."""
    name = urlsplit(url).path.lstrip("/") or "postgres"
    return name if shard == 0 else f"{name}_s{shard}"


def with_database(url: str, name: str) -> str:
    """``url`` naming database ``name`` (user, password, hosts and query kept)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


async def ensure_database(owner_url: str, name: str, *, timeout_s: float = 10.0) -> str:
    """Create database ``name`` on ``owner_url``'s server unless it exists; its URL (as the owner)."""
    import asyncpg

    conn = await asyncpg.connect(owner_url.replace("postgresql+asyncpg://", "postgresql://", 1), timeout=timeout_s)
    try:
        if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            await conn.execute(await conn.fetchval("SELECT format('CREATE DATABASE %I', $1::text)", name))
    finally:
        await conn.close()
    return with_database(owner_url, name)


__all__ = ["ensure_database", "shard_database", "with_database"]
