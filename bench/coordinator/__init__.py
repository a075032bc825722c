"""Coordinator benchmark: durable ingest, lease acquire, idle liveness, replay, restart and
standby takeover — each against a baseline measured in the same run on the same machine.

The coordinator runs as its own process (``python -m coordinator``, as in production) on a
fresh database and a unique subject prefix; this process plays the worker over NATS. The
bench worker keeps its epoch across a coordinator takeover the way a real one does: told
SUSPENDED, it resumes with the digests of the replicas it committed (never re-registers).

* **ingest** — a synthetic worker holds write leases on N blocks, then publishes N commit
  transitions (ALLOCATED → READY) to JetStream (``publish_async``, ``Nats-Msg-Id`` =
  source id, as a worker's outbox would, but pipelined). Timed from the first publish to
  the commit watermark that covers the last seq: decode, judge, apply, group-commit
  append to PostgreSQL, ack. Baseline: ``COPY`` (asyncpg ``copy_records_to_table``) of N
  rows with the very payloads the coordinator stores into a scratch table ``LIKE events
  INCLUDING ALL`` (same columns, constraints and indexes), measured before and after the
  ingest (the baseline is their mean).
* **backlog** — the same on a backlog: the coordinator is stopped, N more commit transitions
  are published (as workers keep doing while no coordinator runs), and it is started again:
  from its ``/readyz`` 200 until the watermark covers the last (``ingest_backlog_*``). The
  coordinator's own drain rate, without the publisher competing for the machine's cores.
* **full pool** — the core alone, in this process: the decision cost of a 16-block write grant
  on a worker whose pool (100k slots; quick 10k) is full of READY replicas, so that every
  written block evicts one (``grant_full_pool_us``). Baseline: scanning the pool for the same
  victims (``grant_full_pool_scan_us``), what the core did before its LRU index. Then the
  decision of that worker's resume holding the whole pool (``resume_full_pool_ms``,
  ``resume_full_pool_us_per_replica``; no baseline: what every worker costs after a takeover).
* **leases** — ``--inflight`` (64) concurrent LeaseAcquire requests, total N, each for a
  16-block prompt whose first 12 blocks are cached (READY: pinned for reading) and whose
  last 4 are not (write grants), ``reuse=True``; then every lease is released the same way
  (its 4 unfilled writes abort). Throughput and per-request latency p50/p99. Baseline: a
  trivial nats-py responder process replying with a byte string of the real reply's size,
  driven with the same request bytes, concurrency and N, before and after the lease run.
  Also a few hundred requests one at a time (latency without queueing), both ways.
* **idle** — ``--idle-workers`` (8; quick 4) registered workers holding nothing heartbeat
  every ``--idle-heartbeat-ms`` (100: time compressed 10×) to a coordinator configured with
  that interval; the events appended to the log during ``--idle-seconds`` (30; quick 10) and
  the heartbeats it answered (its ``kvl_coordinator_requests_total{op="heartbeat"}``), per
  worker per hour *at the default 1 s interval* (:func:`idle_rates`). No baseline: before
  heartbeats became soft state every heartbeat was an event (3600 per worker per hour).
* **replay** — a log of ``--replay-events`` (1M) events built by the real core commands
  (register, acquire with reuse and LRU eviction, commit transitions, release)
  and bulk-loaded with COPY into a fresh database; then ``coordinator.replay.load_state``
  (the code a restart runs) from empty. Baseline: reading the same rows (same columns,
  same pages) with raw asyncpg, no decode or fold. Also the pure fold rate (decode + apply
  of the in-memory payloads, no I/O).
* **restart** — a coordinator process started on that log with a snapshot taken 2% before
  its end: process start → ``/readyz`` 200 (``restart_history_events`` says how long the log
  was; ``snapshot_bytes``, ``snapshot_replicas`` what the snapshot held). Baseline: the same on
  an empty log (the first coordinator's start, which also creates the schema).
* **takeover** — that coordinator leads; a worker commits 256 blocks, a second coordinator
  process on the same database and prefix waits as a hot standby (``/readyz`` 503
  ``standby``, the log followed up to the leader's position), the worker churns leases one at
  a time for 2 s, then the leader is killed (SIGKILL): kill → the standby's ``/readyz`` 200.
  ``--takeover-rounds`` (3; quick 1) times, each standby the next round's leader; the
  figure is the slowest round. Baseline: ``restart_to_ready_s`` (a cold start that loads the
  snapshot and replays the tail). Also how many events the standby still had to fold, when
  the worker had resumed (keeping all 256) and when the new leader granted its first lease.

    python -m bench.coordinator            # 100k ingest, 20k leases, 8 idle workers 30 s, 1M-event replay
    python -m bench.coordinator --quick    # 10k ingest, 2k leases, 4 idle workers 10 s, 50k-event replay

Services: ``--database-url``/``--nats-url`` (default ``$KVL_DATABASE_URL``/``$KVL_NATS_URL``),
else embedded PostgreSQL and NATS are started. Progress goes to stderr; the last line
printed to stdout is one JSON object: every figure with its baseline and ratio, N per
phase, CPU microseconds per operation by process (``*_cpu_us_per_op_*``: coordinator, all
postgres and nats-server processes on the machine, this process), the group-commit
batches, how often the coordinator lost leadership, which goals were met, the load average.
``--only ingest,leases,idle,replay`` runs a subset (replay includes restart and takeover).
``KVL_BENCH_PYSPY=<dir>`` (py-spy installed) samples the coordinator during the timed ingest
and lease phases into ``<dir>``.

The code: :mod:`~bench.coordinator.harness` (services, the coordinator process, the echo
responder, the request driver, CPU accounting), :mod:`~bench.coordinator.synthetic_worker` (the
worker this process plays), one module per phase (:mod:`~bench.coordinator.ingest` with the
backlog, :mod:`~bench.coordinator.full_pool`, :mod:`~bench.coordinator.leases`,
:mod:`~bench.coordinator.idle`, :mod:`~bench.coordinator.replay` with the restart,
:mod:`~bench.coordinator.takeover`), the log they replay (:mod:`~bench.coordinator.log_builder`),
and the run with its options and goals (:mod:`~bench.coordinator.run`).
"""
