"""What the engine derives from the configuration: worker id, pool sizes, tenant salts."""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import socket
from pathlib import Path

from shared.config import Config
from shared.forms import FormCatalogue, FormScope

_TOKEN = re.compile(r"[^A-Za-z0-9_\-]")
#: Salt secret of the single ``default`` tenant when ``auth.salt_secret`` is empty: stable,
#: so every worker (and every restart) hashes the default tenant's blocks alike.
DEFAULT_TENANT_SECRET = "kvledger-default-tenant-salt-v1"


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


def salt_secret(cfg: Config, tenant: str) -> str:
    """The secret a tenant's salt derives from (see :func:`tenant_salt`).

    ``auth.salt_secret`` when set. Otherwise the ``default`` tenant gets a stable public
    secret (one tenant has nobody to be isolated from) and any other tenant a random secret
    kept in ``<state_dir>/tenant-salt.secret`` (0600), created on first use.
    """
    if cfg.auth.salt_secret:
        return cfg.auth.salt_secret
    if tenant == "default":
        return DEFAULT_TENANT_SECRET
    path = Path(cfg.state_dir) / "tenant-salt.secret"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        value = secrets.token_hex(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(value)
        return value


def tenant_salt(secret: str, tenant: str) -> bytes:
    """16-byte salt of ``tenant``: keyed BLAKE2b, so a salt reveals nothing about the secret."""
    key = hashlib.blake2b(secret.encode(), digest_size=32).digest()
    return hashlib.blake2b(tenant.encode(), key=key, digest_size=16, person=b"kvl-tenant-salt").digest()
