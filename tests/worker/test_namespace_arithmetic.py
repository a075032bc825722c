"""The namespace sees what the model code computes, not only its weights and versions.

A build whose arithmetic changed (an op that rounds another way) without a ``KERNEL_ABI_VERSION``
bump must not reuse blocks the old build wrote: the engine hashes a digest of a seeded
forward's logits and payloads (``CausalLM.arithmetic_digest``) into its namespace. The same
code, weights and machine must agree on it in every process (workers share a directory), and a
model that computes other bits on two identical runs keeps its blocks to itself."""

from __future__ import annotations

import subprocess
import sys

import torch

from tests.worker.conftest import BS, config
from worker.engine import Engine
from worker.model import build_model
from worker.model.norms import RMSNorm
from worker.selfcheck import self_check


def test_the_digest_follows_the_weights_and_the_storage_precision_and_is_memoised() -> None:
    a, b = build_model(seed=0), build_model(seed=0)
    digest = a.arithmetic_digest(BS)
    assert len(digest) == 32 and digest == b.arithmetic_digest(BS)
    assert build_model(seed=1).arithmetic_digest(BS) != digest
    assert a.arithmetic_digest(BS, "bfloat16") != digest
    assert a.arithmetic_digest(2 * BS) != digest
    # batch-invariant ops: a unit's bits do not depend on how the prompt was cut, so the digest
    # runs it as one unit, and engines with other prefill units share blocks
    assert a.batch_invariant and a.arithmetic_digest(BS, chunk_blocks=2) == digest
    assert {a._arithmetic_run(BS, None, units) for units in (None, 1, 2)} == {digest}
    a._arithmetic_run = None   # a second call must not run anything
    assert a.arithmetic_digest(BS) == digest


def test_every_process_computes_the_same_digest() -> None:
    here = build_model(seed=0).arithmetic_digest(BS)
    code = ("import torch; torch.set_num_threads(1)\n"
            "from worker.model import build_model\n"
            f"print(build_model(seed=0).arithmetic_digest({BS}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == here


def test_a_changed_op_changes_the_namespace_with_the_same_weights(tmp_path, monkeypatch) -> None:
    before = Engine(build_model(seed=0), config(tmp_path / "a"), None)

    def divided(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        # the same value, rounded another way: x / sqrt(ms + eps) instead of x * rsqrt(ms + eps)
        xf = x.float()
        return (self.weight * (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)

    monkeypatch.setattr(RMSNorm, "forward", divided)
    after = Engine(build_model(seed=0), config(tmp_path / "b"), None)
    assert after.arithmetic and after.arithmetic != before.arithmetic
    assert after.namespace != before.namespace
    monkeypatch.undo()
    again = Engine(build_model(seed=0), config(tmp_path / "c"), None)
    assert (again.arithmetic, again.namespace) == (before.arithmetic, before.namespace)
    assert self_check(again).arithmetic == again.arithmetic


def test_a_model_that_differs_run_to_run_keeps_its_blocks_to_itself(tmp_path, monkeypatch) -> None:
    def noisy(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x.float() * (1 + 1e-3 * torch.rand(()))).to(x.dtype)

    monkeypatch.setattr(RMSNorm, "forward", noisy)
    model = build_model(seed=0)
    assert model.arithmetic_digest(BS) == ""
    one, two = (Engine(model, config(tmp_path / n), None) for n in ("a", "b"))
    assert one.arithmetic == "" and self_check(one).arithmetic == ""
    assert one.namespace != two.namespace   # not even another engine of this process shares them


def test_the_vision_encoder_is_part_of_the_digest(monkeypatch) -> None:
    from worker.model.dense import DenseConfig, build_dense
    from worker.model.vision import VisionConfig, VisionEncoder

    def vlm():
        return build_dense(DenseConfig(vision=VisionConfig(image_size=32, patch_size=8), image_token_id=255), seed=7)

    digest = vlm().arithmetic_digest(BS)
    assert digest and vlm().arithmetic_digest(BS) == digest
    forward = VisionEncoder.forward
    # the encoder's output rounded another way; the text path (no image) is untouched
    monkeypatch.setattr(VisionEncoder, "forward", lambda self, px: forward(self, px) * (1 + 2 ** -20))
    assert vlm().arithmetic_digest(BS) not in ("", digest)


def test_the_digest_reaches_the_window_and_the_indexers_selection(monkeypatch) -> None:
    """A prompt shorter than the indexer's selection reads every compressed entry, so an op that
    only decides *which* entries a query reads never ran in the digest: here, an off-by-one at
    the top-k cutoff (the (k+1)-th best replaces the k-th), which a two-block prompt does not see
    with ``index_topk`` 12 and the digest's own prompt does."""
    import worker.model.indexer as indexer
    from worker.model.config import ModelConfig

    cfg = ModelConfig(index_topk=12)
    reach = max(cfg.sliding_window, cfg.index_topk * cfg.csa_ratio)
    assert build_model(cfg, seed=0).arithmetic_prompt_tokens(BS) > reach > 2 * BS + 3
    assert build_model(seed=0).arithmetic_prompt_tokens(BS) > ModelConfig().sliding_window
    # capped by the positions (whole blocks, with room for the next token), and still computable
    capped = build_model(ModelConfig(index_topk=12, max_position_embeddings=reach), seed=0)
    assert capped.arithmetic_prompt_tokens(BS) == (reach - 1) // BS * BS
    assert len(capped.arithmetic_digest(BS)) == 32

    def digests() -> tuple[str, str]:
        full, short = build_model(cfg, seed=0), build_model(cfg, seed=0)
        short.arithmetic_prompt_tokens = lambda bs: 2 * bs + 3       # stop 40's prompt
        return full.arithmetic_digest(BS), short.arithmetic_digest(BS)

    full, short = digests()
    select = indexer.indexer_topk_many

    def off_by_one(parts, ratio: int, topk: int) -> torch.Tensor:
        picks, more = select(parts, ratio, topk), select(parts, ratio, topk + 1)
        over = more[:, topk] >= 0                   # rows with more visible entries than topk
        picks[over, topk - 1] = more[over, topk]
        return picks

    monkeypatch.setattr(indexer, "indexer_topk_many", off_by_one)
    changed_full, changed_short = digests()
    assert changed_short == short                   # the gap the longer prompt closes
    assert changed_full not in ("", full)
