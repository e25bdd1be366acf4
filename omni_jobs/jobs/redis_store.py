"""RedisJobStore: the JobStore (omni_jobs.jobs.store) of every deployment, in one Redis. Jobs are
hashes, events streams, the outbox and leases sorted sets; every change is one Lua script
(omni_jobs.jobs.scripts), so it applies whole or not at all.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeAlias, TypeVar, cast

import redis
import redis.asyncio as aioredis
import redis.asyncio.client
import redis.client
import redis.sentinel
from redis.exceptions import NoScriptError
from redis.typing import XReadResponse

from omni_jobs.core import jsontext, keys
from omni_jobs.core.errors import NotDurable
from omni_jobs.core.redis_clients import async_retry_options
from omni_jobs.core.redis_replies import members, text, text_hash
from omni_jobs.jobs import codec
from omni_jobs.jobs.change import Change, Conflict, Guard, OutboxEntry, ReleasePass
from omni_jobs.jobs.flows import Commit, CommitPlaced, Get, Idempotency, Oldest, Operation, QueuePosition
from omni_jobs.jobs.group_commit import GroupCommit
from omni_jobs.jobs.models import Job, JobEvent, JobStatus, StageRecord, now
from omni_jobs.jobs.scripts import CLAIM, COMMIT, COMMIT_PLACED, NO_TEMPLATES, RELEASE, RELEASE_AND_CLAIM, lua_templates
from omni_jobs.jobs.steps import from_json, stage_slot
from omni_jobs.jobs.store import (
    IdempotencyRecord,
    JobPage,
    WebhookSlot,
    as_int,
    decode_webhook_slots,
    estimate_position,
    job_pending_steps,
    waiting_stage,
)

ScriptReply: TypeAlias = list[int | bytes | None]
"""What the commit script answers: integers, strings, and nil for the rank of an absent member
(redis-py types a script's reply as Any)."""
Pipeline: TypeAlias = redis.client.Pipeline | redis.asyncio.client.Pipeline
Command: TypeAlias = tuple[str | int, ...]
ScriptCommands: TypeAlias = Generator[Command, object, tuple[ScriptReply, list[object] | None]]
"""A script's call as the commands it sends, in turn (``RedisJobStore._script_commands``): each one's reply
is sent back in, a server's error thrown in; it returns the script's reply and what its waits answered."""
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Read:
    """A read operation's commands and how its reply reads, for either client: ``send`` queues them on
    a pipeline (several commands, one round trip) where ``pipelined``, else makes the one command on the
    client itself; ``send`` None: the answer is known without a round trip (``parse(None)``)."""

    send: Callable[[Any], Any] | None
    parse: Callable[[Any], object]
    pipelined: bool = False


class RedisJobStore:
    """Jobs as hashes, events as streams, the outbox and leases as sorted sets, in one Redis."""

    def __init__(self, client: redis.Redis, *, ttl_s: int, events_maxlen: int = 2000, wait_replicas: int = 0,
                 wait_timeout_ms: int = 1000, wait_aof: bool = False,
                 async_client: Callable[[], aioredis.Redis] | None = None,
                 broker_templates: Mapping[str, str] | None = None) -> None:
        """``wait_replicas``: a durable change (a submit) is acknowledged only once this many replicas
        have it (Redis WAIT); 0 relies on the primary's own AOF (``appendfsync always``).
        ``wait_aof``: a durable change is acknowledged only once the primary's AOF has it on disk
        (WAITAOF, Redis >= 7.2 or Valkey), so the server can run ``appendfsync everysec``: only a submit
        waits for the disk, and every other write (a stage starting, progress, a result) answers at once.
        ``async_client``: makes the redis.asyncio client of ``arun``, one per event loop
        (its connections belong to the loop that made them); default: the same server as ``client``.
        ``broker_templates``: this Redis (this database) is also the Celery broker, and these are the
        task messages of each step kind (omni_jobs.dispatch.queueing.broker_message_templates): the scripts
        that make an entry due push its message onto its queue themselves (see ``publish_in_commit``)."""
        self.redis = client
        self.broker_templates = dict(broker_templates) if broker_templates else None
        self._windows: Callable[[Change], Mapping[str, int] | None] | None = None
        prelude = lua_templates(self.broker_templates)
        self._commit_source = COMMIT.replace(NO_TEMPLATES, prelude, 1)
        self._commit_placed_source = COMMIT_PLACED.replace(NO_TEMPLATES, prelude, 1)
        self._make_async = async_client or (lambda: same_server_async(client))
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aioredis.Redis] = weakref.WeakKeyDictionary()
        self.ttl_s = ttl_s
        self.events_maxlen = events_maxlen
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self.wait_aof = wait_aof
        self._commit = client.register_script(self._commit_source)
        self._commit_placed = client.register_script(self._commit_placed_source)
        self.commits: GroupCommit[list[str], ScriptReply] = GroupCommit(
            lambda args: self._commit(args=args), self._commit_many)
        """Commits of this process's threads, sent together when they come together (omni_jobs.jobs.group_commit)."""
        self._claim = client.register_script(CLAIM)
        self._release = client.register_script(RELEASE)
        self._release_and_claim = client.register_script(RELEASE_AND_CLAIM.replace(NO_TEMPLATES, prelude, 1))

    # --- reading ---
    def _read(self, pipe: Pipeline, job_id: str) -> None:
        pipe.hgetall(keys.job(job_id))
        pipe.get(keys.job_progress(job_id))
        pipe.lrange(keys.job_deliveries(job_id), 0, -1)

    def get(self, job_id: str) -> Job | None:
        return self.run(Get(job_id))

    def get_many(self, job_ids: Sequence[str]) -> list[Job | None]:
        if not job_ids:
            return []
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                self._read(pipe, job_id)
            replies = pipe.execute()
        return [_decode_job(replies[i:i + 3]) for i in range(0, len(replies), 3)]

    def page(self, *, limit: int, cursor: str | None = None, status: JobStatus | None = None,
             tenant: str | None = None) -> JobPage:
        """Newest first. The cursor is an opaque offset into the index: all jobs or one status's, the
        tenant's own when given; so a page costs the same whatever the number of jobs kept."""
        if status is not None:
            index = keys.jobs_by_status(status.value, tenant)
        else:
            index = keys.JOBS_INDEX if tenant is None else keys.tenant_jobs(tenant)
        position = int(cursor) if cursor and cursor.isascii() and cursor.isdigit() else 0  # '²'.isdigit()
        found: list[Job] = []
        while len(found) < limit:
            ids = members(self.redis.zrevrange(index, position, position + limit - len(found) - 1))
            if not ids:
                return JobPage(found, None)
            for job_id, job in zip(ids, self.get_many(ids), strict=True):
                if job is None:  # expired: drop it from the index lazily
                    self.redis.zrem(index, job_id)
                    continue
                position += 1
                if status is None or job.status is status:
                    found.append(job)
        more = int(self.redis.zcard(index)) > position
        return JobPage(found, str(position) if more else None)

    def _jobs(self, ids: list[str]) -> list[Job]:
        return [j for j in self.get_many(ids) if j is not None]

    def events(self, job_id: str, *, after: str = "0-0", block_ms: int | None = None,
               count: int = 100) -> list[JobEvent]:
        return parse_stream(self.redis.xread({keys.job_events(job_id): after}, count=count, block=block_ms))

    def webhook_slots(self, job_id: str) -> dict[str, WebhookSlot]:
        raw = self.redis.hgetall(keys.job_webhooks(job_id))
        return decode_webhook_slots(text_hash(raw))

    def idempotency(self, tenant: str, key: str) -> IdempotencyRecord | None:
        return self.run(Idempotency(tenant, key))

    # --- writing ---
    def publish_in_commit(self, windows: Callable[[Change], Mapping[str, int] | None]) -> None:
        """With ``broker_templates``: a commit that dispatches, schedules or frees a place also runs the
        scheduler's pass over its queues (``windows``: queue -> window for a change, None when the
        scheduler cannot tell yet: Scheduler.windows_for) and pushes what is due onto the broker, in
        its own script: a step reaches its worker with no relay between. ``Change.passed`` says so."""
        self._windows = windows

    def _pass_spec(self, change: Change) -> tuple[str, list[str], frozenset[str]]:
        """The commit script's ARGV[2] for ``change`` ('' for none), its pass's queues and the closed ones."""
        if self.broker_templates is None or self._windows is None or not (change.outbox or change.scheduled
                                                                           or change.freed):
            return "", [], frozenset()
        windows = self._windows(change)
        if windows is None:
            return "", [], frozenset()
        given, args, closed = self._release_args(windows)
        at = now()
        due = [entry.id for entry in change.outbox if entry.due_at <= at]
        if not args and not due:  # nothing could go out now (no room, no worker): as without a pass
            return "", [], frozenset()
        spec = {"o": keys.OUTBOX, "i": keys.OUTBOX_ITEMS, "n": at, "l": 100, "q": args, "d": due}
        return jsontext.dumps(spec), given, closed

    def _passed(self, change: Change, spec: tuple[str, list[str], frozenset[str]], reply: ScriptReply) -> None:
        """Note on ``change`` what the commit's own pass did (a reply ``{1, released, full, sent, ...}``)."""
        if spec[0] and as_int(reply[0]) == 1:
            pairs, full, sent = reply[1], reply[2], reply[3]
            assert isinstance(pairs, list) and isinstance(full, list)
            change.passed = self._release_pass(spec[1], spec[2], pairs, full, as_int(sent))

    def _waits(self, change: Change) -> bool:
        """Whether this change is acknowledged only once its replicas or the disk have it."""
        return change.durable and (self.wait_replicas > 0 or self.wait_aof)

    def _wait_commands(self) -> list[tuple[str | int, ...]]:
        """What a durable change waits on after its script: WAIT for the replicas, WAITAOF for the
        primary's disk (numlocal 1: its own AOF fsynced past this connection's last write)."""
        commands: list[tuple[str | int, ...]] = []
        if self.wait_replicas > 0:
            commands.append(("WAIT", self.wait_replicas, self.wait_timeout_ms))
        if self.wait_aof:
            commands.append(("WAITAOF", 1, 0, self.wait_timeout_ms))
        return commands

    def _check_durability(self, reply: ScriptReply, waited: Sequence[object]) -> None:
        """Raise NotDurable if an applied change did not reach its replicas or the disk in time. A
        refused change wrote nothing: there is nothing to wait for. A server that cannot WAITAOF (Redis
        < 7.2, or AOF off) answers an error here: the change was applied, so the client's retry with its
        Idempotency-Key finds it; ``omni-jobs doctor`` and /readyz name the setting to fix."""
        if as_int(reply[0]) != 1:
            return
        rest = list(waited)
        if self.wait_replicas > 0:
            acked = rest.pop(0)
            if isinstance(acked, Exception):
                raise acked
            acked = int(str(acked))
            if acked < self.wait_replicas:
                raise NotDurable(acked, self.wait_replicas, self.wait_timeout_ms)
        if self.wait_aof:
            answer = rest.pop(0)
            if isinstance(answer, Exception):
                raise NotDurable(0, 1, self.wait_timeout_ms, disk=f"the server answered: {answer}")
            assert isinstance(answer, list)
            if int(answer[0]) < 1:
                raise NotDurable(0, 1, self.wait_timeout_ms,
                                 disk=f"its AOF was not fsynced within {self.wait_timeout_ms} ms")

    def commit(self, change: Change) -> Conflict | None:
        return self.run(Commit(change))

    def _commit_here(self, change: Change) -> Conflict | None:
        """``Commit`` on this thread: with this process's other commits (group commit), or, where it
        waits for replicas or the disk, on a connection of its own."""
        spec = self._pass_spec(change)
        args = [change.wire(), spec[0]]
        if self._waits(change):
            reply = self._checked(self._on_connection(self._script_commands(self._commit.sha, self._commit_source, args,
                                                                             waits=True)))
        else:
            reply = self.commits.call(args)
        self._passed(change, spec, reply)
        return self._conflict(change, reply)

    def _placed_args(self, change: Change, job: Job | None) -> tuple[tuple[str, list[str], frozenset[str]], list[str]]:
        """The commit-placed script's pass spec and arguments: the change, its pass, and the keys it reads
        ``job``'s queue position from after the write ('[]': none)."""
        record = waiting_stage(job) if job is not None else None
        place = jsontext.dumps(position_keys(job, record) if job is not None and record is not None else [])
        spec = self._pass_spec(change)
        return spec, [change.wire(), spec[0], place]

    def _placed_answer(self, change: Change, spec: tuple[str, list[str], frozenset[str]],
                       reply: ScriptReply) -> tuple[Conflict | None, int | None]:
        self._passed(change, spec, reply)
        conflict = self._conflict(change, reply)
        if conflict is not None or len(reply) != 8:
            return conflict, None
        return None, estimate_position(reply[4:])

    def _script_commands(self, sha: str, source: str, args: Sequence[str], *, waits: bool) -> ScriptCommands:
        """A commit script's call as its commands: EVALSHA (a restarted server that lacks the script
        answers NOSCRIPT, nothing ran: SCRIPT LOAD, and once more), then, where ``waits``, WAIT and
        WAITAOF (an error of theirs, e.g. no WAITAOF, is kept for ``_check_durability`` to name).
        The script is not registered with a pipeline, which would cost a SCRIPT EXISTS round trip."""
        try:
            reply = yield ("EVALSHA", sha, 0, *args)
        except NoScriptError:
            yield ("SCRIPT LOAD", source)
            reply = yield ("EVALSHA", sha, 0, *args)
        assert isinstance(reply, list)
        if not waits:
            return reply, None
        waited: list[object] = []
        for command in self._wait_commands():
            try:
                waited.append((yield command))
            except redis.ResponseError as exc:
                waited.append(exc)
        return reply, waited

    def _checked(self, answer: tuple[ScriptReply, list[object] | None]) -> ScriptReply:
        """The script's reply, once its waits say the change is durable (NotDurable if not)."""
        reply, waited = answer
        if waited is not None:
            self._check_durability(reply, waited)
        return reply

    def _on_connection(self, commands: ScriptCommands) -> tuple[ScriptReply, list[object] | None]:
        """``commands`` on one connection, each in its own round trip: WAITAOF waits for its own
        connection's writes, and sent in the same packet as the write, Valkey 8.0 left it blocked until
        its next timer tick (100 ms per submit; 0.3 ms once the write was answered:
        docs/decisions/waitaof.md)."""
        pool = self.redis.connection_pool
        conn = pool.get_connection()

        def send(command: Command) -> object:
            conn.send_command(*command)  # type: ignore[no-untyped-call]  # redis-py
            return self.redis.parse_response(conn, str(command[0]))  # type: ignore[no-untyped-call]  # redis-py leaves parse_response untyped

        try:
            return _send_all(commands, send)
        except redis.ResponseError:
            raise
        except BaseException:
            # cut off mid-reply: the connection's next user must not read this one's answer
            conn.disconnect()  # type: ignore[no-untyped-call]  # redis-py
            raise
        finally:
            pool.release(conn)

    async def _aon_connection(self, client: aioredis.Redis,
                              commands: ScriptCommands) -> tuple[ScriptReply, list[object] | None]:
        """``_on_connection`` on an asyncio client."""
        pool = client.connection_pool
        conn = await pool.get_connection()  # type: ignore[no-untyped-call]  # redis-py

        async def send(command: Command) -> object:
            await conn.send_command(*command)
            return await client.parse_response(conn, str(command[0]))

        try:
            return await _asend_all(commands, send)
        except redis.ResponseError:
            raise
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)

    def commit_each(self, changes: Sequence[Change]) -> list[Conflict | None]:
        if any(self._waits(c) for c in changes):
            return [self.commit(c) for c in changes]  # each waits for its replicas or the disk
        if not changes:
            return []
        conflicts: list[Conflict | None] = []
        for change, reply in zip(changes, self._commit_many([[c.wire()] for c in changes]), strict=True):
            if isinstance(reply, Exception):
                raise reply
            conflicts.append(self._conflict(change, reply))
        return conflicts

    def _commit_many(self, args: Sequence[Sequence[str]]) -> list[ScriptReply | Exception]:
        """The commit script once per ``args``, pipelined in one round trip: each its own script (applied or
        refused alone), its reply or its error in order."""
        sha = self._commit.sha
        for attempt in range(2):
            with self.redis.pipeline(transaction=False) as pipe:
                for one in args:
                    pipe.evalsha(sha, 0, *one)
                replies = pipe.execute(raise_on_error=False)
            if not any(isinstance(r, NoScriptError) for r in replies):
                break
            if attempt:  # the server lost its scripts twice in a row: give up as commit would
                raise next(r for r in replies if isinstance(r, NoScriptError))
            self.redis.script_load(self._commit_source)  # a restarted server: nothing ran; once more with the script
        return list(replies)

    @staticmethod
    def _conflict(change: Change, reply: ScriptReply) -> Conflict | None:
        """The commit script's answer: None (applied), or the guard or cap that refused it."""
        outcome = as_int(reply[0])
        if outcome == 1:
            return None
        found = reply[2] if len(reply) > 2 else None
        if outcome == 2:
            return Conflict(None, str(as_int(found)), cap=change.caps[as_int(reply[1]) - 1])
        guard: Guard = change.guards[as_int(reply[1]) - 1]
        return Conflict(guard, text(found) if found is not None else None)

    # --- async (the API's event loop) ---
    def use_async_client(self, make: Callable[[], aioredis.Redis]) -> None:
        """How ``arun`` makes its client (once per event loop), e.g. from the same URL as
        the sync client, TLS and Sentinels and all: ``lambda: async_client_from_url(url)``
        (omni_jobs.core.redis_clients; the Runtime does so)."""
        self._make_async = make

    def _aclient(self) -> aioredis.Redis:
        """This event loop's client."""
        loop = asyncio.get_running_loop()
        found = self._async.get(loop)
        if found is None:
            found = self._async[loop] = self._make_async()
        return found

    # --- the operations of a flow (omni_jobs.jobs.flows): each built and read once, sent by run or arun ---
    def run(self, op: Operation[T]) -> T:
        """Answer ``op`` with the sync client. A commit goes with this process's other commits."""
        if isinstance(op, Commit):
            return cast(T, self._commit_here(op.change))
        if isinstance(op, CommitPlaced):
            spec, args = self._placed_args(op.change, op.job)
            waits = self._waits(op.change)
            commands = self._script_commands(self._commit_placed.sha, self._commit_placed_source, args, waits=waits)
            sent = self._on_connection(commands) if waits else _send_all(commands, self._call)
            return cast(T, self._placed_answer(op.change, spec, self._checked(sent)))
        read = self._read_of(op)
        if read.send is None:
            return cast(T, read.parse(None))
        if not read.pipelined:
            return cast(T, read.parse(read.send(self.redis)))
        with self.redis.pipeline(transaction=False) as pipe:
            read.send(pipe)
            return cast(T, read.parse(pipe.execute()))

    async def arun(self, op: Operation[T]) -> T:
        """Answer ``op`` with this event loop's client. A commit is one EVALSHA of the commit script
        that also reads the job's queue position after the write (``CommitPlaced``; a ``Commit`` reads
        none): one round trip, one command, then WAIT / WAITAOF on the same connection where the change
        must reach replicas or the disk."""
        client = self._aclient()
        if isinstance(op, Commit | CommitPlaced):
            spec, args = self._placed_args(op.change, op.job if isinstance(op, CommitPlaced) else None)
            waits = self._waits(op.change)
            commands = self._script_commands(self._commit_placed.sha, self._commit_placed_source, args, waits=waits)
            sent = await (self._aon_connection(client, commands) if waits
                          else _asend_all(commands, lambda command: client.execute_command(*command)))  # type: ignore[no-untyped-call]  # redis-py leaves execute_command untyped
            answer = self._placed_answer(op.change, spec, self._checked(sent))
            return cast(T, answer if isinstance(op, CommitPlaced) else answer[0])
        read = self._read_of(op)
        if read.send is None:
            return cast(T, read.parse(None))
        if not read.pipelined:
            return cast(T, read.parse(await read.send(client)))
        async with client.pipeline(transaction=False) as pipe:
            read.send(pipe)
            return cast(T, read.parse(await pipe.execute()))

    def _call(self, command: Command) -> object:
        return self.redis.execute_command(*command)  # type: ignore[no-untyped-call]  # redis-py

    def _read_of(self, op: Operation[Any]) -> _Read:
        """What a read operation sends and how its reply reads (for ``run`` and ``arun`` alike)."""
        if isinstance(op, Get):
            job_id = op.job_id
            return _Read(lambda pipe: self._read(pipe, job_id), _decode_job, pipelined=True)
        if isinstance(op, Idempotency):
            key = keys.idempotency(op.tenant, op.key)
            return _Read(lambda client: client.hgetall(key), lambda raw: IdempotencyRecord.of(text_hash(raw)))
        if isinstance(op, QueuePosition):
            # 1-based place of the job's waiting stage on its queue (1 = next to start). Released steps go
            # in release order; a ready one comes after all released ones, at its rank in its tenant's order
            # times the tenants taking turns (an estimate: tenants come and go).
            job, record = op.job, waiting_stage(op.job)
            if record is None:
                return _Read(None, lambda _: None)
            return _Read(lambda pipe: _read_position(pipe, job, record), estimate_position, pipelined=True)
        if isinstance(op, Oldest):
            key, since = op.key, op.since
            return _Read(lambda client: client.zrangebyscore(key, since, "+inf", start=0, num=1, withscores=True),
                         lambda first: float(first[0][1]) if first else None)
        raise TypeError(f"a job store answers no {type(op).__name__}")

    async def aclose(self) -> None:
        found = self._async.pop(asyncio.get_running_loop(), None)
        if found is not None:
            await found.aclose()

    # --- outbox ---
    def claim_outbox(self, *, now: float, limit: int, hold_s: float, job_id: str | None = None) -> list[OutboxEntry]:
        reply = self._claim(keys=[keys.OUTBOX, keys.OUTBOX_ITEMS],
                            args=[repr(now), repr(now + hold_s), limit, f":{job_id}:" if job_id else ""])
        return [OutboxEntry(from_json(reply[i + 1]), now) for i in range(0, len(reply), 2)][:limit]

    def ack_outbox(self, ids: Sequence[str]) -> None:
        if ids:
            with self.redis.pipeline(transaction=True) as pipe:
                pipe.zrem(keys.OUTBOX, *ids)
                pipe.hdel(keys.OUTBOX_ITEMS, *ids)
                pipe.execute()

    def release(self, windows: Mapping[str, int], *, now: float, limit: int = 100) -> ReleasePass:
        """The scheduler's pass over the queues in ``windows``, in one script: while fewer than its
        window of a queue's steps are released or running, move its next ready step to the outbox,
        taking the tenants in turn (the one served longest ago first) and each tenant's steps in
        order. A queue with a window of 0 is full."""
        given, args, closed = self._release_args(windows)
        if not given:
            return ReleasePass([], closed)
        pairs, full = self._release(keys=[keys.OUTBOX, keys.OUTBOX_ITEMS], args=[repr(now), limit, *args])
        return self._release_pass(given, closed, pairs, full)

    def release_and_claim(self, windows: Mapping[str, int], *, now: float, limit: int,
                          hold_s: float) -> tuple[ReleasePass, list[OutboxEntry]]:
        """``release`` then ``claim_outbox`` (up to ``limit`` of each), in one script: the relay's pass."""
        given, args, closed = self._release_args(windows)
        direct = "1" if self.broker_templates is not None else "0"
        pairs, full, claimed, sent, first = self._release_and_claim(
            keys=[keys.OUTBOX, keys.OUTBOX_ITEMS], args=[repr(now), limit, repr(now + hold_s), limit, direct, *args])
        entries = [OutboxEntry(from_json(claimed[i + 1]), now) for i in range(0, len(claimed), 2)][:limit]
        done = self._release_pass(given, closed, pairs, full, int(sent))
        return replace(done, next_due=float(first) if first else None), entries

    @staticmethod
    def _release_args(windows: Mapping[str, int]) -> tuple[list[str], list[str | int], frozenset[str]]:
        """(the queues with a window, the script's five values for each, the queues without)."""
        given = [queue for queue, window in windows.items() if window > 0]
        args: list[str | int] = []
        for queue in given:
            args += [keys.queue_tenants(queue), keys.queue_released(queue), keys.queue_running(queue),
                     keys.queue_ready(queue, ""), windows[queue]]
        return given, args, frozenset(queue for queue, window in windows.items() if window <= 0)

    @staticmethod
    def _release_pass(given: list[str], closed: frozenset[str], pairs: list[bytes],
                      full: list[int], published: int = 0) -> ReleasePass:
        return ReleasePass([(text(pairs[i]), text(pairs[i + 1])) for i in range(0, len(pairs), 2)],
                           closed | {given[int(n) - 1] for n in full}, published=published,
                           queues=frozenset(given) | closed)

    def scheduled_queues(self) -> list[str]:
        return sorted(members(self.redis.smembers(keys.SCHEDULED_QUEUES)))

    def oldest(self, key: str, *, since: float) -> float | None:
        return self.run(Oldest(key, since))

    def count(self, key: str) -> int:
        return int(self.redis.zcard(key))

    def outbox_holds(self, ids: Sequence[str]) -> set[str]:
        if not ids:
            return set()
        scores = self.redis.zmscore(keys.OUTBOX, list(ids))
        return {i for i, s in zip(ids, scores, strict=True) if s is not None}

    def next_outbox_due(self) -> float | None:
        first = self.redis.zrange(keys.OUTBOX, 0, 0, withscores=True)
        return float(first[0][1]) if first else None

    # --- leases and queues ---
    def expired_leases(self, *, now: float, limit: int) -> list[str]:
        return members(self.redis.zrangebyscore(keys.LEASES, "-inf", now, start=0, num=limit))

    def leased_slots(self) -> list[str]:
        return members(self.redis.zrange(keys.LEASES, 0, -1))

    def released(self, queue: str, *, before: float, limit: int) -> list[str]:
        found = self.redis.zrangebyscore(keys.queue_released(queue), "-inf", before, start=0, num=limit)
        return members(found)

    def queue_counts(self, queue: str) -> tuple[int, int]:
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.zcard(keys.queue_waiting(queue))
            pipe.zcard(keys.queue_running(queue))
            waiting, running = pipe.execute()
        return int(waiting), int(running)

    def queue_position(self, job: Job) -> int | None:
        """1-based place of the job's waiting stage on its queue (1 = next to start); None when none waits."""
        return self.run(QueuePosition(job))

    def try_lock(self, name: str, owner: str, ttl_s: float) -> bool:
        return bool(self.redis.set(name, owner, nx=True, px=max(1, int(ttl_s * 1000))))

    def throttle(self, name: str, interval_s: float) -> bool:
        if interval_s <= 0:
            return True
        return bool(self.redis.set(keys.throttle(name), b"1", nx=True, px=max(1, int(interval_s * 1000))))

    # --- retention ---
    def job_ids_created(self, *, after: float | None, until: float) -> list[str]:
        low = "-inf" if after is None else f"({after!r}"
        return members(self.redis.zrangebyscore(keys.JOBS_INDEX, low, until))

    def overdue(self, *, now: float, limit: int) -> list[str]:
        return members(self.redis.zrangebyscore(keys.DEADLINES, "-inf", now, start=0, num=limit))

    def delete(self, job_id: str) -> None:
        """The job and everything indexed under it: an expired job must not stay counted on a queue,
        nor leave a dispatch waiting in the outbox."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.job(job_id))
            pipe.hgetall(keys.job_webhooks(job_id))
            raw, hooks = pipe.execute()
        fields = text_hash(raw)
        pending = job_pending_steps(job_id, fields, text_hash(hooks))
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys.job(job_id), keys.job_events(job_id), keys.job_progress(job_id),
                        keys.job_webhooks(job_id), keys.job_deliveries(job_id))
            pipe.zrem(keys.JOBS_INDEX, job_id)
            pipe.zrem(keys.DEADLINES, job_id)
            if "tenant" in fields:
                pipe.zrem(keys.tenant_jobs(fields["tenant"]), job_id)
                pipe.zrem(keys.tenant_active(fields["tenant"]), job_id)
            if "status" in fields:
                for tenant in (None, fields.get("tenant")):
                    pipe.zrem(keys.jobs_by_status(fields["status"], tenant), job_id)
            for queue, slot, entry_id in pending:
                # released too: a step sent and never started would hold its place in the queue's
                # window for ever, and enough of them stop the queue releasing
                for index in (keys.queue_waiting(queue), keys.queue_running(queue), keys.queue_released(queue),
                              keys.LEASES):
                    pipe.zrem(index, slot)
                if "tenant" in fields:
                    pipe.zrem(keys.queue_ready(queue, fields["tenant"]), entry_id)
                pipe.zrem(keys.OUTBOX, entry_id)
                pipe.hdel(keys.OUTBOX_ITEMS, entry_id)
            pipe.execute()

    def get_mark(self, name: str) -> str | None:
        raw = self.redis.get(name)
        return text(raw) if raw is not None else None

    def set_mark(self, name: str, value: str) -> None:
        self.redis.set(name, value)


def position_keys(job: Job, record: StageRecord) -> list[str]:
    """What the commit script reads a just-written job's queue position from (as _read_position)."""
    slot = stage_slot(job.id, record.id)
    return [keys.queue_released(record.queue), slot, keys.queue_ready(record.queue, job.tenant),
            f"{slot}:{record.attempts + 1}", keys.queue_tenants(record.queue)]


