"""A file's or a batch's record is acknowledged only once it is durable (WAITAOF), as a job's submit is;
and the record and its indexes are one write. Real servers: valkey with AOF, and one without AOF."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from omni_jobs.accept.files import DurableRecords
from omni_jobs.core.errors import NotDurable
from omni_jobs.local.devservices import RunningService, find_waitaof_server, start_redis

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def aof_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    binary = find_waitaof_server()
    if binary is None:
        pytest.skip("no server with WAITAOF (Redis >= 7.2 or Valkey) is installed")
    with start_redis(data_dir=tmp_path_factory.mktemp("aof"), appendonly=True, appendfsync="everysec",
                     binary=binary, waitaof=True) as service:
        yield service


def test_a_record_and_its_indexes_are_written_and_waited_on(aof_server: RunningService) -> None:
    client = redis.Redis.from_url(aof_server.url)
    records = DurableRecords(client, wait_aof=True, timeout_ms=2000)
    records.put("t:rec", {"id": "b1", "tenant": "acme"}, indexes=["t:idx1", "t:idx2"], member="b1", score=12.5,
                ttl_s=60)
    assert client.hgetall("t:rec") == {b"id": b"b1", b"tenant": b"acme"}
    assert 0 < client.ttl("t:rec") <= 60
    assert client.zscore("t:idx1", "b1") == 12.5 and client.zscore("t:idx2", "b1") == 12.5
    assert client.info("persistence")["aof_enabled"] == 1


def test_without_aof_the_write_is_refused_as_not_durable(tmp_path: Path) -> None:
    binary = find_waitaof_server()
    if binary is None:
        pytest.skip("no server with WAITAOF (Redis >= 7.2 or Valkey) is installed")
    with start_redis(data_dir=tmp_path, appendonly=False, binary=binary) as service:
        client = redis.Redis.from_url(service.url)
        with pytest.raises(NotDurable) as caught:
            DurableRecords(client, wait_aof=True, timeout_ms=200).put("t:rec", {"id": "x"}, indexes=[], member="x",
                                                                    score=1.0)
        assert "OMNI_REDIS_WAIT_AOF" in str(caught.value)
        DurableRecords(client).put("t:rec2", {"id": "y"}, indexes=["t:i"], member="y", score=2.0)  # no wait asked
        assert client.hget("t:rec2", "id") == b"y" and client.ttl("t:rec2") == -1
