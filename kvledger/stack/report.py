"""What the stack reports (step 5 of :mod:`kvledger.stack`): one row per service, the table and
the commands to try printed when it is up, and ``<state_dir>/stack.json`` for scripts and for
the next ``kvledger up`` (:mod:`kvledger.stack.orphans`) and the operator commands
(:mod:`kvledger.discovery`) — never a password.

:class:`StackReport` is part of :class:`kvledger.stack.supervisor.Stack`.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

from kvledger.discovery import cli_command, found_from
from kvledger.stack.child import Child
from kvledger.stack.options import StackOptions
from shared.config import Config
from shared.nats_auth import CredentialStore
from shared.nats_cluster import NatsCluster, embedded_nodes


class StackReport:
    """The table, hints and state file of a :class:`~kvledger.stack.supervisor.Stack` (its attributes below)."""

    cfg: Config
    opts: StackOptions
    state_dir: Path
    services: Any
    pg_failover: Any
    credentials: CredentialStore | None
    coordinators: list[Child]
    workers: list[Child]
    gateways: list[Child]
    _wrote_state: bool

    def rows(self) -> list[dict[str, Any]]:
        """What runs where: one row per service (also the content of stack.json)."""
        out: list[dict[str, Any]] = []
        svc = self.services
        if svc is not None:
            nats = [(name, node.url, node, str(node.data_dir / "nats.log"))
                    for name, node in embedded_nodes(svc.nats)] \
                if isinstance(svc.nats, NatsCluster) else [("nats", svc.nats_url, svc.nats, "nats/nats.log")]
            for name, url, emb, log in (
                    ("postgres", svc.database_url, svc.postgres, "postgres/postgres.log"), *nats):
                out.append({"name": name, "url": url, "role": "embedded" if emb is not None else "configured",
                            "pid": emb.proc.pid if emb is not None and emb.proc is not None else None,
                            "log": str(self.state_dir / log) if emb is not None else None, "restarts": None})
            if self.pg_failover is not None:
                out += self.pg_failover.rows()
        for c in self.children:
            role = "OpenAI API" if c in self.workers else "OpenAI API (gateway)" if c in self.gateways else "admin API"
            out.append({"name": c.name, "url": c.url, "role": role,
                        "pid": c.pid if c.alive else None, "log": str(c.log_path), "restarts": c.restarts})
        return out

    def summary_table(self) -> Any:
        from rich.table import Table

        t = Table(title="kvledger stack", title_justify="left", show_lines=False)
        for col in ("service", "address", "", "pid", "restarts", "log"):
            t.add_column(col, overflow="fold")
        for r in self.rows():
            url = r["url"] or ""
            if r["role"].startswith("OpenAI API"):
                url += "/v1"
            restarts = "-" if r["restarts"] is None else str(r["restarts"])
            t.add_row(r["name"], redact_url(url), r["role"], str(r["pid"] or "-"), restarts, r["log"] or "-")
        return t

    def hints(self) -> str:
        """Two commands to try, with this stack's addresses."""
        lines = []
        endpoint = self.gateways[0].url if self.gateways else self.workers[0].url if self.workers else None
        if self.workers and endpoint:
            ca = f"--cacert {self.cfg.tls.ca_file} " if self.cfg.tls.ca_file and self.cfg.tls.cert_file else ""
            lines.append(f"  curl {ca}{endpoint}/v1/completions -H 'Content-Type: application/json' "
                         "-d '{\"prompt\": \"Hello\", \"max_tokens\": 8}'")
        # NOTE: as printed, from a fresh shell: the full command (no activated venv needed) and, unless
        # the nearest .kvl-state of the working directory is this stack's, its state dir (kvledger.discovery)
        kvl = cli_command()
        flag = "" if found_from(self.state_dir, Path.cwd()) else f" --state-dir {shlex.quote(str(self.state_dir))}"
        lines += [f"  {kvl} {command}{flag}" for command in ("workers", "events --follow", "audit")]
        lines.append(f"  state and logs: {self.state_dir}/ (stack.json lists the addresses; logs/*.log are JSON lines)")
        if self.credentials is not None:
            lines.append(f"  NATS users (operator, observer, ...): passwords in {self.credentials.dir}/ "
                         "(docs/operations.md, \"Identity on the bus\")")
        return "try:\n" + "\n".join(lines)

    def write_state_file(self, ready: bool = True) -> None:
        """``<state_dir>/stack.json``: what runs where (for scripts), and what to clean up if this
        supervisor is killed before it can stop its children (:func:`kvledger.stack.orphans.stop_leftovers`)."""
        doc = {"supervisor_pid": os.getpid(), "ready": ready, "state_dir": str(self.state_dir),
               "coordinator_url": self.coordinator_url, "coordinator_urls": [c.url for c in self.coordinators],
               "worker_urls": [w.url for w in self.workers],
               "gateway_url": self.gateways[0].url if self.gateways else None,
               "gateway_urls": [g.url for g in self.gateways],
               # the operator commands that find this file read this configuration too (kvledger.discovery)
               "config": str(Path(self.opts.config_path).resolve()) if self.opts.config_path else None,
               "services": [{**r, "url": redact_url(r["url"] or "")} for r in self.rows()]}
        path = self.state_dir / "stack.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        tmp.replace(path)
        self._wrote_state = True


def redact_url(url: str) -> str:
    """A URL without its password (``postgresql://user:secret@host`` → ``user:***@host``)."""
    if "://" in url and "@" in url:
        scheme, rest = url.split("://", 1)
        cred, host = rest.rsplit("@", 1)
        if ":" in cred:
            cred = cred.split(":", 1)[0] + ":***"
        return f"{scheme}://{cred}@{host}"
    return url
