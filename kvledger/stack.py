"""``kvledger up``: the whole stack on one machine, started in order and stopped without a trace.

Theory of operation — a small process supervisor, threads and ``subprocess``, no asyncio:

1. **Services.** PostgreSQL and NATS from the configuration; whichever has no URL is started
   embedded under ``state_dir`` (:mod:`shared.embedded`), owned by this process; NATS as a
   3- or 5-node JetStream cluster with ``--nats-cluster`` (:mod:`shared.nats_cluster`), each
   node supervised and listed on its own; with ``--pg-standby`` a streaming standby of the
   embedded PostgreSQL, which the coordinators follow when it is promoted (:mod:`kvledger.pg_failover`).
2. **Migrations.** ``kvledger db upgrade`` in-process, so a schema problem is reported
   before anything else starts (the coordinator would also migrate; this makes the step
   visible and its failure one clear line, like compose's one-shot ``migrate`` service).
3. **Coordinators.** ``python -m coordinator`` with the resolved URLs in its environment
   (``KVL_DATABASE_URL``, ``KVL_NATS_URL``) and the admin port; wait for ``/readyz`` 200.
   ``--coordinators 2`` (or 3) then starts hot standbys on the next admin ports and waits
   only for their ``/healthz``: the event log's advisory lock lets one coordinator lead,
   the others answer ``/readyz`` 503 ``standby`` until the leader goes away.
4. **Workers.** N × ``python -m worker`` with per-worker overrides (``KVL_WORKER__WORKER_ID``,
   ``KVL_WORKER__PORT``); wait for each ``/readyz`` to say ``ready`` (registered, pools
   allocated). Port 0 means "any free port": the worker prints ``listening on URL``.
5. **Summary.** A table of what runs where (URL, pid, log file) on stdout, and the same as
   JSON in ``<state_dir>/stack.json`` for scripts.
6. **Supervision.** Every child runs in its own process group (Ctrl-C reaches only this
   process, which then stops the children in order). Its stdout and stderr go, line by line,
   to ``<state_dir>/logs/<name>.log`` as JSON lines (a plain line, such as ``listening on
   URL`` or a traceback's, wrapped in an ``output`` record; rotated at ``logging.max_bytes``,
   ``logging.backups`` kept) and to the terminal rendered readably with a ``name |`` prefix.
   A coordinator or worker that exits while the stack is up is reported with the end of its
   log and **restarted** with the same port and worker id, after a backoff that doubles while
   it keeps dying (0.5 s up to 10 s); the others keep running (a restarted worker registers
   again and the coordinator fences its old epoch; a restarted coordinator replays the log,
   or stands by if another one took the lead). The restarts are counted in the table,
   ``stack.json`` and a JSON line in the child's log. A process that dies more than
   ``--max-restarts`` times within ``--restart-window`` seconds is a crash loop, not bad luck:
   **the whole stack stops** (exit 1) and says so. An embedded PostgreSQL or NATS that exits is
   started again on the same port and data directory (the coordinator and workers reconnect;
   the workers keep their caches), under the same limit — except a PostgreSQL primary that has a
   standby: that one is promoted instead (``database.failover_after_s``, or ``kvledger db promote``).
7. **Shutdown** on SIGINT/SIGTERM (a second signal hurries: SIGKILL at once): workers, then
   the coordinators, each by SIGTERM to its process group with a grace period, then SIGKILL;
   then NATS and PostgreSQL. Finally every process this supervisor started, and anything
   still in their process groups or below them, is looked for; any survivor is killed and
   reported (exit 1).
8. **A supervisor that was killed** (SIGKILL, OOM) cannot stop anything: the kernel sends
   SIGTERM to the coordinators and workers (parent-death signal), and the next ``kvledger up``
   with the same state_dir finds the ``stack.json`` it left and stops what is still running
   there (the embedded servers above all), or refuses if that supervisor is in fact alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from shared import nats_auth
from shared.child_process import parent_death_signal
from shared.config import Config
from kvledger.discovery import cli_command, found_from
from shared.logging import JsonLinesFile
from shared.nats_auth import CredentialStore
from shared.nats_cluster import NatsCluster, embedded_nodes
from shared.subjects import Subjects
from shared.tls import client_context, http_scheme

#: Colours of the log prefixes (coordinators first, then workers in turn).
_COLOURS = ("cyan", "green", "magenta", "blue", "yellow", "bright_green", "bright_magenta", "bright_blue")
_LEVEL_STYLE = {"debug": "dim", "info": "", "warning": "yellow", "error": "bold red", "critical": "bold red"}
#: Keys of a structlog JSON line shown in the prefix, not as ``key=value``.
_META = ("event", "level", "timestamp", "logger")


class StackError(RuntimeError):
    """The stack could not be brought up; the message says which part and why."""


class Interrupted(Exception):
    """A stop was requested (signal) while something was still starting."""


@dataclass
class StackOptions:
    workers: int = 1
    #: The first leads; the others are hot standbys on the next admin ports.
    coordinators: int = 1
    #: None = the config's coordinator.port; 0 = any free port (each).
    coordinator_port: int | None = None
    #: None = the config's worker.port; worker i listens on base + i; 0 = any free port each.
    worker_base_port: int | None = None
    #: Run the gateway (the stack's one endpoint) in front of the workers.
    gateway: bool = True
    #: None = the config's gateway.port; 0 = any free port.
    gateway_port: int | None = None
    #: Gateway replicas (None = the config's gateway.replicas).
    gateways: int | None = None
    #: Embedded nats-servers, clustered when 3 or 5 (None = the config's nats.cluster_size).
    nats_cluster: int | None = None
    config_path: str | None = None
    start_timeout_s: float = 180.0
    stop_timeout_s: float = 20.0
    #: Echo the children's logs on the terminal (always written to the log files).
    echo_logs: bool = True
    #: A child that exits is restarted after restart_backoff_s, doubled for each earlier exit
    #: within restart_window_s (at most restart_backoff_max_s); more than max_restarts exits
    #: within the window stop the stack (0 = stop at the first).
    max_restarts: int = 5
    restart_window_s: float = 60.0
    restart_backoff_s: float = 0.5
    restart_backoff_max_s: float = 10.0
    #: A streaming standby of the embedded PostgreSQL (``kvledger.pg_failover``).
    pg_standby: bool = False


# --- the terminal ------------------------------------------------------------------------------

class Console:
    """Thread-safe printing: the supervisor's own lines and the children's, prefixed.

    If the output goes away (``kvledger up | head``), further output is discarded and
    ``on_gone`` is called once: the stack stops, as it would on SIGHUP.
    """

    def __init__(self, stream: IO[str] | None = None, on_gone: Callable[[], None] | None = None) -> None:
        from rich.console import Console as RichConsole

        console = self

        class _Rich(RichConsole):
            def on_broken_pipe(self) -> None:  # rich's default raises SystemExit, in whichever thread printed
                self.quiet = True
                if console.on_gone is not None:
                    console.on_gone()

        stream = stream or sys.stdout
        # Not a terminal (a pipe, a file, `make up | tee`): wide enough that no URL is cut.
        width = None if stream.isatty() else 200
        self._rich = _Rich(file=stream, highlight=False, markup=False, soft_wrap=True, emoji=False, width=width)
        self._lock = threading.Lock()
        self.width = 12
        self.on_gone = on_gone

    def say(self, message: str, style: str = "bold") -> None:
        self.print(f"kvledger up: {message}", style=style)

    def print(self, renderable: Any, style: str | None = None) -> None:
        # NOTE: a closed terminal must never stop the supervisor from stopping its children.
        with self._lock, contextlib.suppress(OSError, ValueError):
            self._rich.print(renderable, style=style)

    def child_line(self, name: str, colour: str, line: str) -> None:
        from rich.text import Text

        text = Text()
        text.append(f"{name:<{self.width}}| ", style=colour)
        level, body = render_log_line(line)
        text.append(body, style=_LEVEL_STYLE.get(level, ""))
        with self._lock:
            self._rich.print(text)  # errors reach Child._pump, which stops echoing


def render_log_line(line: str) -> tuple[str, str]:
    """``(level, readable text)`` of one output line: a structlog JSON line becomes
    ``HH:MM:SS level  event key=value …``; anything else is passed through."""
    line = line.rstrip("\n")
    if line.startswith("{"):
        try:
            doc = json.loads(line)
        except ValueError:
            doc = None
        if isinstance(doc, dict) and "event" in doc:
            level = str(doc.get("level", "info"))
            ts = str(doc.get("timestamp", ""))
            clock = ts[11:19] if len(ts) >= 19 else ""
            rest = " ".join(f"{k}={_short(v)}" for k, v in doc.items() if k not in _META)
            return level, f"{clock} {level:<7} {doc['event']}" + (f"  {rest}" if rest else "")
    lowered = line.lower()
    level = "error" if ("traceback" in lowered or "error" in lowered[:40]) else "info"
    return level, line


def _short(v: Any) -> str:
    s = v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
    return s if len(s) <= 160 else s[:157] + "..."


# --- one child process ---------------------------------------------------------------------------

class Child:
    """A supervised process in its own process group; output to a log file and the terminal.
    :meth:`start` again after it exited runs it anew with the same command and environment."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path, console: Console,
                 colour: str, echo: bool, *, max_bytes: int = 50 * 2**20, backups: int = 5) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        #: Every line the child prints, as one JSON object per line, rotated by size (logging.max_bytes).
        self.log = JsonLinesFile(log_path, max_bytes, backups, logger=name)
        self.console = console
        self.colour = colour
        self.echo = echo
        self.url: str | None = None
        self.url_seen = threading.Event()
        self.popen: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._tail: list[str] = []
        #: Supervision: restarts so far, recent exits (monotonic), when it is due to start again.
        self.restarts = 0
        self.exits: list[float] = []
        self.restart_at: float | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._tail = []  # the end of the log shown when it exits is this run's
        self.popen = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, bufsize=1, errors="replace",
                                      start_new_session=True, preexec_fn=parent_death_signal())
        self._reader = threading.Thread(target=self._pump, name=f"log-{self.name}", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.popen is not None and self.popen.stdout is not None
        for line in self.popen.stdout:
            # NOTE: a plain line (`listening on …`, a traceback) goes to the log file as an `output` record
            self.log.write(line, render_log_line(line)[0])
            self._tail.append(line.rstrip("\n"))
            del self._tail[:-40]
            if line.startswith("listening on http"):
                self.url = line.split()[-1].strip()
                self.url_seen.set()
            if self.echo:
                try:
                    self.console.child_line(self.name, self.colour, line)
                except (OSError, ValueError):  # the terminal went away (`kvledger up | head`)
                    self.echo = False  # keep draining the pipe, or the child blocks on a full one

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def tail(self, n: int = 15) -> str:
        return "\n".join(self._tail[-n:])

    def note(self, event: str, level: str, **fields: Any) -> None:
        """A JSON line of the supervisor's own in this child's log, so that the log says where one
        run ended and why the next began. Only between runs (after :meth:`stop`): no reader writes."""
        ts = datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")
        doc = {"event": event, "level": level, "logger": "kvledger.up", "timestamp": ts, "name": self.name, **fields}
        self.log.write_json(json.dumps(doc))

    def signal_group(self, sig: int) -> None:
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)  # start_new_session: its pgid is its pid

    def stop(self, timeout_s: float, hurry: threading.Event | None = None) -> int | None:
        """SIGTERM to the group, wait (until ``timeout_s`` or ``hurry``), then SIGKILL the group.
        Returns the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.signal_group(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while self.popen.poll() is None and time.monotonic() < deadline and not (hurry and hurry.is_set()):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(0.1)
            if self.popen.poll() is None:
                why = "second signal" if hurry and hurry.is_set() else f"did not stop within {timeout_s:.0f}s"
                self.console.say(f"{self.name}: {why}; killing it", style="yellow")
        # NOTE: the group may hold processes the child started; they go too, whatever the child did.
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)
        if self._reader is not None:
            self._reader.join(2)
        return self.popen.poll()


# --- the stack -----------------------------------------------------------------------------------

def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def http_json(url: str, timeout_s: float = 2.0, context: Any = None) -> tuple[int, Any]:
    """GET ``url``: ``(status, JSON body or None)``; status 0 when nothing answers. ``context``:
    the TLS context for an ``https`` URL (``shared.tls.client_context``)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as r:  # noqa: S310 - our own URL
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"null")
        except ValueError:
            return e.code, None
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None


