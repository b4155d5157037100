"""Which addresses the server may bind: loopback always; anything else only with an API key or an explicit
`--allow-insecure-bind`, so that a port open to a network never serves anyone by accident.

Kept free of heavy imports: the CLI checks this before it loads a model.
"""

from __future__ import annotations

import ipaddress

from nextoken.errors import NextokenError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # any other host name may resolve to a public address


def check_bind(host: str, api_key: str | None, allow_insecure_bind: bool) -> None:
    if is_loopback(host) or api_key or allow_insecure_bind:
        return
    raise NextokenError(f"refusing to bind {host!r} without --api-key: anyone who can reach it could use the "
                        "server; set --api-key, bind 127.0.0.1, or pass --allow-insecure-bind")
