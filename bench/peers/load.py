"""The workload, as guidellm generates and sends it: synthetic multi-turn chat with shared system
prefixes, one guidellm run per concurrency level (its own seed, so a level finds nothing a previous
level cached; the same seed for every server, so each server gets the same conversations)."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.peers.report import Failed, Level, read_levels
from bench.peers.servers import clean_env


@dataclass(frozen=True)
class Workload:
    """A conversation: a system prefix shared with other conversations (one of ``prefix_count``),
    ``turns`` user turns of ``prompt_tokens`` each, every later turn carrying the whole history, and
    ``output_tokens`` generated per turn. First turn ≈ prefix + prompt = 704 tokens; the third ≈ 1,152."""

    prefix_tokens: int = 512
    prefix_count: int = 2
    prompt_tokens: int = 192
    turns: int = 3
    output_tokens: int = 32

    def data_arg(self) -> str:
        return (f"kind=synthetic_text,prompt_tokens={self.prompt_tokens},output_tokens={self.output_tokens},"
                f"turns={self.turns},prefix_tokens={self.prefix_tokens},prefix_count={self.prefix_count}")


def requests_at(c: int, quick: bool) -> int:
    """Requests (turns) per level, whole conversations: ``max(c, 8)`` conversations (quick: ``c``, and
    3 at c=1), doubled at c > 1 outside quick runs. A level also stops at ``--max-seconds``."""
    turns = Workload().turns
    if quick:
        return (3 if c == 1 else c) * turns
    return (8 if c == 1 else 2 * max(c, 8)) * turns


def guidellm_command(guidellm: Path, target: str, model: str, tokenizer_dir: Path, c: int, requests: int,
                     max_seconds: int, seed: int, out: Path, w: Workload = Workload()) -> list[str]:
    return [str(guidellm), "run",
            # validate_backend=false: guidellm's check is GET /health, which llama-cpp-python's server
            # lacks; the bench has already seen /v1/models answer and a chat request served
            "--backend", f"kind=openai_http,target={target},model={model},request_format=/v1/chat/completions,"
                         "validate_backend=false",
            "--profile", f"kind=concurrent,streams={c}",
            "--data", w.data_arg(),
            "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}",
            "--constraint", f"kind=max_requests,count={requests}",
            "--constraint", f"kind=max_duration,seconds={max_seconds}",
            "--seed", f"kind=static,value={seed}",
            "--output", f"kind=json,path={out}",
            "--disable-console-interactive"]


def run_level(guidellm: Path, target: str, model: str, tokenizer_dir: Path, c: int, requests: int,
              max_seconds: int, work: Path, tag: str) -> Level | Failed:
    """One guidellm run at concurrency ``c``; its report kept as ``work/<tag>_c<c>.json``. Raises
    RuntimeError when guidellm itself fails (no report)."""
    out = work / f"{tag}_c{c}.json"
    cmd = guidellm_command(guidellm, target, model, tokenizer_dir, c, requests, max_seconds, seed=1000 + c, out=out)
    log = work / f"{tag}_c{c}.guidellm.log"
    t0 = time.monotonic()
    with open(log, "wb") as fh:
        # guidellm's own budget is max_seconds; the rest is its start (imports, tokenizer, data)
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=work,
                            env=clean_env(), timeout=max_seconds + 300).returncode
    if rc != 0 or not out.exists():
        tail = log.read_text(errors="replace")[-1500:]
        raise RuntimeError(f"guidellm at c={c} against {tag} failed ({rc}): ...{tail}")
    [lv] = read_levels(out)
    took = f"({time.monotonic() - t0:.0f} s)"
    if isinstance(lv, Failed):
        print(f"bench.peers: {tag} c={c}: failed: {lv.reason} {took}", file=sys.stderr, flush=True)
    else:
        print(f"bench.peers: {tag} c={c}: {lv.requests_ok} ok, {lv.requests_errored} errored, "
              f"{lv.output_tps:.1f} output tok/s, ttft p50 {lv.ttft_p50_ms:.0f} ms, itl p50 {lv.itl_p50_ms:.1f} ms "
              f"{took}", file=sys.stderr, flush=True)
    return lv
