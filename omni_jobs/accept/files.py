"""Files of OpenAI's Files API (``purpose: batch``): a tenant's batch inputs and the batches' outputs.

The bytes go to the artifact store's large backend (local or S3), never to Redis; Redis keeps a small
record per file (``keys.file``) and each tenant's index. A file is another tenant's or missing: the
same answer, so that ids cannot be probed. Output and error files of a batch have ids derived from
the batch's (``file-<batch>-output``), so a finalize run again after a crash rewrites the same file.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import redis

from omni_jobs.artifacts import ArtifactRef, ArtifactStore
from omni_jobs.core import keys
from omni_jobs.core.errors import NotDurable
from omni_jobs.core.redis_replies import members, text_hash

JSONL = "application/jsonl"
PURPOSES = ("batch", "batch_output")
"""``batch``: an uploaded batch input; ``batch_output``: a batch's output or error file (OpenAI's names)."""


class FileNotFound(LookupError):
    """No such file for this tenant (or none at all: the same answer)."""


@dataclass(frozen=True)
class FileRecord:
    """One file as OpenAI's ``file`` object describes it, plus where its bytes are."""

    id: str
    tenant: str
    purpose: str
    filename: str
    size: int
    created_at: int
    lines: int
    artifact: ArtifactRef
    expires_at: int | None = None

    def as_openai(self) -> dict[str, object]:
        """OpenAI's file object (``status: processed``: a file is checked before it is stored)."""
        return {"id": self.id, "object": "file", "bytes": self.size, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "status_details": None,
                "expires_at": self.expires_at}

    def fields(self) -> dict[str, str]:
        return {"id": self.id, "tenant": self.tenant, "purpose": self.purpose, "filename": self.filename,
                "bytes": str(self.size), "created_at": str(self.created_at), "lines": str(self.lines),
                "artifact": self.artifact.model_dump_json(),
                "expires_at": "" if self.expires_at is None else str(self.expires_at)}

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> FileRecord:
        return cls(id=fields["id"], tenant=fields["tenant"], purpose=fields["purpose"], filename=fields["filename"],
                   size=int(fields["bytes"]), created_at=int(fields["created_at"]), lines=int(fields["lines"]),
                   artifact=ArtifactRef.model_validate_json(fields["artifact"]),
                   expires_at=int(fields["expires_at"]) if fields.get("expires_at") else None)


_PUT = """
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
if tonumber(ARGV[1]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
for i = 2, #KEYS do redis.call('ZADD', KEYS[i], ARGV[2], ARGV[3]) end
return 1
"""
"""One record written atomically: the hash KEYS[1] (fields ARGV[4..], TTL ARGV[1] when > 0) and its member
ARGV[3] at score ARGV[2] in each index KEYS[2..]."""


@dataclass(frozen=True)
class DurableRecords:
    """Writes a record (a file's, a batch's) and acknowledges it only once it is where the job store's
    durable writes must be (OMNI_REDIS_WAIT_REPLICAS, OMNI_REDIS_WAIT_AOF): a 200 for a file or a batch
    means it survives Redis being killed, as a 202 for a job does. NotDurable otherwise (the API's 503)."""

    client: redis.Redis
    wait_replicas: int = 0
    wait_aof: bool = False
    timeout_ms: int = 1000

    def put(self, key: str, fields: Mapping[str, str], *, indexes: Sequence[str], member: str, score: float,
            ttl_s: int = 0) -> None:
        script = self.client.register_script(_PUT)
        flat = [value for pair in fields.items() for value in pair]
        with self.client.pipeline(transaction=False) as pipe:  # one connection: the waits follow the write
            script(keys=[key, *indexes], args=[ttl_s, score, member, *flat], client=pipe)
            if self.wait_replicas > 0:
                pipe.execute_command("WAIT", self.wait_replicas, self.timeout_ms)  # type: ignore[no-untyped-call]  # redis-py leaves execute_command untyped
            if self.wait_aof:
                pipe.execute_command("WAITAOF", 1, 0, self.timeout_ms)  # type: ignore[no-untyped-call]  # redis-py leaves execute_command untyped
            replies = pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, Exception) and not isinstance(reply, redis.ResponseError):
                raise reply
        if isinstance(replies[0], Exception):
            raise replies[0]
        waited = list(replies[1:])
        if self.wait_replicas > 0:
            acked = waited.pop(0)
            if isinstance(acked, Exception) or int(str(acked)) < self.wait_replicas:
                raise NotDurable(0 if isinstance(acked, Exception) else int(str(acked)), self.wait_replicas,
                                 self.timeout_ms)
        if self.wait_aof:
            answer = waited.pop(0)
            if isinstance(answer, Exception):
                raise NotDurable(0, 1, self.timeout_ms, disk=f"the server answered: {answer}")
            if not isinstance(answer, list) or int(answer[0]) < 1:
                raise NotDurable(0, 1, self.timeout_ms, disk=f"its AOF was not fsynced within {self.timeout_ms} ms")


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


