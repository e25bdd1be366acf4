"""API keys: each belongs to one tenant; only a hash of it is stored.

A key reads ``ok_<id>_<secret>``: ``id`` (16 hex characters) names its record, so a check is one
Redis read; ``secret`` is 32 random bytes. The record (``keys.api_key(id)``) holds the tenant, a
name, the creation time, a revoked flag and the SHA-256 of the whole key, never the key itself.

Why plain SHA-256 and not bcrypt/argon2: those slow hashes protect low-entropy passwords from
guessing after a leak. A key with 256 random bits cannot be guessed however fast the hash is, and
a slow hash would cost every request tens of milliseconds. The digest is compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass

import redis

from omni_jobs.core import keys
from omni_jobs.core.redis_replies import members, text_hash

KEY_PREFIX = "ok_"
ID_HEX = 16
DEFAULT_TENANT = "default"
"""The tenant of every job while auth is off (embedded demo only)."""

TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_KEY_RE = re.compile(rf"^{KEY_PREFIX}(?P<id>[0-9a-f]{{{ID_HEX}}})_(?P<secret>[A-Za-z0-9_-]{{20,128}})$")


class InvalidApiKey(Exception):
    """Missing, malformed, unknown or revoked key (the caller answers 401 without saying which)."""


@dataclass(frozen=True)
class ApiKeyInfo:
    """What is stored about a key (no secret, no hash): safe to print and list."""

    id: str
    tenant: str
    name: str
    created_at: float
    revoked: bool


def check_tenant(tenant: str) -> str:
    if not TENANT_RE.match(tenant):
        raise ValueError(f"tenant {tenant!r} must be 1-64 characters of letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    return tenant


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    """Create, verify, revoke and list API keys in Redis."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client

    def create(self, tenant: str, name: str = "") -> tuple[str, ApiKeyInfo]:
        """A new key for ``tenant``: (the key, shown once and never again, and its record)."""
        check_tenant(tenant)
        if len(name) > 200:
            raise ValueError("name must be at most 200 characters")
        key_id = secrets.token_hex(ID_HEX // 2)
        key = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
        info = ApiKeyInfo(id=key_id, tenant=tenant, name=name, created_at=time.time(), revoked=False)
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(keys.api_key(key_id), mapping={
                "tenant": tenant, "name": name, "created_at": repr(info.created_at), "revoked": "0",
                "hash": hash_key(key)})
            pipe.zadd(keys.API_KEYS_INDEX, {key_id: info.created_at})
            pipe.execute()
        return key, info

    def _record(self, key_id: str) -> dict[str, str] | None:
        raw = self.redis.hgetall(keys.api_key(key_id))
        return text_hash(raw) if raw else None

    @staticmethod
    def _info(key_id: str, record: dict[str, str]) -> ApiKeyInfo:
        return ApiKeyInfo(id=key_id, tenant=record["tenant"], name=record.get("name", ""),
                          created_at=float(record.get("created_at", "0")), revoked=record.get("revoked") == "1")

    def verify(self, key: str) -> ApiKeyInfo:
        """The key's record if it is known and not revoked; InvalidApiKey otherwise."""
        match = _KEY_RE.match(key.strip())
        if match is None:
            raise InvalidApiKey("malformed key")
        record = self._record(match.group("id"))
        if record is None or not hmac.compare_digest(record.get("hash", ""), hash_key(key.strip())):
            raise InvalidApiKey("unknown key")
        info = self._info(match.group("id"), record)
        if info.revoked:
            raise InvalidApiKey("revoked key")
        return info

    def active(self, key_id: str) -> ApiKeyInfo:
        """The record of key ``key_id`` if it exists and is not revoked (a console session's check on
        every request); InvalidApiKey otherwise."""
        record = self._record(key_id) if re.fullmatch(r"[0-9a-f]{16}", key_id) else None
        if record is None:
            raise InvalidApiKey("unknown key")
        info = self._info(key_id, record)
        if info.revoked:
            raise InvalidApiKey("revoked key")
        return info

    def revoke(self, key_id: str) -> ApiKeyInfo:
        """Mark the key revoked (kept for the record); KeyError if there is no such key."""
        key_id = key_id.removeprefix(KEY_PREFIX)[:ID_HEX]
        record = self._record(key_id)
        if record is None:
            raise KeyError(key_id)
        self.redis.hset(keys.api_key(key_id), "revoked", "1")
        return self._info(key_id, {**record, "revoked": "1"})

    def list(self) -> list[ApiKeyInfo]:
        """Every key, oldest first (revoked ones included, marked)."""
        found: list[ApiKeyInfo] = []
        for key_id in members(self.redis.zrange(keys.API_KEYS_INDEX, 0, -1)):
            record = self._record(key_id)
            if record is not None:
                found.append(self._info(key_id, record))
        return found


class ConsoleSessions:
    """The web console's sessions, kept in Redis: a cookie carries a random token, never the API key.

    A session records the key it signed in with (its id and tenant); each request checks that key
    again (``ApiKeys.active``), so revoking the key ends its sessions at once, and signing out
    deletes the session, so a copy of the cookie is worth nothing after it. Only the token's SHA-256
    is stored, as for API keys (256 random bits: a fast hash is safe)."""

    def __init__(self, client: redis.Redis, *, ttl_s: int) -> None:
        self.redis = client
        self.ttl_s = ttl_s

    def start(self, info: ApiKeyInfo) -> str:
        """A new session for the key ``info``; its token, for the cookie."""
        token = secrets.token_urlsafe(32)
        key = keys.ui_session(hash_key(token))
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"key_id": info.id, "tenant": info.tenant, "created_at": repr(time.time())})
            pipe.expire(key, self.ttl_s)
            pipe.execute()
        return token

    def check(self, token: str) -> ApiKeyInfo:
        """The key of a live session, if that key is still valid; InvalidApiKey otherwise."""
        if not token or len(token) > 128:
            raise InvalidApiKey("no session")
        raw = self.redis.hgetall(keys.ui_session(hash_key(token)))
        session = text_hash(raw) if raw else {}
        if "key_id" not in session:
            raise InvalidApiKey("no such session (signed out, or expired)")
        info = ApiKeys(self.redis).active(session["key_id"])
        if info.tenant != session.get("tenant"):
            raise InvalidApiKey("the key's tenant changed")
        return info

    def end(self, token: str) -> None:
        """Delete the session (signing out): its cookie, sent again, signs in nobody."""
        if token and len(token) <= 128:
            self.redis.delete(keys.ui_session(hash_key(token)))
