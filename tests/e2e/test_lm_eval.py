"""The lm-eval harness against a running stack: its ``local-completions`` model scores a small
multiple-choice log-likelihood task from a local file with ``echo`` + ``logprobs`` completions
(through the gateway, prefix cache on), and every score equals the one computed from the model
directly (``bench.lm_eval_loglikelihood`` does the work; this asserts what it measures)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench.lm_eval_loglikelihood import main

pytestmark = pytest.mark.timeout(600)


def test_lm_eval_scores_equal_the_models_own_loglikelihoods() -> None:
    lm_eval = Path(sys.executable).parent / "lm_eval"
    assert lm_eval.exists(), "lm-eval is a test dependency: run make install"
    r = main(str(lm_eval))
    assert r["questions"] == 12 and r["loglikelihoods"] == 36
    assert r["loglikelihoods_equal"] and r["max_abs_diff"] == 0.0
    assert r["lm_eval_acc"] == r["direct_acc"]
    assert r["worker_cached_prompt_tokens"] > 0          # the choices of a question shared their context
