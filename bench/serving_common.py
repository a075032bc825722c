"""The serving benchmark's common parts (:mod:`bench.serving`): its workloads, helpers, the two
tenants' API keys, and the :class:`Cluster` of processes it serves from (a coordinator and one
worker, with their own database and subject prefix).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import random
import re
import string
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LEVELS = (1, 8, 32)
#: The worker's cache.block_size (the config's default).
BLOCK = 16


@dataclass(frozen=True)
class Workload:
    system_chars: int
    task_chars: int
    observation_chars: int
    turns: int
    max_tokens: int
    #: Agents at concurrency 1 (run one after the other); at c > 1, c agents.
    serial_agents: int
    #: The served model's id, as requests name it.
    model: str = "kvledger/dsv4-tiny"
    #: Real text (``bench.realtext``) instead of random letters: for a real checkpoint.
    real_text: bool = False

    def agents(self, c: int) -> int:
        return c if c > 1 else self.serial_agents


FULL = Workload(system_chars=256, task_chars=64, observation_chars=128, turns=4, max_tokens=4, serial_agents=4)
QUICK = Workload(system_chars=128, task_chars=16, observation_chars=32, turns=2, max_tokens=2, serial_agents=2)


def _log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def _text(rng: random.Random, n: int) -> str:
    alphabet = string.ascii_lowercase + "      ,."
    return "".join(rng.choice(alphabet) for _ in range(n))


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


#: API keys of the two tenants (one per mode); the worker's config stores their sha256.
KEYS = {"on": "bench-serving-reuse-on", "off": "bench-serving-reuse-off"}


# --- processes -------------------------------------------------------------------------------------

class Cluster:
    """A coordinator and one worker process, with their own database and subject prefix."""

    def __init__(self, tmp: Path, db_url: str, nats_url: str, pool_mb: int, model_dir: str = "",
                 cache_dtype: str = "auto", service: dict[str, int] | None = None,
                 cache: dict[str, int] | None = None, dtype: str = "auto") -> None:
        from shared.embedded import free_port

        self.model_dir = model_dir
        self.dtype = dtype
        self.cache_dtype = cache_dtype
        self.cache = cache or {}
        #: ``service.*`` settings of the worker that differ from the config's defaults.
        self.service = service or {}
        self.tmp = tmp
        self.db_url = db_url
        self.nats_url = nats_url
        self.pool_mb = pool_mb
        self.admin_port = free_port()
        self.prefix = f"kvlbs{uuid.uuid4().hex[:8]}"
        self.procs: list[tuple[subprocess.Popen[bytes], Any]] = []
        self.worker_log = tmp / "worker.log"

    def _start(self, name: str, module: str, doc: dict[str, Any]) -> subprocess.Popen[bytes]:
        import yaml

        cfg = self.tmp / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump(doc))
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVL_")}
        env.update(PYTHONPATH=str(REPO), KVL_TORCH_THREADS="1")
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        p = subprocess.Popen([sys.executable, "-m", module, "--config", str(cfg)], cwd=REPO, env=env, stdout=log,
                             stderr=subprocess.STDOUT)
        self.procs.append((p, log))
        return p

    def start(self, bench_db: str) -> None:
        base = {"database": {"url": bench_db},
                "nats": {"url": self.nats_url, "subject_prefix": self.prefix, "request_timeout_ms": 5000},
                # NOTE: a long liveness window: on a starved machine heartbeats queue behind work.
                "coordinator": {"port": self.admin_port, "commit_batch_ms": 2, "missed_heartbeats": 30},
                "logging": {"format": "json", "level": "warning"}}
        self.coordinator = self._start("coordinator", "coordinator", {**base, "state_dir": str(self.tmp / "c")})
        self.worker = self._start("worker", "worker", {
            **base, "state_dir": str(self.tmp / "w"),
            "cache": {"host_tier_bytes": 0, "offload_dir": "", "dtype": self.cache_dtype, **self.cache},
            "worker": {"worker_id": "bench-serving", "port": 0, "pool_bytes": self.pool_mb * 2**20,
                       "model_dir": self.model_dir, "dtype": self.dtype},
            "service": {"request_timeout_ms": 600_000, "queue_timeout_ms": 600_000, **self.service},
            "auth": {"keys": [{"key_sha256": hashlib.sha256(k.encode()).hexdigest(), "tenant": f"bench-{mode}"}
                              for mode, k in KEYS.items()]}})

    async def wait_ready(self, timeout: float = 120) -> str:
        import aiohttp

        deadline = time.monotonic() + timeout
        url = None
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                for p, _ in self.procs:
                    if p.poll() is not None:
                        raise RuntimeError(f"a process exited during start; see {self.tmp}")
                if url is None:
                    m = re.search(r"^listening on (http://\S+)$", self.worker_log.read_text(errors="replace"), re.M)
                    url = m.group(1) if m else None
                if url is not None:
                    try:
                        async with http.get(url + "/readyz") as r:
                            if (await r.json()).get("status") == "ready":
                                return url
                    except aiohttp.ClientError:
                        pass
                await asyncio.sleep(0.1)
        raise RuntimeError(f"the worker was not ready within {timeout} s; see {self.tmp}")

    def pids(self) -> dict[str, int]:
        """The stack's own processes by role (``bench.proc_cpu.stack_cpu`` adds the servers)."""
        return {"worker": self.worker.pid, "coordinator": self.coordinator.pid}

    def stop(self) -> None:
        for p, log in reversed(self.procs):
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            log.close()


async def stop_and_drop(cluster: Cluster, db_url: str, db_name: str) -> None:
    """A run's teardown: stop its processes, then drop the database it made (best effort: a
    database left behind is reported, not raised, so the run's own error stays the one seen)."""
    from bench.worker import _drop_db

    cluster.stop()
    try:
        await _drop_db(db_url, db_name)
    except Exception as e:  # noqa: BLE001 - best effort
        _log(f"could not drop {db_name}: {e}")


__all__ = ["BLOCK", "FULL", "KEYS", "LEVELS", "QUICK", "REPO", "Cluster", "Workload", "percentile", "stop_and_drop"]
