"""The webhook SSRF guard: which addresses are refused, the allowlist, and pinning to a checked address."""

from __future__ import annotations

import pytest

from omni_jobs.core.net_guard import HostDoesNotResolve, NetGuard, UnsafeWebhookUrl, is_public, system_resolver

PUBLIC = "93.184.216.34"


def fixed(table: dict[str, list[str]]):  # type: ignore[no-untyped-def]
    """A resolver answering from a table: the DNS a test controls (e.g. one that rebinds)."""
    return lambda host, port: list(table[host])


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254",
                                     "100.64.0.1", "0.0.0.0", "224.0.0.1", "255.255.255.255", "::1", "fe80::1",
                                     "fc00::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::", "240.0.0.1"])
def test_private_loopback_link_local_multicast_reserved_are_not_public(address: str) -> None:
    assert not is_public(address)


@pytest.mark.parametrize("address", [PUBLIC, "8.8.8.8", "2606:4700:4700::1111"])
def test_global_addresses_are_public(address: str) -> None:
    assert is_public(address)


@pytest.mark.parametrize("url", ["https://127.0.0.1/hook", "https://[::1]/hook", "https://169.254.169.254/latest",
                                 "https://10.0.0.5:8443/x", "https://localhost/hook"])
def test_internal_targets_are_refused_with_the_fix_named(url: str) -> None:
    with pytest.raises(UnsafeWebhookUrl, match="OMNI_WEBHOOK_ALLOW_HOSTS"):
        NetGuard().check(url)  # the real resolver: literals and /etc/hosts, no network needed


def test_a_name_resolving_to_any_private_address_is_refused() -> None:
    guard = NetGuard(resolve=fixed({"mixed.example": [PUBLIC, "10.0.0.1"]}))
    with pytest.raises(UnsafeWebhookUrl, match="10.0.0.1"):
        guard.check("https://mixed.example/hook")


def test_plain_http_is_refused_unless_the_host_is_allowlisted() -> None:
    guard = NetGuard(resolve=fixed({"hooks.example": [PUBLIC]}))
    assert guard.check("https://hooks.example/x") == [PUBLIC]
    with pytest.raises(UnsafeWebhookUrl, match="https://"):
        guard.check("http://hooks.example/x")


def test_allowlist_by_host_or_host_and_port() -> None:
    assert NetGuard(allow_hosts=["127.0.0.1"]).check("http://127.0.0.1:9999/hook") == ["127.0.0.1"]
    by_port = NetGuard(allow_hosts=["localhost:8081"])
    assert "127.0.0.1" in by_port.check("http://localhost:8081/hook")
    with pytest.raises(UnsafeWebhookUrl):
        by_port.check("http://localhost:8082/hook")


def test_unresolvable_host_is_its_own_error() -> None:
    with pytest.raises(HostDoesNotResolve):
        system_resolver("no-such-host.invalid", 443)


def test_pin_binds_the_url_to_the_checked_address_and_keeps_host_and_sni() -> None:
    guard = NetGuard(resolve=fixed({"hooks.example": [PUBLIC, "1.1.1.1"]}))
    pinned = guard.pin("https://hooks.example:8443/a/b?x=1")
    assert pinned.url == f"https://{PUBLIC}:8443/a/b?x=1"
    assert pinned.headers == {"host": "hooks.example:8443"}
    assert pinned.extensions == {"sni_hostname": "hooks.example"}


def test_dns_rebinding_after_submit_is_refused_at_delivery() -> None:
    table = {"rebind.example": [PUBLIC]}
    guard = NetGuard(resolve=fixed(table))
    guard.check("https://rebind.example/hook")  # submit time: public, accepted
    table["rebind.example"] = ["127.0.0.1"]  # the attacker's DNS now points inside
    with pytest.raises(UnsafeWebhookUrl, match="127.0.0.1"):
        guard.pin("https://rebind.example/hook")
