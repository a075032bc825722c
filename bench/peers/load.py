"""The workload, as guidellm generates and sends it: synthetic multi-turn chat with shared system
prefixes, one guidellm run per concurrency level (its own seed, so a level finds nothing a previous
level cached; the same seed for every server, so each server gets the same conversations)."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.peers.report import Level, read_levels
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
    """Requests (turns) per level: whole conversations, at least two rounds of ``c`` streams at c > 1
    (quick: one), and 12 conversations at c=1 (quick: 3)."""
    turns = Workload().turns
    if c == 1:
        return (3 if quick else 12) * turns
    return c * (1 if quick else 2) * turns


def guidellm_command(guidellm: Path, target: str, tokenizer_dir: Path, c: int, requests: int, max_seconds: int,
                     seed: int, out: Path, w: Workload = Workload()) -> list[str]:
    return [str(guidellm), "run",
            "--backend", f"kind=openai_http,target={target},request_format=/v1/chat/completions",
            "--profile", f"kind=concurrent,streams={c}",
            "--data", w.data_arg(),
            "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}",
            "--constraint", f"kind=max_requests,count={requests}",
            "--constraint", f"kind=max_duration,seconds={max_seconds}",
            "--seed", f"kind=static,value={seed}",
            "--output", f"kind=json,path={out}",
            "--disable-console-interactive"]


def run_level(guidellm: Path, target: str, tokenizer_dir: Path, c: int, requests: int, max_seconds: int,
              work: Path, tag: str) -> Level:
    """One guidellm run at concurrency ``c``; its report kept as ``work/<tag>_c<c>.json``."""
    out = work / f"{tag}_c{c}.json"
    cmd = guidellm_command(guidellm, target, tokenizer_dir, c, requests, max_seconds, seed=1000 + c, out=out)
    log = work / f"{tag}_c{c}.guidellm.log"
    t0 = time.monotonic()
    with open(log, "wb") as fh:
        # guidellm's own budget is max_seconds; the rest is its start (imports, tokenizer, data)
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=work,
                            env=clean_env(), timeout=max_seconds + 300).returncode
    if rc != 0 or not out.exists():
        tail = log.read_text(errors="replace")[-1500:]
        raise RuntimeError(f"guidellm at c={c} against {tag} failed ({rc}): ...{tail}")
    levels = read_levels(out)
    print(f"bench.peers: {tag} c={c}: {levels[0].requests_ok} ok, {levels[0].output_tps:.1f} output tok/s, "
          f"ttft p50 {levels[0].ttft_p50_ms:.0f} ms, itl p50 {levels[0].itl_p50_ms:.1f} ms "
          f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    return levels[0]
