"""What the engine derives from the configuration: worker id, pool sizes, tenant salts."""

from __future__ import annotations

import os
import re
import socket

from shared.config import Config
from shared.forms import FormCatalogue, FormScope

_TOKEN = re.compile(r"[^A-Za-z0-9_\-]")


def worker_id(cfg: Config) -> str:
    """``worker.worker_id``, else ``<host>-<pid>`` (a NATS subject token either way)."""
    wid = cfg.worker.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    wid = _TOKEN.sub("-", wid)[:64]
    if not wid:
        raise ValueError("worker.worker_id: must contain letters, digits, '_' or '-'")
    return wid


def pool_slots(catalogue: FormCatalogue, cfg: Config) -> dict[str, int]:
    """Slots per form from ``worker.pool_bytes × service.cache_reserve_ratio × <form>_pool_limit``.

    Full-history forms (``compressed``, ``indexer``) grow together — a resume needs both for
    every block — so they split ``compressed_pool_limit`` into equal slot counts. A window
    form takes ``swa_pool_limit``, a resume-point form ``tail_pool_limit``. The shares of scopes
    a model does not declare go to those it does, in proportion (a dense model's one full-history
    form gets all three).
    """
    c = cfg.cache
    budget = cfg.worker.pool_bytes * cfg.service.cache_reserve_ratio
    return scope_slots(catalogue.forms, budget, {
        FormScope.FULL_HISTORY: c.compressed_pool_limit, FormScope.WINDOW: c.swa_pool_limit,
        FormScope.RESUME_POINT: c.tail_pool_limit})


def scope_slots(forms, budget: float, limits: dict) -> dict[str, int]:
    """Slots per form: each scope's share of ``budget`` (``limits``, rescaled over the scopes
    present) split into equal slot counts among its forms (``forms`` have ``name``, ``scope``,
    ``bytes_per_block``; scopes compare by value)."""
    present = {str(s): frac for s, frac in limits.items() if any(str(f.scope) == str(s) for f in forms)}
    scale = sum(limits.values()) / sum(present.values()) if present and sum(present.values()) else 0.0
    out: dict[str, int] = {}
    for scope, frac in present.items():
        group = [f for f in forms if str(f.scope) == scope]
        per_block = sum(f.bytes_per_block for f in group)
        n = int(budget * frac * scale // per_block)
        for f in group:
            out[f.name] = n
    return out
