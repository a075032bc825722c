"""``kvledger up --pg-standby``: the supervisor's side of the PostgreSQL standby.

The standby itself (clone, streaming, synchronous commit, promotion) is :mod:`shared.pg_standby`;
this module is what :class:`kvledger.stack.supervisor.Stack` calls to start it, to give the coordinators a
URL that follows a promotion, and, while the stack is up, to watch the primary:

* A primary that exits is **not restarted** while it has a standby: once the standby may have
  been promoted, a second server that accepts writes would split the ledger (the coordinators'
  URL names both and takes whichever accepts writes). The way back is the standby.
* With ``database.failover_after_s`` > 0 the standby is promoted once the primary has been dead
  that long; with 0 the operator decides (``kvledger db promote``), and this module notices the
  promotion and says so.
* A standby that exits before its promotion is restarted like any embedded service (with a
  synchronous standby, commits wait until it is back).
"""

from __future__ import annotations

import contextlib
import subprocess
from typing import Any

from shared import pg_standby
from shared.embedded import EmbeddedPostgres


class PgFailover:
    """``stack`` is the :class:`kvledger.stack.supervisor.Stack` (its console, state file, pids and service
    restart); typed ``Any`` so that neither module imports the other at import time."""

    def __init__(self, stack: Any, primary: EmbeddedPostgres, standby: pg_standby.EmbeddedStandby) -> None:
        self.stack = stack
        self.primary = primary
        self.standby = standby
        self.after_s = float(stack.cfg.database.failover_after_s)
        self.synchronous = stack.cfg.database.synchronous_standby
        #: When (monotonic) the primary was found dead; None while it runs.
        self.primary_down_since: float | None = None
        self.promoted_reported = False

    @classmethod
    def start(cls, stack: Any) -> "PgFailover":
        primary = stack.services.postgres
        assert primary is not None
        standby = pg_standby.start_standby(primary, stack.state_dir, synchronous=stack.cfg.database.synchronous_standby)
        assert standby.proc is not None
        stack._pids.add(standby.proc.pid)
        stack._started += 1
        return cls(stack, primary, standby)

    @staticmethod
    def without_standby(primary: EmbeddedPostgres, state_dir: Any) -> None:
        """Refuse a primary whose standby was promoted (it is behind the ledger); and a primary that
        had a synchronous standby in an earlier run waits for it on every commit: alone, it must not."""
        pg_standby.refuse_superseded(primary, state_dir)
        if pg_standby.synchronous_configured(primary):
            pg_standby.set_synchronous(primary, False)

    def url(self, url: str) -> str:
        """``url`` (the primary's) naming the standby too: the coordinators follow a promotion."""
        return pg_standby.failover_url(url, (self.standby.host, self.standby.port))

    def describe(self) -> str:
        mode = "synchronous" if self.synchronous else "asynchronous"
        auto = f"promoted after {self.after_s:g}s without a primary" if self.after_s else "promoted by `kvledger db promote`"
        return f"PostgreSQL standby on {self.standby.host}:{self.standby.port} ({mode}; {auto})"

    def tick(self, now: float) -> bool:
        """One look from the supervision loop; False when the stack cannot go on (reported)."""
        say = self.stack.console.say
        p = self.primary
        if p.proc is not None and p.proc.poll() is not None:
            code = p.proc.returncode
            self.stack._pids.discard(p.proc.pid)
            p.proc = None  # NOTE: also keeps the generic service restart away from it
            self.primary_down_since = now
            what = (f"the standby is promoted in {self.after_s:g}s" if self.after_s and not self.standby.promoted
                    else "promote the standby: kvledger db promote")
            self.stack.write_state_file()  # stack.json no longer lists its pid (before the line: see below)
            say(f"embedded postgres (primary) exited (code {code}); not restarting it next to its standby; {what}",
                style="bold red")
        if self.standby.promoted:
            if not self.promoted_reported:
                self.promoted_reported = True
                # NOTE: stack.json first: whoever reads the line (an operator's script, a drill)
                # then finds the standby's new role there, not the old one
                self.stack.write_state_file()
                say(f"the standby was promoted: PostgreSQL on {self.standby.host}:{self.standby.port} is the "
                    f"primary now (no standby left)", style="bold yellow")
        elif self.primary_down_since is not None and self.after_s and now - self.primary_down_since >= self.after_s:
            say(f"the primary has been dead {now - self.primary_down_since:.1f}s: promoting the standby",
                style="bold yellow")
            try:
                self.standby.promote()
            except pg_standby.StandbyError as e:
                say(f"cannot promote the standby ({e}); stopping the stack", style="bold red")
                return False
        s = self.standby
        if s.proc is not None and s.proc.poll() is not None:
            return self.stack._restart_service("postgres-standby", s, now)
        return True

    def rows(self) -> list[dict[str, Any]]:
        s = self.standby
        role = "embedded (promoted: the primary)" if s.promoted else \
            f"embedded standby ({'sync' if self.synchronous else 'async'})"
        return [{"name": "postgres-standby", "url": f"postgresql://{s.host}:{s.port}/postgres", "role": role,
                 "pid": s.proc.pid if s.proc is not None else None,
                 "log": str(s.data_dir / "postgres.log"), "restarts": None}]

    def stop(self) -> None:
        """The standby, after the primary stops naming it synchronous: a later start of the primary
        alone (``kvledger db upgrade``, ``kvledger services``) must not wait for it on every commit."""
        if self.primary.proc is not None and self.primary.proc.poll() is None and not self.standby.promoted:
            with contextlib.suppress(pg_standby.StandbyError, OSError, subprocess.TimeoutExpired):
                pg_standby.set_synchronous(self.primary, False)
        self.standby.stop()
