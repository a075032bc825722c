"""NATS subject names, all under one configurable prefix (default ``kvl``).

Tests give each test its own prefix, so parallel tests never see each other's traffic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"^[A-Za-z0-9_\-]+$")
#: Queue group of the coordinator's request/reply service.
COORDINATOR_QUEUE = "kvl-coordinator"


@dataclass(frozen=True, slots=True)
class Subjects:
    prefix: str = "kvl"

    def __post_init__(self) -> None:
        if not all(_TOKEN.match(p) for p in self.prefix.split(".")):
            raise ValueError(f"subject prefix {self.prefix!r}: dot-separated tokens of letters, digits, '_' or '-'")

    # request/reply to the coordinator
    @property
    def lease_acquire(self) -> str: return f"{self.prefix}.lease.acquire"
    @property
    def lease_renew(self) -> str: return f"{self.prefix}.lease.renew"
    @property
    def lease_release(self) -> str: return f"{self.prefix}.lease.release"
    @property
    def worker_register(self) -> str: return f"{self.prefix}.worker.register"
    @property
    def worker_heartbeat(self) -> str: return f"{self.prefix}.worker.heartbeat"
    @property
    def worker_resume(self) -> str: return f"{self.prefix}.worker.resume"

    # JetStream transitions
    @property
    def stream_name(self) -> str:
        """JetStream stream name (``KVL_EVENTS`` for the default prefix)."""
        return re.sub(r"[^A-Za-z0-9_-]", "_", self.prefix).upper() + "_EVENTS"
    @property
    def events_wildcard(self) -> str: return f"{self.prefix}.events.>"
    def events(self, worker_id: str) -> str:
        _check_token(worker_id)
        return f"{self.prefix}.events.{worker_id}"

    # coordinator → worker
    def watermark(self, worker_id: str) -> str:
        _check_token(worker_id)
        return f"{self.prefix}.worker.{worker_id}.watermark"
    def inventory(self, worker_id: str) -> str:
        _check_token(worker_id)
        return f"{self.prefix}.worker.{worker_id}.inventory"
    def control(self, worker_id: str) -> str:
        _check_token(worker_id)
        return f"{self.prefix}.worker.{worker_id}.control"


def _check_token(s: str) -> None:
    if not _TOKEN.match(s):
        raise ValueError(f"{s!r} cannot be a NATS subject token: use letters, digits, '_' or '-'")
