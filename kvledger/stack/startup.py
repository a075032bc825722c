"""Bringing the stack up, in order (steps 1 to 4 of :mod:`kvledger.stack`): the embedded
services (and the PostgreSQL standby), the migrations, the coordinators, the workers, the
gateways — each waited for until it answers ready, or the start fails with one clear line.

:class:`StartupSteps` is part of :class:`kvledger.stack.supervisor.Stack`; it reads the stack's
configuration and options and fills in its services and children.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvledger.stack.child import Child
from kvledger.stack.console import COLOURS, Console
from kvledger.stack.options import StackError, StackOptions
from kvledger.stack.probes import http_json, port_free
from shared import nats_auth
from shared.config import Config
from shared.nats_auth import CredentialStore
from shared.nats_cluster import NatsCluster, embedded_nodes
from shared.subjects import Subjects
from shared.tls import http_scheme


class StartupSteps:
    """The start sequence of a :class:`~kvledger.stack.supervisor.Stack` (its attributes below)."""

    cfg: Config
    opts: StackOptions
    console: Console
    python: str
    state_dir: Path
    log_dir: Path
    services: Any
    pg_failover: Any
    tls_context: Any
    credentials: CredentialStore | None
    coordinators: list[Child]
    workers: list[Child]
    gateways: list[Child]
    _pids: set[int]
    _started: int

    #: The coordinators' own login role on the embedded PostgreSQL (a ``kvledger_writer`` member).
    COORDINATOR_ROLE = "kvledger_coordinator"

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
        standbys, then each further shard's; with 0, distinct free ports."""
        from shared.embedded import free_port

        first = self.cfg.coordinator.port if self.opts.coordinator_port is None else self.opts.coordinator_port
        ports: list[int] = []
        for i in range(self.opts.coordinators * self.opts.shards):
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
            nats_config = str(self.credentials.write_server_config(workers, Subjects(cfg.nats.subject_prefix),
                                                                   shards=self.opts.shards))
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

    def _migrate(self) -> None:
        """Migrate as the owner: ``database.owner_url`` if set, else the database URL (the embedded
        server's superuser). With the embedded PostgreSQL, also make the coordinators' login role
        (password kept in ``<state_dir>/postgres-coordinator.password``, mode 0600) and give the
        coordinators its URL (:attr:`_coordinator_database_url`)."""
        import asyncio

        from coordinator.log.migrate import upgrade
        from coordinator.log.postgres import PgSettings, create_engine, describe
        from coordinator.log.roles import RoleError, ensure_login_role, with_credentials
        from kvledger.stack.shard_databases import ensure_database, shard_database, with_database

        owner_url = self.cfg.database.owner_url or self.services.database_url
        embedded = not self.cfg.database.url

        async def migrate(url: str) -> str:
            engine = create_engine(PgSettings.from_config(url, self.cfg.database,
                                                          application_name="kvledger-up-migrate",
                                                          tls=None if embedded else self.cfg.tls))
            try:
                return await upgrade(engine, "head")
            finally:
                await engine.dispose()

        async def go() -> str:
            rev = await migrate(owner_url)
            if embedded:
                password = self._coordinator_password()
                await ensure_login_role(owner_url, self.COORDINATOR_ROLE, password)
                # with a standby: both servers, the one accepting writes is used (kvledger.pg_failover)
                url = self.pg_failover.url(self.services.database_url) if self.pg_failover else self.services.database_url
                self._coordinator_database_url = with_credentials(url, self.COORDINATOR_ROLE, password)
                # shard k ≥ 1: a database of its own on the same server, migrated likewise
                self._shard_database_urls = [self._coordinator_database_url]
                for k in range(1, self.opts.shards):
                    shard_owner_url = await ensure_database(owner_url, shard_database(owner_url, k))
                    await migrate(shard_owner_url)
                    self._shard_database_urls.append(with_credentials(
                        with_database(url, shard_database(url, k)), self.COORDINATOR_ROLE, password))
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
        if self.opts.shards > 1:
            env["KVL_COORDINATOR__SHARDS"] = str(self.opts.shards)
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
        per_shard = self.opts.coordinators
        for n, port in enumerate(ports):
            k, i = divmod(n, per_shard)
            base = "coordinator" if k == 0 else f"coordinator-s{k}"
            name = base if i == 0 else f"{base}-{i + 1}"
            argv = [self.python, "-m", "coordinator", "--host", host, "--port", str(port)]
            # shard k: its identity (its subjects only) and its own database; shard 0 as unsharded
            shard = {"KVL_COORDINATOR__SHARD": str(k), "KVL_DATABASE_URL": self._shard_database_urls[k]} if k else {}
            c = self._spawn(name, argv, self._child_env(**self._identity_env(nats_auth.coordinator(k)), **shard),
                            COLOURS[0])
            c.url = f"{http_scheme(self.cfg.tls)}://{host}:{port}"
            self.coordinators.append(c)
            self.write_state_file(ready=False)
            path = "/readyz" if i == 0 else "/healthz"
            self.console.say(f"{name} starting (pid {c.pid}){' as a standby' if i else ''}, "
                             f"waiting for {c.url}{path}")
            self._wait_ready(c, path, watch=self.coordinators, label=name)

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
            w = self._spawn(wid, [self.python, "-m", "worker"], env, COLOURS[1 + i % (len(COLOURS) - 1)])
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
        gw = self._spawn(gid, [self.python, "-m", "gateway"], env, COLOURS[0])
        gw.url = f"{http_scheme(self.cfg.tls)}://{g.host}:{port}"
        self.gateways.append(gw)
        self.write_state_file(ready=False)
        self._wait_ready(gw, "/readyz" if self.workers else "/healthz", watch=(gw,), label="gateway")

    def _wait_ready(self, child: Child, path: str, *, watch: Sequence[Child], label: str) -> None:
        """Poll ``child``'s ``path`` until it answers 200, for up to ``--start-timeout``; a child of
        ``watch`` that exits meanwhile (or a stop) ends the start at once. ``label`` names ``child``
        in the error."""
        deadline = time.monotonic() + self.opts.start_timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            for other in watch:
                self._died_while_starting(other)
            status, body = http_json(f"{child.url}{path}", context=self.tls_context)
            if status == 200:
                return
            last = body or status
            self._sleep(0.2)
        raise StackError(f"{label} not ready within {self.opts.start_timeout_s:.0f}s (last {path}: {last}); "
                         f"see {child.log_path}")

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