@dataclass
class Stack:
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

    def start(self) -> None:
        cfg = self.cfg
        self.clean_stale()
        host = cfg.coordinator.host
        cports = self._coordinator_ports(host)
        wbase = cfg.worker.port if self.opts.worker_base_port is None else self.opts.worker_base_port
        wports = [0 if wbase == 0 else wbase + i for i in range(self.opts.workers)]
        for p in wports:
            if p and not port_free(cfg.worker.host, p):
                raise StackError(f"port {p} on {cfg.worker.host} is in use; choose another range with "
                                 f"--worker-base-port (0 = any free ports)")
        self.log_dir.mkdir(parents=True, exist_ok=True)

        self._start_services()
        self.write_state_file(ready=False)  # from here on a killed supervisor's leftovers can be found
        self._check_stop()
        self._migrate()
        self._check_stop()
        self._start_coordinators(host, cports)
        self._start_workers(wports)
        if self.opts.gateway:
            for i, gid in enumerate(self.gateway_ids):
                self._start_gateway(i, gid)

    def _coordinator_ports(self, host: str) -> list[int]:
        """The admin ports: coordinator.port (or --coordinator-port) and the next ones for the
        standbys; with 0, distinct free ports."""
        from shared.embedded import free_port

        first = self.cfg.coordinator.port if self.opts.coordinator_port is None else self.opts.coordinator_port
        ports: list[int] = []
        for i in range(self.opts.coordinators):
            port = free_port(host) if first == 0 else first + i
            while first == 0 and port in ports:
                port = free_port(host)
            if first and not port_free(host, port):
                raise StackError(f"port {port} on {host} is in use (another `kvledger up`?); "
                                 f"choose another with --coordinator-port (0 = any free port)")
            ports.append(port)
        return ports

    def _start_services(self) -> None:
        from shared.embedded import EmbeddedServiceError, start_services

        cfg = self.cfg
        what = [n for n, url in (("PostgreSQL", cfg.database.url), ("NATS", cfg.nats.url)) if not url]
        if what:
            self.console.say(f"starting embedded {' and '.join(what)} under {self.state_dir}")
        if not cfg.database.url and cfg.tls.ca_file:
            self.console.say("the embedded PostgreSQL speaks no TLS (loopback only): the coordinators reach it in "
                             "plain text (database.tls false); a configured database.url gets verified TLS",
                             style="yellow")
        nats_config = ""
        if not cfg.nats.url:
            # Every participant its own NATS user, confined to its own subjects (shared.nats_auth).
            self.credentials = CredentialStore(self.state_dir / "nats" / "credentials")
            workers = [nats_auth.worker(wid) for wid in self.worker_ids]
            if self.opts.gateway:
                workers += [nats_auth.gateway(gid) for gid in self.gateway_ids]
            nats_config = str(self.credentials.write_server_config(workers, Subjects(cfg.nats.subject_prefix)))
        size = cfg.nats.cluster_size if self.opts.nats_cluster is None else self.opts.nats_cluster
        # NOTE: a NATS cluster (shared.nats_cluster) starts first and is handed over as the NATS URL
        cluster = NatsCluster(self.state_dir / "nats", size, config_file=nats_config) \
            if size > 1 and not cfg.nats.url else None
        try:
            nats_url = cluster.start().url if cluster is not None else cfg.nats.url
            self.services = start_services(cfg.database.url, nats_url, self.state_dir, nats_config=nats_config)
        except BaseException as e:
            if cluster is not None:
                cluster.stop()
            if isinstance(e, EmbeddedServiceError):
                raise StackError(f"embedded services: {e}") from None
            raise
        if cluster is not None:
            self.services.nats = cluster
            self.console.say(f"NATS: a {size}-node JetStream cluster ({', '.join(cluster.names)})")
        for _, emb in self._embedded():
            if emb.proc is not None:
                self._pids.add(emb.proc.pid)
                self._started += 1
        self._start_pg_standby()

    def _embedded(self) -> list[tuple[str, Any]]:
        """``(name, server)`` of every embedded service this stack runs: postgres, and nats (or
        nats-1 … of a cluster, each supervised on its own)."""
        svc = self.services
        if svc is None:
            return []
        return [*([("postgres", svc.postgres)] if svc.postgres is not None else []), *embedded_nodes(svc.nats)]

    def _start_pg_standby(self) -> None:
        from kvledger.pg_failover import PgFailover
        from shared.embedded import EmbeddedServiceError

        primary = self.services.postgres
        if self.opts.pg_standby and primary is None:
            raise StackError("--pg-standby runs a standby of the embedded PostgreSQL; a configured database.url "
                             "fails over on its own terms (docs/operations.md, \"PostgreSQL standby and failover\")")
        try:
            if self.opts.pg_standby:
                self.console.say("starting the PostgreSQL standby (pg_basebackup on its first start)")
                self.pg_failover = PgFailover.start(self)
                self.console.say(self.pg_failover.describe())
            elif primary is not None:
                PgFailover.without_standby(primary, self.state_dir)
        except EmbeddedServiceError as e:
            raise StackError(f"PostgreSQL standby: {e}") from None

    #: The coordinators' own login role on the embedded PostgreSQL (a ``kvledger_writer`` member).
    COORDINATOR_ROLE = "kvledger_coordinator"

    def _migrate(self) -> None:
        """Migrate as the owner: ``database.owner_url`` if set, else the database URL (the embedded
        server's superuser). With the embedded PostgreSQL, also make the coordinators' login role
        (password kept in ``<state_dir>/postgres-coordinator.password``, mode 0600) and give the
        coordinators its URL (:attr:`_coordinator_database_url`)."""
        import asyncio

        from coordinator.log.migrate import upgrade
        from coordinator.log.postgres import PgSettings, create_engine, describe
        from coordinator.log.roles import RoleError, ensure_login_role, with_credentials

        owner_url = self.cfg.database.owner_url or self.services.database_url
        embedded = not self.cfg.database.url

        async def go() -> str:
            engine = create_engine(PgSettings.from_config(owner_url, self.cfg.database,
                                                          application_name="kvledger-up-migrate",
                                                          tls=None if embedded else self.cfg.tls))
            try:
                rev = await upgrade(engine, "head")
            finally:
                await engine.dispose()
            if embedded:
                password = self._coordinator_password()
                await ensure_login_role(owner_url, self.COORDINATOR_ROLE, password)
                # with a standby: both servers, the one accepting writes is used (kvledger.pg_failover)
                url = self.pg_failover.url(self.services.database_url) if self.pg_failover else self.services.database_url
                self._coordinator_database_url = with_credentials(url, self.COORDINATOR_ROLE, password)
            return rev

        try:
            rev = asyncio.run(go())
        except RoleError as e:
            raise StackError(f"database role: {e}") from None
        except Exception as e:  # noqa: BLE001 - one readable line
            raise StackError(f"migrations failed: {describe(e)}") from None
        self.console.say(f"event log schema at revision {rev}")

    def _coordinator_password(self) -> str:
        """The embedded coordinators' role password: generated once, kept 0600 in the state dir."""
        import secrets

        path = self.state_dir / "postgres-coordinator.password"
        with contextlib.suppress(FileNotFoundError):
            if (password := path.read_text().strip()):
                return password
        password = secrets.token_urlsafe(24)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        os.chmod(path, 0o600)
        return password

    def _child_env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        # The coordinators' own role where `_migrate` made one (embedded PostgreSQL), else the configured URL.
        env["KVL_DATABASE_URL"] = getattr(self, "_coordinator_database_url", "") or self.services.database_url
        env["KVL_NATS_URL"] = self.services.nats_url
        if self.services.postgres is not None and self.cfg.tls.ca_file:
            # the embedded PostgreSQL (pgserver's build) speaks no TLS; it listens on loopback only
            env["KVL_DATABASE__TLS"] = "false"
        if self.opts.config_path:
            env["KVL_CONFIG"] = str(Path(self.opts.config_path).resolve())
        # Children always write JSON lines: the log files stay machine-readable, and the
        # terminal gets them rendered (render_log_line) whatever the terminal is.
        if self.cfg.logging.format == "auto" and "KVL_LOGGING__FORMAT" not in os.environ:
            env["KVL_LOGGING__FORMAT"] = "json"
        env["PYTHONUNBUFFERED"] = "1"
        if self.opts.gateway and not self.cfg.auth.gateway_secret and "KVL_AUTH__GATEWAY_SECRET" not in os.environ:
            # the gateway signs the tenant for the workers (shared.tenant_header): one secret per stack
            if not getattr(self, "_gateway_secret", ""):
                self._gateway_secret = secrets.token_hex(32)
            env["KVL_AUTH__GATEWAY_SECRET"] = self._gateway_secret
        env.update(extra)
        return env

    def _spawn(self, name: str, argv: list[str], env: dict[str, str], colour: str) -> Child:
        self.console.width = max(self.console.width, len(name) + 1)
        child = Child(name, argv, env, self.log_dir / f"{name}.log", self.console, colour, self.opts.echo_logs,
                      max_bytes=self.cfg.logging.max_bytes, backups=self.cfg.logging.backups)
        self._run(child)
        return child

    def _run(self, child: Child) -> None:
        child.start()
        self._pids.add(child.pid)
        self._started += 1

    def _start_coordinators(self, host: str, ports: list[int]) -> None:
        """The first until its ``/readyz`` is 200: it takes the leader lock, so that the stack comes
        up with a known leader. Then the standbys, each until its ``/healthz`` answers (their
        ``/readyz`` stays 503 ``standby`` while the first leads)."""
        for i, port in enumerate(ports):
            name = "coordinator" if i == 0 else f"coordinator-{i + 1}"
            argv = [self.python, "-m", "coordinator", "--host", host, "--port", str(port)]
            c = self._spawn(name, argv, self._child_env(**self._identity_env(nats_auth.Identity("coordinator"))),
                            _COLOURS[0])
            c.url = f"{http_scheme(self.cfg.tls)}://{host}:{port}"
            self.coordinators.append(c)
            self.write_state_file(ready=False)
            path = "/readyz" if i == 0 else "/healthz"
            self.console.say(f"{name} starting (pid {c.pid}){' as a standby' if i else ''}, "
                             f"waiting for {c.url}{path}")
            deadline = time.monotonic() + self.opts.start_timeout_s
            last: Any = None
            while time.monotonic() < deadline:
                for other in self.coordinators:
                    self._died_while_starting(other)
                status, body = http_json(f"{c.url}{path}", context=self.tls_context)
                if status == 200:
                    break
                last = body or status
                self._sleep(0.2)
            else:
                raise StackError(f"{name} not ready within {self.opts.start_timeout_s:.0f}s (last {path}: {last}); "
                                 f"see {c.log_path}")

    @property
    def worker_ids(self) -> list[str]:
        base_id = self.cfg.worker.worker_id or "worker"
        return [f"{base_id}-{i}" for i in range(self.opts.workers)]

    def _identity_env(self, ident: nats_auth.Identity) -> dict[str, str]:
        """The NATS user a child connects as (embedded NATS); none with a configured NATS."""
        return self.credentials.env(ident) if self.credentials is not None else {}

    def _start_workers(self, ports: list[int]) -> None:
        for i, (wid, port) in enumerate(zip(self.worker_ids, ports)):
            env = self._child_env(KVL_WORKER__WORKER_ID=wid, KVL_WORKER__PORT=str(port),
                                  **self._identity_env(nats_auth.worker(wid)))
            w = self._spawn(wid, [self.python, "-m", "worker"], env, _COLOURS[1 + i % (len(_COLOURS) - 1)])
            if port:
                w.url = f"{http_scheme(self.cfg.tls)}://{self.cfg.worker.host}:{port}"
            self.workers.append(w)
        self.write_state_file(ready=False)
        if self.workers:
            self.console.say(f"{len(self.workers)} worker(s) starting (model load takes a few seconds)")
        deadline = time.monotonic() + self.opts.start_timeout_s
        for w in self.workers:
            self._wait_worker(w, deadline)
            # a restart keeps the address that clients and the table know, also one that port 0 chose
            w.env["KVL_WORKER__PORT"] = str(w.url).rsplit(":", 1)[1]

    @property
    def gateway_ids(self) -> list[str]:
        """Each gateway replica's id (and NATS identity): ``gateway_id``, then ``<gateway_id>-<i>``."""
        n = self.cfg.gateway.replicas if self.opts.gateways is None else self.opts.gateways
        gid = self.cfg.gateway.gateway_id
        return [gid if i == 0 else f"{gid}-{i}" for i in range(n)]

    def _start_gateway(self, i: int = 0, gid: str = "") -> None:
        """Gateway replica ``i``, until its ``/readyz`` is 200 (it knows the fleet and a worker is
        usable; with no workers, until it answers at all)."""
        from shared.embedded import free_port

        g = self.cfg.gateway
        gid = gid or g.gateway_id
        port = g.port if self.opts.gateway_port is None else self.opts.gateway_port
        port = free_port(g.host) if port == 0 else port + i
        if not port_free(g.host, port):
            raise StackError(f"port {port} on {g.host} is in use; choose another with --gateway-port "
                             f"(0 = any free port) or run without it (--no-gateway)")
        env = self._child_env(KVL_GATEWAY__PORT=str(port), KVL_GATEWAY__GATEWAY_ID=gid,
                              **self._identity_env(nats_auth.gateway(gid)))
        gw = self._spawn(gid, [self.python, "-m", "gateway"], env, _COLOURS[0])
        gw.url = f"{http_scheme(self.cfg.tls)}://{g.host}:{port}"
        self.gateways.append(gw)
        self.write_state_file(ready=False)
        path = "/readyz" if self.workers else "/healthz"
        deadline = time.monotonic() + self.opts.start_timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            self._died_while_starting(gw)
            status, body = http_json(f"{gw.url}{path}", context=self.tls_context)
            if status == 200:
                return
            last = body or status
            self._sleep(0.2)
        raise StackError(f"gateway not ready within {self.opts.start_timeout_s:.0f}s (last {path}: {last}); "
                         f"see {gw.log_path}")

    def _wait_worker(self, w: Child, deadline: float) -> None:
        last: Any = None
        while time.monotonic() < deadline:
            for c in (w, *self.coordinators):
                self._died_while_starting(c)
            if w.url is None:
                self._sleep(0.2)
                continue
            status, body = http_json(f"{w.url}/readyz", context=self.tls_context)
            if status == 200 and isinstance(body, dict) and body.get("coordinator") == "reachable":
                return
            last = body or status
            self._sleep(0.25)
        raise StackError(f"{w.name} not ready within {self.opts.start_timeout_s:.0f}s (last /readyz: {last}); "
                         f"see {w.log_path}")

    def _died_while_starting(self, child: Child) -> None:
        self._check_stop()
        if not child.alive:
            raise StackError(f"{child.name} exited with code {child.returncode} while starting; its last lines:\n"
                             f"{child.tail()}\n(full log: {child.log_path})")

    # --- while up ----------------------------------------------------------------------------

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

    def rows(self) -> list[dict[str, Any]]:
        """What runs where: one row per service (also the content of stack.json)."""
        out: list[dict[str, Any]] = []
        svc = self.services
        if svc is not None:
            nats = [(name, node.url, node, str(node.data_dir / "nats.log"))
                    for name, node in embedded_nodes(svc.nats)] \
                if isinstance(svc.nats, NatsCluster) else [("nats", svc.nats_url, svc.nats, "nats/nats.log")]
            for name, url, emb, log in (
                    ("postgres", svc.database_url, svc.postgres, "postgres/postgres.log"), *nats):
                out.append({"name": name, "url": url, "role": "embedded" if emb is not None else "configured",
                            "pid": emb.proc.pid if emb is not None and emb.proc is not None else None,
                            "log": str(self.state_dir / log) if emb is not None else None, "restarts": None})
            if self.pg_failover is not None:
                out += self.pg_failover.rows()
        for c in self.children:
            role = "OpenAI API" if c in self.workers else "OpenAI API (gateway)" if c in self.gateways else "admin API"
            out.append({"name": c.name, "url": c.url, "role": role,
                        "pid": c.pid if c.alive else None, "log": str(c.log_path), "restarts": c.restarts})
        return out

    def summary_table(self) -> Any:
        from rich.table import Table

        t = Table(title="kvledger stack", title_justify="left", show_lines=False)
        for col in ("service", "address", "", "pid", "restarts", "log"):
            t.add_column(col, overflow="fold")
        for r in self.rows():
            url = r["url"] or ""
            if r["role"].startswith("OpenAI API"):
                url += "/v1"
            restarts = "-" if r["restarts"] is None else str(r["restarts"])
            t.add_row(r["name"], _redact_url(url), r["role"], str(r["pid"] or "-"), restarts, r["log"] or "-")
        return t

    def hints(self) -> str:
        """Two commands to try, with this stack's addresses."""
        lines = []
        endpoint = self.gateways[0].url if self.gateways else self.workers[0].url if self.workers else None
        if self.workers and endpoint:
            ca = f"--cacert {self.cfg.tls.ca_file} " if self.cfg.tls.ca_file and self.cfg.tls.cert_file else ""
            lines.append(f"  curl {ca}{endpoint}/v1/completions -H 'Content-Type: application/json' "
                         "-d '{\"prompt\": \"Hello\", \"max_tokens\": 8}'")
        # NOTE: as printed, from a fresh shell: the full command (no activated venv needed) and, unless
        # the nearest .kvl-state of the working directory is this stack's, its state dir (kvledger.discovery)
        kvl = cli_command()
        flag = "" if found_from(self.state_dir, Path.cwd()) else f" --state-dir {shlex.quote(str(self.state_dir))}"
        lines += [f"  {kvl} {command}{flag}" for command in ("workers", "events --follow", "audit")]
        lines.append(f"  state and logs: {self.state_dir}/ (stack.json lists the addresses; logs/*.log are JSON lines)")
        if self.credentials is not None:
            lines.append(f"  NATS users (operator, observer, ...): passwords in {self.credentials.dir}/ "
                         "(docs/operations.md, \"Identity on the bus\")")
        return "try:\n" + "\n".join(lines)

    def write_state_file(self, ready: bool = True) -> None:
        """``<state_dir>/stack.json``: what runs where (for scripts), and what to clean up if this
        supervisor is killed before it can stop its children (see :meth:`clean_stale`)."""
        doc = {"supervisor_pid": os.getpid(), "ready": ready, "state_dir": str(self.state_dir),
               "coordinator_url": self.coordinator_url, "coordinator_urls": [c.url for c in self.coordinators],
               "worker_urls": [w.url for w in self.workers],
               "gateway_url": self.gateways[0].url if self.gateways else None,
               "gateway_urls": [g.url for g in self.gateways],
               # the operator commands that find this file read this configuration too (kvledger.discovery)
               "config": str(Path(self.opts.config_path).resolve()) if self.opts.config_path else None,
               "services": [{**r, "url": _redact_url(r["url"] or "")} for r in self.rows()]}
        path = self.state_dir / "stack.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        tmp.replace(path)
        self._wrote_state = True

    def clean_stale(self) -> None:
        """A ``stack.json`` left by a ``kvledger up`` that was killed (SIGKILL, OOM): stop what it
        started that still runs, so that the ports and the data directories are free again.
        If that supervisor is still alive, refuse: two stacks must not share a state_dir."""
        import psutil

        path = self.state_dir / "stack.json"
        try:
            doc = json.loads(path.read_text())
            written = path.stat().st_mtime
        except FileNotFoundError:
            return
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            return
        sup = doc.get("supervisor_pid")
        if isinstance(sup, int) and sup != os.getpid() and _is_supervisor(sup):
            raise StackError(f"another `kvledger up` (pid {sup}) runs with state_dir {self.state_dir}; "
                             f"stop it first (Ctrl-C there, or kill {sup})")
        leftovers: list[psutil.Process] = []
        for svc in doc.get("services", []):
            pid = svc.get("pid")
            if not isinstance(pid, int):
                continue
            try:
                p = psutil.Process(pid)
                # a pid reused since is not ours: ours started before the file was last written
                if p.create_time() <= written + 1 and _looks_like(p, svc.get("name", ""), self.state_dir):
                    leftovers.append(p)
            except psutil.Error:
                continue
        if leftovers:
            names = ", ".join(f"{p.pid}" for p in leftovers)
            self.console.say(f"a previous `kvledger up` (pid {sup}) was killed and left processes running "
                             f"({names}); stopping them", style="yellow")
            for p in leftovers:
                _signal_leader(p, signal.SIGTERM)
            _, alive = psutil.wait_procs(leftovers, timeout=15)
            for p in alive:
                _signal_leader(p, signal.SIGKILL)
            psutil.wait_procs(alive, timeout=5)
        path.unlink(missing_ok=True)

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


