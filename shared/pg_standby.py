"""A streaming standby of the embedded PostgreSQL: creation, synchronous commit, promotion, health.

Theory of operation (``kvledger up --pg-standby``, ``database.standby``):

1. **Replication role.** The primary gets a LOGIN REPLICATION role of its own,
   :data:`REPLICATION_ROLE`, with a generated SCRAM password kept in
   ``<primary data dir>/replication.password`` (0600), and a physical replication slot,
   :data:`SLOT`, so that it keeps the WAL the standby has not received yet. ``pg_hba.conf``
   (``shared.embedded.PG_HBA``) lets that role, and no other, replicate, from loopback only.
2. **Clone.** The standby's data directory (``<state_dir>/postgres-standby``) is made once with
   ``pg_basebackup -R`` (WAL streamed during the copy; ``standby.signal`` written) from the
   primary, as the replication role, reading its password from a 0600 passfile. The superuser's
   password file is copied along (the clone has the same roles).
3. **Streaming.** The standby starts with the primary's current address in ``primary_conninfo``
   on its command line (the embedded primary gets a new port on every ``kvledger up``), the
   slot, and ``synchronous_standby_names`` empty: promoted, it must not wait for a standby of
   its own (a setting the clone copied from the primary would otherwise make every commit hang).
4. **Synchronous or not.** :func:`set_synchronous` names the standby in the primary's
   ``synchronous_standby_names`` (``ALTER SYSTEM``, so a restart keeps it). With the primary's
   ``synchronous_commit = on`` a commit then returns only once the standby has flushed its WAL:
   an acknowledged append survives the primary's loss. Without it a commit returns at the local
   flush and the last moment of acknowledged appends may be lost on failover
   (docs/architecture.md, "PostgreSQL standby").
5. **Promotion.** ``pg_ctl promote`` (:meth:`EmbeddedStandby.promote`): the standby ends recovery
   and accepts writes; ``standby.signal`` is gone, which is how a later look tells it was promoted.
   Clients follow with a multi-host URL and ``target_session_attrs=read-write``
   (:func:`failover_url`): the one that accepts writes is the primary.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from shared.embedded import PG_SYSTEM_USER, EmbeddedPostgres, EmbeddedServiceError

#: The standby's login role on the primary: REPLICATION, nothing else.
REPLICATION_ROLE = "kvledger_replication"
#: The primary's replication slot, and the standby's ``application_name`` (what
#: ``synchronous_standby_names`` names).
SLOT = "kvl_standby"
#: The replication role's password, in the primary's data directory (mode 0600).
REPLICATION_PASSWORD_FILE = "replication.password"
#: The standby's data directory under the state directory.
STANDBY_DIR = "postgres-standby"
_SAFE_PASSWORD = re.compile(r"^[A-Za-z0-9_\-]{16,}\Z")


class StandbyError(EmbeddedServiceError):
    """The standby could not be made, started or promoted; the message says why."""


def _owned_file(path: Path, text: str, owner: EmbeddedPostgres) -> None:
    """``path`` with ``text``, mode 0600 from creation on, owned by the server's user."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    owner._pg_owned(path, 0o600)


def _psql(pg: EmbeddedPostgres, sql: str, timeout_s: float = 30.0) -> str:
    """Run ``sql`` as the superuser over ``pg``'s socket; its output (tuples only), or a StandbyError.

    NOTE: ``synchronous_commit = local``: these commits (the replication role, the slot) come
    before the standby streams, and must not wait for it when the data directory still names it
    synchronous from an earlier run."""
    sql = "SET synchronous_commit = local;\n" + sql
    r = subprocess.run([str(pg.bin_dir() / "psql"), "-h", str(pg.socket_dir), "-p", str(pg.port), "-U", "postgres",
                        "-d", "postgres", "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-w"],
                       input=sql, capture_output=True, text=True, timeout=timeout_s,
                       env={**os.environ, "PGPASSWORD": pg.password}, **pg._user_kwargs())  # type: ignore[arg-type]
    if r.returncode != 0:
        raise StandbyError(f"PostgreSQL in {pg.data_dir}: {r.stderr.strip()[-500:]}")
    return r.stdout.strip()


def ensure_replication(primary: EmbeddedPostgres) -> str:
    """The replication role and slot on the running ``primary``; returns the role's password
    (generated once, kept 0600 in the primary's data directory)."""
    path = primary.data_dir / REPLICATION_PASSWORD_FILE
    password = path.read_text().strip() if path.exists() else ""
    if not _SAFE_PASSWORD.match(password):
        password = secrets.token_urlsafe(24)
        _owned_file(path, password + "\n", primary)
    # NOTE: the password is [A-Za-z0-9_-] (checked above), so it can stand in a literal; the
    # server stores its SCRAM verifier (password_encryption = scram-sha-256).
    _psql(primary, f"""
DO $$ BEGIN
  IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{REPLICATION_ROLE}') THEN
    ALTER ROLE {REPLICATION_ROLE} LOGIN REPLICATION NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD '{password}';
  ELSE
    CREATE ROLE {REPLICATION_ROLE} LOGIN REPLICATION PASSWORD '{password}';
  END IF;
END $$;
SELECT pg_create_physical_replication_slot('{SLOT}')
  WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = '{SLOT}');
""")
    return password


