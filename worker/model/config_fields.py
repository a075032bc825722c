"""Reading a checkpoint's ``config.json`` field by field, as every family's loader does.

What the families share: the fields no family reads (:data:`COMMON_IGNORED`), the reader that
remembers which fields were read so the rest are refused by name (:class:`Fields`), the RoPE
and vision sections, and :class:`CheckpointError`. The dense and DeepSeek-V4 mappings are in
:mod:`worker.model.checkpoint`, YOCO's in :mod:`worker.model.yoco.checkpoint`; both import this
module, so the loader can import YOCO's mapping without YOCO importing the loader.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from worker.model.config import ConfigError
from worker.model.dense.config import RopeSpec
from worker.model.vision import VisionConfig

#: Fields of every transformers config that do not change what the model computes from token
#: ids (ids of special tokens are the tokenizer's and generation's business, read there).
COMMON_IGNORED = frozenset({
    "architectures", "model_type", "transformers_version", "_name_or_path", "dtype", "torch_dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "initializer_range", "attention_dropout", "use_cache", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
    "finetuning_task", "id2label", "label2id", "tokenizer_class", "prefix", "task_specific_params",
    "problem_type", "tie_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "pruned_heads", "_attn_implementation_autoset", "use_return_dict", "embd_pdrop", "resid_pdrop",
    # Names, paths and versions (GGUF conversions write _model_name_or_path, the GGUF file's own
    # name for the model; hub exports write _commit_hash), and the ids of special tokens the
    # tokenizer already carries: none of them enters a forward pass.
    "_model_name_or_path", "_commit_hash", "unk_token_id", "mask_token_id", "cls_token_id",
})


class CheckpointError(ConfigError):
    """A checkpoint directory this worker cannot serve; the message names the file or field."""


def field_error(field: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(f"config.json field {field}={json.dumps(value)}: {why}")


class Fields:
    """Reads a config document field by field and remembers which were read, so the rest can be
    refused by name."""

    def __init__(self, doc: Mapping[str, Any], ignored: frozenset[str]) -> None:
        self.doc, self.used = doc, set(ignored)

    def get(self, name: str, default: Any = dataclasses.MISSING, kind: type | tuple[type, ...] | None = None) -> Any:
        self.used.add(name)
        if name not in self.doc or (self.doc[name] is None and default is not dataclasses.MISSING):
            if default is dataclasses.MISSING:
                raise CheckpointError(f"config.json: field {name} is required")
            return default
        v = self.doc[name]
        if kind is not None and (not isinstance(v, kind) or isinstance(v, bool) and bool not in _tuple(kind)):
            raise field_error(name, v, f"expected {_names(kind)}")
        return v

    def require(self, name: str, allowed: tuple, default: Any, why: str) -> Any:
        v = self.get(name, default)
        if v not in allowed:
            raise field_error(name, v, why)
        return v

    def leftover(self) -> None:
        rest = sorted(k for k in self.doc if k not in self.used)
        if rest:
            shown = ", ".join(f"{k}={json.dumps(self.doc[k])[:60]}" for k in rest[:6])
            raise CheckpointError(f"config.json: fields this loader does not know: {shown}"
                                  f"{' …' if len(rest) > 6 else ''} — refusing rather than ignoring what they "
                                  f"might change")


def _tuple(kind) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


def _names(kind) -> str:
    return " or ".join(k.__name__ for k in _tuple(kind))


NUM = (int, float)

def rope_spec(f: Fields, doc: Mapping[str, Any]) -> RopeSpec:
    """``rope_parameters`` (transformers 5) or the older ``rope_theta`` + ``rope_scaling``."""
    params = doc.get("rope_parameters")
    f.used.add("rope_parameters")
    if params is None:
        params = dict(doc.get("rope_scaling") or {})
        params.setdefault("rope_theta", doc.get("rope_theta", 10000.0))
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
        where = "rope_scaling"
    else:
        where = "rope_parameters"
    if not isinstance(params, dict):
        raise field_error(where, params, "expected an object")
    params = dict(params)
    prf = params.pop("partial_rotary_factor", doc.get("partial_rotary_factor", 1.0))
    if prf not in (1, 1.0):
        raise field_error(f"{where}.partial_rotary_factor", prf, "only full rotation (1.0) is supported for this family")
    known = {fl.name for fl in dataclasses.fields(RopeSpec)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise field_error(f"{where}.{unknown[0]}", params[unknown[0]], "not a RoPE parameter this loader knows")
    rope_type = params.get("rope_type", "default")
    try:
        if rope_type == "llama3" or rope_type == "yarn":
            params.setdefault("original_max_position_embeddings", doc.get("max_position_embeddings", 0))
        return RopeSpec(**params)
    except ConfigError as e:
        raise CheckpointError(f"config.json {where}: {e}") from e
    except TypeError as e:
        raise field_error(where, params, f"ill-typed ({e})") from e


def vision_section(f: Fields) -> VisionConfig | None:
    """kvledger's ``vision`` section (``shared.images.CONFIG_KEY``), or None."""
    section = f.get("vision", None, kind=dict)
    if section is None:
        return None
    try:
        return VisionConfig.from_dict(section)
    except TypeError as e:
        raise field_error("vision", section, f"ill-typed ({e})") from e
