"""Load a checkpoint directory as ``transformers`` ``save_pretrained`` writes it.

``load_checkpoint(directory)`` reads ``config.json``, picks the family from ``architectures``
(``DeepseekV4ForCausalLM`` → :class:`HybridAttentionLM`; ``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` → :class:`DenseLM`; kvledger's ``YocoForCausalLM`` →
:class:`worker.model.yoco.YocoLM`), maps the config's fields onto
the family's config, loads ``model.safetensors`` or the shards of
``model.safetensors.index.json`` under the names of :mod:`worker.model.hf_names`, casts to the
dtype it will compute in, and records the directory's digest (:mod:`shared.manifest`).
A directory of kvledger's own format (a ``config.json`` of :class:`ModelConfig` fields, no
``architectures``) still loads.

Nothing is silently defaulted: every field of ``config.json`` is either mapped, checked to
hold the one value this implementation runs (``hidden_act: silu``, ``pretraining_tp: 1`` …),
or listed as not changing what the model computes (token ids, training-only knobs, metadata).
Anything else — another architecture, an unknown RoPE type, quantised weights, a field we do
not know — refuses to start with :class:`CheckpointError` naming the field and its value.

A dense checkpoint may add kvledger's vision encoder (:mod:`worker.model.vision`): a ``vision``
section in ``config.json`` (``image_size``, ``patch_size``, ``hidden_size``, ``num_channels``,
``rms_norm_eps``; an unknown field is refused) with a top-level ``image_token_id``, and its
weights under ``vision.*`` in any of the safetensors files. Both are in the directory's digest,
so a changed encoder never reuses cached blocks.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from shared.manifest import checkpoint_digest
from worker.model.config import ConfigError, ModelConfig, YarnScaling
# CheckpointError and DTYPES stay importable from here (the worker's start-up and the tests name them so).
from worker.model.config_fields import COMMON_IGNORED, NUM, CheckpointError, Fields, field_error, rope_spec, vision_section
from worker.model.dense.config import FULL, SLIDING, DenseConfig
from worker.model.dense.model import DenseLM
from worker.model.hf_names import DSV4_IGNORED, dsv4_target
from worker.model.lm import CausalLM
from worker.model.model import HybridAttentionLM
from worker.model.weight_files import DTYPES, load_weights, weight_files
from worker.model.yoco.checkpoint import yoco_config
from worker.model.yoco.model import YocoLM

ARCHITECTURES = {"DeepseekV4ForCausalLM": "deepseek_v4", "LlamaForCausalLM": "llama",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 # kvledger's own format for the YOCO family (worker.model.yoco.checkpoint)
                 "YocoForCausalLM": "yoco"}

def read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json in the model directory") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return doc


def family_of(doc: Mapping[str, Any]) -> str:
    """``deepseek_v4``, ``llama``, ``qwen2``, ``qwen3``, or ``kvledger`` (our own format)."""
    archs = doc.get("architectures")
    if archs is None and "model_type" not in doc:
        return "kvledger"
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise field_error("architectures", archs, f"not supported; supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[archs[0]]


def checkpoint_dtype(doc: Mapping[str, Any]) -> torch.dtype:
    name = doc.get("dtype", doc.get("torch_dtype", "float32"))
    if name not in DTYPES:
        raise field_error("dtype" if "dtype" in doc else "torch_dtype", name,
                   f"not supported; use one of {', '.join(DTYPES)} (quantised weights are not supported)")
    return DTYPES[name]


# ---- the dense families ----------------------------------------------------------------------------

DENSE_IGNORED = COMMON_IGNORED | {"max_window_layers", "use_sliding_window", "rope_scaling", "rope_theta",
                                  "partial_rotary_factor"}


def dense_config(doc: Mapping[str, Any], family: str, model_id: str) -> DenseConfig:
    f = Fields(doc, DENSE_IGNORED)
    f.require("hidden_act", ("silu",), "silu", "only SwiGLU with silu is implemented")
    f.require("pretraining_tp", (1,), 1, "tensor-parallel pretraining slices (pretraining_tp > 1) are not implemented")
    f.require("attn_logit_softcapping", (None,), None, "logit soft-capping is not implemented")
    f.require("final_logit_softcapping", (None,), None, "logit soft-capping is not implemented")
    f.require("quantization_config", (None,), None, "quantised checkpoints are not supported")
    f.require("mlp_bias", (False,), False, "not supported for this family") if family != "llama" else None
    heads = f.get("num_attention_heads", kind=int)
    hidden = f.get("hidden_size", kind=int)
    layers = f.get("num_hidden_layers", kind=int)
    attention_bias = f.get("attention_bias", False, kind=bool)
    if family == "qwen2" and "attention_bias" in doc:
        raise field_error("attention_bias", doc["attention_bias"], "Qwen2 always has q/k/v biases and no o bias")
    sliding = bool(doc.get("use_sliding_window", False))
    window = f.get("sliding_window", 0, kind=int)
    types = doc.get("layer_types")
    f.used.add("layer_types")
    if types is None:
        # transformers' rule when the config names no layer types (Qwen2/Qwen3): with
        # use_sliding_window, layers from max_window_layers on slide.
        first = int(doc.get("max_window_layers", layers)) if sliding else layers
        types = [SLIDING if i >= first else FULL for i in range(layers)]
    if not isinstance(types, list) or any(t not in (FULL, SLIDING) for t in types):
        raise field_error("layer_types", types, f"expected a list of {FULL!r} / {SLIDING!r}")
    if SLIDING in types and not sliding and family != "llama":
        types = [FULL] * layers   # transformers ignores layer types' windows without use_sliding_window
    if SLIDING in types and family == "llama":
        raise field_error("layer_types", types, "Llama has no sliding-window layers")
    try:
        cfg = DenseConfig(
            model_id=model_id, family=family, vocab_size=f.get("vocab_size", kind=int), hidden_size=hidden,
            intermediate_size=f.get("intermediate_size", kind=int), num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=f.get("num_key_value_heads", heads, kind=int),
            head_dim=f.get("head_dim", hidden // heads, kind=int), rms_norm_eps=f.get("rms_norm_eps", 1e-6, kind=NUM),
            max_position_embeddings=f.get("max_position_embeddings", kind=int),
            tie_word_embeddings=f.get("tie_word_embeddings", False, kind=bool),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family == "qwen2" else attention_bias,
            mlp_bias=f.get("mlp_bias", False, kind=bool), qk_norm=family == "qwen3",
            layer_types=tuple(types), sliding_window=window if SLIDING in types else 0,
            rope=rope_spec(f, doc), vision=vision_section(f), image_token_id=f.get("image_token_id", None, kind=int))
    except CheckpointError:
        raise
    except ConfigError as e:
        raise CheckpointError(f"config.json: {e}") from e
    f.leftover()
    return cfg

# ---- DeepSeek-V4 -----------------------------------------------------------------------------------

CSA, HCA, SWA_TYPE = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
DSV4_IGNORED_FIELDS = COMMON_IGNORED | {"router_aux_loss_coef", "router_jitter_noise", "output_router_logits",
                                        "num_nextn_predict_layers", "rope_theta", "compress_rope_theta"}
#: DeepSeek-V4 fields that are ours under the same name.
DSV4_SAME = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
             "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
             "hc_mult", "hc_sinkhorn_iters", "hc_eps", "n_routed_experts", "num_experts_per_tok",
             "n_shared_experts", "moe_intermediate_size", "scoring_func", "routed_scaling_factor",
             "swiglu_limit", "rms_norm_eps", "max_position_embeddings")


def _dsv4_rope(f: Fields, doc: Mapping[str, Any], head_dim: int) -> dict[str, Any]:
    prf = f.get("partial_rotary_factor", kind=NUM)
    rope_dims = head_dim * prf
    if rope_dims != int(rope_dims):
        raise field_error("partial_rotary_factor", prf, f"head_dim {head_dim} × factor is not a whole number of dims")
    out: dict[str, Any] = {"qk_rope_head_dim": int(rope_dims)}
    stated = f.get("qk_rope_head_dim", int(rope_dims), kind=int)   # transformers writes the derived value too
    if stated != int(rope_dims):
        raise field_error("qk_rope_head_dim", stated, f"disagrees with head_dim × partial_rotary_factor = {int(rope_dims)}")
    params = f.get("rope_parameters", None)
    if params is None:
        out.update(rope_theta=doc.get("rope_theta", 10000.0), compress_rope_theta=doc.get("compress_rope_theta", 160000.0),
                   compress_rope_scaling=None)
        return out
    if not isinstance(params, dict) or set(params) - {"main", "compress"}:
        raise field_error("rope_parameters", params, "expected {\"main\": {...}, \"compress\": {...}}")
    main, comp = params.get("main", {}), params.get("compress", {})
    if main.get("rope_type", "default") != "default":
        raise field_error("rope_parameters.main.rope_type", main.get("rope_type"), "the main table is plain RoPE")
    for name, table in (("main", main), ("compress", comp)):
        p = table.get("partial_rotary_factor", prf)
        if p != prf:
            raise field_error(f"rope_parameters.{name}.partial_rotary_factor", p, f"differs from partial_rotary_factor {prf}")
    out["rope_theta"] = float(main.get("rope_theta", doc.get("rope_theta", 10000.0)))
    out["compress_rope_theta"] = float(comp.get("rope_theta", doc.get("compress_rope_theta", 160000.0)))
    ctype = comp.get("rope_type", "default")
    if ctype == "default":
        out["compress_rope_scaling"] = None
    elif ctype == "yarn":
        if comp.get("attention_factor", 1.0) != 1.0:
            raise field_error("rope_parameters.compress.attention_factor", comp.get("attention_factor"),
                       "DeepSeek-V4 applies no YaRN logit scale (1.0)")
        out["compress_rope_scaling"] = YarnScaling(
            factor=float(comp["factor"]), original_max_position_embeddings=int(comp["original_max_position_embeddings"]),
            beta_fast=float(comp.get("beta_fast", 32.0)), beta_slow=float(comp.get("beta_slow", 1.0)))
    else:
        raise field_error("rope_parameters.compress.rope_type", ctype, "use 'default' or 'yarn'")
    return out


def dsv4_config(doc: Mapping[str, Any], model_id: str) -> ModelConfig:
    f = Fields(doc, DSV4_IGNORED_FIELDS)
    f.require("hidden_act", ("silu",), "silu", "only SwiGLU with silu is implemented")
    f.require("num_key_value_heads", (1,), 1, "DeepSeek-V4 attention has one K=V head")
    f.require("attention_bias", (False,), False, "not implemented")
    f.require("mlp_bias", (False,), False, "not implemented")
    f.require("norm_topk_prob", (True,), True, "the router always renormalises the chosen experts' weights")
    f.require("tie_word_embeddings", (False,), False, "DeepSeek-V4 has a separate head")
    f.require("quantization_config", (None,), None, "quantised checkpoints are not supported")
    kw: dict[str, Any] = {name: f.get(name) for name in DSV4_SAME if name in doc}
    f.used.update(DSV4_SAME)
    types = f.get("layer_types", kind=list)
    rates = f.get("compress_rates", kind=dict)
    bad = sorted({t for t in types if t not in (CSA, HCA, SWA_TYPE)})
    if bad:
        raise field_error("layer_types", bad, f"unknown layer types; known: {SWA_TYPE}, {CSA}, {HCA}")
    for t in {CSA, HCA} & set(types):
        if not isinstance(rates.get(t), int) or rates[t] <= 0:
            raise field_error(f"compress_rates.{t}", rates.get(t), "a positive integer is required for the layers of that type")
    if CSA in rates and HCA in rates and rates[CSA] == rates[HCA] and HCA in types:
        raise field_error("compress_rates", rates, "CSA and HCA need different ratios (the ratio tells them apart here)")
    kw["compress_ratios"] = tuple(0 if t == SWA_TYPE else rates[t] for t in types)
    kw["csa_ratio"] = rates.get(CSA, 4)
    kw["mlp_layer_types"] = tuple(f.get("mlp_layer_types", kind=list))
    kw.update(_dsv4_rope(f, doc, kw.get("head_dim", 64)))
    f.leftover()
    try:
        return ModelConfig(model_id=model_id, **kw)
    except ConfigError as e:
        raise CheckpointError(f"config.json: {e}") from e
    except TypeError as e:
        raise CheckpointError(f"config.json: ill-typed field ({e})") from e


def native_config(doc: Mapping[str, Any]) -> ModelConfig:
    """kvledger's own format: :class:`ModelConfig` field names; unknown names are refused."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(doc) - known - {"eos_token_id", "bos_token_id"})
    if unknown:
        raise field_error(unknown[0], doc[unknown[0]], f"not a ModelConfig field (known: {', '.join(sorted(known))})")
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in doc.items() if k in known}
    if isinstance(kw.get("compress_rope_scaling"), dict):
        try:
            kw["compress_rope_scaling"] = YarnScaling(**kw["compress_rope_scaling"])
        except TypeError as e:
            raise field_error("compress_rope_scaling", doc["compress_rope_scaling"], f"not YaRN parameters ({e})") from e
    try:
        return ModelConfig(**kw)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"config.json: {e}") from e

