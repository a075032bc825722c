"""Which client addresses an HTTP API answers (``worker.allowed_networks``, ``gateway.allowed_networks``).

A list of networks in CIDR form (a bare address is its own /32 or /128); empty = every address.
A request from anywhere else is answered 403 before anything else looks at it — before the API
key, the body and the route — so an address outside the list learns nothing but that. The
address is the TCP peer's: a proxy in front must be in the list itself, and headers such as
``X-Forwarded-For`` are not trusted. An IPv4 client reaching a dual-stack socket
(``::ffff:10.1.2.3``) is matched as the IPv4 address it is.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable, Sequence
from typing import Any

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(key: str, values: Sequence[str]) -> tuple[Network, ...]:
    """The networks of a config list; a ``ValueError`` naming ``key`` and the bad entry."""
    out = []
    for v in values:
        try:
            out.append(ipaddress.ip_network(v.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{key}: {v!r} is not an address or network in CIDR form "
                             "(e.g. 10.0.0.0/8, 192.168.1.7, fd00::/8)") from None
    return tuple(out)


def allowed(networks: Sequence[Network], remote: str | None) -> bool:
    """Whether a peer address is in ``networks`` (every address when there are none)."""
    if not networks:
        return True
    if not remote:
        return False            # not a TCP peer (a Unix socket): nothing to match
    try:
        ip = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in n for n in networks)


def allowlist_middleware(key: str, networks: Sequence[Network],
                         refused: Callable[[], Any] | None = None) -> Any:
    """An aiohttp middleware answering 403 to a peer outside ``networks`` (None: no list, no
    middleware). ``refused`` is called for each refusal (a metric)."""
    if not networks:
        return None
    from aiohttp import web     # NOTE: here, so that shared.config can validate lists without aiohttp

    nets = tuple(networks)

    @web.middleware
    async def middleware(request: Any, handler: Any) -> Any:
        if allowed(nets, request.remote):
            return await handler(request)
        if refused is not None:
            refused()
        body = {"error": {"message": f"this address is not allowed here ({key})", "type": "forbidden",
                          "param": None, "code": "address_not_allowed"}}
        # NOTE: the connection is closed: a refused peer gets no keep-alive to probe with
        return web.Response(status=403, body=json.dumps(body), content_type="application/json",
                            headers={"Connection": "close"})

    return middleware
