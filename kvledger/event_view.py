"""How ``kvledger events`` shows what an event changed: ``from → to``, from the event's payload.

Replica states (``absent``, ALLOCATED, READY, EVICTED, INVALID, LOST) for the events that move
replicas; the worker's life cycle (registered, suspended, alive, draining, LOST) for its events.
The payloads are the ledger's events (``coordinator.core.events``) as the admin API returns them.
"""

from __future__ import annotations

from typing import Any


def transition(e: dict[str, Any]) -> str:
    """What an event changed, as ``from → to`` (replica or worker states), from its payload."""
    p = e.get("event") if isinstance(e.get("event"), dict) else {}
    kind = e.get("type", "")
    if kind in ("transition.applied", "transition.rejected"):
        t = p.get("transition") or {}
        what = f"{t.get('form', '?')}@{t.get('location', '?')} {str(t.get('block_hash', ''))[:12]}"
        change = f"{t.get('from_state') or 'absent'} → {t.get('to_state', '?')}"
        return f"{change}  {what}" + (f"  REJECTED: {p.get('reason', '')}" if kind.endswith("rejected") else "")
    if kind == "lease.granted":
        writes = sum(len(v) for v in (p.get("write") or {}).values())
        parts = [f"absent → ALLOCATED ×{writes}" if p.get("allocated") and writes else "",
                 f"READY → EVICTED ×{len(p['evicted'])}" if p.get("evicted") else "",
                 f"pins {len(p.get('read') or [])}" if p.get("read") else ""]
        return "  ".join(x for x in parts if x) or "no replica change"
    if kind in ("lease.released", "lease.expired"):
        return "ALLOCATED → EVICTED (unfilled writes)"
    if kind == "replica.allocated":
        return f"absent → ALLOCATED  {p.get('form', '?')}@{p.get('location', '?')}"
    if kind == "replica.evicted":
        return f"READY → EVICTED ({p.get('reason', '')})  {p.get('form', '?')}@{p.get('location', '?')}"
    if kind == "invalidated":
        return (f"live → INVALID ×{len(p.get('affected') or [])}  {p.get('scope', '')} "
                f"{str(p.get('value', ''))[:16]}")
    worker = {"worker.registered": "→ registered", "worker.suspended": "alive → suspended",
              "worker.resumed": "suspended → alive", "worker.draining": "alive → draining"}
    if kind in worker:
        return f"{worker[kind]} (epoch {p.get('epoch', '?')})"
    if kind == "worker.lost":
        return f"epoch {p.get('epoch', '?')} → LOST; replicas → LOST ×{len(p.get('lost') or [])}"
    if kind == "cache.switched":
        return f"reuse → {'on' if p.get('enabled') else 'off'}"
    return ""
