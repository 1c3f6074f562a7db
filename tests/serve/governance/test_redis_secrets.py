"""A Redis password never leaves the process in any URL form (docs/SECURITY.md, "Secrets"): not in a log line,
an error, the repr of a config, nor the validation error of a refused URL."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis
from pydantic import ValidationError

from schemas.redis_url import redacted
from serve.config import AppConfig
from serve.governance.config import GovernanceConfig
from serve.governance.shared_state import RedisConnection, SharedStateUnavailable

PASSWORD = "hunter2-s3cr3t"
FORMS = [f"redis://qvpic:{PASSWORD}@redis.internal:6379/0",   # user and password
         f"rediss://:{PASSWORD}@redis.internal:6380/0",        # password only, TLS
         f"redis://{PASSWORD}@redis.internal:6379",             # a bare userinfo
         f"redis://redis.internal:6379/0?password={PASSWORD}",  # the query string
         f"redis://redis.internal/0?db=1&password={PASSWORD}&socket_timeout=1",
         f"redis://redis.internal/0?Password={PASSWORD.replace('-', '%2D')}"]  # percent-encoded, any case


@pytest.mark.parametrize("url", FORMS)
def test_every_url_form_is_redacted_and_still_names_its_server(url):
    assert PASSWORD not in redacted(url) and "%2D" not in redacted(url) and "redis.internal" in redacted(url)
    config = GovernanceConfig(redis_url=url)
    assert config.redis_url == url  # the client is given the URL itself
    printed = repr(config) + str(config) + repr(GovernanceConfig.model_validate({"redis_url": url}))
    assert PASSWORD not in printed and "redis.internal" in printed


@pytest.mark.parametrize("url", [f"http://:{PASSWORD}@redis.internal:6379", f"redis:/{PASSWORD}@x", PASSWORD])
def test_a_refused_url_is_not_echoed_in_its_validation_error(url):
    with pytest.raises(ValidationError, match="redis:// or rediss://") as refused:
        AppConfig.model_validate({"store": {"uri": "/data/store"}, "ingress": {"governance": {"redis_url": url}}})
    assert PASSWORD not in str(refused.value) and PASSWORD not in repr(refused.value.errors())


@pytest.mark.parametrize("url", [FORMS[3], FORMS[0]])
def test_a_client_error_quoting_the_url_is_scrubbed_from_logs_and_errors(url, caplog):
    caplog.set_level(logging.DEBUG)
    connection = RedisConnection(url.replace("redis.internal", "127.0.0.1"), timeout_s=0.2, retry_after_s=60)

    def fails(client):  # a client error that quotes the URL it was given (percent-decoded, too)
        raise redis.ConnectionError(f"cannot reach {url} ({url.replace('-', '%2D')})")

    with pytest.raises(SharedStateUnavailable) as raised:
        asyncio.run(connection.call("test", fails))
    assert PASSWORD not in str(raised.value) + caplog.text and raised.value.__cause__ is None
    assert "redis.internal" in str(raised.value)  # the rest of the message stays
    assert PASSWORD not in repr(connection.url)
