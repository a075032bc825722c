"""The standard full-attention family: Llama, Qwen2 and Qwen3 decoders (GQA, RoPE, SwiGLU).

:class:`DenseConfig` (sizes), :class:`DenseLM` (the model), :class:`DenseState` (one request's
paged K/V). Checkpoints load through :mod:`worker.model.checkpoint`.
"""

from worker.model.dense.config import DenseConfig, RopeSpec
from worker.model.dense.model import DenseLM, build_dense
from worker.model.dense.state import KV, DenseState, dense_form_layouts

__all__ = ["KV", "DenseConfig", "DenseLM", "DenseState", "RopeSpec", "build_dense", "dense_form_layouts"]
