"""API keys → tenants, and each tenant's limits.

Keys come from ``auth.keys`` and the YAML file ``auth.keys_file`` (a ``keys:`` list of the
same shape); both store only the SHA-256 of a key, never the key. A request's bearer key
is hashed and looked up; the match names the tenant.

* No keys configured and ``auth.required`` false: every request is tenant ``default`` and
  the Authorization header is ignored.
* Keys configured: a request that presents a key must present a known one (401
  otherwise — a typo must not silently become another tenant); a request without a key
  is tenant ``default`` unless ``auth.required`` is true (then 401).

The tenant's *salt* is the engine's (:meth:`worker.engine.Engine.salt`, derived from
``auth.salt_secret`` in :mod:`worker.settings`); the serving layer passes only the tenant id
and the engine salts every block hash with it, so two tenants' identical prompts never
share a block and one cannot probe the other's cache.

Limits (per tenant; 0 = none): ``max_concurrency`` — requests running at once (more wait
in the queue); ``cache_quota_blocks`` — blocks of this tenant a worker keeps in its GPU
pools (new blocks beyond it are computed but not cached); ``requests_per_second`` and
``tokens_per_minute`` — what the gateway admits (``gateway.limits``). Several keys may name
one tenant; they must then agree on its limits.

Priority: ``priority`` (lower runs first, vLLM's convention; default 0) is the tenant's, from
its key's configuration. A request's own ``priority`` may only lower it — a larger number —
and one that asks for more than its tenant has is given its tenant's (:func:`effective_priority`),
so no client can jump the queue by sending ``priority: -1000000``.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import yaml

from shared.config import ApiKey, AuthConfig, Config, ConfigError

DEFAULT_TENANT = "default"
#: What a tenant name may be (``shared.config.ApiKey``'s pattern). Checked again here, where
#: keys are loaded, because an ApiKey built in code skips the config's validation, and the
#: name becomes a directory of the shared offload tier: ``..`` or ``a/b`` must never get there.
TENANT_NAME = re.compile(r"[A-Za-z0-9_\-]{1,64}")


class AuthError(Exception):
    """The request's credentials are missing or wrong (401); the message says which."""


@dataclass(frozen=True, slots=True)
class Tenant:
    id: str
    max_concurrency: int = 0
    cache_quota_blocks: int = 0
    requests_per_second: float = 0.0
    tokens_per_minute: int = 0
    #: Scheduling priority (lower first); a request may ask for a larger number, never a smaller one.
    priority: int = 0


def effective_priority(tenant: Tenant, requested: int | None) -> int:
    """The priority a request runs at: its tenant's, or the lower one (a larger number) it asked for.

    A request asking for a higher priority (a smaller number) than its tenant's gets its tenant's:
    clamped, not refused, so an OpenAI client that always sends ``priority: 0`` keeps working."""
    return tenant.priority if requested is None else max(requested, tenant.priority)


def key_sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class _KeysFile(msgspec.Struct, forbid_unknown_fields=True):
    keys: list[ApiKey] = []


def _read_keys_file(path: str) -> list[ApiKey]:
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"config key auth.keys_file: cannot read {p}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config key auth.keys_file: {p} is not valid YAML: {e}") from e
    try:
        return msgspec.convert(doc, _KeysFile).keys
    except msgspec.ValidationError as e:
        raise ConfigError(f"config key auth.keys_file: {p}: {e}") from None


