"""Weights: deterministic seeded initialisation, safetensors load/save, the weights digest.

Tensor names are the Hugging Face ``DeepseekV4ForCausalLM`` checkpoint names
(``model.layers.3.self_attn.compressor.kv_proj.weight``, ``model.layers.0.mlp.gate.tid2eid``,
…), because the modules are named after them; the persistent buffers ``tid2eid`` and
``e_score_correction_bias`` are part of the checkpoint like the parameters.

Initialisation draws every tensor from its own generator seeded by blake2b(seed, name),
so a tensor's values do not depend on which other tensors exist or their order. Scales
keep activations of order one so every path (clamps, sinks, biases) matters, and the
tensors Hugging Face initialises to zero or one (``sinks``, ``position_bias``, mHC
``base``/``scale``, ``e_score_correction_bias``, norm weights) are perturbed so that a
parity test exercises them.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from worker.model.config import ModelConfig
from worker.model.model import HybridAttentionLM
from worker.model.seeding import tensor_generator
# WeightsError stays importable from here (the worker's start-up and the tests name it so).
from worker.model.weight_files import WeightsError, files_of, load_weights

__all__ = ["WeightsError", "build_model", "init_weights", "load_safetensors", "save_safetensors", "weights_digest"]


def _init_tensor(cfg: ModelConfig, name: str, t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(t.shape, generator=g, dtype=torch.float32) * std + mean

    if leaf == "tid2eid":
        V, k = t.shape
        return torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:k] for _ in range(V)])
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if leaf == "sinks":
        return normal(1.0)
    if leaf == "position_bias":
        return normal(0.5)
    if leaf in ("base", "hc_base"):
        return normal(0.5)
    if leaf in ("scale", "hc_scale"):
        return normal(0.1, 1.0)
    if leaf == "e_score_correction_bias":
        return normal(0.1)
    if "norm" in name.rsplit(".", 2)[-2] and leaf == "weight":
        return normal(0.1, 1.0)
    if leaf in ("gate_up_proj", "down_proj") and t.dim() == 3:  # stacked expert weights
        return normal(1.0 / math.sqrt(t.shape[-1]))
    if t.dim() == 2:  # linear weights (incl. mHC fn, grouped o_a_proj): fan-in scaling
        return normal(1.0 / math.sqrt(t.shape[-1]))
    raise AssertionError(f"no init rule for {name} {tuple(t.shape)}")


@torch.no_grad()
def init_weights(model: HybridAttentionLM, seed: int = 0) -> HybridAttentionLM:
    """Fill every checkpoint tensor of ``model`` deterministically from ``seed``."""
    for name, t in model.state_dict().items():
        t.copy_(_init_tensor(model.cfg, name, t, tensor_generator(seed, name)).to(t.dtype))
    return model


def build_model(cfg: ModelConfig | None = None, seed: int = 0) -> HybridAttentionLM:
    """A model with seeded weights, float32, in eval mode."""
    model = HybridAttentionLM(cfg or ModelConfig())
    return init_weights(model, seed).eval()


def save_safetensors(model: HybridAttentionLM, path: str | Path) -> None:
    """Write every checkpoint tensor under its HF name."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(path), metadata={"format": "pt", "model_id": model.cfg.model_id})


def load_safetensors(model: HybridAttentionLM, path: str | Path, *,
                     ignore_prefixes: tuple[str, ...] = ("mtp.",)) -> HybridAttentionLM:
    """Load a checkpoint (one file or a directory of shards) in our own naming into ``model``:
    every model tensor present with its shape, nothing unexpected (except names under
    ``ignore_prefixes``: multi-token-prediction layers, which this model does not instantiate);
    the checks and copies are :func:`worker.model.weight_files.load_weights`'."""
    load_weights(model, files_of(Path(path)), lambda k: (k, None), ignore=lambda k: k.startswith(ignore_prefixes))
    return model


def weights_digest(model: HybridAttentionLM) -> str:
    """32-hex blake2b over every checkpoint tensor's name, shape, dtype and bytes, sorted by name.

    It enters the cache namespace: cached state of one set of weights never matches another.
    """
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().contiguous().cpu()
        h.update(name.encode() + b"\0")
        h.update(repr(tuple(t.shape)).encode() + b"\0" + str(t.dtype).encode() + b"\0")
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
