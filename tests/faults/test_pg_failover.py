"""The PostgreSQL failover drill (issue 54, item 2), as an operator meets it with `kvledger up`.

`kvledger up --pg-standby` with a synchronous standby, promoted by the supervisor after
`database.failover_after_s` or, with 0, by the operator's `kvledger db promote`; a client
sends completions through the gateway without pause while a reader follows the primary's event
log (every event it sees there is committed, and so acknowledged to the coordinator that appended
it). Then every process of the primary is killed with SIGKILL. The supervisor must not restart
it; the standby is promoted (by the supervisor, or by the command while nothing else happens and
the supervisor notices); the coordinators must continue on the
promoted standby (the multi-host URL with ``target_session_attrs=read-write``), requests keep
being served, and on the promoted server every event the reader saw is there with the same
chain hash (0 acknowledged events lost), the log goes on past them, the worker's outbox drains
(every transition it sent is in the log) and `kvledger audit` is clean, hash chain included. The
leader's gauges say what an operator must know: one synchronous standby before, none after.
The command's refusals (primary alive, already promoted): tests/integration/test_pg_standby.py.
Part of the fault drills (tests/faults) but with a stack of its own: the drills' shared stack has
no standby, and this drill ends its primary for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import psutil
import pytest

from tests.e2e.test_stack_supervision import eventually, readyz_status, service
from tests.e2e.test_stack_up import UP_READY, UpProcess, kvledger, still_running, ups, wait_outbox_empty  # noqa: F401


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A directory outside pytest's base temp dir. NOTE: as root the servers run as an unprivileged
    user that must traverse the path, and every pytest session that starts resets its base
    directory (``/tmp/pytest-of-<user>``) to 0700: another session starting meanwhile made
    initdb and pg_basebackup fail with "Permission denied" here."""
    d = Path(tempfile.mkdtemp(prefix="kvl-pg-standby-"))
    d.chmod(0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Load(threading.Thread):
    """Completions through the gateway, one after another, each with a prompt of its own."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.ok: list[float] = []
        self.failed = 0
        self.stop = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            body = json.dumps({"prompt": f"failover drill request {i}: " + "the ledger survives its database. " * 4,
                               "max_tokens": 1, "temperature": 0}).encode()
            req = urllib.request.Request(f"{self.url}/v1/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    json.loads(r.read())
                self.ok.append(time.monotonic())
            except (OSError, ValueError):
                self.failed += 1
                time.sleep(0.1)


class LogReader(threading.Thread):
    """Follows a server's ``events`` table: ``(position → chain hash)`` of every event it saw."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.seen: dict[int, bytes] = {}
        self.stop = threading.Event()
        self.error = ""

    def run(self) -> None:
        asyncio.run(self._follow())

    async def _follow(self) -> None:
        conn = await asyncpg.connect(self.url, timeout=5)
        try:
            while not self.stop.is_set():
                rows = await conn.fetch("SELECT position, chain_hash FROM events WHERE position > $1 ORDER BY position",
                                        max(self.seen, default=0))
                self.seen.update((r[0], bytes(r[1])) for r in rows)
                await asyncio.sleep(0.02)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError) as e:
            self.error = repr(e)  # the primary went away: what was seen until then is what counts
        finally:
            conn.terminate()


async def read_log(url: str) -> dict[int, bytes]:
    conn = await asyncpg.connect(url, timeout=5)
    try:
        return {r[0]: bytes(r[1]) for r in await conn.fetch("SELECT position, chain_hash FROM events")}
    finally:
        await conn.close()


pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def database_gauges(coordinator_url: str) -> tuple[float, float] | None:
    """``(kvl_coordinator_database_standbys, kvl_coordinator_database_synchronous)`` of a coordinator."""
    with urllib.request.urlopen(f"{coordinator_url}/metrics", timeout=5) as r:
        found = dict(line.split() for line in r.read().decode().splitlines()
                     if line.startswith(("kvl_coordinator_database_standbys ", "kvl_coordinator_database_synchronous ")))
    if len(found) < 2:
        return None
    return float(found["kvl_coordinator_database_standbys"]), float(found["kvl_coordinator_database_synchronous"])


def port_of(row: dict[str, Any]) -> int:
    return int(row["url"].rsplit(":", 1)[1].split("/")[0])


