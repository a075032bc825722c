"""The ledger's own error: it cannot decide, or make a decision durable, right now.

The services answer it as its ``code`` says (UNAVAILABLE, or NOT_LEADER when another
coordinator leads), with its ``retry_after_ms``. A module of its own because the ledger
(``coordinator.ledger``) and its snapshots (``coordinator.ledger_snapshots``) both raise it.
"""

from __future__ import annotations

from shared.messages import ErrorCode


class Unavailable(Exception):
    """The ledger cannot decide or make a decision durable right now (typed for the reply)."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.UNAVAILABLE, retry_after_ms: int = 500) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_ms = retry_after_ms


__all__ = ["Unavailable"]
