"""Fleet benchmark: hundreds of simulated workers against a ledger of 1, 2 and 4 coordinator
shards — real coordinators, real NATS, real PostgreSQL — and what a lease costs in CPU at each.

Each round starts N shards as a deployment runs them (docs/operations.md, "A sharded ledger"):
N ``python -m coordinator`` leader processes, shard k with its own database (created for the
round, dropped after), its own subjects and stream (``<prefix>`` for shard 0, ``<prefix>.s<k>``),
``coordinator.shards: N``; the shard map (static, version 1) stored in the NATS KV bucket. One
shard is today's unsharded deployment. Then ``--workers`` (200) simulated workers, split between
``--drivers`` (2) driver processes, each one asyncio loop over ``--connections`` (4) NATS
connections (worker i on connection i mod 4: many worker identities per connection, as subjects
name the worker, not the connection). Every worker registers with *every* shard (its pool share
there: slots × owned partitions / P), heartbeats each at the interval it answers (1 s) and follows
each one's watermarks; each lease goes to the shard that owns its chain by the map read from the
KV bucket (:func:`shared.shards.shard_of`, the rule the real worker follows).

The request mix (:mod:`bench.fleet.mix`): ``--namespaces`` (4) models, the workers split between
them; per namespace ``--prompts`` (8) shared system prompts with Zipf popularity, under which 80 %
of conversations start (the rest have a root of their own); each worker keeps 6 conversations
going, each turn extending one by 2–6 blocks until 48. A turn is acquire (reuse, writes) → one
JetStream batch of the granted blocks' commits → the commit watermark → release, one turn at a
time per worker (so up to ``--workers`` leases in flight).

After ``--warmup`` (10 s), counting for ``--seconds`` (30 s) at steady load: leases completed by
shard, and the CPU (user + system, from ``/proc``) of every process over that window — the
coordinators, the drivers, every ``postgres`` and ``nats-server`` process on the machine
(``bench.proc_cpu.stack_cpu``, as ``bench.serving`` counts them: other work on the same servers
counts too) and this process. Keys, per N:

* ``leases_per_s_shards<N>`` — completed turns (acquire … release) per second of the window;
* ``cpu_us_per_lease_shards<N>`` — all that CPU per lease (``…_<role>``: by role);
* ``scaling_efficiency_shards<N>`` — leases per CPU-second at N over at one shard (goal ≥ 0.9:
  adding shards costs no CPU per lease, so on more cores the fleet scales; on a 2-core machine
  leases/s cannot grow with N, CPU per lease is the honest measure);
* ``…_ledger_shards<N>``: the same of the coordinators', PostgreSQL's and NATS's CPU only (what a
  deployment's ledger machines pay; the workers' share runs on the GPU hosts);
* ``idle_cpu_ms_per_s_shards<N>`` — the joined fleet's CPU per second before any turn (counted
  for ``--idle`` s: heartbeats, workers × shards a second, and the coordinators' timers), and
  ``…_beyond_idle_shards<N>``: CPU per lease and efficiency without it;
* ``append_txs_per_lease_shards<N>``, ``append_events_per_tx_shards<N>`` — the coordinators'
  group commits (their ``/metrics``): how much a shard's smaller share of the load batches less;
* ``wrong_shard_shards<N>`` (must be 0: a refusal means the routing is wrong), ``errors_shards<N>``,
  ``hottest_shard_share_shards<N>`` (the busiest shard's leases over an even share: hot roots),
  ``reuse_share_shards<N>`` (blocks read from cache over blocks read or written).
  ``run_wrong_shard`` and ``run_errors`` count the whole run, warm-up and wind-down included;
  ``goals`` says which of efficiency ≥ 0.9 (per N), 0 ``wrong_shard`` and 0 errors were met.

    python -m bench.fleet            # 1, 2, 4 shards; 200 workers; 5 s idle, 10 s warm-up, 30 s counted each (~2.5 min)
    python -m bench.fleet --quick    # 16 workers, 1 driver; 2 s + 2 s + 4 s each (~10 s a round)
    python -m bench.fleet --workers-per-shard 100   # the fleet grows with the shards (100, 200, 400)

Services: ``--database-url``/``--nats-url`` (default ``$KVL_DATABASE_URL``/``$KVL_NATS_URL``), else
embedded PostgreSQL and NATS. Progress and a table go to stderr; the last line on stdout is one
JSON object.

The code: :mod:`~bench.fleet.mix` (the requests), :mod:`~bench.fleet.sim_worker` (one worker, a
member of every shard), :mod:`~bench.fleet.driver` (a driver process), :mod:`~bench.fleet.cluster`
(the shards' and drivers' processes), :mod:`~bench.fleet.report` (the keys and the table),
:mod:`~bench.fleet.run` (options and rounds).
"""
