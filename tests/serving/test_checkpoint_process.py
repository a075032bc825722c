"""End to end with a real checkpoint: a Llama directory written by transformers (weights,
tokenizer, chat template, generation config), a manifest, and ``python -m worker`` serving it
behind a real coordinator, PostgreSQL and NATS — driven by the openai client. A changed byte in
the weights refuses the start, naming the file."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from shared.manifest import write_manifest
from tests.checkpoints import save_hf, save_tokenizer, token_id

pytest.importorskip("transformers")

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
            "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
PROMPT = "The ledger records every block. Hello! How are you? You are a helpful assistant. " * 2


@pytest.fixture
def llama_dir(tmp_path):
    d = save_hf("llama", tmp_path / "llama-ckpt", seed=3, vocab_size=256)
    save_tokenizer(d, bos="<|begin_of_text|>", eos="<|eot_id|>", template=TEMPLATE,
                   gen={"do_sample": False, "eos_token_id": [token_id("<|eot_id|>")]})
    write_manifest(d)
    return d


async def test_a_llama_checkpoint_directory_serves_with_exact_reuse(cluster, llama_dir) -> None:
    cluster.start_coordinator()
    cluster.start_worker("wl", worker={"port": 0, "model_dir": str(llama_dir), "require_manifest": True})
    await cluster.wait_coordinator()
    await cluster.wait_worker("wl")
    url = await cluster.http_url("wl")
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    try:
        (served,) = (await c.models.list()).data
        assert served.id == "llama-ckpt"
        cold = await c.completions.create(model=served.id, prompt=PROMPT, max_tokens=6, temperature=0)
        warm = await c.completions.create(model=served.id, prompt=PROMPT, max_tokens=6, temperature=0)
        n = cold.usage.prompt_tokens
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        assert warm.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 0
        assert warm.choices[0].text == cold.choices[0].text
        msgs = [{"role": "user", "content": PROMPT}]
        first = await c.chat.completions.create(model=served.id, messages=msgs, max_tokens=4, temperature=0)
        again = await c.chat.completions.create(model=served.id, messages=msgs, max_tokens=4, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert again.choices[0].message.content == first.choices[0].message.content
        replicas = await cluster.replicas(worker="wl")
        assert replicas and {r["form"] for r in replicas} == {"kv"}
        report = await cluster.audit()
        assert report["ok"], report
    finally:
        await c.close()


async def test_a_changed_weights_file_refuses_the_start_naming_it(cluster, llama_dir) -> None:
    weights = llama_dir / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1
    weights.write_bytes(bytes(raw))
    cluster.start_coordinator()
    proc = cluster.start_worker("wx", worker={"port": 0, "model_dir": str(llama_dir)})
    deadline = time.monotonic() + 60
    while proc.alive and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not proc.alive and proc.popen.returncode == 2
    log = proc.log.read_text(errors="replace")
    assert "cannot load the model" in log and "model.safetensors" in log and "Traceback" not in log