def _signal_leader(p: Any, sig: int) -> None:
    """``sig`` to ``p``'s process group when it leads one (as everything the stack starts does)."""
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        if os.getpgid(p.pid) == p.pid:
            os.killpg(p.pid, sig)
        else:
            os.kill(p.pid, sig)


def _is_supervisor(pid: int) -> bool:
    import psutil

    try:
        cmd = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False
    return " up" in cmd and ("kvledger" in cmd or "kvledger.cli" in cmd)


def _looks_like(p: Any, name: str, state_dir: Path) -> bool:
    """Whether ``p`` is the ``name`` service a stack with ``state_dir`` started."""
    cmd = " ".join(p.cmdline())
    if name in ("postgres", "nats", "postgres-standby") or name.startswith("nats-"):
        return str(state_dir) in cmd
    if name == "coordinator" or name.startswith("coordinator-"):
        return "-m coordinator" in cmd
    return "-m worker" in cmd or "-m gateway" in cmd   # workers and gateways carry their ids as names


def descendants(pids: set[int]) -> list[Any]:
    """Every process below ``pids`` right now (taken before the stop: orphans lose their parent)."""
    import psutil

    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            out += psutil.Process(pid).children(recursive=True)
    return out


def survivors(pids: set[int], below: list[Any] | None = None) -> list[str]:
    """Processes started here (``pids``), in their process groups, or among ``below`` (taken
    with :func:`descendants` before the stop) that still run: each is SIGKILLed and described.
    Empty = nothing left behind."""
    import psutil

    suspects: dict[int, psutil.Process] = {}
    for p in below or []:
        with contextlib.suppress(psutil.Error):
            if p.is_running():  # also checks that the pid was not reused since
                suspects[p.pid] = p
    for p in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            if p.pid in pids or os.getpgid(p.pid) in pids:
                suspects[p.pid] = p
    out = []
    for pid, p in sorted(suspects.items()):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            desc = f"pid {pid} ({' '.join(p.cmdline())[:100] or p.name()})"
            p.kill()
            out.append(desc)
        except psutil.Error:
            continue
    return out


