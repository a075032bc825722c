"""The coordinator's admin REST API as the operator commands call it: where it is (the flag, the
environment, the stack this command belongs to, the configuration), its token and TLS settings,
one call with its failure as one readable line, and the following of cursor pages."""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from kvledger.cli_support import CliError
from shared.config import Config, load_config
from shared.tls import client_context, http_scheme


@dataclass
class AdminClient:
    url: str
    token: str = ""
    timeout_s: float = 10.0
    #: Verifies an ``https`` coordinator (``tls.ca_file``, and ``cert_file`` for mutual TLS); None = system CAs.
    context: Any = None

    def call(self, method: str, path: str, body: dict[str, Any] | None = None,
             query: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        q = {k: v for k, v in (query or {}).items() if v not in (None, "")}
        full = self.url.rstrip("/") + path + (f"?{urllib.parse.urlencode(q)}" if q else "")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(full, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s,  # noqa: S310 - operator's URL
                                        context=self.context) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            raise CliError(self._http_error(e)) from None
        except urllib.error.URLError as e:
            reason = getattr(e.reason, "strerror", None) or str(e.reason)
            raise CliError(f"coordinator not reachable at {self.url} ({reason}); is it running? (kvledger up)") \
                from None
        except TimeoutError:
            raise CliError(f"coordinator at {self.url} did not answer within {timeout_s or self.timeout_s:.0f}s "
                           f"({method} {path})") from None
        except ConnectionError as e:
            raise CliError(f"coordinator not reachable at {self.url} ({e.strerror or e}); is it running? "
                           f"(kvledger up)") from None

    def _http_error(self, e: urllib.error.HTTPError) -> str:
        try:
            err = json.loads(e.read() or b"{}").get("error", {})
            message = err.get("message") or e.reason
        except (ValueError, AttributeError):
            message = e.reason
        if e.code == 401:
            return (f"the coordinator at {self.url} refused the request: {message} "
                    f"(give the admin token with --token, KVL_ADMIN_TOKEN or coordinator.admin_token)")
        if e.code == 503:
            return f"the coordinator at {self.url} is not serving right now: {message}"
        if e.code == 404 and not message:
            return f"not found at {self.url}"
        return f"{message} (HTTP {e.code})"


def coordinator_url(cfg: Config, given: str | None) -> str:
    if given:
        return given.rstrip("/")
    if os.environ.get("KVL_COORDINATOR_URL"):
        return os.environ["KVL_COORDINATOR_URL"].rstrip("/")
    host = cfg.coordinator.host
    if host in ("0.0.0.0", "::", ""):  # listening everywhere: talk to it over loopback
        host = "127.0.0.1"
    return f"{http_scheme(cfg.tls)}://{host}:{cfg.coordinator.port}"


def client_for(args: argparse.Namespace) -> AdminClient:
    from kvledger.discovery import NoStack, find_stack

    cfg = load_config(getattr(args, "config", None))
    url = args.coordinator_url or os.environ.get("KVL_COORDINATOR_URL")
    if not url:
        try:
            stack = find_stack(getattr(args, "state_dir", None), cfg.state_dir)
        except NoStack as e:
            raise CliError(str(e)) from None
        if stack is not None and stack.coordinator_url:
            url = stack.coordinator_url
            if stack.config_path and not getattr(args, "config", None) and not os.environ.get("KVL_CONFIG"):
                cfg = load_config(stack.config_path)   # its admin token and TLS settings
    token = args.token or cfg.coordinator.admin_token or os.environ.get("KVL_ADMIN_TOKEN", "")
    return AdminClient(coordinator_url(cfg, url), token, args.timeout, client_context(cfg.tls))


def pages(client: AdminClient, path: str, key: str, query: dict[str, Any], follow_all: bool) -> tuple[list[Any], str | None]:
    """The ``key`` items of ``path``'s first page, or of every page with ``follow_all``; and the
    cursor of the next page, if any."""
    items: list[Any] = []
    while True:
        doc = client.call("GET", path, query=query)
        items += doc[key]
        cursor = doc.get("next_cursor")
        if not (follow_all and cursor):
            return items, cursor
        query = {**query, "cursor": cursor}
