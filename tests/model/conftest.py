"""Shared fixtures for the model tests: the tiny model, a 200-token prompt, its cold run.

The tiny model is overhead-bound; one intra-op thread is faster than two on a shared
machine and keeps timings steady.
"""

from __future__ import annotations

import pytest
import torch

from worker.model import ModelConfig, build_model

torch.set_num_threads(1)

BLOCK = 16
SEED = 0
PROMPT_SEED = 1234
PROMPT_LEN = 200   # 50 CSA entries (>> top-4, so the indexer really selects), 12 HCA entries


def prompt(n: int = PROMPT_LEN, seed: int = PROMPT_SEED, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="session")
def make_prompt():
    return prompt


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
    return ModelConfig()


@pytest.fixture(scope="session")
def tiny(tiny_cfg):
    return build_model(tiny_cfg, seed=SEED)


@pytest.fixture(scope="session")
def tokens() -> torch.Tensor:
    return prompt()


@pytest.fixture(scope="session")
def cold_run(tiny, tokens):
    """Block-aligned cold prefill of the prompt: (logits [200, V], exported blocks)."""
    state = tiny.new_state(BLOCK)
    logits = tiny.prefill(tokens, state)
    blocks = [state.export_block(i) for i in range(state.completed_blocks)]
    return logits, blocks
