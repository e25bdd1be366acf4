"""What a Redis URL names: one server (``redis://``, ``rediss://``, ``unix://``), or a primary that
Sentinels name and that moves when they fail over (``sentinel://``, ``sentinels://`` for TLS).

Parsing only, with no Redis import, so that Settings can refuse a malformed URL at start in one
line. ``omni_jobs.core.redis_clients`` turns a URL into a client; this module says what the URL means.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, quote, unquote, urlsplit

DEFAULT_SENTINEL_PORT = 26379
SENTINEL_SCHEMES = {"sentinel": False, "sentinels": True}
"""Scheme -> TLS (to the Sentinels and to the primary, as ``rediss://`` is to one server)."""
SERVER_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_FORMAT = ("sentinel://[[user]:password@]host[:port][,host[:port]...]/master-name[/db]"
                   "[?sentinel_password=...&sentinel_username=...] (sentinels:// for TLS, with ssl_ca_certs=FILE)")
SENTINEL_OPTIONS = ("sentinel_password", "sentinel_username", "ssl_ca_certs")
BROKER_TIMEOUT_S, BROKER_CONNECT_TIMEOUT_S, BROKER_HEALTH_CHECK_S = 10.0, 2.0, 5
"""kombu's read and connect timeouts and health checks on a Sentinel broker (see ``kombu_broker``)."""


class RedisUrlInvalid(ValueError):
    """A Redis URL that names no server and no Sentinels: one line, naming the setting and the format."""


@dataclass(frozen=True)
class SentinelUrl:
    """The Sentinels to ask, the primary's name among them, and how to reach and log in to it.

    ``password``/``username`` (the URL's user part) log in to the primary and its replicas, as in
    ``redis://``; ``sentinel_password``/``sentinel_username`` (query) to the Sentinels, where they
    require it (``requirepass`` in sentinel.conf); none when not given."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    tls: bool = False
    ssl_ca_certs: str | None = None
    """The CA bundle that signed the servers' and the Sentinels' certificates (TLS; default: the system's)."""

    @property
    def scheme(self) -> str:
        return "sentinels" if self.tls else "sentinel"

    def redacted(self) -> str:
        """The URL with its passwords masked (for logs, /readyz, doctor)."""
        auth = f"{self.username or ''}:***@" if self.password is not None else ""
        hosts = ",".join(_hostport(h, p) for h, p in self.sentinels)
        return f"{self.scheme}://{auth}{hosts}/{self.master}/{self.db}"


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def _invalid(setting: str, why: str) -> RedisUrlInvalid:
    return RedisUrlInvalid(f"{setting} {why}; a Sentinel URL is {SENTINEL_FORMAT}")


def _parse_host(part: str, setting: str) -> tuple[str, int]:
    host, port = part, ""
    if part.startswith("["):  # [::1]:26379
        end = part.find("]")
        if end < 0:
            raise _invalid(setting, f"has an unclosed IPv6 address {part!r}")
        host, rest = part[1:end], part[end + 1:]
        if rest and not rest.startswith(":"):
            raise _invalid(setting, f"has a malformed Sentinel address {part!r}")
        port = rest[1:]
    elif ":" in part:
        host, port = part.rsplit(":", 1)
    if not host:
        raise _invalid(setting, f"has a Sentinel address with no host ({part!r})")
    if not port:
        return host, DEFAULT_SENTINEL_PORT
    if not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise _invalid(setting, f"has a bad port in Sentinel address {part!r}")
    return host, int(port)


def parse_sentinel_url(url: str, setting: str = "OMNI_REDIS_URL") -> SentinelUrl:
    """The Sentinels, primary name, database and credentials of a ``sentinel://`` URL; RedisUrlInvalid,
    naming ``setting`` and the format (never the password), when it is malformed."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SENTINEL_SCHEMES:
        raise _invalid(setting, "is not a Sentinel URL")
    rest, _, query = rest.partition("?")
    rest, _, _fragment = rest.partition("#")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
        if not colon:  # sentinel://secret@host: redis-py reads a lone user part as the password too
            username, password = None, unquote(user) or None
    if not hosts.strip(","):
        raise _invalid(setting, "names no Sentinel (host:port)")
    sentinels = tuple(_parse_host(h.strip(), setting) for h in hosts.split(",") if h.strip())
    parts = [p for p in path.split("/") if p]
    if not parts:
        raise _invalid(setting, "names no master (the name Sentinels monitor, e.g. /mymaster)")
    if len(parts) > 2:
        raise _invalid(setting, f"has a path of {len(parts)} parts where /master-name[/db] is expected")
    master = unquote(parts[0])
    db = 0
    if len(parts) == 2:
        if not parts[1].isascii() or not parts[1].isdigit():
            raise _invalid(setting, f"has database {parts[1]!r}, not a number")
        db = int(parts[1])
    options: dict[str, str] = {}
    for name, values in parse_qs(query, keep_blank_values=True).items():
        if name not in SENTINEL_OPTIONS:
            raise _invalid(setting, f"has an unknown option {name!r} (known: {', '.join(SENTINEL_OPTIONS)})")
        options[name] = values[-1]
    return SentinelUrl(sentinels=sentinels, master=master, db=db, username=username, password=password,
                       sentinel_username=options.get("sentinel_username") or None,
                       sentinel_password=options.get("sentinel_password") or None,
                       tls=SENTINEL_SCHEMES[scheme.lower()], ssl_ca_certs=options.get("ssl_ca_certs") or None)


def check_redis_url(url: str, setting: str) -> str:
    """``url`` if it names a server or Sentinels (a Sentinel URL is parsed in full), else RedisUrlInvalid."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in SENTINEL_SCHEMES:
        parse_sentinel_url(url, setting)
    elif scheme not in SERVER_SCHEMES:
        raise RedisUrlInvalid(f"{setting} must start with redis://, rediss://, unix://, or sentinel:// "
                              f"(Sentinels: {SENTINEL_FORMAT})")
    return url


def redact_url(url: str) -> str:
    """``url`` with any password masked."""
    if is_sentinel_url(url):
        try:
            return parse_sentinel_url(url).redacted()
        except RedisUrlInvalid:
            return url.split("://", 1)[0] + "://***"
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = quote(parts.username or "", safe="")
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


def kombu_broker(url: str, setting: str = "OMNI_BROKER_URL") -> dict[str, object]:
    """Celery's broker settings for ``url``: ``broker_url`` in kombu's spelling, and for Sentinels the
    transport options and TLS it needs besides.

    kombu's Sentinel transport takes each Sentinel as a URL of its own (``sentinel://h1:26379;
    sentinel://h2:26379``, the primary's password in them, the database on the first), the primary's
    name as the transport option ``master_name``, and the Sentinels' own login in ``sentinel_kwargs``.
    Any other URL is kombu's already."""
    if not is_sentinel_url(url):
        return {"broker_url": url}
    target = parse_sentinel_url(url, setting)
    auth = ""
    if target.password is not None:
        auth = f"{quote(target.username or '', safe='')}:{quote(target.password, safe='')}@"
    urls = [f"sentinel://{auth}{_hostport(h, p)}" for h, p in target.sentinels]
    urls[0] += f"/{target.db}"
    sentinel_kwargs: dict[str, object] = {}
    if target.sentinel_password is not None:
        sentinel_kwargs["password"] = target.sentinel_password
    if target.sentinel_username is not None:
        sentinel_kwargs["username"] = target.sentinel_username
    tls: dict[str, object] = {"ssl_cert_reqs": "required"}  # kombu turns TLS on only for a non-empty dict
    if target.ssl_ca_certs is not None:
        tls["ssl_ca_certs"] = target.ssl_ca_certs
    if target.tls:
        sentinel_kwargs.update(ssl=True, **tls)
    # A primary whose machine is gone answers nothing and resets nothing: without timeouts a publish
    # waited on it for ever, and a consumer's BRPOP for brpop_timeout + 2 x health_check_interval (51 s).
    options: dict[str, object] = {"master_name": target.master, "socket_timeout": BROKER_TIMEOUT_S,
                                  "socket_connect_timeout": BROKER_CONNECT_TIMEOUT_S, "socket_keepalive": True,
                                  "health_check_interval": BROKER_HEALTH_CHECK_S}
    if sentinel_kwargs:
        options["sentinel_kwargs"] = sentinel_kwargs
    config: dict[str, object] = {"broker_url": ";".join(urls), "broker_transport_options": options}
    if target.tls:
        config["broker_use_ssl"] = tls
    return config