def _redact_url(url: str) -> str:
    """A URL without its password (``postgresql://user:secret@host`` → ``user:***@host``)."""
    if "://" in url and "@" in url:
        scheme, rest = url.split("://", 1)
        cred, host = rest.rsplit("@", 1)
        if ":" in cred:
            cred = cred.split(":", 1)[0] + ":***"
        return f"{scheme}://{cred}@{host}"
    return url


# --- the subcommand -----------------------------------------------------------------------------

def add_arguments(p: Any) -> None:
    p.add_argument("--workers", "-n", type=int, default=1, help="number of workers (default 1)")
    p.add_argument("--coordinators", type=int, default=1, metavar="N",
                   help="coordinator processes, 1 to 3 (default 1): the first leads, the others are hot "
                        "standbys on the next admin ports")
    p.add_argument("--coordinator-port", type=int, default=None,
                   help="admin API port (default: coordinator.port, 8321; 0 = any free port)")
    p.add_argument("--worker-base-port", type=int, default=None,
                   help="worker i listens on BASE+i (default: worker.port, 8400; 0 = any free ports)")
    p.add_argument("--gateway-port", type=int, default=None,
                   help="the gateway's port, the stack's one OpenAI endpoint (default: gateway.port, 8300; 0 = any "
                        "free port)")
    p.add_argument("--nats-cluster", type=int, choices=(1, 3, 5), default=None, metavar="N",
                   help="embedded NATS as a cluster of N JetStream servers, 1, 3 or 5 (default: nats.cluster_size, 1); "
                        "the transitions stream gets N replicas and every client the N servers")
    p.add_argument("--gateways", type=int, default=None, metavar="N",
                   help="gateway replicas, 1 to 16 (default: gateway.replicas, 1), each routing by the ledger's "
                        "block locations; replica i on the gateway's port + i")
    p.add_argument("--no-gateway", action="store_true",
                   help="run no gateway: clients choose a worker themselves")
    p.add_argument("--start-timeout", type=float, default=180.0, metavar="SECONDS",
                   help="how long each part may take to become ready (default 180)")
    p.add_argument("--max-restarts", type=int, default=5, metavar="N",
                   help="a coordinator or worker that exits is restarted; one that exits more than N times "
                        "within --restart-window stops the stack (default 5; 0 = stop at the first exit)")
    p.add_argument("--restart-window", type=float, default=60.0, metavar="SECONDS",
                   help="the window of --max-restarts (default 60)")
    p.add_argument("--pg-standby", action="store_true",
                   help="also run a streaming standby of the embedded PostgreSQL (database.standby; "
                        "database.synchronous_standby, database.failover_after_s; `kvledger db promote`)")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="do not echo the services' logs (they are still written under <state_dir>/logs)")


