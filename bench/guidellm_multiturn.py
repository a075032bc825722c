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
import subprocess

from bench.tiny_stack import external_tool, metric, tiny_stack


def main() -> dict:
    guidellm = external_tool("GUIDELLM", "guidellm")
    with tiny_stack(2, "kvl-bench-guidellm-") as (d, model, stack):
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
        queries = sum(metric(u, "kvl_worker_prefix_cache_queries_total") for u in stack["worker_urls"])
        hits = sum(metric(u, "kvl_worker_prefix_cache_validated_hits_total") for u in stack["worker_urls"])
        result = {"bench": "guidellm_multiturn",
                  "requests_ok": metric(gw, 'kvl_gateway_requests_total{path="/v1/chat/completions",status="200"}'),
                  "prompt_tokens": queries, "cached_tokens": hits,
                  "prefix_reuse": round(hits / queries, 3) if queries else None,
                  "gateway_expected_cached_tokens": metric(gw, "kvl_gateway_expected_cached_tokens_total"),
                  "gateway_realized_cached_tokens": metric(gw, "kvl_gateway_realized_cached_tokens_total"),
                  "route_by_cache": metric(gw, 'kvl_gateway_route_decisions_total{reason="cache"}')}
        print(json.dumps(result))
        return result


if __name__ == "__main__":
    main()
