"""Per-tenant rate limits at the gateway: requests per second and tokens per minute, each a
token bucket (pure: the clock is passed in).

A request is admitted when *both* of its tenant's buckets hold enough — one request, and its
token estimate: the prompt's tokens (the gateway tokenized it to route) plus the completion it
may generate (``max_tokens``, or the API default when omitted). Admission takes from both at
once; a refusal takes from neither and says when to come back (``Retry-After``). When the
answer is known the estimate is corrected: what was not generated goes back into the bucket
(the whole estimate for an answer that was not a 200).

Bursts: the request bucket holds one second of its rate (at least one request), the token
bucket one minute of its rate. A request whose estimate is over a whole minute's tokens could
never be admitted: that is a 400, not a 429 a client would retry forever.

The buckets are this gateway's: several gateways side by side each admit the full rate, so
give each ``1/k`` of a tenant's limits (docs/operations.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.tenants import Tenant


@dataclass(slots=True)
class TokenBucket:
    rate_per_s: float
    capacity: float
    level: float
    at: float

    @classmethod
    def full(cls, rate_per_s: float, capacity: float, now: float) -> TokenBucket:
        return cls(rate_per_s, capacity, capacity, now)

    def _refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.rate_per_s)
            self.at = now

    def wait_s(self, n: float, now: float) -> float:
        """Seconds until ``n`` can be taken (0 = now)."""
        self._refill(now)
        return 0.0 if self.level >= n else (n - self.level) / self.rate_per_s

    def take(self, n: float) -> None:
        self.level -= n

    def give(self, n: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + n)


@dataclass(frozen=True, slots=True)
class Admitted:
    tenant: str
    tokens: int


@dataclass(frozen=True, slots=True)
class Refused:
    status: int          # 429 (come back later) or 400 (never fits)
    message: str
    code: str
    retry_after_s: int = 0


class TenantLimits:
    """Every limited tenant's two buckets, created on its first request."""

    def __init__(self) -> None:
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}

    def admit(self, tenant: Tenant, tokens: int, now: float) -> Admitted | Refused:
        rps, tpm = tenant.requests_per_second, tenant.tokens_per_minute
        if tpm and tokens > tpm:
            return Refused(400, f"this request may use {tokens} tokens (prompt + max_tokens), over tenant "
                                f"{tenant.id!r}'s limit of {tpm} tokens per minute: send a shorter prompt or a "
                                f"smaller max_tokens", "tokens_over_rate_limit")
        waits = []
        req = tok = None
        if rps:
            req = self._requests.get(tenant.id)
            if req is None:
                req = self._requests[tenant.id] = TokenBucket.full(rps, max(1.0, rps), now)
            waits.append(("requests per second", rps, req.wait_s(1, now)))
        if tpm:
            tok = self._tokens.get(tenant.id)
            if tok is None:
                tok = self._tokens[tenant.id] = TokenBucket.full(tpm / 60, float(tpm), now)
            waits.append(("tokens per minute", tpm, tok.wait_s(tokens, now)))
        worst = max(waits, key=lambda w: w[2], default=None)
        if worst is not None and worst[2] > 0:
            what, limit, wait = worst
            return Refused(429, f"tenant {tenant.id!r} is over its rate limit of {limit:g} {what}; retry after "
                                f"{math.ceil(wait)} s", "rate_limit_exceeded", max(1, math.ceil(wait)))
        if req is not None:
            req.take(1)
        if tok is not None:
            tok.take(tokens)
        return Admitted(tenant.id, tokens)

    def refund(self, admitted: Admitted, used_tokens: int, now: float) -> None:
        """The answer used ``used_tokens`` of the estimate: the rest goes back."""
        tok = self._tokens.get(admitted.tenant)
        if tok is not None and used_tokens < admitted.tokens:
            tok.give(admitted.tokens - max(0, used_tokens), now)


__all__ = ["Admitted", "Refused", "TenantLimits", "TokenBucket"]
