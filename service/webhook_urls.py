"""Where a webhook may be sent: the URL policy, checked when an endpoint is registered and again
on every address its host resolves to when a delivery is sent (a name that resolved to a public
address at registration may resolve to 127.0.0.1 later: DNS rebinding).

Refused unless the operator allows them (`LORAQ_WEBHOOK_ALLOW_HOSTS`: names, addresses, CIDRs):
- a scheme other than https (http too with `LORAQ_WEBHOOK_ALLOW_HTTP`);
- loopback (127/8, ::1), link-local (169.254/16, fe80::/10: cloud metadata services live
  there), unspecified (0.0.0.0, ::) and multicast addresses, IPv4-mapped IPv6 forms included;
- the API's own host: the name or address a request reached it by, its bind address, and any
  address of this machine (one a socket can bind to);
- `LORAQ_WEBHOOK_DENY_NETWORKS` (e.g. the private networks of the deployment).

The sender connects to the address it checked (`Target.address`), never resolving again.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from service.errors import InvalidRequestError
from service.settings import Settings, get_settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
MAX_URL_CHARS = 2048


class UrlRefused(Exception):
    """A webhook URL the policy refuses; the message says why."""


@dataclass(frozen=True)
class Target:
    """A checked URL: where to connect (`address`) and what to name (`host`: Host header, SNI)."""

    scheme: str
    host: str
    port: int
    address: str
    path: str  # path and query, as given


def _address(host: str) -> IPAddress | None:
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    return ip


def _allowed(host: str, ip: IPAddress | None, settings: Settings) -> bool:
    for entry in settings.webhook_allow_hosts:
        if entry.lower() == host.lower():
            return True
        if ip is not None:
            try:
                if ip in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                continue  # a host name entry
    return False


def _is_local(ip: IPAddress) -> bool:
    """Is `ip` an address of this machine? Only a local address can be bound."""
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((str(ip), 0))
        return True
    except OSError:
        return False


def address_refusal(ip: IPAddress, settings: Settings) -> str | None:
    """Why the policy refuses address `ip` (not counting the allow list), or None."""
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_unspecified:
        return "an unspecified address"
    if ip.is_multicast:
        return "a multicast address"
    for network in settings.webhook_deny_networks:
        if ip in network:
            return f"in {network} (LORAQ_WEBHOOK_DENY_NETWORKS)"
    if _address(settings.host) == ip or _is_local(ip):
        return "an address of the API's own host"
    return None


def _split(url: str, settings: Settings) -> tuple[str, str, int, str]:
    """(scheme, host, port, path) of an absolute http(s) URL the policy's scheme rule allows."""
    if len(url) > MAX_URL_CHARS:
        raise UrlRefused(f"it is longer than {MAX_URL_CHARS} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise UrlRefused(f"it is not a valid URL ({e})") from None
    scheme = parts.scheme.lower()
    if scheme not in ("https", "http"):
        raise UrlRefused("it must be an https:// URL")
    if scheme == "http" and not settings.webhook_allow_http:
        raise UrlRefused("it must be https:// (http:// is allowed only with LORAQ_WEBHOOK_ALLOW_HTTP)")
    if not parts.hostname:
        raise UrlRefused("it has no host")
    if parts.username is not None or parts.password is not None:
        raise UrlRefused("it may not hold a user name or password (the signature authenticates)")
    if parts.fragment:
        raise UrlRefused("it may not have a #fragment")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return scheme, parts.hostname, port or (443 if scheme == "https" else 80), path


def _resolve(host: str, port: int) -> list[IPAddress]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise UrlRefused(f"its host {host!r} does not resolve ({e.strerror or e})") from None
    except (UnicodeError, ValueError) as e:  # not a host name (IDNA refuses it, a NUL byte)
        raise UrlRefused(f"its host {host!r} is not a valid host name ({e})") from None
    found: list[IPAddress] = []
    for info in infos:
        ip = _address(str(info[4][0]))
        if ip is not None and ip not in found:
            found.append(ip)
    if not found:
        raise UrlRefused(f"its host {host!r} has no address")
    return found


def resolve_target(url: str, *, api_hosts: frozenset[str] = frozenset()) -> Target:
    """Check `url` and every address its host resolves to; the first allowed address is the one
    to connect to. `api_hosts`: names the API was reached by (a request's Host). `UrlRefused`."""
    settings = get_settings()
    scheme, host, port, path = _split(url, settings)
    literal = _address(host)
    if _allowed(host, literal, settings):
        addresses = [literal] if literal is not None else _resolve(host, port)
        return Target(scheme, host, port, str(addresses[0]), path)
    if literal is None and host.lower() in {h.lower() for h in api_hosts} | {settings.host.lower()}:
        raise UrlRefused(f"its host {host!r} is the API's own host")
    addresses = [literal] if literal is not None else _resolve(host, port)
    for ip in addresses:
        why = None if _allowed(host, ip, settings) else address_refusal(ip, settings)
        if why is not None:
            shown = host if literal is not None else f"{host!r} resolves to {ip}, which"
            raise UrlRefused(f"{shown} is {why}; an operator may allow it with LORAQ_WEBHOOK_ALLOW_HOSTS")
    return Target(scheme, host, port, str(addresses[0]), path)


def check_endpoint_url(url: str, *, api_hosts: frozenset[str], param: str = "url") -> str:
    """`url` if the policy allows it now, else a 400 naming `param` and why."""
    try:
        resolve_target(url, api_hosts=api_hosts)
    except UrlRefused as e:
        raise InvalidRequestError(
            f"invalid {param}: {url[:200]!r} is refused: {e}", param=param, code="invalid_webhook_url"
        ) from None
    return url
