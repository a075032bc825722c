"""Typed keys for the app's state and the request's tenant."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from shared.config import Config
from shared.text.chat_template import ChatTemplate
from worker.engine import Engine
from shared.text.generation_config import SamplingDefaults
from worker.structured import StructuredOutput
from worker.request import ServingMetrics
from worker.scheduler import Scheduler
from shared.tenants import Tenant, TenantDirectory
from shared.text.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Served:
    """What the API says about the model it serves."""

    model_id: str
    #: ``system_fingerprint``: the cache namespace (model, weights, cache format, kernel ABI).
    fingerprint: str
    created: int
    max_body_bytes: int
    body_read_timeout_s: float = 10.0


ENGINE = web.AppKey("engine", Engine)
SCHEDULER = web.AppKey("scheduler", Scheduler)
TOKENIZER = web.AppKey("tokenizer", Tokenizer)
CHAT_TEMPLATE = web.AppKey("chat_template", ChatTemplate)
SAMPLING = web.AppKey("sampling_defaults", SamplingDefaults)
TENANTS = web.AppKey("tenants", TenantDirectory)
CONFIG = web.AppKey("config", Config)
SERVED = web.AppKey("served", Served)
METRICS = web.AppKey("serving_metrics", ServingMetrics)
STRUCTURED = web.AppKey("structured_output", StructuredOutput)
#: The tool-call syntax read from chat output (``service.tool_call_parser`` and the template's).
TOOL_FORMAT = web.AppKey("tool_call_format", str)
TENANT = web.RequestKey("tenant", Tenant)