def _identity(key: str) -> tuple[str, None]:
    return key, None


def _dsv4_target(key: str) -> tuple[str, Any] | None:
    return dsv4_target(key) or (key, None)   # names already in our form pass unchanged


# ---- the entry point --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Loaded:
    model: CausalLM
    family: str
    #: The dtype the checkpoint's config declares and the one the model computes in.
    checkpoint_dtype: torch.dtype
    dtype: torch.dtype


def _empty(cls, cfg, dtype: torch.dtype, device: str | torch.device) -> CausalLM:
    """The model with uninitialised tensors of the target dtype on the target device: built on
    the meta device, so no random initialisation runs and no float32 copy is made of weights
    that load_weights overwrites (every tensor of the state dict, or it refuses)."""
    with torch.device("meta"):
        model = cls(cfg).to(dtype)
    return model.to_empty(device=torch.device(device))


def model_id_for(directory: Path, doc: Mapping[str, Any]) -> str:
    name = doc.get("_name_or_path")
    return name if isinstance(name, str) and name and not name.startswith("/") else directory.resolve().name


def load_checkpoint(directory: str | Path, *, dtype: str = "auto", require_manifest: bool = False,
                    device: str | torch.device = "cpu", progress=None) -> Loaded:
    """The model of ``directory`` (see the module docstring), on ``device``, in eval mode."""
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"config key worker.model_dir: {d} is not a directory")
    doc = read_config(d)
    family = family_of(doc)
    if dtype != "auto" and dtype not in DTYPES:
        raise CheckpointError(f"config key worker.dtype: {dtype!r}; use auto, {', '.join(DTYPES)}")
    if family == "kvledger":
        declared = torch.float32
        want = DTYPES[dtype] if dtype != "auto" else declared
        model: CausalLM = _empty(HybridAttentionLM, native_config(doc), want, device)
        load_weights(model, weight_files(d), _identity, ignore=lambda k: k.startswith("mtp."))
    elif family == "deepseek_v4":
        declared = checkpoint_dtype(doc)
        want = DTYPES[dtype] if dtype != "auto" else declared
        model = _empty(HybridAttentionLM, dsv4_config(doc, model_id_for(d, doc)), want, device)
        load_weights(model, weight_files(d), _dsv4_target, ignore=lambda k: bool(DSV4_IGNORED.match(k)))
    elif family == "yoco":
        declared = checkpoint_dtype(doc)
        want = DTYPES[dtype] if dtype != "auto" else declared
        model = _empty(YocoLM, yoco_config(doc, model_id_for(d, doc)), want, device)
        tied = model.cfg.tie_word_embeddings
        load_weights(model, weight_files(d), _identity,
                     ignore=(lambda k: k == "lm_head.weight") if tied else (lambda k: False),
                     optional=frozenset({"lm_head.weight"}) if tied else frozenset())
    else:
        declared = checkpoint_dtype(doc)
        want = DTYPES[dtype] if dtype != "auto" else declared
        model = _empty(DenseLM, dense_config(doc, family, model_id_for(d, doc)), want, device)
        tied = model.cfg.tie_word_embeddings
        # NOTE: with tied embeddings transformers ties after loading, so the embedding wins over
        # a stray lm_head.weight in the file; the head here IS the embedding parameter.
        load_weights(model, weight_files(d), _identity,
                     ignore=(lambda k: k == "lm_head.weight") if tied else (lambda k: False),
                     optional=frozenset({"lm_head.weight"}) if tied else frozenset())
    model = model.eval()
    model.checkpoint_digest = checkpoint_digest(d, require_manifest=require_manifest, progress=progress)
    return Loaded(model=model, family=family, checkpoint_dtype=declared, dtype=want)
