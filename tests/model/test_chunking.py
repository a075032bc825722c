"""Chunking invariance: any split of the prompt into forwards gives the same logits.

Different splits run different operations (row counts, window gathers, ring reads), so
they agree within float32 tolerance, not bit for bit. The block-aligned schedule is
checked bit for bit against itself in test_resume.py.
"""

from __future__ import annotations

import random

import pytest
import torch

TOL = 1e-4
BLOCK = 16


def run_chunks(model, tokens, sizes) -> torch.Tensor:
    state = model.new_state(BLOCK)
    out, s = [], 0
    for n in sizes:
        out.append(model.extend(tokens[s:s + n], state))
        s += n
    assert s == len(tokens) and state.pos == len(tokens)
    return torch.cat(out)


def split(total: int, size: int) -> list[int]:
    return [size] * (total // size) + ([total % size] if total % size else [])


@pytest.fixture(scope="module")
def one_chunk(tiny, tokens) -> torch.Tensor:
    return run_chunks(tiny, tokens, [len(tokens)])


def test_one_chunk_matches_block_prefill(one_chunk, cold_run) -> None:
    assert (one_chunk - cold_run[0]).abs().max().item() < TOL


@pytest.mark.parametrize("size", [3, 7, 16, 17, 33])
def test_fixed_chunk_sizes(tiny, tokens, one_chunk, size) -> None:
    got = run_chunks(tiny, tokens, split(len(tokens), size))
    assert (got - one_chunk).abs().max().item() < TOL


def test_random_chunk_sizes(tiny, tokens, one_chunk) -> None:
    rng = random.Random(7)
    sizes, left = [], len(tokens)
    while left:
        sizes.append(min(left, rng.randint(1, 40)))
        left -= sizes[-1]
    got = run_chunks(tiny, tokens, sizes)
    assert (got - one_chunk).abs().max().item() < TOL


def test_token_by_token_decode(tiny, tokens, one_chunk) -> None:
    state = tiny.new_state(BLOCK)
    got = torch.stack([tiny.decode_step(t, state) for t in tokens])
    assert (got - one_chunk).abs().max().item() < TOL


def test_prefill_with_larger_units_stays_within_tolerance(tiny, tokens, cold_run) -> None:
    for k in (2, 5):
        state = tiny.new_state(BLOCK)
        assert (tiny.prefill(tokens, state, chunk_blocks=k) - cold_run[0]).abs().max().item() < TOL