def _read_position(pipe: Pipeline, job: Job, record: StageRecord) -> None:
    """Queue the reads a queue position is estimated from (``estimate_position``) on ``pipe``."""
    released_key, slot, ready_key, entry, tenants_key = position_keys(job, record)
    pipe.zrank(released_key, slot)
    pipe.zcard(released_key)
    pipe.zrank(ready_key, entry)
    pipe.zcard(tenants_key)


def _decode_job(replies: Sequence[Any]) -> Job | None:
    """A job from the replies of ``_read``'s three reads."""
    return codec.decode(replies[0], replies[1], replies[2])


def _send_all(commands: ScriptCommands, send: Callable[[Command], object]) -> tuple[ScriptReply, list[object] | None]:
    """Run ``commands`` with ``send``: each reply sent back in, a server's error thrown in where it was sent."""
    try:
        command = next(commands)
        while True:
            try:
                reply = send(command)
            except redis.ResponseError as exc:
                command = commands.throw(exc)
            else:
                command = commands.send(reply)
    except StopIteration as done:
        answer: tuple[ScriptReply, list[object] | None] = done.value
        return answer


async def _asend_all(commands: ScriptCommands,
                     send: Callable[[Command], Awaitable[object]]) -> tuple[ScriptReply, list[object] | None]:
    """``_send_all`` with a coroutine ``send``."""
    try:
        command = next(commands)
        while True:
            try:
                reply = await send(command)
            except redis.ResponseError as exc:
                command = commands.throw(exc)
            else:
                command = commands.send(reply)
    except StopIteration as done:
        answer: tuple[ScriptReply, list[object] | None] = done.value
        return answer


