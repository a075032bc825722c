"""The benchmarks on a real checkpoint (issue 52 item 5): ``bench.worker`` and ``bench.serving``
take ``--model-dir``/``--dtype``, feed SmolLM2 real text through its tokenizer, and
``bench.serving_bound`` times the checkpoint the serving run served. What they measure is in
docs/BENCHMARKS.md; here, that the options reach the model and the workload is real text."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from bench.realtext import Passages, TokenStream, corpus
from tests.realmodel.conftest import BS, smollm2


def test_the_options_are_checked() -> None:
    from bench import serving, worker

    with pytest.raises(SystemExit) as e:
        worker.main(["--model-dir", "/nonexistent/kvl-model"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        serving.main(["--model-dir", str(smollm2()), "--overload"])
    assert e.value.code == 2


def test_the_worker_bench_loads_the_checkpoint_in_the_dtype_asked() -> None:
    from bench.worker import _model

    m = _model(argparse.Namespace(model_dir=str(smollm2()), dtype="bfloat16"))
    assert m.dtype == torch.bfloat16 and "SmolLM2" in m.cfg.model_id
    tiny = _model(argparse.Namespace(model_dir="", dtype="auto"))     # the default: the tiny model, as before
    assert tiny.dtype == torch.float32 and tiny.cfg.model_id == "kvledger/dsv4-tiny"


def test_real_prompts_are_consecutive_runs_of_the_docs_through_the_tokenizer() -> None:
    from shared.text.tokenizer import load_tokenizer

    tok = load_tokenizer(str(smollm2()), 49152)
    stream = TokenStream(tok, seed=1)
    a, b = stream.take(64), stream.take(64)
    again = TokenStream(tok, seed=1)
    assert again.take(128) == a + b                       # consecutive, and seeded
    assert a[:BS] != b[:BS]                               # no two prompts share a first block
    text = tok.decode(a + b)
    middle = len(text) // 4
    assert len(text) > 200 and text[middle:middle + 40] in corpus()      # the docs' own text
    words = corpus().split()
    p = Passages(seed=2).text(120)
    assert len(p) >= 120 and p in " ".join(words)


async def test_a_serving_level_on_smollm2_is_a_real_conversation(serve) -> None:
    from bench.serving import QUICK, run_level, served_model

    async with serve() as s:
        model = await served_model(s.url)
        assert model == s.engine.model.cfg.model_id
        w = dataclasses.replace(QUICK, model=model, real_text=True, system_chars=120, task_chars=40,
                                observation_chars=40, turns=2, max_tokens=8, serial_agents=1)
        run = await run_level(s.url, w, 1, True, seed=3)
    assert not run.errors and len(run.turns) == 2
    assert all(t.text.strip() for t in run.turns)                # replies are text
    cached, prompt, reply = run.next_turn[0]
    assert reply > 0 and cached >= prompt // BS * BS              # the second turn found the first prompt


def test_the_serving_bound_times_the_checkpoint_served(tmp_path) -> None:
    from bench.serving_bound import for_serving
    from shared.config import MAX_BATCH_TOKENS
    from worker.model.checkpoint import CheckpointError

    def level(requests: int, wall_s: float) -> dict:
        return {"on": {"requests": requests, "wall_s": wall_s, "prompt_tokens": 40 * requests,
                       "completion_tokens": 2 * requests, "cached_fraction": 0.4}}

    # the config's largest budget: the bound's "any budget" timing is then the same one (no third)
    result = {"max_batch_tokens": MAX_BATCH_TOKENS, "model_lanes_resolved": 1, "lane_min_rows": 512,
              "workload": {"levels": [1, 2]}, "c1": level(2, 1.0), "c2": level(2, 1.0), "throughput_c2_vs_c1": 1.0,
              "model_dir": str(smollm2()), "dtype": "float32"}
    out = for_serving(result, quick=True)
    assert out["bound_model_ms_c1"] > 0 and out["throughput_aligned_c2_vs_c1"] > 0
    with pytest.raises(CheckpointError):        # the directory named is the one loaded, not the tiny model
        for_serving({**result, "model_dir": str(tmp_path)}, quick=True)
