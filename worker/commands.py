"""``kvledger worker``: the worker subcommand of the ``kvledger`` command line."""

from __future__ import annotations

import argparse


def _run(args: argparse.Namespace) -> int:
    from worker.engine_main import main

    argv = ["--config", args.config] if args.config else []
    if args.worker_id:
        argv += ["--worker-id", args.worker_id]
    return main(argv)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("worker", help="run a worker: the model and its cache engine")
    p.add_argument("--worker-id", help="worker id (default: worker.worker_id, else <host>-<pid>)")
    p.set_defaults(func=_run)
