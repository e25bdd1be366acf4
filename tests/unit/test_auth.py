"""API key format, hashing and tenant names (the Redis-backed store: tests/integration/test_api_keys.py)."""

from __future__ import annotations

import hashlib

import pytest

from omni_jobs.accept.auth import _KEY_RE, KEY_PREFIX, check_tenant, hash_key
from omni_jobs.core.settings import Settings
from omni_jobs.pipelines.limits import Limits


def test_hash_is_sha256_of_the_whole_key_and_never_the_key() -> None:
    key = KEY_PREFIX + "0123456789abcdef_" + "s" * 43
    assert hash_key(key) == hashlib.sha256(key.encode()).hexdigest()
    assert key not in hash_key(key)


@pytest.mark.parametrize("key", ["ok_0123456789abcdef_" + "A" * 43, "ok_ffffffffffffffff_a-b_c" + "x" * 30])
def test_well_formed_keys_parse(key: str) -> None:
    match = _KEY_RE.match(key)
    assert match is not None and len(match.group("id")) == 16


@pytest.mark.parametrize("key", ["", "Bearer ok_x", "ok_0123456789abcde_" + "A" * 43, "sk_0123456789abcdef_" + "A" * 43,
                                 "ok_0123456789abcdef_short", "ok_0123456789abcdef_" + "A" * 43 + " extra"])
def test_malformed_keys_do_not_parse(key: str) -> None:
    assert _KEY_RE.match(key) is None


@pytest.mark.parametrize("tenant", ["acme", "team-1", "a.b_c", "X" * 64])
def test_tenant_names(tenant: str) -> None:
    assert check_tenant(tenant) == tenant


@pytest.mark.parametrize("tenant", ["", "-acme", "a b", "a/b", "x" * 65, "tenant:evil"])
def test_bad_tenant_names_are_refused(tenant: str) -> None:
    with pytest.raises(ValueError, match="tenant"):
        check_tenant(tenant)


def test_auth_is_on_by_default_and_limits_have_safe_defaults() -> None:
    s = Settings()
    assert s.auth_enabled is True
    assert s.webhook_allow_hosts == []
    limits = Limits.from_settings(s)
    assert (limits.max_steps, limits.max_image_side, limits.max_tokens, limits.max_outputs) == (200, 2048, 4096, 10)
    assert s.max_request_bytes == 32 * 1024 * 1024


def test_limits_name_the_field_the_cap_and_the_setting() -> None:
    limits = Limits(max_steps=10, max_image_side=64, max_tokens=16)
    errors = limits.check_params({"dit": {"num_inference_steps": 11, "width": 64, "height": 72},
                                  "ar": {"max_tokens": 17, "temperature": 1.5}})
    found = {e.loc: e.message for e in errors}
    assert set(found) == {("params", "dit", "num_inference_steps"), ("params", "dit", "height"),
                          ("params", "ar", "max_tokens")}
    assert "at most 10 (OMNI_MAX_STEPS)" in found[("params", "dit", "num_inference_steps")]
    assert "at most 64 (OMNI_MAX_IMAGE_SIDE)" in found[("params", "dit", "height")]
    assert limits.check_params({"dit": {"num_inference_steps": 10, "width": None}}) == []


def test_secret_settings_never_show_in_reprs_or_dumps() -> None:
    s = Settings(s3_secret_access_key="s3-very-secret-value", webhook_secret="whsec_" + "A" * 44)  # type: ignore[arg-type]
    for text in (repr(s), str(s), s.model_dump_json()):
        assert "s3-very-secret-value" not in text and "A" * 44 not in text
    assert s.s3_secret_access_key is not None and s.s3_secret_access_key.get_secret_value() == "s3-very-secret-value"
