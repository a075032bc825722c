"""The supervisor of ``kvledger up``: :class:`Stack` composes the start sequence
(:mod:`~kvledger.stack.startup`), the supervision loop (:mod:`~kvledger.stack.supervision`) and
the reports (:mod:`~kvledger.stack.report`), and owns what they share: the signals, the
children, the pids it started, and the ordered stop that leaves nothing behind.
"""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvledger.stack.child import Child
from kvledger.stack.console import Console
from kvledger.stack.options import Interrupted, StackError, StackOptions
from kvledger.stack.orphans import descendants, stop_leftovers, survivors
from kvledger.stack.report import StackReport
from kvledger.stack.startup import StartupSteps
from kvledger.stack.supervision import Supervision
from shared.config import Config
from shared.nats_auth import CredentialStore
from shared.tls import client_context


@dataclass
class Stack(StartupSteps, Supervision, StackReport):
    cfg: Config
    opts: StackOptions
    console: Console = field(default_factory=Console)
    python: str = sys.executable

    def __post_init__(self) -> None:
        self.console.on_gone = self.console.on_gone or (lambda: self.request_stop(signal.SIGPIPE))
        # NOTE: absolute, because the embedded PostgreSQL resolves a relative socket directory
        # against its data directory (a relative state_dir such as the default .kvl-state fails).
        self.state_dir = Path(self.cfg.state_dir).resolve()
        self.log_dir = self.state_dir / "logs"
        self.services: Any = None
        #: The embedded PostgreSQL's standby and its watch (``--pg-standby``), else None.
        self.pg_failover: Any = None
        #: How the supervisor's probes verify the children's HTTPS (``tls`` section; None = plain or system CAs).
        self.tls_context = client_context(self.cfg.tls)
        #: The embedded NATS's users and passwords (``None`` with a configured NATS).
        self.credentials: CredentialStore | None = None
        self.coordinators: list[Child] = []
        self.workers: list[Child] = []
        self.gateways: list[Child] = []
        self._stop = threading.Event()
        self._hurry = threading.Event()
        self._signals = 0
        #: The processes this supervisor runs now (a restarted child's old pid is no longer ours).
        self._pids: set[int] = set()
        #: Exit times of the embedded services, for the same crash-loop limit as the children.
        self._service_exits: dict[str, list[float]] = {}
        self._started = 0
        self._wrote_state = False

    @property
    def coordinator_url(self) -> str:
        """The first coordinator's (the leader when the stack came up): where the hints point."""
        return (self.coordinators[0].url or "") if self.coordinators else ""

    @property
    def children(self) -> list[Child]:
        return [*self.coordinators, *self.workers, *self.gateways]

    # --- signals ---------------------------------------------------------------------------

    def request_stop(self, signum: int = signal.SIGTERM, _frame: Any = None) -> None:
        self._signals += 1
        if self._signals > 1:
            self._hurry.set()
        self._stop.set()

    def _install_signals(self) -> dict[int, Any]:
        old = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old[sig] = signal.signal(sig, self.request_stop)
        return old

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise Interrupted

    def _sleep(self, seconds: float) -> None:
        if self._stop.wait(seconds):
            raise Interrupted

    # --- run ---------------------------------------------------------------------------------

    def run(self) -> int:
        """Bring the stack up, supervise it until a signal or a failure, stop everything."""
        old = self._install_signals()
        code = 0
        try:
            self.start()
            self.console.print(self.summary_table())
            self.console.print(self.hints())
            self.console.say("up; Ctrl-C (or SIGTERM) stops everything", style="bold green")
            self.write_state_file()
            failed = self.supervise()
            code = 1 if failed else 0
        except Interrupted:
            self.console.say("stop requested while starting", style="yellow")
            code = 130
        except StackError as e:
            self.console.say(f"error: {e}", style="bold red")
            code = 2
        finally:
            left = self.shutdown()
            for sig, handler in old.items():
                signal.signal(sig, handler)
            if left:
                code = code or 1
        return code

    def clean_stale(self) -> None:
        """Stop what a killed ``kvledger up`` with this state_dir left running; refuse if it lives
        (:func:`kvledger.stack.orphans.stop_leftovers`)."""
        stop_leftovers(self.state_dir, self.console)

    # --- stop --------------------------------------------------------------------------------

    def shutdown(self) -> list[str]:
        """Stop everything started, in reverse order; return descriptions of survivors (killed)."""
        started = [*self.gateways, *reversed(self.workers), *self.coordinators]
        below = descendants(self._pids)
        if started or self.services is not None:
            self.console.say("stopping")
        grace = 0.0 if self._hurry.is_set() else self.opts.stop_timeout_s
        # Workers together (each releases its leases and drains its outbox), then the coordinators
        # together (a standby stops at once, before the leader releases the lock at its end).
        for group in (self.gateways, list(reversed(self.workers)), self.coordinators):
            threads = [threading.Thread(target=c.stop, args=(grace, self._hurry)) for c in group]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        for c in started:
            restarts = f", restarted {c.restarts} time(s)" if c.restarts else ""
            self.console.say(f"{c.name} stopped (exit code {c.returncode}{restarts})", style="dim")
        if self.services is not None:
            try:
                if self.pg_failover is not None:
                    self.pg_failover.stop()
                self.services.stop()
            except Exception as e:  # noqa: BLE001 - go on to the check below
                self.console.say(f"stopping embedded services: {e}", style="yellow")
        if self._wrote_state:  # never another stack's file
            (self.state_dir / "stack.json").unlink(missing_ok=True)
        left = survivors(self._pids, below)
        if left:
            self.console.say("still running after stop (now killed): " + "; ".join(left), style="bold red")
        elif started or self.services is not None:
            self.console.say(f"stopped; none of the {self._started} processes it started is left", style="bold")
        return left
