"""Which Redis `omni-jobs up` starts, and how it keeps a 202 (omni_jobs.local.embedded.redis_durability)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from omni_jobs.local import devservices, embedded
from omni_jobs.local.devservices import ServiceError, server_version
from omni_jobs.local.embedded import redis_durability


def fake_server(tmp_path: Path, name: str, banner: str) -> str:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\necho '{banner}'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_server_version_reads_redis_and_valkey_banners(tmp_path: Path) -> None:
    assert server_version(fake_server(tmp_path, "r", "Redis server v=7.0.15 sha=00000000:0 malloc=jemalloc")) == (7, 0)
    assert server_version(fake_server(tmp_path, "v", "Valkey server v=8.0.1 sha=00000000:0")) == (8, 0)
    assert server_version(fake_server(tmp_path, "x", "no version here")) == (0, 0)
    assert server_version(str(tmp_path / "missing")) == (0, 0)


def test_a_waitaof_server_is_redis_72_or_valkey(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = tmp_path / "old"
    old.mkdir()
    fake_server(old, "redis-server", "Redis server v=7.0.15")
    monkeypatch.setenv("PATH", str(old))
    monkeypatch.setattr(devservices, "_find_binary", lambda name: str(old / name) if (old / name).exists() else None)
    assert devservices.find_waitaof_server() is None
    valkey = fake_server(old, "valkey-server", "Valkey server v=8.0.1")
    assert devservices.find_waitaof_server() == valkey
    newer = fake_server(old, "redis-server", "Redis server v=7.2.4")
    assert devservices.find_waitaof_server() == newer  # redis-server first, where it can


def test_auto_takes_waitaof_where_a_server_can(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_REDIS_WAIT_AOF", raising=False)
    monkeypatch.setattr(embedded, "find_waitaof_server", lambda: "/usr/bin/valkey-server")
    assert redis_durability("auto") == ("waitaof", "/usr/bin/valkey-server")
    assert redis_durability("always") == ("always", None)
    assert redis_durability("everysec") == ("everysec", None)
    monkeypatch.setenv("OMNI_REDIS_WAIT_AOF", "false")  # turned off: every write fsynced instead
    assert redis_durability("auto") == ("always", None)


def test_without_such_a_server_auto_fsyncs_every_write(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_REDIS_WAIT_AOF", raising=False)
    monkeypatch.setattr(embedded, "find_waitaof_server", lambda: None)
    monkeypatch.setattr(devservices, "find_waitaof_server", lambda: None)  # require_waitaof_server's
    assert redis_durability("auto") == ("always", None)
    with pytest.raises(ServiceError, match="valkey-server"):
        redis_durability("waitaof")
    with pytest.raises(ValueError, match="auto, always, waitaof or everysec"):
        redis_durability("sometimes")
