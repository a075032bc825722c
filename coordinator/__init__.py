"""The coordinator: the single authority on cache-block state, backed by an append-only log.

Run it with ``kvledger coordinator`` or ``python -m coordinator [--config FILE]`` (PostgreSQL
and NATS from the config, embedded ones when no URL is set); migrate a database with
``kvledger db upgrade`` and check it with ``kvledger db current``. In-process (tests,
benchmarks): ``coordinator.app.create_app(config)`` is an ``aiohttp`` application.

Map (pure core first, then the shell around it):

* ``core/``          — events, the fold, the replica life cycle, decisions (no I/O);
* ``log/``           — the event-log port, its PostgreSQL adapter and in-memory twin,
  group commit, leader election with epoch fencing, migrations runner;
* ``ledger.py``      — live state: decide → apply → append (group commit) → answer
  (``ledger_snapshots.py``: the freeze, snapshots; ``unavailable.py``: its error);
* ``replay.py``      — snapshot + tail replay (restart, rebuild, audit);
* ``nats_service.py``— request/reply service, JetStream consumer, watermarks, worker calls
  (the JetStream half, consumer and watermarks, in ``transition_consumer.py``);
* ``runtime.py``     — the process's parts and their life cycle (leadership loop, stop);
* ``audit.py``       — replay vs live vs workers, read-only;
* ``admin.py``       — admin REST routes, OpenAPI, errors and auth in one place each
  (``admin_context.py``: errors, patterns, app state; ``admin_input.py``: parameters and
  bodies; ``admin_middleware.py``: errors as responses, the token);
* ``app.py``         — ``create_app`` (resources in ``cleanup_ctx``) and the process entry point.
"""
