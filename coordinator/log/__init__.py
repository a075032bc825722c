"""The append-only event log: a port, its PostgreSQL adapter, an in-memory twin, group commit
and single-writer election."""

from coordinator.log.memory import InMemoryEventLog
from coordinator.log.port import (
    EventLog, LeaderInfo, LogError, LogUnavailable, NewEvent, NotLeader, Snapshot, StoredEvent, StreamConflict,
)

__all__ = [
    "EventLog", "InMemoryEventLog", "LeaderInfo", "LogError", "LogUnavailable", "NewEvent", "NotLeader",
    "Snapshot", "StoredEvent", "StreamConflict",
]