def set_synchronous(primary: EmbeddedPostgres, on: bool) -> None:
    """Whether a commit on ``primary`` waits for the standby's flush (persisted with ALTER SYSTEM)."""
    setting = f"SET synchronous_standby_names = '{SLOT}'" if on else "RESET synchronous_standby_names"
    _psql(primary, f"ALTER SYSTEM {setting};\nSELECT pg_reload_conf();\n")


def synchronous_configured(primary: EmbeddedPostgres) -> bool:
    """Whether the data directory names a synchronous standby (read from the file: no server needed)."""
    auto = primary.data_dir / "pgdata" / "postgresql.auto.conf"
    with contextlib.suppress(OSError):
        return any(line.strip().startswith("synchronous_standby_names") for line in auto.read_text().splitlines())
    return False


def replication_state(primary: EmbeddedPostgres) -> dict[str, str | int] | None:
    """The standby as the primary sees it (``pg_stat_replication``): ``state`` (``streaming`` …),
    ``sync_state`` (``sync``/``async``) and ``lag_bytes`` (sent but not yet replayed); None when
    it is not connected."""
    out = _psql(primary, f"SELECT state, sync_state, coalesce(pg_wal_lsn_diff(sent_lsn, replay_lsn), 0)::bigint "
                         f"FROM pg_stat_replication WHERE application_name = '{SLOT}';\n")
    if not out:
        return None
    state, sync_state, lag = out.splitlines()[0].split("|")
    return {"state": state, "sync_state": sync_state, "lag_bytes": int(lag)}


