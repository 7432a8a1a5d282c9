"""Who may ask, checked before any route runs: the Host a request names, the Origin a browser says it comes from, and
the API key (to a tenant).

A browser is the client to fear when the server has no key (the default on loopback): any page the local user opens
may send it requests. It cannot read the answers of another origin, but it can send a form (a "simple" request, no
CORS preflight), and with DNS rebinding (a name of the attacker's that resolves to 127.0.0.1) it can read them too,
under its own origin. So: a request whose `Host` is not a name of this server is refused (a rebinding page sends its
own name), and a state-changing request (POST, DELETE, ...) whose `Origin` is another site's is refused (a page
always sends its origin with those). Clients that are not browsers send no Origin, and the right Host.
`/health` and `/ready` answer any Host: probes (kubelet) send the pod's IP.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from .errors import ApiError
from .tenants import DEFAULT_TENANT, Keys

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
ANY_HOST = ("/health", "/ready")  # probes address the pod by IP


@dataclass(frozen=True)
class Names:
    """This server's names: those a request's Host may be (None: any), and those given with --allowed-host, whose
    pages (an Origin on any port) are this server's too (a reverse proxy's public name)."""

    hosts: frozenset[str] | None = None
    trusted: frozenset[str] = frozenset()


def server_names(listen: str, extra: Iterable[str] = ()) -> Names:
    """The address the server listens on (and, for a loopback one, every loopback name), plus the `--allowed-host`
    names (lower case, no port). Any Host for a wildcard address (0.0.0.0, ::) without `--allowed-host`, or where one
    of them is `*`."""
    trusted = frozenset(h.strip().lower().rstrip(".") for h in extra) - {""}
    if "*" in trusted:
        return Names(None, trusted - {"*"})
    try:
        address = ipaddress.ip_address(listen)
    except ValueError:
        address = None
    if address is not None and address.is_unspecified:
        return Names(trusted or None, trusted)
    hosts = set(trusted) | {listen.lower()}
    if listen.lower() == "localhost" or (address is not None and address.is_loopback):
        hosts.update(LOOPBACK_NAMES)
    return Names(frozenset(hosts), trusted)


def _host_port(netloc: str) -> tuple[str, int | None]:
    """("example.com", 8000) from "Example.com:8000"; ValueError if it is not a host[:port]."""
    parts = urlsplit("//" + netloc)
    if not parts.hostname or parts.username is not None or parts.path or parts.query or parts.fragment:
        raise ValueError(netloc)
    return parts.hostname.rstrip("."), parts.port


def check_host(path: str, headers: Mapping[str, str], names: Names) -> None:
    """400 unless the request's Host is one of this server's names (a DNS-rebinding page sends its own)."""
    host, allowed = headers.get("host"), names.hosts
    if allowed is None or host is None or path in ANY_HOST:  # no Host: HTTP/1.0, not a browser
        return
    try:
        name, _ = _host_port(host)
    except ValueError:
        name = None
    if name not in allowed:
        raise ApiError(400, f"Host {host[:100]!r} is not a name of this server: address it as "
                            f"{' or '.join(sorted(allowed))} (or start it with --allowed-host NAME)",
                       code="invalid_host")


def check_origin(method: str, headers: Mapping[str, str], names: Names) -> None:
    """400 for a state-changing request that a browser sent from a page of another origin: its Origin must be this
    server as the request addresses it (its Host, port included), or a name given with --allowed-host."""
    origin = headers.get("origin")
    if origin is None or method in SAFE_METHODS:
        return
    try:
        parts = urlsplit(origin)
        name, port = _host_port(parts.netloc)
        if parts.scheme not in ("http", "https"):
            raise ValueError(origin)
        port = port or (443 if parts.scheme == "https" else 80)
        host, host_port = _host_port(headers.get("host", ""))
    except ValueError:
        name = port = host = host_port = None
    same = name is not None and name == host and (port == host_port or (host_port is None and port in (80, 443)))
    if not same and name not in names.trusted:
        raise ApiError(400, f"cross-origin request refused: Origin {origin[:100]!r} is not this server (a web page "
                            "of another site may not send it requests)", code="cross_origin_request")


def authorize(path: str, headers: Mapping[str, str], keys: Keys | None) -> str:
    """The tenant a request is from: its key's (401 for a missing or unknown key on /v1/), `default` without keys."""
    if keys is None or not path.startswith("/v1/"):
        return DEFAULT_TENANT
    header = headers.get("authorization", "")
    given = header[7:].strip() if header[:7].lower() == "bearer " else ""
    tenant = keys.tenant(given) if given else None
    if tenant is None:
        raise ApiError(401, "missing or wrong API key: send Authorization: Bearer KEY",
                       headers={"WWW-Authenticate": "Bearer"})
    return tenant
