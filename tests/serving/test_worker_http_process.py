"""End to end: ``python -m worker`` serving HTTP, with a real coordinator, PostgreSQL and NATS,
driven by the openai client as a user would."""

from __future__ import annotations

import signal

import aiohttp
import openai

from tests.serving.conftest import MODEL, until
from tests.worker.processes import Cluster

PROMPT = "Every block state change is an event in the log, replayable. "   # 62 bytes


async def _no_leases(cluster: Cluster, worker_id: str) -> bool:
    return (await cluster.admin(f"/v1/leases?worker={worker_id}"))["leases"] == []


async def test_openai_client_against_a_worker_process(cluster) -> None:
    cluster.start_coordinator()
    cluster.start_worker("wh", worker={"port": 0, "host": "127.0.0.1"})
    await cluster.wait_coordinator()
    await cluster.wait_worker("wh")
    url = await cluster.http_url("wh")
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    try:
        cold = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
        warm = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        assert warm.usage.prompt_tokens_details.cached_tokens == 48
        assert warm.choices[0].text == cold.choices[0].text
        chunks = [ch async for ch in await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                                                temperature=0, stream=True)]
        assert "".join(ch.choices[0].text for ch in chunks) == cold.choices[0].text
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 48
        msgs = [{"role": "user", "content": PROMPT}]
        chat = await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0)
        stream = await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0,
                                                 stream=True)
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream])
        assert text == chat.choices[0].message.content
        # the same answer from the engine itself (NATS debug subject): the HTTP layer adds nothing
        direct = await cluster.generate("wh", list(PROMPT.encode()), 4)
        assert bytes(direct["tokens"]).decode("utf-8", "replace") == cold.choices[0].text
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/readyz") as r:
                body = await r.json()
                assert r.status == 200 and body["status"] == "ready" and body["coordinator"] == "reachable"
            async with http.get(url + "/metrics") as r:
                assert "kvl_worker_time_to_first_token_seconds_count" in await r.text()
        # nothing leased is left behind once the requests are done
        assert await cluster.flush("wh")
        await until("a lease left behind", lambda: _no_leases(cluster, "wh"))
    finally:
        await c.close()
    proc = cluster.workers["wh"]
    proc.kill(signal.SIGTERM)
    assert proc.popen.returncode == 0, proc.tail()
