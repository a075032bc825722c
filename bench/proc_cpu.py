"""CPU seconds of the processes a benchmark keeps busy, read from Linux ``/proc``.

A benchmark on a shared 2-core machine cannot trust wall time alone: what each process spent
per operation says which one sets the rate, and how far any schedule could take it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

#: Server processes counted by their command name (every one on the machine: other work on the
#: same servers counts too).
SERVERS = {"postgres": "postgres", "nats-server": "nats"}


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of one process so far (0.0 where ``/proc`` cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def stack_cpu(named: Mapping[str, int]) -> dict[str, dict[int, float]]:
    """CPU seconds so far, per process, by role: each ``role: pid`` of ``named``, every
    ``postgres`` and ``nats-server`` process on the machine, and this process (``bench``)."""
    tick = os.sysconf("SC_CLK_TCK")
    by_pid = {pid: role for role, pid in named.items()}
    out: dict[str, dict[int, float]] = {role: {} for role in named}
    out.update({role: {} for role in SERVERS.values()})
    out["bench"] = {os.getpid(): time.process_time()}
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        role = by_pid.get(int(d)) or SERVERS.get(comm)
        if role is not None:
            fields = stat[stat.rindex(")") + 2:].split()
            out[role][int(d)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_spent(a: dict[str, dict[int, float]], b: dict[str, dict[int, float]]) -> dict[str, float]:
    """CPU seconds by role between two :func:`stack_cpu` readings (processes that ended in
    between are not counted; ones that started count in full)."""
    return {role: sum(t - a.get(role, {}).get(pid, 0.0) for pid, t in procs.items()) for role, procs in b.items()}


__all__ = ["SERVERS", "cpu_spent", "process_cpu", "stack_cpu"]