@pytest.mark.parametrize("promotion", ["automatic", "command"])
def test_kill_the_primary_under_load_the_standby_is_promoted_and_no_acknowledged_event_is_lost(
        tmp_path: Path, ups: list[UpProcess], promotion: str) -> None:
    after_s = 2 if promotion == "automatic" else 0
    up = UpProcess(tmp_path, {"worker": {"pool_bytes": 4 * 2**20},
                              "database": {"synchronous_standby": True, "failover_after_s": after_s,
                                           "standby_check_interval_s": 0.5}},
                   "--quiet", "--workers", "1", "--pg-standby")
    ups.append(up)
    up.wait_for(UP_READY, timeout_s=240)
    stack = up.stack()
    primary, standby = service(up, "postgres"), service(up, "postgres-standby")
    assert standby["role"] == "embedded standby (sync)" and standby["pid"]
    password = (up.state / "postgres" / "superuser.password").read_text().strip()
    primary_url = f"postgresql://postgres:{password}@127.0.0.1:{port_of(primary)}/postgres"
    standby_url = f"postgresql://postgres:{password}@127.0.0.1:{port_of(standby)}/postgres"
    curl, wurl = stack["coordinator_url"], stack["worker_urls"][0]
    tree = up.tree()
    # what an operator sees: one standby streaming, commits waiting for it
    eventually("the leader reports its synchronous standby", lambda: database_gauges(curl) == (1.0, 1.0))

    load, reader = Load(stack["gateway_url"]), LogReader(primary_url)
    load.start()
    reader.start()
    start = len(reader.seen)
    eventually("events committed under load", lambda: len(load.ok) >= 5 and len(reader.seen) >= start + 20,
               timeout_s=120)

    server = psutil.Process(primary["pid"])
    doomed = [server, *server.children(recursive=True)]  # PostgreSQL's children lead process groups of their own
    for p in doomed:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    reader.join(30)
    assert reader.error, "the reader should have lost the primary"
    acknowledged = dict(reader.seen)
    up.wait_for("embedded postgres (primary) exited", timeout_s=15)
    if promotion == "automatic":
        up.wait_for("promoting the standby", timeout_s=30)
    else:  # the operator's turn: nothing happens by itself
        up.wait_for("promote the standby: kvledger db promote", timeout_s=15)
        time.sleep(3)
        assert "the standby was promoted" not in up.output() and service(up, "postgres")["pid"] is None
        done = kvledger("db", "promote", "--state-dir", str(up.state))
        assert done.returncode == 0 and "promoted" in done.stdout, done.stdout + done.stderr
    up.wait_for("the standby was promoted", timeout_s=30)
    promoted_at = time.monotonic()
    assert service(up, "postgres")["pid"] is None  # not restarted next to its promoted standby
    assert service(up, "postgres-standby")["role"] == "embedded (promoted: the primary)"

    eventually(f"{curl}/readyz 200 on the promoted standby", lambda: readyz_status(curl)[0] == 200, timeout_s=90)
    eventually("requests served after the promotion", lambda: sum(t > promoted_at for t in load.ok) >= 5,
               timeout_s=120)
    # on the promoted server: no standby, and its commits wait for none
    eventually("the leader reports the promoted server alone", lambda: database_gauges(curl) == (0.0, 0.0))
    load.stop.set()
    load.join(60)
    wait_outbox_empty(wurl, timeout_s=60)  # every transition the worker sent is in the log

    after = asyncio.run(read_log(standby_url))
    lost = {pos for pos, h in acknowledged.items() if after.get(pos) != h}
    assert not lost, f"{len(lost)} of {len(acknowledged)} acknowledged events lost or changed: {sorted(lost)[:10]}"
    assert max(after) > max(acknowledged)  # the log went on, on the promoted standby
    audit = kvledger("audit", "--coordinator-url", curl)
    assert audit.returncode == 0 and "CLEAN" in audit.stdout and "intact" in audit.stdout, audit.stdout + audit.stderr
    assert up.popen.poll() is None

    up.popen.send_signal(signal.SIGTERM)
    assert up.popen.wait(90) == 0, up.output()[-4000:]
    up._reader.join(5)
    assert "processes it started is left" in up.output(), up.output()[-3000:]
    assert still_running(tree + doomed) == []
