"""A Redis URL that never shows its credentials: not in a log line, an error, the `repr` of a config, nor a
validation error about it (docs/SECURITY.md, "Secrets").

Redis takes its password in the userinfo (`redis://user:pass@host`, `rediss://:pass@host`) or the query string
(`redis://host/0?password=pass`): `redacted` hides both. `RedisUrl` is a `str` (the Redis client reads it as
given) whose `repr` is redacted, so a config holding one prints safely; the `RedisUrlField` validator checks the
scheme on a wrapped input, so a refused URL is not echoed back either (pydantic quotes the input it refused).
`scrub` takes the secrets out of any other text — an exception's message that quotes the URL.
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from pydantic import BeforeValidator, PlainValidator

SCHEMES = ("redis://", "rediss://")
HIDDEN = "***"
SECRET_PARAMS = ("password", "pass", "secret", "token", "auth")  # a query parameter holding one of these


def is_secret_param(name: str) -> bool:
    return any(word in name.lower() for word in SECRET_PARAMS)


def secrets(url: str) -> list[str]:
    """The credentials `url` holds: its userinfo's password (or the whole userinfo) and secret query values."""
    parts = urlsplit(url)
    found = []
    if "@" in parts.netloc:
        userinfo = parts.netloc.rsplit("@", 1)[0]
        found.append(userinfo.partition(":")[2] or userinfo)
    for pair in parts.query.split("&"):
        name, _, value = pair.partition("=")
        if is_secret_param(unquote(name)):
            found.append(value)
    found += [unquote(secret) for secret in found]  # as given and as the client decodes it (%40 is @)
    return sorted({s for s in found if s}, key=len, reverse=True)  # longest first: one may contain another


def redacted(url: str) -> str:
    """`url` without its credentials: `redis://u:p@host:6379/0?password=p` → `redis://***@host:6379/0?password=***`."""
    parts = urlsplit(url)
    netloc = HIDDEN + "@" + parts.netloc.rsplit("@", 1)[1] if "@" in parts.netloc else parts.netloc
    query = "&".join(f"{name}={HIDDEN if is_secret_param(name) else value}"
                     for name, value in parse_qsl(parts.query, keep_blank_values=True))
    return scrub(urlunsplit(parts._replace(netloc=netloc, query=query)), url)


def scrub(text: str, url: str) -> str:
    """`text` with every credential of `url` replaced (an error message that quotes the URL, in any form)."""
    for secret in secrets(url):
        text = text.replace(secret, HIDDEN)
    return text


class RedisUrl(str):
    """A Redis URL whose `repr` (a config's, a log's `%r`) hides its credentials."""

    def __repr__(self) -> str:
        return repr(redacted(self))


class _Refused:
    """A redis_url input on its way through validation: a validation error prints none of it (a malformed URL has
    no part known not to be secret: `redis:/pass@host`)."""

    def __init__(self, value: str):
        self.value = value

    def __repr__(self) -> str:
        return "<hidden>"


def _wrap(value: Any) -> Any:
    return _Refused(value) if isinstance(value, str) else value


def _check(value: Any) -> RedisUrl:
    url = value.value if isinstance(value, _Refused) else value
    if not isinstance(url, str) or not url.startswith(SCHEMES):
        raise ValueError("redis_url must be a redis:// or rediss:// URL")
    return RedisUrl(url)


RedisUrlField = Annotated[RedisUrl, PlainValidator(_check, json_schema_input_type=str), BeforeValidator(_wrap)]
