"""kvledger's checkpoint format for the YOCO family (there is no transformers class for it).

A directory as ``save_pretrained`` would write one: ``config.json`` with
``architectures: ["YocoForCausalLM"]`` and the fields of :class:`YocoConfig` (RoPE as
``rope_parameters``, as transformers 5 spells it; the vision encoder as a ``vision`` section
with ``image_token_id``), weights in ``model.safetensors`` (or shards with an index) under the
module names of :class:`worker.model.yoco.model.YocoLM`, optionally the tokenizer and chat
template files, and ``kvledger-manifest.json``. :func:`save_yoco` writes one;
``worker.model.checkpoint.load_checkpoint`` reads it like any other family (same refusals of
unknown fields, same digest).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from worker.model.config import ConfigError
from worker.model.config_fields import COMMON_IGNORED, NUM, CheckpointError, Fields, rope_spec, vision_section
from worker.model.yoco.config import YocoConfig
from worker.model.yoco.model import YocoLM

ARCHITECTURE = "YocoForCausalLM"
MODEL_TYPE = "kvledger_yoco"


def yoco_config(doc: Mapping[str, Any], model_id: str) -> YocoConfig:
    """``config.json`` → :class:`YocoConfig`; a field it does not know refuses the start by name."""
    f = Fields(doc, COMMON_IGNORED | {"rope_theta", "rope_scaling"})
    f.require("hidden_act", ("silu",), "silu", "only SwiGLU with silu is implemented")
    kw: dict[str, Any] = {"model_id": model_id, "rope": rope_spec(f, doc), "vision": vision_section(f),
                          "image_token_id": f.get("image_token_id", None, kind=int)}
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_self_decoder_layers",
                 "num_cross_decoder_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "sliding_window", "max_position_embeddings"):
        kw[name] = f.get(name, kind=int)
    kw["rms_norm_eps"] = float(f.get("rms_norm_eps", 1e-6, kind=NUM))
    kw["tie_word_embeddings"] = f.get("tie_word_embeddings", False, kind=bool)
    f.leftover()
    try:
        return YocoConfig(**kw)
    except ConfigError as e:
        raise CheckpointError(f"config.json: {e}") from e


def config_doc(cfg: YocoConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` (what :func:`yoco_config` reads back)."""
    rope = {k: v for k, v in dataclasses.asdict(cfg.rope).items() if v is not None}
    doc: dict[str, Any] = {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "dtype": str(dtype).removeprefix("torch."),
        "hidden_act": "silu", "rope_parameters": rope,
        **{k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_self_decoder_layers",
                                         "num_cross_decoder_layers", "num_attention_heads", "num_key_value_heads",
                                         "head_dim", "sliding_window", "max_position_embeddings", "rms_norm_eps",
                                         "tie_word_embeddings")},
    }
    if cfg.vision is not None:
        doc["vision"] = dataclasses.asdict(cfg.vision)
        doc["image_token_id"] = cfg.image_token_id
    return doc


def save_yoco(model: YocoLM, directory: str | Path) -> Path:
    """Write ``model`` as a checkpoint directory (config.json + model.safetensors); returns it."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.cfg.tie_word_embeddings)}
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(config_doc(model.cfg, model.dtype), indent=2) + "\n")
    return d
