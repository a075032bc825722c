"""``kvledger up``: the whole stack on one machine, started in order and stopped without a trace.

Theory of operation — a small process supervisor, threads and ``subprocess``, no asyncio:

1. **Services.** PostgreSQL and NATS from the configuration; whichever has no URL is started
   embedded under ``state_dir`` (:mod:`shared.embedded`), owned by this process; NATS as a
   3- or 5-node JetStream cluster with ``--nats-cluster`` (:mod:`shared.nats_cluster`), each
   node supervised and listed on its own; with ``--pg-standby`` a streaming standby of the
   embedded PostgreSQL, which the coordinators follow when it is promoted (:mod:`kvledger.pg_failover`).
2. **Migrations.** ``kvledger db upgrade`` in-process, so a schema problem is reported
   before anything else starts (the coordinator would also migrate; this makes the step
   visible and its failure one clear line, like compose's one-shot ``migrate`` service).
3. **Coordinators.** ``python -m coordinator`` with the resolved URLs in its environment
   (``KVL_DATABASE_URL``, ``KVL_NATS_URL``) and the admin port; wait for ``/readyz`` 200.
   ``--coordinators 2`` (or 3) then starts hot standbys on the next admin ports and waits
   only for their ``/healthz``: the event log's advisory lock lets one coordinator lead,
   the others answer ``/readyz`` 503 ``standby`` until the leader goes away.
4. **Workers.** N × ``python -m worker`` with per-worker overrides (``KVL_WORKER__WORKER_ID``,
   ``KVL_WORKER__PORT``); wait for each ``/readyz`` to say ``ready`` (registered, pools
   allocated). Port 0 means "any free port": the worker prints ``listening on URL``.
5. **Summary.** A table of what runs where (URL, pid, log file) on stdout, and the same as
   JSON in ``<state_dir>/stack.json`` for scripts.
6. **Supervision.** Every child runs in its own process group (Ctrl-C reaches only this
   process, which then stops the children in order). Its stdout and stderr go, line by line,
   to ``<state_dir>/logs/<name>.log`` as JSON lines (a plain line, such as ``listening on
   URL`` or a traceback's, wrapped in an ``output`` record; rotated at ``logging.max_bytes``,
   ``logging.backups`` kept) and to the terminal rendered readably with a ``name |`` prefix.
   A coordinator or worker that exits while the stack is up is reported with the end of its
   log and **restarted** with the same port and worker id, after a backoff that doubles while
   it keeps dying (0.5 s up to 10 s); the others keep running (a restarted worker registers
   again and the coordinator fences its old epoch; a restarted coordinator replays the log,
   or stands by if another one took the lead). The restarts are counted in the table,
   ``stack.json`` and a JSON line in the child's log. A process that dies more than
   ``--max-restarts`` times within ``--restart-window`` seconds is a crash loop, not bad luck:
   **the whole stack stops** (exit 1) and says so. An embedded PostgreSQL or NATS that exits is
   started again on the same port and data directory (the coordinator and workers reconnect;
   the workers keep their caches), under the same limit — except a PostgreSQL primary that has a
   standby: that one is promoted instead (``database.failover_after_s``, or ``kvledger db promote``).
7. **Shutdown** on SIGINT/SIGTERM (a second signal hurries: SIGKILL at once): workers, then
   the coordinators, each by SIGTERM to its process group with a grace period, then SIGKILL;
   then NATS and PostgreSQL. Finally every process this supervisor started, and anything
   still in their process groups or below them, is looked for; any survivor is killed and
   reported (exit 1).
8. **A supervisor that was killed** (SIGKILL, OOM) cannot stop anything: the kernel sends
   SIGTERM to the coordinators and workers (parent-death signal), and the next ``kvledger up``
   with the same state_dir finds the ``stack.json`` it left and stops what is still running
   there (the embedded servers above all), or refuses if that supervisor is in fact alive.

The package, one module per part (this ``__init__`` imports none of them: import a name from its module):

* :mod:`~kvledger.stack.options` — :class:`StackOptions` and the two errors;
* :mod:`~kvledger.stack.console` — the terminal: the supervisor's lines and the children's, rendered;
* :mod:`~kvledger.stack.child` — one supervised process, its log file and its process group;
* :mod:`~kvledger.stack.probes` — free ports and the HTTP health probes;
* :mod:`~kvledger.stack.startup` — steps 1 to 4: services, migrations, coordinators, workers, gateways;
* :mod:`~kvledger.stack.supervision` — step 6: restarts and the crash-loop limit;
* :mod:`~kvledger.stack.report` — step 5: the table, the hints and ``stack.json``;
* :mod:`~kvledger.stack.orphans` — steps 7 and 8: what a killed supervisor left, survivors after a stop;
* :mod:`~kvledger.stack.supervisor` — :class:`Stack`, which composes the above: run, signals, shutdown;
* :mod:`~kvledger.stack.command` — the ``kvledger up`` subcommand (its arguments, checked).
"""
