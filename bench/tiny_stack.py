"""A tiny Llama checkpoint as transformers saves it (weights, tokenizer, chat template) served by
``kvledger up``: what the external-tool benchmarks (guidellm, lm-eval) run against — they need a
Hugging Face tokenizer, which the built-in model does not have."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shared.child_process import parent_death_signal

CHAT_TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n{{ m['content'] }}"
                 "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n"
                 "{% endif %}")


def write_checkpoint(directory: Path) -> Path:
    from tests.checkpoints import save_hf, save_tokenizer

    return save_tokenizer(save_hf("llama", directory, seed=7, vocab_size=256, num_hidden_layers=2),
                          bos="<s>", eos="</s>", template=CHAT_TEMPLATE)


def launch_up(d: Path, workers: int) -> tuple[subprocess.Popen, dict]:
    """``kvledger up`` in ``d`` (with its ``kvledger.yaml``) on free ports, once it is up: the
    process and its ``stack.json``."""
    up = subprocess.Popen([sys.executable, "-m", "kvledger.cli", "up", "--config", "kvledger.yaml", "--workers",
                           str(workers), "--coordinator-port", "0", "--worker-base-port", "0", "--gateway-port", "0",
                           "--quiet"], cwd=d, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          # a stack dies with the run that started it (a killed pytest left one holding the
                          # leader lock on the shared PostgreSQL, and the next run's coordinator waited as standby)
                          start_new_session=True, preexec_fn=parent_death_signal(),
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert up.stdout is not None
    for line in up.stdout:
        if "up; Ctrl-C" in line:
            break
        if "kvledger up: error" in line:
            up.kill()
            raise SystemExit(f"the stack did not start: {line.strip()}")
    return up, json.loads((d / "state" / "stack.json").read_text())


@contextmanager
def tiny_stack(workers: int, prefix: str) -> Iterator[tuple[Path, Path, dict]]:
    """(work directory, checkpoint, stack.json) of a running ``kvledger up`` on the tiny checkpoint."""
    d = Path(tempfile.mkdtemp(prefix=prefix))
    model = write_checkpoint(d / "model")
    (d / "kvledger.yaml").write_text(f"state_dir: state\nworker:\n  model_dir: {model}\n  pool_bytes: 33554432\n")
    up, stack = launch_up(d, workers)
    try:
        yield d, model, stack
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
        shutil.rmtree(d, ignore_errors=True)


def metric(url: str, name: str) -> float:
    """Sum of a Prometheus series at ``url/metrics`` (``name`` may carry its labels)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))


def external_tool(env: str, name: str) -> str:
    """The tool's executable: ``$env``, else the one installed beside this Python, else on PATH."""
    beside = Path(sys.executable).parent / name
    path = os.environ.get(env) or (str(beside) if beside.exists() else shutil.which(name))
    if not path or not Path(path).exists():
        raise SystemExit(f"{name} not found: install it apart and set {env} (see the benchmark's docstring)")
    return path
