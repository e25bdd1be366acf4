"""SSRF protection for webhooks: where a job may make this system send an HTTP request.

A webhook URL names a host that the job's author controls, so it could point the webhooks worker at
Redis, a cloud metadata endpoint (169.254.169.254) or anything else inside the network. The guard
resolves the host and refuses private, loopback, link-local, multicast, reserved and unspecified
addresses, and plain ``http://``, unless the host (or ``host:port``) is in ``OMNI_WEBHOOK_ALLOW_HOSTS``.

It runs at submit time (a 422 naming ``webhook``) and again at each delivery, where the address
it checked is the one the connection uses: the request goes to the IP, with the original ``Host``
header and TLS server name, so a DNS answer that changes between the check and the connect
(DNS rebinding) cannot redirect it. Redirects are never followed (``webhooks.post_webhook``).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

Resolver = Callable[[str, int], list[str]]
"""(host, port) -> the IP addresses it resolves to now."""

DEFAULT_PORTS = {"http": 80, "https": 443}


class UnsafeWebhookUrl(ValueError):
    """The URL may not be called; the message says why and how to allow it."""


class HostDoesNotResolve(UnsafeWebhookUrl):
    """No address now: refused at submit; at delivery a transient failure, retried."""


def system_resolver(host: str, port: int) -> list[str]:
    """Every address getaddrinfo gives for host (the OS resolver, /etc/hosts included)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise HostDoesNotResolve(f"host {host!r} does not resolve ({exc})") from None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def is_public(address: str) -> bool:
    """True for a globally routable unicast address; False for private, loopback, link-local, ..."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return bool(ip.is_global and not (ip.is_multicast or ip.is_private or ip.is_loopback or ip.is_link_local
                                      or ip.is_reserved or ip.is_unspecified))


@dataclass(frozen=True)
class PinnedRequest:
    """A webhook URL bound to the address that was checked: what the HTTP client is given."""

    url: str
    """The URL with its host replaced by the checked IP address."""
    address: str
    headers: dict[str, str]
    """``Host`` as the original URL names it."""
    extensions: dict[str, str]
    """``sni_hostname`` for TLS (the certificate is verified against the original host name)."""


@dataclass
class NetGuard:
    """Checks webhook URLs and pins them to a checked address."""

    allow_hosts: Sequence[str] = ()
    resolve: Resolver = field(default=system_resolver)

    def __post_init__(self) -> None:
        self._allowed = {h.strip().lower() for h in self.allow_hosts if h.strip()}

    def allowed(self, host: str, port: int) -> bool:
        host = host.lower()
        return host in self._allowed or f"{host}:{port}" in self._allowed or f"[{host}]:{port}" in self._allowed

    def _target(self, url: str) -> tuple[str, str, int, bool]:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in DEFAULT_PORTS or not parts.hostname:
            raise UnsafeWebhookUrl("must be an https:// URL with a host")
        try:
            port = parts.port or DEFAULT_PORTS[scheme]
        except ValueError:
            raise UnsafeWebhookUrl("has an invalid port") from None
        allowed = self.allowed(parts.hostname, port)
        if scheme != "https" and not allowed:
            raise UnsafeWebhookUrl(f"must be an https:// URL (http:// only for hosts in OMNI_WEBHOOK_ALLOW_HOSTS; "
                                   f"{parts.hostname!r} is not)")
        return scheme, parts.hostname, port, allowed

    def _addresses(self, host: str, port: int, allowed: bool) -> list[str]:
        addresses = self.resolve(host, port)
        if not addresses:
            raise HostDoesNotResolve(f"host {host!r} resolves to no address")
        if not allowed:
            blocked = [a for a in addresses if not is_public(a)]
            if blocked:
                raise UnsafeWebhookUrl(
                    f"host {host!r} resolves to {', '.join(blocked)}, a private, loopback, link-local or reserved "
                    f"address; webhooks go only to public addresses unless the host is in OMNI_WEBHOOK_ALLOW_HOSTS")
        return addresses

    def check(self, url: str) -> list[str]:
        """The addresses the URL's host resolves to, all permitted; UnsafeWebhookUrl otherwise."""
        _scheme, host, port, allowed = self._target(url)
        return self._addresses(host, port, allowed)

    def pin(self, url: str) -> PinnedRequest:
        """Check the URL now and bind it to the first checked address (call at each delivery)."""
        scheme, host, port, allowed = self._target(url)
        address = self._addresses(host, port, allowed)[0]
        parts = urlsplit(url)
        ip_host = f"[{address}]" if ":" in address else address
        netloc = ip_host if parts.port is None else f"{ip_host}:{parts.port}"
        name = f"[{host}]" if ":" in host else host  # an IPv6 literal URL keeps its brackets
        host_header = name if parts.port is None else f"{name}:{parts.port}"
        pinned = urlunsplit((scheme, netloc, parts.path or "/", parts.query, ""))
        extensions = {"sni_hostname": host} if scheme == "https" else {}
        return PinnedRequest(url=pinned, address=address, headers={"host": host_header},
                             extensions=extensions)
