"""A Redis password named by the URL (kvlab.store.secrets) instead of carried in it, and never
shown, whatever characters it holds: not in the Redis tier's errors and warnings, nor in the
connector's configuration errors."""

from __future__ import annotations

import logging
from urllib.parse import quote

import pytest

from kvlab.connector.config import ConnectorConfig
from kvlab.runtime.servers import free_port
from kvlab.store.secrets import redact, resolve_redis_url
from kvlab.store.tiers import RedisTier, StoreStats

SECRET = "s3cret-Pass"


def test_a_password_file_or_variable_is_read_into_the_url(tmp_path, monkeypatch):
    file = tmp_path / "password"
    file.write_text("a/b@c\n")
    assert resolve_redis_url(f"redis://127.0.0.1:6379/0?password_file={file}") == "redis://:a%2Fb%40c@127.0.0.1:6379/0"
    monkeypatch.setenv("KVLAB_REDIS_PASSWORD", SECRET)
    assert resolve_redis_url("rediss://kv@h:1/2?ssl_cert_reqs=none&password_env=KVLAB_REDIS_PASSWORD") \
        == f"rediss://kv:{SECRET}@h:1/2?ssl_cert_reqs=none"
    assert resolve_redis_url("redis://:pw@h:1/0") == "redis://:pw@h:1/0"  # nothing named: as it is


@pytest.mark.parametrize("query, message", [
    ("password_file={missing}", "password_file '.*missing' cannot be read"),
    ("password_file={empty}", "password_file '.*empty' holds no password"),
    ("password_env=KVLAB_UNSET_PASSWORD", "names 'KVLAB_UNSET_PASSWORD', an environment variable that is not set"),
    ("password_env=KVLAB_EMPTY_PASSWORD", "is empty"),
    ("password_env=A&password_file=/b", "not several"),
])
def test_a_password_that_is_not_there_is_a_clear_error_naming_the_key(tmp_path, monkeypatch, query, message):
    (tmp_path / "empty").write_text("\n")
    monkeypatch.delenv("KVLAB_UNSET_PASSWORD", raising=False)
    monkeypatch.setenv("KVLAB_EMPTY_PASSWORD", "")
    url = "redis://127.0.0.1:6379/0?" + query.format(missing=tmp_path / "missing", empty=tmp_path / "empty")
    with pytest.raises(ValueError, match=f"^redis_url: .*{message}"):
        resolve_redis_url(url)
    with pytest.raises(ValueError, match=f"KVLabConnector: the redis tier: redis_url: .*{message}"):  # at start-up
        ConnectorConfig.parse({"tiers": ["memory", "redis"], "redis": {"url": url}})


