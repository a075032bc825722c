"""Exact reuse for every family and dtype, through the engine: checkpoints written by
transformers, loaded by ``worker.model.checkpoint``, served with the cache on and compared bit
for bit with a cache-off engine (``torch.equal``, logits and tokens) — at every block boundary.
"""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import save_hf
from tests.worker.conftest import BS, config
from tests.twin import InProcessCoordinator
from worker.engine import Engine
from worker.model.checkpoint import load_checkpoint

pytest.importorskip("transformers")

CASES = [("llama", "float32"), ("llama", "bfloat16"), ("qwen2", "float32"), ("qwen2", "float16"),
         ("qwen3", "bfloat16"), ("deepseek_v4", "float32"), ("deepseek_v4", "bfloat16"),
         ("yoco", "float32"), ("yoco", "bfloat16")]
FORMS = {"deepseek_v4": ("compressed", "indexer", "tail", "swa"), "yoco": ("global_kv", "swa")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}
    for family in ("llama", "qwen2", "qwen3"):
        made[family] = save_hf(family, tmp_path_factory.mktemp(family) / "ckpt", seed=5)
    made["deepseek_v4"] = save_hf("deepseek_v4", tmp_path_factory.mktemp("dsv4") / "ckpt", seed=5)
    # kvledger's own format (there is no transformers class): a window shorter than the prompt
    from worker.model.yoco import YocoConfig, build_yoco
    from worker.model.yoco.checkpoint import save_yoco
    made["yoco"] = save_yoco(build_yoco(YocoConfig(sliding_window=40), seed=5), tmp_path_factory.mktemp("yoco") / "ckpt")
    return made


def same(a, b) -> bool:
    return a.tokens == b.tokens and torch.equal(a.logits, b.logits)


@pytest.mark.parametrize("family,dtype", CASES)
async def test_resume_at_every_block_boundary_is_bit_identical(checkpoints, tmp_path, family, dtype) -> None:
    model = load_checkpoint(checkpoints[family], dtype=dtype).model
    assert str(model.dtype) == f"torch.{dtype}"
    toks = torch.randint(0, model.cfg.vocab_size, (6 * BS + 5,), generator=torch.Generator().manual_seed(9)).tolist()
    cold = Engine(model, config(tmp_path / "cold"), None)
    twin = InProcessCoordinator()
    # every hit read where the pool holds it (the dense family), not only those into new buffers
    engine = Engine(model, config(tmp_path, **{"cache.restore_in_place": "always"}), twin)
    await engine.start()
    try:
        assert engine.catalogue.names == FORMS.get(family, ("kv",))
        first = await engine.generate(toks, max_tokens=3)
        assert first.cached_tokens == 0
        assert same(first, await cold.generate(toks, max_tokens=3))
        for b in range(1, 7):
            # the first b blocks are cached; a different continuation follows them
            probe = toks[:b * BS] + [(t + b) % model.cfg.vocab_size for t in toks[b * BS:b * BS + 7]]
            warm = await engine.generate(probe, max_tokens=3)
            assert warm.cached_tokens == b * BS, (b, warm.cached_tokens, warm.fallbacks)
            assert same(warm, await cold.generate(probe, max_tokens=3)), b
        assert engine.metrics.value("kvl_worker_batch_invariant") == 1
        in_place = engine.metrics.value("kvl_worker_restored_blocks_total", {"how": "in_place"})
        copied = engine.metrics.value("kvl_worker_restored_blocks_total", {"how": "copied"})
        assert in_place + copied == sum(range(1, 7))
        # the dense family reads a hit where the pool holds it wherever the compiled attention serves
        # its dtype; the others copy (their states have no prefix table yet)
        assert (in_place > 0) == (family in ("llama", "qwen2", "qwen3") and dtype != "float16"), (in_place, copied)
        assert engine.metrics.value("kvl_worker_pinned_slots") == 0      # every hold let go with its request
    finally:
        await engine.stop()
        await cold.stop()
    assert not twin.rejected
