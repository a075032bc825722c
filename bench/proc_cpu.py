"""CPU seconds of the processes a benchmark keeps busy, read from Linux ``/proc``.

A benchmark on a shared 2-core machine cannot trust wall time alone: what each process spent
per operation says which one sets the rate, and how far any schedule could take it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping

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


def _processes() -> Iterator[tuple[int, int, str, float]]:
    """Every process's (pid, parent pid, command name, CPU seconds so far), from ``/proc``."""
    tick = os.sysconf("SC_CLK_TCK")
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        yield int(d), int(fields[1]), stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / tick


def stack_cpu(named: Mapping[str, int]) -> dict[str, dict[int, float]]:
    """CPU seconds so far, per process, by role: each ``role: pid`` of ``named``, every
    ``postgres`` and ``nats-server`` process on the machine, and this process (``bench``)."""
    by_pid = {pid: role for role, pid in named.items()}
    out: dict[str, dict[int, float]] = {role: {} for role in named}
    out.update({role: {} for role in SERVERS.values()})
    out["bench"] = {os.getpid(): time.process_time()}
    for pid, _, comm, cpu in _processes():
        role = by_pid.get(pid) or SERVERS.get(comm)
        if role is not None and pid != os.getpid():
            out[role][pid] = cpu
    return out


def cpu_spent(a: dict[str, dict[int, float]], b: dict[str, dict[int, float]]) -> dict[str, float]:
    """CPU seconds by role between two :func:`stack_cpu` readings (processes that ended in
    between are not counted; ones that started count in full)."""
    return {role: sum(t - a.get(role, {}).get(pid, 0.0) for pid, t in procs.items()) for role, procs in b.items()}


#: A process of a server's tree, by a word of its command line (the first that matches), else its command name.
ROLES = (("worker", "worker"), ("coordinator", "coordinator"), ("gateway", "gateway"),
         ("EngineCore", "engine"), ("vllm", "api"))


def _role(pid: str, comm: str) -> str:
    if comm in SERVERS:
        return SERVERS[comm]
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return comm
    return next((role for word, role in ROLES if word in cmd or word in comm), comm)


def tree_cpu(root: int) -> dict[str, float]:
    """CPU seconds so far of ``root`` and every process below it, summed by role (``worker``,
    ``coordinator``, ``gateway``, ``postgres``, ``nats``; vLLM's ``api`` and ``engine``; else the
    command name): a server's whole cost, however many processes it runs."""
    stats = {pid: (ppid, comm, cpu) for pid, ppid, comm, cpu in _processes()}
    below = {root}
    grew = True
    while grew:
        grew = False
        for pid, (ppid, _, _) in stats.items():
            if ppid in below and pid not in below:
                below.add(pid)
                grew = True
    out: dict[str, float] = {}
    for pid in below:
        if pid in stats:
            role = _role(str(pid), stats[pid][1])
            out[role] = out.get(role, 0.0) + stats[pid][2]
    return out


def tree_spent(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """CPU seconds by role between two :func:`tree_cpu` readings (a process that ended in between
    takes its seconds with it: a server's tree keeps its processes for the whole run)."""
    return {role: round(t - a.get(role, 0.0), 2) for role, t in b.items() if t - a.get(role, 0.0) > 0.005}


__all__ = ["ROLES", "SERVERS", "cpu_spent", "process_cpu", "stack_cpu", "tree_cpu", "tree_spent"]