class FileStore:
    """A tenant's files: the record in Redis, the bytes in the artifact store."""

    def __init__(self, redis_client: redis.Redis, artifacts: ArtifactStore, *, ttl_s: int,
                 records: DurableRecords | None = None) -> None:
        self.redis = redis_client
        self.artifacts = artifacts
        self.ttl_s = ttl_s
        self.records = records or DurableRecords(redis_client)

    def put(self, tenant: str, data: bytes, *, filename: str, purpose: str, lines: int,
            file_id: str | None = None) -> FileRecord:
        """Store the bytes, then the record (a crash between leaves bytes nobody points at, not a record
        without bytes). ``file_id``: a fixed id (a batch's output), written again as it was."""
        file_id = file_id or new_file_id()
        ref = self.artifacts.put_output(keys.file_artifact(file_id), data, JSONL)
        created = int(time.time())
        record = FileRecord(file_id, tenant, purpose, filename, len(data), created, lines, ref, created + self.ttl_s)
        self.redis.zadd(keys.FILES_EXPIRING, {file_id: created + self.ttl_s})  # first: the bytes go when it is due
        self.records.put(keys.file(file_id), record.fields(), indexes=[keys.tenant_files(tenant)], member=file_id,
                         score=created, ttl_s=self.ttl_s)
        return record

    def get(self, tenant: str, file_id: str) -> FileRecord:
        fields = text_hash(self.redis.hgetall(keys.file(file_id)))
        if not fields or fields.get("tenant") != tenant:
            raise FileNotFound(file_id)
        return FileRecord.from_fields(fields)

    def content(self, tenant: str, file_id: str) -> bytes:
        return self.artifacts.get(self.get(tenant, file_id).artifact)

    def delete(self, tenant: str, file_id: str) -> FileRecord:
        record = self.get(tenant, file_id)
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(keys.file(file_id))
            pipe.zrem(keys.tenant_files(tenant), file_id)
            pipe.execute()
        self.artifacts.delete(record.artifact)
        self.redis.zrem(keys.FILES_EXPIRING, file_id)
        return record

    def sweep(self, now: float, *, limit: int = 100) -> int:
        """Delete the bytes of the files whose time ran out (their records expire by TTL); returns how many."""
        due = members(self.redis.zrangebyscore(keys.FILES_EXPIRING, 0, now, start=0, num=limit))
        for file_id in due:
            self.artifacts.large.delete(keys.file_artifact(file_id))
            with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(keys.file(file_id))
                pipe.zrem(keys.FILES_EXPIRING, file_id)
                pipe.execute()
        return len(due)

    def list(self, tenant: str, *, limit: int = 100) -> list[FileRecord]:
        """The tenant's files, newest first (ids whose record expired are dropped from the index)."""
        ids = members(self.redis.zrevrange(keys.tenant_files(tenant), 0, limit - 1))
        records: list[FileRecord] = []
        for file_id in ids:
            try:
                records.append(self.get(tenant, file_id))
            except FileNotFound:
                self.redis.zrem(keys.tenant_files(tenant), file_id)
        return records
