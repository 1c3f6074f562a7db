"""Optional bearer-token auth: an API key names its tenant.

Config holds sha256 hex digests of the keys, never the keys (`qvpic`-side: `printf %s KEY | sha256sum`).
With keys configured, every governed request needs `Authorization: Bearer <key>` (the OpenAI client
sends its `api_key` so) and the tenant comes from the key alone; `X-Tenant` cannot override it. With
none, the tenant is `X-Tenant` or the default tenant — attribution without authentication, which is
why `qvpic serve` binds 127.0.0.1 unless `--host` says otherwise.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from pydantic import TypeAdapter, ValidationError

from schemas.api import Label
from schemas.errors import InvalidHeaderError, UnauthorizedError
from serve.config import AuthConfig, Sha256Hex

_LABEL = TypeAdapter(Label)


def key_digest(api_key: str) -> Sha256Hex:
    return hashlib.sha256(api_key.encode()).hexdigest()


def header_label(headers: Mapping[str, str], name: str) -> str | None:
    """A tenant / task-type header's value (`headers` is case-insensitive), validated like the body fields."""
    value = headers.get(name)
    if value is None:
        return None
    try:
        return _LABEL.validate_python(value)
    except ValidationError:
        raise InvalidHeaderError(f"{name} must be 1-64 characters of [A-Za-z0-9_.:@-], got {value[:80]!r}") from None


class Authenticator:
    def __init__(self, config: AuthConfig, default_tenant: str):
        self.tenant_of_digest = dict(config.api_key_sha256)
        self.default_tenant = default_tenant

    @property
    def required(self) -> bool:
        return bool(self.tenant_of_digest)

    def tenant(self, headers: Mapping[str, str]) -> str:
        """The request's tenant; `UnauthorizedError` when keys are configured and none of them is given."""
        if not self.required:
            return header_label(headers, "X-Tenant") or self.default_tenant
        scheme, _, api_key = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not api_key.strip():
            raise UnauthorizedError("this server needs an API key: send 'Authorization: Bearer <key>'")
        tenant = self.tenant_of_digest.get(key_digest(api_key.strip()))
        if tenant is None:
            raise UnauthorizedError("unknown API key")
        return tenant