def wait_streaming(primary: EmbeddedPostgres, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = replication_state(primary)
        if st is not None and st["state"] == "streaming":
            return
        time.sleep(0.1)
    raise StandbyError(f"the standby did not start streaming from the primary within {timeout_s:.0f}s")


@dataclass
class EmbeddedStandby(EmbeddedPostgres):
    """A streaming standby of ``primary`` (an :class:`EmbeddedPostgres` that runs), cloned on first start."""

    primary: EmbeddedPostgres | None = field(default=None, repr=False)

    @property
    def pgdata(self) -> Path:
        return self.data_dir / "pgdata"

    @property
    def passfile(self) -> Path:
        return self.data_dir / "replication.pgpass"

    @property
    def promoted(self) -> bool:
        """Made and no longer in recovery (``pg_ctl promote`` removes ``standby.signal``)."""
        return (self.pgdata / "PG_VERSION").exists() and not (self.pgdata / "standby.signal").exists()

    def _conninfo(self) -> str:
        assert self.primary is not None
        return (f"host={self.primary.host} port={self.primary.port} user={REPLICATION_ROLE} "
                f"application_name={SLOT} passfile={self.passfile} connect_timeout=3")

    def _prepare(self) -> None:
        self.data_dir = Path(self.data_dir).resolve()
        if self.primary is not None:
            if not (self.pgdata / "PG_VERSION").exists():
                self._clone()
            # NOTE: on the command line, so that it wins over what the clone copied from the primary's
            # postgresql.auto.conf (a promoted standby must not wait for a standby of its own).
            self.extra_args = ["-c", f"primary_conninfo={self._conninfo()}", "-c", f"primary_slot_name={SLOT}",
                               "-c", "synchronous_standby_names=", "-c", "hot_standby=on"]
        super()._prepare()

    def _clone(self) -> None:
        primary = self.primary
        assert primary is not None
        if primary.proc is None:
            raise StandbyError("the primary must run to make its standby")
        password = ensure_replication(primary)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._traversable()  # pg_basebackup runs as the server's user, before the base class's _prepare
        os.chmod(self.data_dir, 0o700)
        if os.name == "posix" and os.geteuid() == 0:
            import pwd
            pw = pwd.getpwnam(PG_SYSTEM_USER)
            os.chown(self.data_dir, pw.pw_uid, pw.pw_gid)
        shutil.rmtree(self.pgdata, ignore_errors=True)  # what a clone that failed halfway left
        _owned_file(self.password_file, primary.password + "\n", self)  # the clone has the same superuser
        _owned_file(self.passfile, f"*:*:*:{REPLICATION_ROLE}:{password}\n", self)
        r = subprocess.run([str(self.bin_dir() / "pg_basebackup"), "-D", str(self.pgdata), "-d", self._conninfo(),
                            "-X", "stream", "-S", SLOT, "-R", "-c", "fast", "-w"],
                           capture_output=True, text=True, timeout=600, **self._user_kwargs())  # type: ignore[arg-type]
        if r.returncode != 0:
            shutil.rmtree(self.pgdata, ignore_errors=True)
            raise StandbyError(f"pg_basebackup from the primary failed: {r.stderr.strip()[-1000:]}")

    def _traversable(self) -> None:
        """As root: the server's user may still reach the data directory. NOTE: granted at start
        (``_prepare``), but something may have taken it back since (pytest, for one, resets its
        base directory to 0700 whenever a run starts), and a promotion must not fail on that."""
        if os.name == "posix" and os.geteuid() == 0:
            for parent in reversed(self.data_dir.resolve().parents):
                mode = parent.stat().st_mode
                if not mode & 0o001:
                    parent.chmod(mode | 0o001)

    def promote(self, timeout_s: float = 60.0) -> None:
        """End recovery: the standby accepts writes (``pg_ctl promote``, waits until it has)."""
        if self.promoted:
            return
        self._traversable()
        r = subprocess.run([str(self.bin_dir() / "pg_ctl"), "promote", "-D", str(self.pgdata), "-w",
                            "-t", str(int(timeout_s))],
                           capture_output=True, text=True, timeout=timeout_s + 10,
                           **self._user_kwargs())  # type: ignore[arg-type]
        if r.returncode != 0:
            raise StandbyError(f"pg_ctl promote failed: {(r.stderr or r.stdout).strip()[-500:]}")


def start_standby(primary: EmbeddedPostgres, state_dir: Path, *, synchronous: bool,
                  timeout_s: float = 120.0) -> EmbeddedStandby:
    """Make (first time) and start the standby of the running ``primary``, wait until it streams,
    then set whether commits wait for it. A standby that was promoted earlier is refused: its
    data has moved on from the primary's, and only an operator may choose which one is the ledger."""
    refuse_superseded(primary, state_dir)
    standby = EmbeddedStandby(Path(state_dir) / STANDBY_DIR, primary=primary)
    ensure_replication(primary)
    standby.start(timeout_s)
    try:
        wait_streaming(primary, timeout_s)
        set_synchronous(primary, synchronous)
    except BaseException:
        standby.stop()
        raise
    return standby


def refuse_superseded(primary: EmbeddedPostgres, state_dir: str | os.PathLike[str]) -> None:
    """A StandbyError when the standby beside ``primary`` was promoted: the primary's data is then
    behind the ledger (everything appended after the failover is on the standby), and starting
    it, with or without a standby, would serve an older log."""
    standby = EmbeddedStandby(Path(state_dir) / STANDBY_DIR)
    if standby.promoted:
        raise StandbyError(
            f"the standby in {standby.data_dir} was promoted: it, not {primary.data_dir}, holds the ledger now. "
            f"Stop, move {primary.data_dir} aside, rename {standby.data_dir} to {primary.data_dir} and start "
            f"again (docs/operations.md, \"PostgreSQL standby and failover\")")


def failover_url(url: str, *hosts: tuple[str, int]) -> str:
    """``url`` naming ``hosts`` after its own, with ``target_session_attrs=read-write``: libpq and
    asyncpg try each and keep the one that accepts writes (the promoted standby after a failover)."""
    parts = urlsplit(url)
    cred, _, host = parts.netloc.rpartition("@")
    netloc = (f"{cred}@" if cred else "") + ",".join([host, *(f"{h}:{p}" for h, p in hosts)])
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "target_session_attrs"]
    query.append(("target_session_attrs", "read-write"))
    return urlunsplit((parts.scheme, netloc, parts.path, urlencode(query), parts.fragment))


def promote_in(state_dir: str | os.PathLike[str], *, force: bool = False) -> EmbeddedStandby:
    """``kvledger db promote``: promote the running standby of the stack in ``state_dir``.

    Refused while the primary's server still runs (two primaries: coordinators could write to
    either), unless ``force``; refused when there is no running standby."""
    state = Path(state_dir).resolve()
    standby = EmbeddedStandby(state / STANDBY_DIR)
    if not (standby.pgdata / "PG_VERSION").exists():
        raise StandbyError(f"no standby in {standby.data_dir} (start the stack with `kvledger up --pg-standby`)")
    if standby.promoted:
        raise StandbyError(f"the standby in {standby.data_dir} was promoted already; it is the primary")
    if _postmaster_pid(standby.pgdata) is None:
        raise StandbyError(f"the standby in {standby.data_dir} is not running")
    primary_pid = _postmaster_pid(state / "postgres" / "pgdata")
    if primary_pid is not None and not force:
        raise StandbyError(f"the primary (pid {primary_pid}) still runs: promoting now would make two primaries. "
                           f"Stop it first, or pass --force if it is unreachable for good")
    standby.promote()
    return standby


def _postmaster_pid(pgdata: Path) -> int | None:
    """The pid of the server that runs on ``pgdata``, or None (no ``postmaster.pid``, or a stale one)."""
    try:
        pid = int((pgdata / "postmaster.pid").read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    return pid