@pytest.mark.parametrize("text, redacted", [
    (f"redis://:{SECRET}@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    (f"redis://kv:{SECRET}@host/0", "redis://kv:***@host/0"),
    (f"rediss://kv:{SECRET}@host:6380", "rediss://kv:***@host:6380"),
    (f"cannot reach 'redis://:{SECRET}@h:1/0' (refused)", "cannot reach 'redis://:***@h:1/0' (refused)"),
    (f"redis://h:1/0?db=1&password={SECRET}&ssl=1", "redis://h:1/0?db=1&password=***"),  # all after it
    ("redis://h:1/0?password_file=/run/pw", "redis://h:1/0?password_file=/run/pw"),  # a file's name is no secret
    ("redis://kv@h:1/0", "redis://kv@h:1/0"),
])
def test_redact(text, redacted):
    assert redact(text) == redacted


def test_the_redis_tier_never_shows_the_password(caplog):
    """Its start-up error and its warnings name the server, not the password."""
    url = f"redis://:{SECRET}@127.0.0.1:{free_port()}/0"  # nobody listens there
    tier = RedisTier(url, StoreStats(), timeout_s=0.5)
    with pytest.raises(ValueError, match="cannot reach") as error:
        tier.check()
    assert SECRET not in str(error.value) and "redis://:***@127.0.0.1" in str(error.value)
    with caplog.at_level(logging.WARNING, logger="kvlab.store"):
        assert tier.locate("0" * 32) is None
    assert "Redis at redis://:***@127.0.0.1" in caplog.text and SECRET not in caplog.text


def test_configuration_errors_never_show_the_password():
    with pytest.raises(ValueError, match="redis_url must start with") as error:
        ConnectorConfig.parse({"tiers": ["redis"], "redis": {"url": f"http://:{SECRET}@127.0.0.1:6379/0"}})
    assert SECRET not in str(error.value)
    with pytest.raises(ValueError, match="redis_url's port must be a number") as error:
        ConnectorConfig.parse({"tiers": ["redis"], "redis": {"url": f"redis://:{SECRET}@127.0.0.1:port/0"}})
    assert SECRET not in str(error.value)


# Passwords as people write them into a URL, not percent-encoded (base64 ones hold '/'): each
# character that ends a part of a URL, and the rest of the list. No part of one may show.
PARTS = ("Zq7", "Kw9", "Jx4")
PASSWORDS = [f"{PARTS[0]}{c}{PARTS[1]}{c}{PARTS[2]}" for c in ("/", "#", "?", "@", "%", " ", ":", "é€", "/#?@% :")]


def shows_none(text: str) -> bool:
    return not any(part in text for part in PARTS)


@pytest.mark.parametrize("password", PASSWORDS)
def test_no_password_shows_whatever_it_holds(password: str, caplog) -> None:
    """redact() finds it in the user information, as ``?password=``, percent-encoded, and inside
    a message; the connector's start-up errors and the Redis tier's errors and warnings hide it,
    or refuse a URL redis-py would misread (with a message that hides it too)."""
    port = free_port()  # nobody listens there
    inline = [f"redis://:{password}@127.0.0.1:{port}/0", f"rediss://kv:{password}@[::1]:{port}",
              f"redis://kv:{quote(password, safe='')}@127.0.0.1:{port}/0", f"unix://:{password}@/run/redis.sock?db=0",
              f"redis://127.0.0.1:{port}/0?password={password}", f"redis-cluster://:{password}@127.0.0.1:{port}"]
    for url in inline:
        assert shows_none(redact(url)) and shows_none(redact(f"cannot reach {url!r} (refused)")), url
        try:
            ConnectorConfig.parse({"tiers": ["redis"], "redis": {"url": url}})
        except ValueError as error:
            assert shows_none(str(error)), error
    for url in (inline[0], inline[2]):
        try:
            tier = RedisTier(url, StoreStats(), timeout_s=0.5)
        except ValueError as error:  # a URL redis-py would misread
            assert shows_none(str(error)) and "percent-encoded" in str(error), error
            continue
        with pytest.raises(ValueError, match="cannot reach") as error:
            tier.check()
        assert shows_none(str(error.value))
        with caplog.at_level(logging.WARNING, logger="kvlab.store"):
            assert tier.locate("0" * 32) is None
    assert "Redis at redis://" in caplog.text and shows_none(caplog.text)


@pytest.mark.parametrize("password", PASSWORDS)
def test_a_named_password_holds_any_character(password: str, tmp_path, monkeypatch) -> None:
    """By file or variable, a password reaches redis-py whole (percent-encoded in the URL)."""
    file = tmp_path / "password"
    file.write_text(password + "\n", encoding="utf-8")
    monkeypatch.setenv("KVLAB_REDIS_PASSWORD", password)
    for query in (f"password_file={quote(str(file))}", "password_env=KVLAB_REDIS_PASSWORD"):
        url = f"redis://127.0.0.1:6379/0?{query}"
        import redis

        assert redis.Redis.from_url(resolve_redis_url(url)).connection_pool.connection_kwargs["password"] == password
        ConnectorConfig.parse({"tiers": ["redis"], "redis": {"url": url}})
