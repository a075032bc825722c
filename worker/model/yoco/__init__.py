"""The YOCO family ("You Only Cache Once"): a self-decoder of sliding-window layers, one global
K/V, a cross-decoder that attends to it. :class:`YocoConfig` (sizes), :class:`YocoLM` (the
model), :class:`YocoState` (one request's cached state); checkpoints load through
:mod:`worker.model.yoco.checkpoint`."""

from worker.model.yoco.config import YocoConfig
from worker.model.yoco.model import YocoLM, build_yoco
from worker.model.yoco.state import GLOBAL_KV, SWA, YocoState, yoco_form_layouts

__all__ = ["GLOBAL_KV", "SWA", "YocoConfig", "YocoLM", "YocoState", "build_yoco", "yoco_form_layouts"]
