"""``omni-jobs keys create|revoke|list|limits``: manage API keys and quotas in OMNI_REDIS_URL's Redis.

Run where Redis is reachable, e.g. ``docker compose run --rm api omni-jobs keys create --tenant acme``.
The key is printed once, on stdout, and never stored; only its hash is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from omni_jobs.accept.auth import ApiKeys, check_tenant
from omni_jobs.core import keys
from omni_jobs.core.redis_clients import redis_client
from omni_jobs.core.settings import load_settings


def _keys() -> ApiKeys:
    return ApiKeys(redis_client(load_settings().redis_url))


def cmd_create(args: argparse.Namespace) -> int:
    try:
        key, info = _keys().create(args.tenant, args.name or "")
    except ValueError as exc:
        print(f"omni-jobs keys create: {exc}", file=sys.stderr)
        return 2
    print(key)
    print(f"created key {info.id} for tenant {info.tenant!r}; it is shown only now: keep it "
          f"(revoke: omni-jobs keys revoke {info.id})", file=sys.stderr)
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    try:
        info = _keys().revoke(args.key_id)
    except KeyError:
        print(f"omni-jobs keys revoke: no key with id {args.key_id!r} (omni-jobs keys list shows them)",
              file=sys.stderr)
        return 1
    print(f"revoked key {info.id} (tenant {info.tenant!r})")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = [info.__dict__ for info in _keys().list()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(row["created_at"]))
        state = "revoked" if row["revoked"] else "active"
        print(f"{row['id']}  {row['tenant']:<20} {state:<8} {created}Z  {row['name']}")
    return 0


LIMITS = ("max_active", "per_minute")


def cmd_limits(args: argparse.Namespace) -> int:
    """Show, set or clear the quotas of a tenant or of one API key (docs/scaling.md)."""
    client = redis_client(load_settings().redis_url, decode_responses=True)
    if args.key_id:
        target, what = keys.api_key(args.key_id), f"key {args.key_id}"
        if not client.exists(target):
            print(f"omni-jobs keys limits: no key with id {args.key_id!r} (omni-jobs keys list shows them)",
                  file=sys.stderr)
            return 1
    else:
        target, what = keys.tenant_limits(check_tenant(args.tenant)), f"tenant {args.tenant!r}"
    changes = {name: getattr(args, name) for name in LIMITS if getattr(args, name) is not None}
    if args.clear:
        client.hdel(target, *LIMITS)
    if changes:
        client.hset(target, mapping={name: str(value) for name, value in changes.items()})
    current = {name: client.hget(target, name) for name in LIMITS}
    shown = ", ".join(f"{name}={str(value) if value not in (None, '', '0') else 'none'}" for name, value in current.items())
    print(f"{what}: {shown} (unset limits fall back to the tenant's, then to OMNI_TENANT_MAX_ACTIVE / "
          f"OMNI_TENANT_JOBS_PER_MINUTE; new values apply within 5 s)")
    return 0


def add_key_commands(sub: Any) -> None:
    keys = sub.add_parser("keys", help="create, revoke and list API keys (in OMNI_REDIS_URL's Redis)")
    actions = keys.add_subparsers(dest="keys_action", required=True)
    create = actions.add_parser("create", help="make a key for a tenant; prints it once")
    create.add_argument("--tenant", required=True, help="who owns the jobs made with this key")
    create.add_argument("--name", default="", help="a note: who or what uses the key")
    create.set_defaults(func=cmd_create)
    revoke = actions.add_parser("revoke", help="revoke a key by its id (the 16 hex characters after ok_)")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=cmd_revoke)
    listing = actions.add_parser("list", help="every key: id, tenant, active or revoked, created, name")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=cmd_list)
    limits = actions.add_parser("limits", help="show or set the quotas of a tenant (or of one key): jobs queued or "
                                "running at once, jobs per minute; 0 means none")
    who = limits.add_mutually_exclusive_group(required=True)
    who.add_argument("--tenant", help="the tenant whose limits to show or set")
    who.add_argument("--key", dest="key_id", help="a key id: its own limits, over its tenant's")
    limits.add_argument("--max-active", dest="max_active", type=int, help="jobs queued or running at once")
    limits.add_argument("--per-minute", dest="per_minute", type=int, help="jobs submitted per minute")
    limits.add_argument("--clear", action="store_true", help="remove the limits set here first")
    limits.set_defaults(func=cmd_limits)
