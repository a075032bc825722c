"""Tiny checkpoint directories written by transformers' own ``save_pretrained`` (random weights,
nothing downloaded), for the loader's parity and reuse tests."""

from __future__ import annotations

import functools
import string
from pathlib import Path
from typing import Any

import torch

#: Family → (config class, model class, tiny config fields).
TINY: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    "qwen2": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=512, use_sliding_window=True,
                  sliding_window=24, max_window_layers=1, tie_word_embeddings=True),
    "qwen3": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 128}),
    "deepseek_v4": dict(vocab_size=96, hidden_size=32, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25, q_lora_rank=16, o_groups=2,
                        o_lora_rank=8, sliding_window=16, index_n_heads=4, index_head_dim=16, index_topk=3, hc_mult=2,
                        hc_sinkhorn_iters=5, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], num_nextn_predict_layers=0,
                        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                                     "compressed_sparse_attention"],
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
                        max_position_embeddings=512,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                         "beta_fast": 32.0, "beta_slow": 1.0}),
}


def hf_classes(family: str):
    import transformers as tf
    name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "deepseek_v4": "DeepseekV4"}[family]
    return getattr(tf, f"{name}Config"), getattr(tf, f"{name}ForCausalLM")


def save_hf(family: str, directory: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
            max_shard_size: str | None = None, **over: Any) -> Path:
    """``<Family>ForCausalLM(config).save_pretrained(directory)`` with seeded random weights."""
    config_cls, model_cls = hf_classes(family)
    cfg = config_cls(**{**TINY.get(family, {}), **over})
    torch.manual_seed(seed)
    model = model_cls(cfg).to(dtype).eval()
    with torch.no_grad():   # transformers zero-initialises biases and some V4 tensors: perturb them all
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if p.dtype.is_floating_point and (p.abs().max() == 0 or name.endswith("norm.weight")):
                p.add_((torch.randn(p.shape, generator=g) * 0.1).to(dtype))
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kw)
    return directory


# --- the text side: a tiny tokenizer saved by transformers -----------------------------------------

SPECIALS = ["<unk>", "<s>", "</s>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]


@functools.cache
def trained_tokenizer() -> str:
    """A character-level BPE (printable ASCII, a few merges, the special tokens) as JSON."""
    from tokenizers import Tokenizer, decoders, models, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS, initial_alphabet=list(string.printable))
    tok.train_from_iterator(["You are a helpful assistant. Hello! How are you? The ledger records every block.\n"] * 4,
                            trainer)
    return tok.to_str()


def save_tokenizer(d: Path, *, bos: str | None, eos: str, template: Any = None, jinja_files: bool = True,
          gen: dict[str, Any] | None = None, added: tuple[str, ...] = (), **tokens: str) -> Path:
    """``added``: special tokens appended to the vocabulary (ids from 200 on; e.g. an image token)."""
    from tokenizers import Tokenizer, processors
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    tok = Tokenizer.from_str(trained_tokenizer())
    if added:
        tok.add_special_tokens(list(added))
    if bos is not None:     # Llama's tokenizer.json adds BOS in its post-processor
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, chat_template=template, **tokens)
    fast.save_pretrained(d, save_jinja_files=jinja_files)
    if gen is not None:
        GenerationConfig(**gen).save_pretrained(d)
    return d


def token_id(token: str) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(trained_tokenizer()).token_to_id(token)


# --- a vision encoder beside a dense checkpoint ------------------------------------------------------

def add_vision(d: Path, *, image_token_id: int, seed: int = 0, **sizes: Any) -> Path:
    """Give the dense checkpoint in ``d`` kvledger's vision encoder: ``config.json``'s ``vision``
    section and ``image_token_id``, and seeded ``vision.*`` weights in ``vision.safetensors``."""
    import dataclasses
    import json
    import math

    from safetensors.torch import save_file

    from worker.model.vision import VisionConfig, VisionEncoder

    doc = json.loads((d / "config.json").read_text())
    vc = VisionConfig(**sizes)
    enc = VisionEncoder(vc, doc["hidden_size"])
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, t in enc.state_dict().items():
        if name == "norm.weight":
            v = torch.randn(t.shape, generator=g) * 0.1 + 1.0
        elif name.endswith("bias"):
            v = torch.randn(t.shape, generator=g) * 0.1
        else:
            v = torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-1])
        tensors[f"vision.{name}"] = v.contiguous()
    save_file(tensors, str(d / "vision.safetensors"))
    doc["vision"] = dataclasses.asdict(vc)
    doc["image_token_id"] = image_token_id
    (d / "config.json").write_text(json.dumps(doc, indent=2))
    return d
