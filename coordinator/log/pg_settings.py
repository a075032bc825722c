"""The PostgreSQL log's connection settings (``PgSettings``) and the SQLAlchemy engine the migrations use."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.embedded import asyncpg_url
from shared.tls import client_context

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine


@dataclass(frozen=True, slots=True)
class PgSettings:
    """Connection bounds: a dead or unreachable PostgreSQL must fail calls quickly, not hang them."""

    url: str
    pool_size: int = 5
    connect_timeout_s: float = 3.0
    statement_timeout_s: float = 6.0
    #: ``application_name`` of every session (a takeover terminates the old holder's sessions by it).
    application_name: str = "kvledger"
    #: TLS context of every connection (``shared.tls.client_context``: set when ``tls.ca_file`` is);
    #: ``None`` = asyncpg decides (``PGSSLMODE``; default ``prefer``: try TLS, fall back to plain).
    ssl: ssl.SSLContext | None = None
    #: Appends of at least this many events go by COPY (:meth:`PostgresEventLog._append_copy`);
    #: 0 = never. Below it ``kvl_append``'s single round trip is cheaper.
    copy_min_events: int = 256

    @classmethod
    def from_config(cls, url: str, db_cfg: Any, application_name: str = "kvledger",
                    tls: Any = None) -> "PgSettings":
        connect = db_cfg.connect_timeout_ms / 1000
        return cls(url=url, pool_size=db_cfg.pool_size, connect_timeout_s=connect,
                   statement_timeout_s=max(2 * connect, 5.0), application_name=application_name[:63],
                   ssl=client_context(tls) if tls is not None and db_cfg.tls else None,
                   copy_min_events=db_cfg.copy_append_min_events)

    @property
    def dsn(self) -> str:
        """The URL as asyncpg takes it (any SQLAlchemy driver suffix removed)."""
        return _plain_dsn(self.url)

    def server_settings(self) -> dict[str, str]:
        return {
            "application_name": self.application_name[:63],
            "statement_timeout": str(int(self.statement_timeout_s * 1000)),
            "lock_timeout": str(int(self.connect_timeout_s * 1000)),
            "idle_in_transaction_session_timeout": str(int(self.statement_timeout_s * 2000)),
        }


def _plain_dsn(url: str) -> str:
    for prefix in ("postgresql+asyncpg://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql://" + url[len(prefix):]
    return url


def create_engine(settings: PgSettings) -> AsyncEngine:
    """A SQLAlchemy engine (for the Alembic migrations)."""
    from sqlalchemy.ext.asyncio import create_async_engine

    return create_async_engine(
        asyncpg_url(settings.url),
        pool_size=settings.pool_size,
        max_overflow=2,
        pool_timeout=settings.connect_timeout_s,
        pool_pre_ping=True,
        connect_args={
            "timeout": settings.connect_timeout_s,
            "command_timeout": settings.statement_timeout_s,
            "server_settings": settings.server_settings(),
            # only when set: an explicit ssl=None would override a ?ssl= in the URL
            **({"ssl": settings.ssl} if settings.ssl is not None else {}),
        },
    )
