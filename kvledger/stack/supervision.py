"""Keeping the stack up (step 6 of :mod:`kvledger.stack`): a coordinator, worker or gateway that
exits is reported and restarted with the same port and id, after a backoff that doubles while
it keeps dying; an embedded PostgreSQL or NATS likewise on its port and data directory; more
than ``--max-restarts`` exits within ``--restart-window`` stop the stack.

:class:`Supervision` is part of :class:`kvledger.stack.supervisor.Stack`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kvledger.stack.child import Child
from kvledger.stack.console import Console
from kvledger.stack.options import StackOptions


class Supervision:
    """The supervision loop of a :class:`~kvledger.stack.supervisor.Stack` (its attributes below)."""

    opts: StackOptions
    console: Console
    pg_failover: Any
    _stop: threading.Event
    _pids: set[int]
    _service_exits: dict[str, list[float]]
    _started: int

    def supervise(self) -> bool:
        """Until a stop is requested (False) or the stack cannot go on (True, reported): a child
        that exits is restarted (:meth:`_exited`, :meth:`_restart`), the others keep running."""
        while not self._stop.wait(0.25):
            now = time.monotonic()
            for child in self.children:
                if child.restart_at is not None:
                    if now >= child.restart_at and not self._restart(child):
                        return True
                elif not child.alive and not self._exited(child, now):
                    return True
            # NOTE: first, so that a dead primary with a standby is not restarted below
            if self.pg_failover is not None and not self.pg_failover.tick(now):
                return True
            for name, emb in self._embedded():
                if emb is not None and emb.proc is not None and emb.proc.poll() is not None \
                        and not self._restart_service(name, emb, now):
                    return True
        return False

    def _restart_service(self, name: str, emb: Any, now: float) -> bool:
        """An embedded PostgreSQL or NATS exited: start it again on the same port and data
        directory (the coordinator and workers reconnect and carry on); False on a crash loop or
        when it cannot start."""
        o = self.opts
        code = emb.proc.returncode
        self._pids.discard(emb.proc.pid)
        exits = [t for t in self._service_exits.get(name, []) if now - t < o.restart_window_s] + [now]
        self._service_exits[name] = exits
        if len(exits) > o.max_restarts:
            self.console.say(f"embedded {name} exited (code {code}; log under {emb.data_dir}); not restarting it: "
                             f"it exited {len(exits)} times within {o.restart_window_s:g}s "
                             f"(--max-restarts {o.max_restarts}); stopping the stack", style="bold red")
            return False
        self.console.say(f"embedded {name} exited (code {code}; log under {emb.data_dir}); restarting it on the "
                         "same port", style="bold yellow")
        emb.proc = None
        try:
            emb.start(60.0)
        except Exception as e:  # noqa: BLE001 - one readable line, then the stack stops
            self.console.say(f"embedded {name}: cannot restart it ({e}); stopping the stack", style="bold red")
            return False
        self._pids.add(emb.proc.pid)
        self._started += 1
        self.console.say(f"embedded {name} restarted (pid {emb.proc.pid})", style="bold yellow")
        self.write_state_file()
        return True

    def _exited(self, child: Child, now: float) -> bool:
        """Report a child that exited and schedule its restart (True), or, when it exited more
        than ``max_restarts`` times within ``restart_window_s``, say so (False: stop the stack)."""
        o = self.opts
        pid = child.pid
        code = child.stop(0)  # what is left of its process group goes too: it could hold the port
        self._pids.discard(pid)
        child.exits = [t for t in child.exits if now - t < o.restart_window_s] + [now]
        last = f"its last lines:\n{child.tail()}\n(full log: {child.log_path})"
        if len(child.exits) > o.max_restarts:
            why = (f"it exited {len(child.exits)} times within {o.restart_window_s:g}s "
                   f"(--max-restarts {o.max_restarts})")
            child.note("process_exited", "error", pid=pid, exit_code=code, action="stopping the stack", reason=why)
            self.console.say(f"{child.name} (pid {pid}) exited (code {code}); {last}\n"
                             f"not restarting it: {why}; stopping the stack", style="bold red")
            return False
        delay = min(o.restart_backoff_s * 2 ** (len(child.exits) - 1), o.restart_backoff_max_s)
        child.restart_at = now + delay
        child.note("process_exited", "warning", pid=pid, exit_code=code, action="restarting",
                   restart=child.restarts + 1, delay_s=delay)
        self.console.say(f"{child.name} (pid {pid}) exited (code {code}); restarting in {delay:g}s "
                         f"(restart {child.restarts + 1}); {last}", style="bold yellow")
        self.write_state_file()
        return True

    def _restart(self, child: Child) -> bool:
        """Start ``child`` again (same command, environment, port and worker id); False if it cannot be."""
        child.restart_at = None
        child.restarts += 1
        try:
            self._run(child)
        except OSError as e:
            self.console.say(f"{child.name}: cannot restart it ({e}); stopping the stack", style="bold red")
            return False
        self.console.say(f"{child.name} restarted (pid {child.pid}, restart {child.restarts})", style="bold yellow")
        self.write_state_file()
        self.console.print(self.summary_table())
        return True
