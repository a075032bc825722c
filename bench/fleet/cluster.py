"""The processes of one ``bench.fleet`` round: N coordinator shards and the driver processes.

A shard is laid out as docs/operations.md ("A sharded ledger") says: every coordinator sets
``coordinator.shards: N`` and the same ``shard_partitions``; shard k sets ``coordinator.shard: k``,
has a database of its own (created here, dropped afterwards) and lives under the deployment's
prefix (shard 0) or ``<prefix>.s<k>``, with its own stream. The shard map (the static one,
version 1) is stored in the NATS KV bucket before the coordinators start, as the first of them
would store it; they and the drivers read it from there. One shard is today's deployment,
unsharded (``coordinator.shards: 1``, no map). Each coordinator is ``python -m coordinator``
(:class:`bench.coordinator.harness.CoordinatorProc`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from bench.coordinator.harness import REPO, CoordinatorProc, create_db, drop_db
from shared.shards import ShardMap, map_bucket, shard_subjects


def log(msg: str) -> None:
    print(f"[bench.fleet {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextlib.asynccontextmanager
async def shards(nc: Any, db_url: str, nats_url: str, tmp: Path, n: int, partitions: int,
                 made: dict[str, list[str]]) -> AsyncIterator[tuple[str, list[CoordinatorProc]]]:
    """N shards' coordinators, each leading its own database and stream: ``(prefix, procs)``.
    Databases, streams and the map's bucket are removed afterwards (best effort, said if not);
    ``made`` lists what was made (``prefixes``, ``databases``: for a check that none is left)."""
    prefix = f"kvlfleet{uuid.uuid4().hex[:8]}"
    made.setdefault("prefixes", []).append(prefix)
    dbs: list[str] = []
    procs: list[CoordinatorProc] = []
    ok = False
    try:
        if n > 1:
            from shared.shard_store import ShardMapStore
            await ShardMapStore(nc.jetstream(), prefix).load(ShardMap.uniform(n, partitions))
        for k in range(n):
            url, name = await create_db(db_url, f"fleet{n}s{k}")
            dbs.append(name)
            made.setdefault("databases", []).append(name)
            procs.append(CoordinatorProc(tmp, f"n{n}-shard{k}", url, nats_url, prefix, {
                "shards": n, "shard": k, "shard_partitions": partitions}))
        for p in procs:
            p.start()
        await asyncio.gather(*(p.wait_ready() for p in procs))
        yield prefix, procs
        ok = True
    finally:
        for p in procs:
            if not ok:
                log(f"--- {p.name} log (tail) ---\n{p.tail()}")
            p.stop()
        js = nc.jetstream(timeout=10)
        for k in range(n):
            try:
                await js.delete_stream(shard_subjects(prefix, k).stream_name)
            except Exception as e:  # noqa: BLE001 - best effort, say so
                log(f"could not delete stream {shard_subjects(prefix, k).stream_name}: {type(e).__name__}: {e}")
        if n > 1:
            with contextlib.suppress(Exception):
                await js.delete_key_value(map_bucket(prefix))
        for name in dbs:
            try:
                await drop_db(db_url, name)
            except Exception as e:  # noqa: BLE001 - best effort, say so
                log(f"could not drop database {name}: {e}")


class DriverProc:
    """``python -m bench.fleet --drive <spec>``: one line per command on stdin, per answer on stdout."""

    def __init__(self, spec: dict[str, Any], logfile: Path) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.logfile = logfile
        with open(logfile, "ab") as err:
            self.popen = subprocess.Popen([sys.executable, "-m", "bench.fleet", "--drive", json.dumps(spec)],
                                          cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=err, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    async def _readline(self, timeout_s: float) -> str:
        """The driver's next line; an error naming its exit status if it ends first (its stdout
        pipe may be held open by no one else, but a reader blocked on it is not told why)."""
        assert self.popen.stdout is not None
        pending = asyncio.ensure_future(asyncio.to_thread(self.popen.stdout.readline))
        deadline = time.monotonic() + timeout_s
        while not pending.done():
            await asyncio.wait([pending], timeout=0.5)
            if not pending.done() and (self.popen.poll() is not None or time.monotonic() > deadline):
                pending.cancel()
                raise RuntimeError(f"driver {self.pid}: no answer (exit status {self.popen.poll()}):\n{self.tail()}")
        line = pending.result()
        if not line:
            raise RuntimeError(f"driver {self.pid} exited ({self.popen.wait(5)}):\n{self.tail()}")
        return line.decode().strip()

    async def expect(self, word: str, timeout_s: float) -> None:
        line = await self._readline(timeout_s)
        if line != word:
            raise RuntimeError(f"driver {self.pid} said {line!r}, not {word}:\n{self.tail()}")

    def send(self, cmd: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(cmd.encode() + b"\n")
        self.popen.stdin.flush()

    async def ask(self, cmd: str, timeout_s: float = 120) -> dict[str, Any]:
        self.send(cmd)
        return json.loads(await self._readline(timeout_s))

    def tail(self, n: int = 3000) -> str:
        return self.logfile.read_text(errors="replace")[-n:] if self.logfile.exists() else ""

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


__all__ = ["DriverProc", "log", "shards"]
