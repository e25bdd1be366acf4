"""The Redis job store's Lua scripts (omni_jobs.jobs.redis_store), read once, at import, from lua/*.lua.

Three files hold functions that several scripts share: ``publish`` (an outbox entry pushed onto its
Celery queue where this Redis is the broker), ``claim`` (the outbox's due entries) and ``release``
(the scheduler's pass over queues). The others are the bodies of the scripts: ``commit`` (a Change,
applied if its guards hold), ``claim_outbox``, ``release_queues`` and ``release_and_claim`` (the
relay's pass). A script is its functions, then its body, each after a blank line; one that publishes
starts with the TEMPLATES table that ``publish`` reads (``NO_TEMPLATES``: none; a store that is the
broker puts ``lua_templates`` in its place, with the JOB_KEY and PROGRESS_SUFFIX it reads a job by).
``commit_placed`` is the commit's ending for a submit: instead of the commit's last line, it also
answers the queue position of the job written.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from omni_jobs.core import keys

LUA = Path(__file__).parent / "lua"
NO_TEMPLATES = "local TEMPLATES = {}\n"
"""The scripts' TEMPLATES table where the store is not the broker (see lua_templates)."""


def _chunk(name: str) -> str:
    return "\n" + (LUA / f"{name}.lua").read_text(encoding="utf-8")


def _script(*names: str) -> str:
    """The chunks named, in order (the functions a body calls come before it)."""
    with_templates = "publish" in names
    return (NO_TEMPLATES if with_templates else "") + "".join(_chunk(name) for name in names)


_COMMIT_RETURN = "\nreturn {1, released, full, sent}\n"

COMMIT = _script("publish", "release", "commit")
"""Applies a Change if all its guards hold (KEYS: none; ARGV[1]: the change's wire form, ARGV[2]: its pass)."""
assert COMMIT.endswith(_COMMIT_RETURN)
COMMIT_PLACED = COMMIT.replace(_COMMIT_RETURN, _chunk("commit_placed"))
"""The commit script, answering the queue position of the job it wrote as well (a submit's answer)."""
CLAIM = _script("publish", "claim", "claim_outbox")
RELEASE = _script("release", "release_queues")
RELEASE_AND_CLAIM = _script("publish", "claim", "release", "release_and_claim")


def lua_templates(templates: Mapping[str, str] | None) -> str:
    """The scripts' TEMPLATES table (see publish): step kind -> its task message, as long strings."""
    if not templates:
        return NO_TEMPLATES
    for kind, template in templates.items():
        if not kind.isidentifier() or "]===]" in template:
            raise ValueError(f"a broker message template for {kind!r} cannot go into a script")
    job_key, progress_suffix = keys.job(""), keys.job_progress("").removeprefix(keys.job(""))
    return ("local TEMPLATES = {" + ", ".join(f"{kind} = [===[{t}]===]" for kind, t in sorted(templates.items()))
            + f"}}\nlocal JOB_KEY, PROGRESS_SUFFIX = '{job_key}', '{progress_suffix}'\n")
