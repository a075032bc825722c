"""End to end with the YOCO family: ``kvledger model init --family yoco`` writes a checkpoint
directory, ``python -m worker`` serves it (fp8 cache storage) behind a real coordinator,
PostgreSQL and NATS, and the openai client drives an agent conversation through it — long
prompt, tool call, tool result — with exact reuse of every turn's prefix; the audit replayed
from the log is clean and the cached forms are YOCO's own."""

from __future__ import annotations

import openai

from kvledger.cli import main as kvledger

DOC = "The ledger records every block of every form, and a worker validates each before reuse. " * 12
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a term up in the ledger.",
                                            "parameters": {"type": "object", "required": ["term"],
                                                           # bounded: random weights would write on forever
                                                           "properties": {"term": {"enum": ["block", "replica"]}}}}}]


async def test_a_yoco_checkpoint_serves_an_agent_conversation_with_exact_reuse(cluster, tmp_path) -> None:
    d = tmp_path / "yoco"
    assert kvledger(["model", "init", str(d), "--family", "yoco", "--sliding-window", "40"]) == 0
    cluster.start_coordinator()
    cluster.start_worker("wy", cache={"dtype": "float8_e4m3fn"},
                         worker={"port": 0, "model_dir": str(d), "require_manifest": True})
    await cluster.wait_coordinator()
    await cluster.wait_worker("wy")
    url = await cluster.http_url("wy")
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    try:
        (served,) = (await c.models.list()).data
        msgs = [{"role": "system", "content": "Answer from the document."},
                {"role": "user", "content": DOC + "\nWhat does a worker validate?"}]
        first = await c.chat.completions.create(model=served.id, messages=msgs, tools=TOOLS, max_tokens=200,
                                                temperature=0, tool_choice={"type": "function",
                                                                            "function": {"name": "lookup"}})
        assert first.choices[0].message.tool_calls, (first.choices[0].message, first.choices[0].finish_reason)
        call = first.choices[0].message.tool_calls[0]
        assert call.function.name == "lookup" and first.choices[0].finish_reason == "tool_calls"
        again = await c.chat.completions.create(model=served.id, messages=msgs, tools=TOOLS, max_tokens=200,
                                                temperature=0, tool_choice={"type": "function",
                                                                            "function": {"name": "lookup"}})
        assert again.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
        n = first.usage.prompt_tokens
        assert again.usage.prompt_tokens_details.cached_tokens >= (n - 1) // 16 * 16 - 16 > 0
        # the next turn: the call and its result appended — its prompt extends the previous one
        msgs += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "Every replica, in four layers."}]
        turn2 = await c.chat.completions.create(model=served.id, messages=msgs, tools=TOOLS, max_tokens=4,
                                                temperature=0)
        assert turn2.usage.prompt_tokens_details.cached_tokens >= (n - 1) // 16 * 16 - 16
        replicas = await cluster.replicas(worker="wy")
        assert replicas and {r["form"] for r in replicas} == {"global_kv", "swa"}
        report = await cluster.audit()
        assert report["ok"], report
    finally:
        await c.close()