class TenantDirectory:
    def __init__(self, keys: list[ApiKey], *, required: bool = False) -> None:
        self.required = required
        self._by_hash: dict[str, Tenant] = {}
        self._tenants: dict[str, Tenant] = {DEFAULT_TENANT: Tenant(DEFAULT_TENANT)}
        from_keys: dict[str, Tenant] = {}
        for k in keys:
            if not isinstance(k.tenant, str) or not TENANT_NAME.fullmatch(k.tenant):
                raise ConfigError(f"auth keys: tenant name {k.tenant!r} is not allowed; use 1 to 64 letters, "
                                  f"digits, '_' or '-' (key hash {str(k.key_sha256)[:12]}…)")
            t = Tenant(k.tenant, k.max_concurrency, k.cache_quota_blocks, k.requests_per_second, k.tokens_per_minute,
                       k.priority)
            known = self._by_hash.get(k.key_sha256)
            if known is not None and known.id != t.id:
                raise ConfigError(f"auth keys: one key hash ({k.key_sha256[:12]}…) is listed for tenants "
                                  f"{known.id!r} and {t.id!r}")
            if from_keys.setdefault(t.id, t) != t:
                raise ConfigError(f"auth keys of tenant {t.id!r} disagree on its limits (max_concurrency, "
                                  f"cache_quota_blocks, requests_per_second, tokens_per_minute, priority); give every key "
                                  f"of a tenant the same limits")
            self._by_hash[k.key_sha256] = t
        self._tenants.update(from_keys)
        #: Keys a reload removed: hash -> (tenant, monotonic deadline); see :meth:`replace`.
        self._retired: dict[str, tuple[Tenant, float]] = {}

    def replace(self, new: TenantDirectory, grace_s: float, now: float | None = None) -> int:
        """Take ``new``'s keys and limits in place (every holder of this object sees them); a key
        that ``new`` no longer lists keeps authenticating for ``grace_s`` more seconds, as its
        tenant under ``new``'s limits. Returns how many retired keys are within their grace."""
        now = time.monotonic() if now is None else now
        retired = {h: v for h, v in self._retired.items() if v[1] > now and h not in new._by_hash}
        for h, t in self._by_hash.items():
            if h not in new._by_hash and grace_s > 0:
                retired[h] = (new._tenants.get(t.id, t), now + grace_s)
        self._by_hash, self._tenants, self.required, self._retired = (
            new._by_hash, new._tenants, new.required, retired)
        return len(retired)

    @classmethod
    def from_config(cls, auth: AuthConfig) -> TenantDirectory:
        keys = list(auth.keys)
        if auth.keys_file:
            keys += _read_keys_file(auth.keys_file)
        return cls(keys, required=auth.required)

    @property
    def has_keys(self) -> bool:
        return bool(self._by_hash) or bool(self._retired)

    def tenant(self, tenant_id: str) -> Tenant:
        return self._tenants.get(tenant_id) or Tenant(tenant_id)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization`` header value (``Bearer <key>``, the scheme in any case,
        any whitespace after it); raises :class:`AuthError` (a 401), whatever the header holds."""
        if not self.has_keys and not self.required:
            return self._tenants[DEFAULT_TENANT]
        if not authorization:
            if self.required:
                raise AuthError("an API key is required: send 'Authorization: Bearer <key>'")
            return self._tenants[DEFAULT_TENANT]
        parts = authorization.split(None, 1)
        if len(parts) != 2 or parts[0].lower() != "bearer" or not parts[1].strip():
            raise AuthError("malformed Authorization header: expected 'Bearer <key>'")
        key = parts[1].strip()
        try:
            digest = key_sha256(key)
        except UnicodeEncodeError:
            # aiohttp hands undecodable header bytes over as surrogates: not a key anyone holds
            raise AuthError("malformed Authorization header: the key is not valid UTF-8") from None
        tenant = self._by_hash.get(digest)
        if tenant is None:
            retired = self._retired.get(digest)
            if retired is None or retired[1] <= time.monotonic():
                raise AuthError("invalid API key")
            tenant = retired[0]
        return tenant


# --- tenant salts: what makes one tenant's block hashes unguessable to another ----------------
#: Salt secret of the single ``default`` tenant when ``auth.salt_secret`` is empty: stable,
#: so every worker (and every restart) hashes the default tenant's blocks alike.
DEFAULT_TENANT_SECRET = "kvledger-default-tenant-salt-v1"


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


__all__ = ["AuthError", "DEFAULT_TENANT", "DEFAULT_TENANT_SECRET", "Tenant", "TenantDirectory", "effective_priority",
           "key_sha256", "salt_secret", "tenant_salt"]
