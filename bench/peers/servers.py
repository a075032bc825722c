"""The servers bench.peers measures, each started alone on 127.0.0.1 and stopped fully before the next:
kvledger (``kvledger up`` with its gateway) and the peers installed by bench/peers/setup.sh."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from shared.child_process import parent_death_signal

PEERS = ("vllm", "transformers", "llamacpp")


class ServerFailed(RuntimeError):
    """A server that exited or never became ready; the message ends with its log's tail."""


def peers_dir() -> Path:
    return Path(os.environ.get("KVL_PEERS_DIR") or Path.home() / ".cache" / "kvledger" / "peers")


def installed(name: str) -> Path | None:
    """The venv of an installed peer (or of guidellm): setup.sh writes ``.kvl-peer-ready`` last."""
    d = peers_dir() / name
    return d if (d / ".kvl-peer-ready").is_file() and (d / "bin" / "python").exists() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without PYTHONPATH: a peer (or guidellm) imports its own packages, never this
    project's (its ``kernels`` shadows Hugging Face's ``kernels``)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra)
    return env


def get_json(url: str, timeout: float = 5) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    """One server process group: started in its own session, its output in ``work/<name>.log``."""

    name = ""
    ready_timeout = 300.0

    def __init__(self, work: Path, model_dir: Path, dtype: str) -> None:
        self.work, self.model_dir, self.dtype = work, model_dir, dtype
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = work / f"{self.name}.log"

    @property
    def url(self) -> str:
        """The OpenAI base URL guidellm targets (no ``/v1``)."""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return clean_env()

    def start(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command(), cwd=self.work, env=self.env(), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=parent_death_signal())

    def log_tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise ServerFailed(f"{self.name} exited with {self.proc.returncode}: ...{self.log_tail()}")

    def wait_ready(self) -> float:
        """Seconds until ``/v1/models`` answers with a model."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.ready_timeout:
            self.check_alive()
            try:
                if self.listed(get_json(self.url + "/v1/models")):
                    return time.monotonic() - t0
            except (OSError, ValueError, urllib.error.URLError):
                pass
            time.sleep(1.0)
        raise ServerFailed(f"{self.name} not ready after {self.ready_timeout:.0f} s: ...{self.log_tail()}")

    def listed(self, models: dict) -> bool:
        """Whether a ``/v1/models`` answer says the model is served."""
        return bool(models.get("data"))

    def model_name(self) -> str:
        """The ``model`` requests name (guidellm's too)."""
        return get_json(self.url + "/v1/models")["data"][0]["id"]

    def warm(self) -> None:
        """One short chat request, so no level pays a first request's one-off costs."""
        body = {"model": self.model_name(), "max_tokens": 8,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        req = urllib.request.Request(self.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            json.loads(r.read())

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM to the process group, SIGKILL after ``timeout``; returns once the leader is gone
        and no process of its group is left."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 10
        while _group_alive(pgid):
            if time.monotonic() > deadline:
                os.killpg(pgid, signal.SIGKILL)
                time.sleep(0.5)
                break
            time.sleep(0.2)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class Kvledger(Server):
    """``kvledger up`` (embedded PostgreSQL and NATS in a fresh state dir, one worker, the gateway):
    its defaults, only the model dir and dtype set, every port picked free."""

    name = "kvledger"

    def __init__(self, work: Path, model_dir: Path, dtype: str) -> None:
        super().__init__(work, model_dir, dtype)
        self.gateway_url = ""

    @property
    def url(self) -> str:
        return self.gateway_url

    def command(self) -> list[str]:
        (self.work / "kvledger.yaml").write_text(
            f"state_dir: state\nworker:\n  model_dir: {self.model_dir}\n  dtype: {self.dtype}\n")
        return [sys.executable, "-m", "kvledger.cli", "up", "--config", "kvledger.yaml", "--coordinator-port", "0",
                "--worker-base-port", "0", "--gateway-port", "0", "--quiet"]

    def env(self) -> dict[str, str]:
        root = str(Path(__file__).resolve().parents[2])
        return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}

    def wait_ready(self) -> float:
        t0 = time.monotonic()
        stack = self.work / "state" / "stack.json"
        while not self.gateway_url:
            self.check_alive()
            if time.monotonic() - t0 > self.ready_timeout:
                raise ServerFailed(f"kvledger up not ready after {self.ready_timeout:.0f} s: ...{self.log_tail()}")
            if "up; Ctrl-C" in self.log_tail(400) and stack.exists():
                self.gateway_url = json.loads(stack.read_text())["gateway_url"].removesuffix("/v1")
            time.sleep(1.0)
        return super().wait_ready() + (time.monotonic() - t0)


class Vllm(Server):
    """vLLM's CPU build: prefix caching on, the model's context capped at 4,096, KV space 4 GiB."""

    name = "vllm"
    ready_timeout = 600.0

    def command(self) -> list[str]:
        venv = installed("vllm")
        assert venv is not None
        return [str(venv / "bin" / "vllm"), "serve", str(self.model_dir), "--host", "127.0.0.1", "--port",
                str(self.port), "--dtype", self.dtype, "--enable-prefix-caching", "--max-model-len", "4096"]

    def env(self) -> dict[str, str]:
        venv = installed("vllm")
        assert venv is not None
        cpus = os.cpu_count() or 1
        return clean_env(LD_PRELOAD=str(venv / "lib" / "libiomp5.so"),
                         VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
                         VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{cpus - 1}"))


class Transformers(Server):
    """``transformers serve`` with continuous batching, its KV reservation capped (it takes 60% of
    RAM otherwise)."""

    name = "transformers"

    def listed(self, models: dict) -> bool:
        return models.get("object") == "list"   # it lists the hub cache only: a local dir never shows

    def model_name(self) -> str:
        return str(self.model_dir)

    def command(self) -> list[str]:
        venv = installed("transformers")
        assert venv is not None
        return [str(venv / "bin" / "transformers"), "serve", str(self.model_dir), "--host", "127.0.0.1",
                "--port", str(self.port), "--continuous-batching", "--device", "cpu", "--dtype", self.dtype,
                "--attn-implementation", "sdpa", "--cb-block-size", "32", "--cb-num-blocks", "512",
                "--cb-max-batch-tokens", "512", "--cb-max-memory-percent", "0.1"]


class Llamacpp(Server):
    """llama-cpp-python's server on the package's GGUF file itself (Q4_1 weights: not the dtype the
    others run; one request at a time)."""

    name = "llamacpp"

    def command(self) -> list[str]:
        from kvledger.models import smollm2_gguf

        venv = installed("llamacpp")
        assert venv is not None
        return [str(venv / "bin" / "python"), "-m", "llama_cpp.server", "--model", str(smollm2_gguf()),
                "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", "4096",
                "--n_threads", str(os.cpu_count() or 1), "--model_alias", "smollm2"]


SERVERS: dict[str, type[Server]] = {"kvledger": Kvledger, "vllm": Vllm, "transformers": Transformers,
                                    "llamacpp": Llamacpp}
