"""guidellm's multi-turn prefix-caching scenario against ``kvledger up``, through the gateway,
with no route overrides (vLLM's benchmark tool, run as its users run it).

guidellm is not a dependency of kvledger (it pulls its own stack); install it apart and name it:

    python3 -m venv /tmp/glvenv && /tmp/glvenv/bin/pip install guidellm==0.8.1
    GUIDELLM=/tmp/glvenv/bin/guidellm python -m bench.guidellm_multiturn     # ~2 min

What runs: a tiny Llama checkpoint with its tokenizer and chat template, written as transformers
saves them (guidellm needs a Hugging Face tokenizer to build its synthetic prompts; the
built-in model has none), ``kvledger up --workers 2`` serving it, and ``guidellm run`` with
synthetic multi-turn chat data (100-token turns, 3 turns, 64-token shared prefixes over 4
prefixes, 16 output tokens; the scenario's shape, scaled to the tiny model's 512-token context),
2 concurrent streams, 24 requests. guidellm reports latency and throughput but not cache reuse,
so the last JSON line adds it from the gateway's and workers' own counters: prompt tokens served
from validated cache, and the gateway's expected vs realised cached tokens.
"""

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
from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n{{ m['content'] }}"
                 "<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n"
                 "{% endif %}")


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))


def main() -> dict:
    guidellm = os.environ.get("GUIDELLM") or shutil.which("guidellm")
    if not guidellm or not Path(guidellm).exists():
        raise SystemExit("bench.guidellm_multiturn: guidellm not found; install it apart and set GUIDELLM "
                         "(see this module's docstring)")
    from tests.checkpoints import save_hf, save_tokenizer

    d = Path(tempfile.mkdtemp(prefix="kvl-bench-guidellm-"))
    model = save_tokenizer(save_hf("llama", d / "model", seed=7, vocab_size=256, num_hidden_layers=2),
                           bos="<s>", eos="</s>", template=CHAT_TEMPLATE)
    (d / "kvledger.yaml").write_text(f"state_dir: state\nworker:\n  model_dir: {model}\n  pool_bytes: 33554432\n")
    up = subprocess.Popen([sys.executable, "-m", "kvledger.cli", "up", "--config", "kvledger.yaml", "--workers", "2",
                           "--coordinator-port", "0", "--worker-base-port", "0", "--gateway-port", "0", "--quiet"],
                          cwd=d, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert up.stdout is not None
        for line in up.stdout:
            if "up; Ctrl-C" in line:
                break
            if "kvledger up: error" in line:
                raise SystemExit(f"bench.guidellm_multiturn: the stack did not start: {line.strip()}")
        stack = json.loads((d / "state" / "stack.json").read_text())
        gw = stack["gateway_url"]
        run = subprocess.run(
            [guidellm, "run", "--backend", f"kind=openai_http,target={gw},request_format=/v1/chat/completions",
             "--profile", "kind=concurrent,streams=2",
             "--data", "kind=synthetic_text,prompt_tokens=100,output_tokens=16,turns=3,prefix_tokens=64,prefix_count=4",
             "--tokenizer", f"kind=hf_auto,model={model}", "--constraint", "kind=max_requests,count=24",
             "--output", f"kind=json,path={d / 'report.json'}", "--disable-console-interactive"],
            capture_output=True, text=True, timeout=900)
        print(run.stdout[-6000:])
        if run.returncode != 0:
            raise SystemExit(f"bench.guidellm_multiturn: guidellm failed ({run.returncode}): {run.stderr[-2000:]}")
        queries = sum(_metric(u, "kvl_worker_prefix_cache_queries_total") for u in stack["worker_urls"])
        hits = sum(_metric(u, "kvl_worker_prefix_cache_validated_hits_total") for u in stack["worker_urls"])
        result = {"bench": "guidellm_multiturn", "requests_ok": _metric(gw, 'kvl_gateway_requests_total{path="/v1/chat/completions",status="200"}'),
                  "prompt_tokens": queries, "cached_tokens": hits,
                  "prefix_reuse": round(hits / queries, 3) if queries else None,
                  "gateway_expected_cached_tokens": _metric(gw, "kvl_gateway_expected_cached_tokens_total"),
                  "gateway_realized_cached_tokens": _metric(gw, "kvl_gateway_realized_cached_tokens_total"),
                  "route_by_cache": _metric(gw, 'kvl_gateway_route_decisions_total{reason="cache"}')}
        print(json.dumps(result))
        return result
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
