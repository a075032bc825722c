"""Driver errors of the PostgreSQL log translated once: SQLSTATEs, what is retried, what means unavailable."""

from __future__ import annotations

import asyncio
import sys

import asyncpg

from coordinator.log.port import LogError, LogUnavailable


#: Rolled back by PostgreSQL and likely to pass on a retry.
RETRYABLE_SQLSTATES = frozenset({"40001", "40P01", "55P03"})
#: The server is going away, not accepting connections, or cancelled us on a timeout.
UNAVAILABLE_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "53300", "57014"})


def _sqlalchemy_error(e: BaseException, name: str) -> bool:
    """Whether ``e`` is SQLAlchemy's ``name`` (only the migrations use SQLAlchemy: if it was never
    imported, no error can be one of its)."""
    exc = sys.modules.get("sqlalchemy.exc")
    return exc is not None and isinstance(e, getattr(exc, name))


def _root(e: BaseException) -> BaseException:
    """The driver's own exception under SQLAlchemy's wrappers."""
    if _sqlalchemy_error(e, "DBAPIError") and e.orig is not None:  # type: ignore[attr-defined]
        orig: BaseException = e.orig  # type: ignore[attr-defined]
        return orig.__cause__ if isinstance(orig.__cause__, BaseException) else orig
    return e


def sqlstate(e: BaseException) -> str | None:
    """The SQLSTATE of a driver error, or of the one a translated :class:`LogError` came from."""
    state = getattr(_root(e), "sqlstate", None)
    if state is None and isinstance(e, LogError) and e.__cause__ is not None:
        return sqlstate(e.__cause__)
    return state


def is_retryable(e: BaseException) -> bool:
    return sqlstate(e) in RETRYABLE_SQLSTATES


def is_unavailable(e: BaseException) -> bool:
    # NOTE: InternalClientError is what asyncpg raises when a statement is sent on a session the
    # server has terminated but whose end it has not processed yet ("cannot switch to state 12;
    # another operation (2) is in progress", tests/integration/test_eventlog_postgres.py): the
    # connection is broken, not the statement refused.
    root = _root(e)
    state = getattr(root, "sqlstate", None) or ""
    return (
        isinstance(root, (OSError, TimeoutError, asyncio.TimeoutError, asyncpg.PostgresConnectionError,
                          asyncpg.InterfaceError, asyncpg.InternalClientError))
        or _sqlalchemy_error(root, "TimeoutError")
        or state.startswith("08") or state in UNAVAILABLE_SQLSTATES
        or (_sqlalchemy_error(e, "DBAPIError") and e.connection_invalidated)  # type: ignore[attr-defined]
    )


def describe(e: BaseException) -> str:
    """One readable line for operators (no SQL text, no parameters)."""
    root = _root(e)
    msg = str(root).splitlines()[0] if str(root) else type(root).__name__
    state = getattr(root, "sqlstate", None)
    return f"{type(root).__name__}{f' [{state}]' if state else ''}: {msg}"


def translate(e: BaseException, what: str, *, committed_unknown: bool = False) -> LogError:
    if is_unavailable(e):
        return LogUnavailable(f"PostgreSQL unavailable during {what}: {describe(e)}",
                              committed_unknown=committed_unknown)
    return LogError(f"PostgreSQL refused {what}: {describe(e)}")
