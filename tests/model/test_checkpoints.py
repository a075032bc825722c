"""Checkpoints as transformers writes them: load, parity with transformers, refusals.

Every directory here is written by transformers' own ``save_pretrained`` (tiny configs, seeded
random weights). Parity compares our logits with the transformers model built from the same
directory, float32, prefill and 16 decode steps through each side's cache, within 1e-4.

DeepSeek-V4's indexer keeps the top-k of scores that tie often (a ReLU of dot products): ours
breaks ties toward the lower entry, transformers' ``Tensor.topk`` in no defined order. The
reference is made deterministic by a stable top-k inside the test (``stable_topk``), never by
a looser tolerance.
"""

from __future__ import annotations

import contextlib
import json
from collections import namedtuple

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.checkpoints import save_hf  # noqa: E402
from worker.model import build_model  # noqa: E402
from worker.model.checkpoint import CheckpointError, load_checkpoint  # noqa: E402
from worker.model.hf_compat import to_hf_model  # noqa: E402
from worker.model.weights import WeightsError  # noqa: E402

TOL = 1e-4
DECODE = 16
_TopK = namedtuple("_TopK", "values indices")


@contextlib.contextmanager
def stable_topk():
    """``Tensor.topk`` that keeps the lower index among equal values (kvledger's tie rule)."""
    original = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):  # noqa: A002 - torch's own parameter name
        idx = torch.sort(self, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
        return _TopK(self.gather(dim, idx), idx)

    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = original


def hf_logits(directory, tokens: torch.Tensor, split: int) -> torch.Tensor:
    """transformers: prefill ``tokens[:split]``, then one token at a time through its cache."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    cache = transformers.DynamicCache(config=hf.config)
    with torch.no_grad(), stable_topk():
        out = [hf(tokens[None, :split], past_key_values=cache, use_cache=True).logits[0]]
        for i in range(split, len(tokens)):
            out.append(hf(tokens[None, i:i + 1], past_key_values=cache, use_cache=True).logits[0])
    return torch.cat(out)


def our_logits(model, tokens: torch.Tensor, split: int) -> torch.Tensor:
    state = model.new_state(16, 512)
    out = [model.prefill(tokens[:split], state)]
    out += [model.decode_step(t, state)[None] for t in tokens[split:]]
    return torch.cat(out)


def check_parity(directory, vocab: int, seed: int, n: int = 72) -> None:
    tokens = torch.randint(0, vocab, (n + DECODE,), generator=torch.Generator().manual_seed(seed))
    loaded = load_checkpoint(directory)
    assert loaded.dtype == torch.float32
    ours = our_logits(loaded.model, tokens, n)
    ref = hf_logits(directory, tokens, n)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < TOL


DENSE_CASES = [
    ("llama", {}),                                                      # llama3 RoPE, GQA 4:2
    ("llama", {"attention_bias": True, "mlp_bias": True, "rope_parameters": {"rope_type": "linear",
                                                                             "rope_theta": 10000.0, "factor": 2.0}}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    ("qwen2", {}),                                                      # q/k/v biases, sliding layers, tied
    ("qwen2", {"use_sliding_window": False, "tie_word_embeddings": False}),
    ("qwen3", {}),                                                      # QK-norm, YaRN RoPE
    ("qwen3", {"attention_bias": True, "use_sliding_window": True, "sliding_window": 20, "max_window_layers": 1}),
]


@pytest.mark.parametrize("family,over", DENSE_CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(DENSE_CASES)])
@pytest.mark.parametrize("seed", [0, 1])
def test_dense_parity_with_transformers(tmp_path, family, over, seed) -> None:
    d = save_hf(family, tmp_path / "ckpt", seed=seed, **over)
    loaded = load_checkpoint(d)
    assert loaded.family == family and loaded.model.cfg.family == family
    check_parity(d, loaded.model.cfg.vocab_size, seed)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_deepseek_v4_parity_with_transformers(tmp_path, seed) -> None:
    d = save_hf("deepseek_v4", tmp_path / "ckpt", seed=seed)
    names = set(json.loads((d / "config.json").read_text()))
    assert {"layer_types", "compress_rates", "rope_parameters"} <= names
    loaded = load_checkpoint(d)
    cfg = loaded.model.cfg
    assert loaded.family == "deepseek_v4"
    assert cfg.compress_ratios == (0, 4, 16, 4) and cfg.csa_ratio == 4 and cfg.qk_rope_head_dim == 8
    assert cfg.compress_rope_scaling is not None      # the compress table's YaRN, from rope_parameters
    check_parity(d, cfg.vocab_size, seed, n=80)


def test_deepseek_v4_round_trip_is_exact(tmp_path, tiny) -> None:
    """Our model → transformers (in memory) → save_pretrained (original names) → our loader:
    every tensor comes back bit for bit, so the original-name table is complete and exact."""
    to_hf_model(tiny).save_pretrained(tmp_path)
    with open(tmp_path / "model.safetensors", "rb") as f:
        assert b"head.weight" in f.read(1 << 16)      # written under the original names
    loaded = load_checkpoint(tmp_path).model
    assert loaded.cfg.compress_ratios == tiny.cfg.compress_ratios
    ours, theirs = tiny.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_sharded_checkpoint_loads(tmp_path) -> None:
    d = save_hf("llama", tmp_path / "ckpt", max_shard_size="40KB")
    assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("*.safetensors"))) > 1
    check_parity(d, 128, 0, n=20)


def test_dtype_from_config_and_override(tmp_path) -> None:
    d = save_hf("qwen3", tmp_path / "ckpt", dtype=torch.bfloat16)
    assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load_checkpoint(d)
    assert loaded.dtype == torch.bfloat16 and loaded.model.dtype == torch.bfloat16
    assert loaded.model.new_state(16, 64).layouts["kv"].spec.dtype == "bfloat16"
    assert load_checkpoint(d, dtype="float32").model.dtype == torch.float32
    with pytest.raises(CheckpointError, match="worker.dtype"):
        load_checkpoint(d, dtype="float64")


def test_deepseek_v4_computes_in_the_dtype_asked_for(tmp_path, tiny) -> None:
    to_hf_model(tiny).save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path, dtype="bfloat16").model
    assert model.dtype == torch.bfloat16 and model.model.layers[2].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    # cached forms keep float32 storage (exact for bfloat16 values); the namespace carries the dtype
    assert model.new_state(16, 64).layouts["compressed"].spec.dtype == "float32"
    assert model.model.layers[0].mlp.gate.tid2eid.dtype == torch.long


def _edit(d, **changes):
    doc = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is ...:
            doc.pop(k, None)
        else:
            doc[k] = v
    (d / "config.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("changes,message", [
    ({"architectures": ["MistralForCausalLM"]}, "architectures"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}, "rope_type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "wobbly", "rope_theta": 10000.0}}, "rope_type 'wobbly'"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"pretraining_tp": 2}, "pretraining_tp"),
    ({"frobnicate": 3}, "frobnicate"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"dtype": "float8_e4m3fn"}, "dtype"),
    ({"vocab_size": "many"}, "vocab_size"),
])
def test_what_cannot_run_is_refused_by_name(tmp_path, changes, message) -> None:
    d = save_hf("llama", tmp_path / "ckpt")
    _edit(d, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(d)


def test_missing_and_unexpected_tensors_are_named(tmp_path) -> None:
    from safetensors.torch import load_file, save_file
    d = save_hf("qwen3", tmp_path / "ckpt")
    tensors = load_file(d / "model.safetensors")
    tensors.pop("model.layers.1.self_attn.k_norm.weight")
    tensors["model.layers.1.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(WeightsError, match=r"k_norm.*extra|missing.*k_norm"):
        load_checkpoint(d)


def test_native_directory_still_loads_and_its_scaling_object_is_read(tmp_path) -> None:
    from worker.model import save_safetensors
    model = build_model(seed=3)
    save_safetensors(model, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_id": "mine", "compress_rope_scaling": {"factor": 16.0, "original_max_position_embeddings": 65536,
                                                      "beta_fast": 32.0, "beta_slow": 1.0}}))
    loaded = load_checkpoint(tmp_path).model
    assert loaded.cfg.model_id == "mine" and loaded.family == "deepseek_v4"
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    (tmp_path / "config.json").write_text(json.dumps({"model_id": "mine", "compress_ratio": [0] * 6}))
    with pytest.raises(CheckpointError, match="compress_ratio"):
        load_checkpoint(tmp_path)


def test_older_config_spellings_load_to_the_same_model(tmp_path) -> None:
    """transformers 4.x wrote ``torch_dtype``, a top-level ``rope_theta`` and ``rope_scaling``
    (``type`` or ``rope_type``); those directories load to the same model as 5.x's."""
    d = save_hf("llama", tmp_path / "ckpt")
    new = load_checkpoint(d).model
    doc = json.loads((d / "config.json").read_text())
    rope = doc.pop("rope_parameters")
    doc["rope_theta"] = rope.pop("rope_theta")
    doc["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    doc["torch_dtype"] = doc.pop("dtype")
    (d / "config.json").write_text(json.dumps(doc))
    old = load_checkpoint(d).model
    assert old.cfg == new.cfg
    tokens = torch.arange(40) % 128
    assert torch.equal(our_logits(old, tokens, 32), our_logits(new, tokens, 32))
