"""Sentinel URLs: parsing, kombu's spelling, redaction, and one-line refusals (no services needed)."""

from __future__ import annotations

import pytest

from omni_jobs.core.redis_clients import async_client_from_url, redis_client
from omni_jobs.core.redis_url import (
    RedisUrlInvalid,
    SentinelUrl,
    check_redis_url,
    kombu_broker,
    parse_sentinel_url,
    redact_url,
)
from omni_jobs.core.settings import Settings, SettingsInvalid, load_settings
from omni_jobs.dispatch.queueing import celery_config

TIMEOUTS = {"socket_timeout": 10.0, "socket_connect_timeout": 2.0, "socket_keepalive": True, "health_check_interval": 5}


def test_sentinels_master_and_db() -> None:
    target = parse_sentinel_url("sentinel://h1:26380,h2,[::1]:26381/mymaster/3")
    assert target == SentinelUrl(sentinels=(("h1", 26380), ("h2", 26379), ("::1", 26381)), master="mymaster", db=3)


def test_passwords_of_the_primary_and_of_the_sentinels() -> None:
    target = parse_sentinel_url("sentinels://app:p%40ss@h1:26379/m?sentinel_password=s3&sentinel_username=sen")
    assert (target.username, target.password, target.sentinel_username, target.sentinel_password, target.tls, target.db) \
        == ("app", "p@ss", "sen", "s3", True, 0)
    assert parse_sentinel_url("sentinel://:pw@h/m").password == "pw"
    assert parse_sentinel_url("sentinel://pw@h/m").password == "pw"  # a lone user part is the password, as redis-py reads it


@pytest.mark.parametrize(("url", "why"), [
    ("sentinel://h1:26379", "names no master"),
    ("sentinel:///m", "names no Sentinel"),
    ("sentinel://h1:port/m", "bad port"),
    ("sentinel://h1:70000/m", "bad port"),
    ("sentinel://h1/m/zero", "database 'zero'"),
    ("sentinel://h1/m/0/extra", "path of 3 parts"),
    ("sentinel://h1/m?master=x", "unknown option 'master'"),
    ("sentinel://[::1/m", "unclosed IPv6"),
])
def test_malformed_is_one_line_naming_setting_and_format(url: str, why: str) -> None:
    with pytest.raises(RedisUrlInvalid) as info:
        parse_sentinel_url(url, "OMNI_BROKER_URL")
    message = str(info.value)
    assert "\n" not in message and why in message
    assert message.startswith("OMNI_BROKER_URL ") and "sentinel://[[user]:password@]host[:port]" in message


def test_other_schemes() -> None:
    for url in ("redis://h:6379/0", "rediss://:pw@h/0", "unix:///run/redis.sock"):
        assert check_redis_url(url, "OMNI_REDIS_URL") == url
    with pytest.raises(RedisUrlInvalid, match="OMNI_REDIS_URL must start with redis://"):
        check_redis_url("http://h:6379", "OMNI_REDIS_URL")


def test_settings_refuse_a_malformed_url_in_one_line_without_its_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_REDIS_URL", "sentinel://:secret@h1:26379/m/x")
    with pytest.raises(SettingsInvalid) as info:
        load_settings()
    text = str(info.value)
    assert "secret" not in text and "OMNI_REDIS_URL" in text and len(text.splitlines()) == 1


def test_redaction() -> None:
    assert redact_url("sentinel://u:pw@h1,h2:1/m/2?sentinel_password=s") == "sentinel://u:***@h1:26379,h2:1/m/2"
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"


def test_kombu_spelling() -> None:
    assert kombu_broker("redis://h:6379/0") == {"broker_url": "redis://h:6379/0"}
    config = kombu_broker("sentinels://:p%3Aw@h1,h2:26380/mymaster/2?sentinel_password=s&ssl_ca_certs=/ca.pem")
    tls = {"ssl_cert_reqs": "required", "ssl_ca_certs": "/ca.pem"}
    assert config == {
        "broker_url": "sentinel://:p%3Aw@h1:26379/2;sentinel://:p%3Aw@h2:26380",
        "broker_transport_options": {"master_name": "mymaster", **TIMEOUTS,
                                     "sentinel_kwargs": {"password": "s", "ssl": True, **tls}},
        "broker_use_ssl": tls,
    }


def test_celery_config_keeps_its_transport_options_and_direct_publish() -> None:
    url = "sentinel://h1,h2/omni/0"
    settings = Settings(redis_url=url)
    config = celery_config(settings)
    assert config["broker_url"] == "sentinel://h1:26379/0;sentinel://h2:26379"
    assert config["broker_transport_options"] == {"ack_emulation": False, "master_name": "omni", **TIMEOUTS}
    assert settings.publishes_in_commit  # the broker is the job store's Redis: commits push the messages


def test_clients_follow_the_sentinels() -> None:
    sync = redis_client("sentinel://:pw@h1:1,h2:2/omni/4?sentinel_password=s", socket_timeout=3)
    pool = sync.connection_pool
    assert pool.service_name == "omni" and pool.is_master  # type: ignore[attr-defined]
    assert pool.connection_kwargs["db"] == 4 and pool.connection_kwargs["password"] == "pw"
    assert pool.connection_kwargs["retry"].get_retries() >= 20  # through a failover, not 3 quick tries
    manager = pool.sentinel_manager  # type: ignore[attr-defined]
    assert [s.connection_pool.connection_kwargs["port"] for s in manager.sentinels] == [1, 2]
    assert manager.sentinels[0].connection_pool.connection_kwargs["password"] == "s"
    bounded = async_client_from_url("sentinel://h1/omni", max_connections=7)
    assert bounded.connection_pool.max_connections == 7
    assert bounded.connection_pool.service_name == "omni"  # type: ignore[attr-defined]


def test_the_broker_may_be_another_transport() -> None:
    assert Settings(broker_url="amqp://guest@rabbit//").broker_url == "amqp://guest@rabbit//"


def test_a_store_on_sentinels_needs_its_async_client_from_the_url() -> None:
    """Its connections name no server: a guess would be the default 127.0.0.1:6379, another Redis."""
    from omni_jobs.jobs.redis_store import same_server_async

    with pytest.raises(TypeError, match="use_async_client"):
        same_server_async(redis_client("sentinel://127.0.0.1:1/omni"))
