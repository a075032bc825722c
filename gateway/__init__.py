"""The gateway: one OpenAI endpoint for the fleet, routing each request to where its cache is.

Stateless (any number side by side). Per request it tokenizes and hashes the prompt exactly as
the workers do (``shared.text``, ``shared.hashing``, the tenant's salt), asks the coordinator
which workers hold how much of it (a read-only route query over NATS, ``coordinator.core.route``),
picks a worker by cached tokens against load (:mod:`gateway.routing`) and forwards the request
over HTTP, streaming the answer through unbuffered. A worker that refuses or fails before the
first byte is skipped for the next candidate. The route is a hint: the worker's own lease and
validation decide what is reused, so a stale answer costs speed, never correctness.
"""
