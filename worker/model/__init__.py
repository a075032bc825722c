"""A faithful DeepSeek-V4-style hybrid-attention model with exact, resumable cache state.

Public pieces: :class:`ModelConfig` (sizes), :func:`build_model` (seeded weights),
:class:`HybridAttentionLM` (``prefill`` / ``decode_step``), :class:`RequestState` (the
per-request cache object, ``export_block`` / ``restore``) and :func:`declare_forms`.
"""

from worker.model.config import ConfigError, ModelConfig, check_block_size
from worker.model.forms import declare_forms, form_layouts
from worker.model.lm import CausalLM
from worker.model.model import HybridAttentionLM
from worker.model.state import BlockPayload, RequestState
from worker.model.weights import build_model, load_safetensors, save_safetensors, weights_digest

__all__ = ["BlockPayload", "CausalLM", "ConfigError", "HybridAttentionLM", "ModelConfig", "RequestState", "build_model",
           "check_block_size", "declare_forms", "form_layouts", "load_safetensors", "save_safetensors",
           "weights_digest"]
