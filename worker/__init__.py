"""The stateless worker: the model, its cache engine, and (later) the inference endpoint.

Map of the cache engine:

* :mod:`worker.cache.planner`  — pure core: which blocks a resume reads, the four hit-validation
  layers, the usable boundary (no I/O; unit-tested alone);
* :mod:`worker.cache.store`    — the GPU tier: static per-form pools plus what each slot holds;
* :mod:`worker.cache.tiers`    — host memory and the shared offload directory;
* :mod:`worker.client`         — the coordinator port: NATS adapter, in-process twin for unit tests;
* :mod:`worker.publisher`      — the transition outbox and the task that drains it into JetStream;
* :mod:`worker.cache.replicas` — every transition the worker emits, and the moves between tiers;
* :mod:`worker.cache.ports`    — the narrow ports a request's cache manager is given;
* :mod:`worker.cache.manager`  — one request (``Session``): lease, validate, restore, prefill,
  commit, release (with :mod:`worker.cache.hits` and :mod:`worker.cache.leases`);
* :mod:`worker.contact`        — the epoch, degraded mode, accounted coordinator calls;
* :mod:`worker.supervisor`     — the background duties, composed of :mod:`worker.membership` (registration,
  heartbeats, resume), :mod:`worker.spill` (the disk writer), :mod:`worker.disk_gc` (segments' bound
  and age) and :mod:`worker.answers` (inventory and control);
* :mod:`worker.engine`         — the composition root: builds and wires the above,
  ``Engine.generate`` / ``Engine.open``;
* :mod:`worker.engine_main`    — the process (``python -m worker``) and its NATS debug subjects.
"""