def same_server_async(client: redis.Redis) -> aioredis.Redis:
    """A redis.asyncio client for the server (address, database, credentials) that ``client`` uses
    (plain TCP or a Unix socket; a TLS deployment passes its URL with ``use_async_client``)."""
    if isinstance(client.connection_pool, redis.sentinel.SentinelConnectionPool):
        # its connections name no server (the Sentinels do): guessing one would be the default 127.0.0.1:6379
        raise TypeError("a job store on Sentinels makes its asyncio client from their URL: "
                        "store.use_async_client(lambda: async_client_from_url(url)) (omni_jobs.core.redis_clients)")
    kwargs = client.connection_pool.connection_kwargs
    wanted = ("host", "port", "db", "username", "password", "path", "socket_timeout", "socket_connect_timeout")
    if "path" in kwargs:
        return aioredis.Redis(unix_socket_path=kwargs["path"], **async_retry_options(),
                              **{k: kwargs[k] for k in wanted if k in kwargs and k not in ("path", "host", "port")})
    return aioredis.Redis(**async_retry_options(), **{k: kwargs[k] for k in wanted if k in kwargs})


def parse_stream(reply: XReadResponse | None) -> list[JobEvent]:
    """XREAD's reply -> events, each with its stream id. The reply is RESP2's, as the clients here
    speak it ([[stream, [(id, fields), ...]]]; None or empty when a blocking read timed out)."""
    if isinstance(reply, dict):
        raise TypeError("XREAD answered a RESP3 map; the job store's clients speak RESP2")
    events: list[JobEvent] = []
    for _stream, entries in reply or []:
        for entry_id, fields in entries:
            event = JobEvent.model_validate_json(fields[b"event"] if b"event" in fields else fields["event"])
            event.id = text(entry_id)
            events.append(event)
    return events
