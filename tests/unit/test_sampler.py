"""The sampler's logit processing and log probabilities, pure (OpenAI's and vLLM's definitions)."""

from __future__ import annotations

import torch

from worker.generation import Sampler, SamplingParams


def test_no_processing_leaves_the_logits_bit_for_bit() -> None:
    x = torch.randn(32)
    assert torch.equal(Sampler(SamplingParams()).process(x), x)


def test_logit_bias_and_penalties_follow_their_definitions() -> None:
    x = torch.tensor([2.0, -1.0, 0.5, 3.0, 1.0])
    p = SamplingParams(logit_bias=((4, 10.0),), repetition_penalty=2.0, presence_penalty=0.5,
                       frequency_penalty=0.25)
    s = Sampler(p, prompt=[0, 1])
    got = s.process(x)
    # bias on 4; repetition over the prompt's 0 and 1: positive divided, negative multiplied
    assert got.tolist() == [1.0, -2.0, 0.5, 3.0, 11.0]
    assert s.pick(x) == 4                      # greedy over the processed logits
    s.pick(x)                                  # 4 twice in the output now
    got = s.process(x)
    # 4: biased to 11, then repetition (it is in the output) 5.5, minus 0.25 × 2 + 0.5
    assert got[4].item() == 11.0 / 2 - (0.25 * 2 + 0.5)


def test_min_tokens_masks_the_stop_tokens_until_reached() -> None:
    x = torch.tensor([0.0, 5.0, 1.0])
    s = Sampler(SamplingParams(min_tokens=2), stop_token_ids=[1])
    assert [s.pick(x), s.pick(x), s.pick(x)] == [2, 2, 1]


def test_logprobs_are_the_log_softmax_of_the_processed_logits() -> None:
    x = torch.randn(50)
    s = Sampler(SamplingParams(logprobs=3, logit_bias=((7, 5.0),)))
    tok = s.pick(x)
    want = torch.log_softmax(torch.where(torch.arange(50) == 7, x + 5.0, x), -1)
    assert s.last is not None and s.last.token == tok == int(torch.argmax(want))
    assert s.last.logprob == float(want[tok])
    assert [t for t, _ in s.last.top] == torch.topk(want, 3).indices.tolist()
    assert s.last.top[0][1] == s.last.logprob


def test_min_p_keeps_only_tokens_near_the_top() -> None:
    x = torch.tensor([4.0, 3.9, -5.0, -6.0])
    picks = {Sampler(SamplingParams(temperature=1.0, min_p=0.5, seed=k)).pick(x) for k in range(40)}
    assert picks == {0, 1}
    picks = {Sampler(SamplingParams(temperature=1.0, min_p=1.0, seed=k)).pick(x) for k in range(10)}
    assert picks == {0}


def test_the_repetition_penalty_covers_the_prompt_and_every_output_token_so_far() -> None:
    """The penalised ids are kept between steps (rebuilt only when a new token joins); every
    step's processed logits must still equal a from-scratch application over prompt ∪ output."""
    g = torch.Generator().manual_seed(3)
    vocab, rp = 97, 1.7
    prompt = torch.randint(0, vocab, (60,), generator=g).tolist()
    s = Sampler(SamplingParams(temperature=1.0, seed=5, repetition_penalty=rp, frequency_penalty=0.1), prompt=prompt)
    out: list[int] = []
    for _ in range(40):
        x = torch.randn(vocab, generator=g)
        want = x.clone()
        idx = torch.tensor(sorted(set(prompt) | set(out)))
        v = want[idx]
        want[idx] = torch.where(v > 0, v / rp, v * rp)
        for tok in set(out):
            want[tok] -= 0.1 * out.count(tok)
        assert torch.equal(s.process(x), want)
        out.append(s.pick(x))
    assert len(set(out) - set(prompt)) > 0        # tokens outside the prompt joined on the way


def _stable_sort_nucleus(probs: torch.Tensor, top_p: float, mass: float) -> torch.Tensor:
    """The nucleus as the sampler first computed it: a stable sort of the whole vocabulary."""
    sorted_p, idx = torch.sort(probs, descending=True, stable=True)
    keep = (torch.cumsum(sorted_p, 0) - sorted_p) < top_p * mass
    return torch.zeros_like(probs).scatter(0, idx, sorted_p * keep)


def test_the_nucleus_keeps_exactly_what_a_stable_sort_keeps() -> None:
    """Ties (rounded logits), zeros (min_p, masked tokens), flat and peaked distributions, heads
    past the first top-k and past an eighth of the vocabulary: the same tokens, the same values."""
    from worker.generation import nucleus

    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        n = int(torch.randint(1, 5000, (1,), generator=g))
        x = torch.randn(n, generator=g) * float(torch.rand(1, generator=g) * 8)
        if trial % 3 == 0:
            x = torch.round(x)
        if trial % 5 == 0:
            x[torch.rand(n, generator=g) < 0.5] = float("-inf")
            x[0] = 0.0
        probs = torch.softmax(x, -1)
        if trial % 4 == 0:
            probs = torch.where(probs < 0.3 * probs.max(), torch.zeros_like(probs), probs)
        mass = float(probs.sum())
        for top_p in (0.01, 0.3, 0.9, 0.999, 1.0 - 1e-9):
            assert torch.equal(nucleus(probs, top_p, mass), _stable_sort_nucleus(probs, top_p, mass)), (trial, top_p)


def test_a_draw_follows_the_probabilities_never_picks_a_zero_and_repeats_with_its_generator() -> None:
    import pytest

    from worker.generation import draw

    probs = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0])
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(5)
    for _ in range(20_000):
        counts[draw(probs, g)] += 1
    assert counts[1] == counts[4] == 0
    assert torch.allclose(counts / 20_000, probs, atol=0.015)
    # the same generator state, the same token; unnormalised weights draw the same as normalised
    a = [draw(probs * 3, torch.Generator().manual_seed(k)) for k in range(50)]
    assert a == [draw(probs, torch.Generator().manual_seed(k)) for k in range(50)]
    for bad in (torch.zeros(4), torch.tensor([0.5, float("nan")]), torch.tensor([float("inf"), 1.0])):
        with pytest.raises(ValueError, match="cannot sample"):
            draw(bad, g)
