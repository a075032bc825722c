"""NATS subject names, all under one configurable prefix (default ``kvl``).

Tests give each test its own prefix, so parallel tests never see each other's traffic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"^[A-Za-z0-9_\-]+\Z")
#: Queue group of the coordinator's request/reply service.
COORDINATOR_QUEUE = "kvl-coordinator"
#: Worker → coordinator requests; each has its own subject per worker (:meth:`Subjects.request`).
REQUEST_OPS = ("register", "resume", "heartbeat", "acquire", "renew", "release", "disk_gc", "host_evict")


@dataclass(frozen=True, slots=True)
class Subjects:
    prefix: str = "kvl"

    def __post_init__(self) -> None:
        if not all(_TOKEN.match(p) for p in self.prefix.split(".")):
            raise ValueError(f"subject prefix {self.prefix!r}: dot-separated tokens of letters, digits, '_' or '-'")

    # request/reply to the coordinator: one subject per worker and operation, so that NATS
    # permissions can confine each worker to its own (``<prefix>.req.<worker>.<op>``)
    def request(self, op: str, worker_id: str) -> str:
        if op not in REQUEST_OPS:
            raise ValueError(f"unknown request operation {op!r}")
        _check_token(worker_id)
        return f"{self.prefix}.req.{worker_id}.{op}"
    def requests_wildcard(self, op: str) -> str:
        """What the coordinator subscribes to for ``op`` (every worker's)."""
        if op not in REQUEST_OPS:
            raise ValueError(f"unknown request operation {op!r}")
        return f"{self.prefix}.req.*.{op}"
    def request_worker(self, subject: str) -> str | None:
        """The worker id a request subject names (``None``: not a request subject of this prefix)."""
        head = f"{self.prefix}.req."
        if not subject.startswith(head):
            return None
        rest = subject[len(head):].split(".")
        return rest[0] if len(rest) == 2 and rest[1] in REQUEST_OPS else None

    # gateway → coordinator route queries: one subject per gateway, as for workers' requests
    def route(self, gateway_id: str) -> str:
        _check_token(gateway_id)
        return f"{self.prefix}.route.{gateway_id}"
    @property
    def route_wildcard(self) -> str: return f"{self.prefix}.route.*"
    def route_gateway(self, subject: str) -> str | None:
        """The gateway id a route subject names (``None``: not a route subject of this prefix)."""
        head = f"{self.prefix}.route."
        rest = subject[len(head):] if subject.startswith(head) else ""
        return rest if rest and "." not in rest else None

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
