"""Shared fixtures for the model tests: the tiny model, a 200-token prompt, its cold run.

The tiny model is overhead-bound: one intra-op thread is faster than several on a shared
machine (spinning worker threads fight other processes for the cores). The setting is
made per module here and restored after, so other test directories keep theirs; the
shared fixtures are module-scoped for the same reason (an autouse fixture runs first only
among fixtures of its own scope).
"""

from __future__ import annotations

import pytest
import torch

from worker.model import ModelConfig, build_model

BLOCK = 16
SEED = 0
PROMPT_SEED = 1234
PROMPT_LEN = 200   # 50 CSA entries (>> top-4, so the indexer really selects), 12 HCA entries


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def prompt(n: int = PROMPT_LEN, seed: int = PROMPT_SEED, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def make_prompt():
    return prompt


@pytest.fixture(scope="module")
def tiny_cfg() -> ModelConfig:
    return ModelConfig()


@pytest.fixture(scope="module")
def tiny(tiny_cfg):
    return build_model(tiny_cfg, seed=SEED)


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return prompt()


@pytest.fixture(scope="module")
def cold_run(tiny, tokens):
    """Block-aligned cold prefill of the prompt: (logits [200, V], exported blocks)."""
    state = tiny.new_state(BLOCK)
    logits = tiny.prefill(tokens, state)
    blocks = [state.export_block(i) for i in range(state.completed_blocks)]
    return logits, blocks