def cmd_up(args: Any) -> int:
    from shared.config import load_config

    if args.workers < 0:
        raise SystemExit("kvledger up: --workers must be >= 0")
    if not 1 <= args.coordinators <= 3:
        raise SystemExit("kvledger up: --coordinators must be 1, 2 or 3")
    if args.max_restarts < 0:
        raise SystemExit("kvledger up: --max-restarts must be >= 0 (0 = stop the stack when a process exits)")
    if not args.restart_window > 0:
        raise SystemExit("kvledger up: --restart-window must be > 0 seconds")
    cfg = load_config(getattr(args, "config", None))
    if args.gateways is not None and not 1 <= args.gateways <= 16:
        raise SystemExit("kvledger up: --gateways must be 1 to 16 (or --no-gateway for none)")
    if (args.nats_cluster or 1) > 1 and cfg.nats.url:
        raise SystemExit("kvledger up: --nats-cluster runs an embedded NATS cluster, but nats.url is set: list your "
                         "cluster's servers there instead (comma-separated nats:// URLs)")
    opts = StackOptions(workers=args.workers, coordinators=args.coordinators, coordinator_port=args.coordinator_port,
                        worker_base_port=args.worker_base_port, config_path=getattr(args, "config", None),
                        gateway=not args.no_gateway, gateway_port=args.gateway_port, gateways=args.gateways,
                        start_timeout_s=args.start_timeout, echo_logs=not args.quiet,
                        max_restarts=args.max_restarts, restart_window_s=args.restart_window,
                        nats_cluster=args.nats_cluster,
                        pg_standby=args.pg_standby or cfg.database.standby)
    return Stack(cfg, opts).run()
