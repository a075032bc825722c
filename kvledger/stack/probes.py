"""The supervisor's probes: whether a port is free, and a health endpoint's answer."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def http_json(url: str, timeout_s: float = 2.0, context: Any = None) -> tuple[int, Any]:
    """GET ``url``: ``(status, JSON body or None)``; status 0 when nothing answers. ``context``:
    the TLS context for an ``https`` URL (``shared.tls.client_context``)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as r:  # noqa: S310 - our own URL
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"null")
        except ValueError:
            return e.code, None
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None
