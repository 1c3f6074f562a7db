"""Optional bearer-token auth: an API key names its tenant.

Config holds sha256 hex digests of the keys, never the keys (`qvpic`-side: `printf %s KEY | sha256sum`).
With keys configured, every governed request needs `Authorization: Bearer <key>` (the OpenAI client
sends its `api_key` so) and the tenant comes from the key alone; `X-Tenant` cannot override it. With
none, the tenant is `X-Tenant` or the default tenant — attribution without authentication, for loopback
and development only: `qvpic serve` binds 127.0.0.1 unless told otherwise, and refuses a wider bind without
keys unless `insecure_no_auth` (`--insecure-no-auth`) accepts it, warning at every start (`exposure`). A key file
counts only for the keys it holds: an empty one is no keys.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Mapping
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from schemas.api import Label
from schemas.errors import InvalidHeaderError, UnauthorizedError
from serve.governance.config import AuthConfig, Sha256Hex

_LABEL = TypeAdapter(Label)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname may resolve anywhere: treat it as exposed


def exposure(host: str, auth: AuthConfig) -> str | None:
    """None when binding `host` is safe (loopback, or API keys configured); the warning to log at every start
    when the operator accepted an open server; ValueError when it would open one unasked."""
    if is_loopback(host) or auth.api_key_sha256 or auth.trusted_proxy_sha256 or file_keys(auth):
        return None
    if not auth.insecure_no_auth:
        raise ValueError(f"refusing to listen on {host} with no API keys: anyone who reaches it could act as any "
                         "tenant. Configure ingress.governance.auth.api_key_sha256, bind 127.0.0.1, or pass "
                         "--insecure-no-auth (auth.insecure_no_auth: true) to accept it")
    return (f"WARNING: listening on {host} with no API keys (insecure_no_auth): anyone who reaches it may act "
            "as any tenant through X-Tenant")


def file_keys(auth: AuthConfig) -> dict[Sha256Hex, str]:
    """The keys of `auth.api_key_sha256_file` ({} without one): a file that is empty, all comments, or unreadable
    holds no keys, so it cannot stand for auth (an unmounted or empty Secret must not open the server);
    ValueError for an unreadable or malformed file."""
    if auth.api_key_sha256_file is None:
        return {}
    try:
        return read_key_file(auth.api_key_sha256_file)
    except OSError as error:
        raise ValueError(f"cannot read the API key file {auth.api_key_sha256_file.name!r}: "
                         f"{error.strerror or type(error).__name__}") from None


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


PROXY = object()  # the "tenant" of a trusted proxy's key: the request's X-Tenant decides


def read_key_file(path: Path) -> dict[Sha256Hex, str]:
    """`<sha256 hex> <tenant>` per line (blank lines and `#` comments skipped), each checked like the config's."""
    keys: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2:
            raise ValueError(f"{path.name}:{number}: expected '<sha256 hex> <tenant>', got {len(fields)} fields")
        keys[fields[0]] = fields[1]
    try:  # the same checks as api_key_sha256 in the config (64 lowercase hex digits, a tenant label)
        return AuthConfig(api_key_sha256=keys).api_key_sha256
    except ValidationError as error:
        raise ValueError(f"{path.name}: {error.errors()[0]['msg']}") from None


class Authenticator:
    def __init__(self, config: AuthConfig, default_tenant: str):
        keys = dict(config.api_key_sha256)
        if config.api_key_sha256_file is not None:
            keys |= read_key_file(config.api_key_sha256_file)
        # (digest bytes, tenant): every request compares against each digest in constant time, so how long the
        # check takes says nothing about how close a guess was (a dict lookup would hash and compare early-out)
        self.digests = [(bytes.fromhex(digest), tenant) for digest, tenant in keys.items()]
        self.digests += [(bytes.fromhex(digest), PROXY) for digest in config.trusted_proxy_sha256]
        self.open_paths = config.open_paths
        # no keys and no insecure_no_auth: `exposure` allowed only a loopback bind, so only loopback Hosts are
        # answered (serve/http/guards.py LoopbackHostGate: DNS rebinding)
        self.loopback_only = not self.digests and not config.insecure_no_auth
        self.default_tenant = default_tenant

    @property
    def required(self) -> bool:  # any key configured, a proxy's included
        return bool(self.digests)

    def admits(self, headers: Mapping[str, str]) -> bool:
        """Whether the request may see what only a key holder sees (`/readyz`'s detail): always without keys
        configured, else only with a valid key."""
        if not self.required:
            return True
        try:
            self.tenant(headers)
        except (UnauthorizedError, InvalidHeaderError):
            return False
        return True

    def tenant(self, headers: Mapping[str, str]) -> str:
        """The request's tenant; `UnauthorizedError` when keys are configured and none of them is given."""
        if not self.required:
            return header_label(headers, "X-Tenant") or self.default_tenant
        scheme, _, api_key = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not api_key.strip():
            raise UnauthorizedError("this server needs an API key: send 'Authorization: Bearer <key>'")
        given = hashlib.sha256(api_key.strip().encode()).digest()
        tenant = None
        for digest, owner in self.digests:  # no early exit
            if hmac.compare_digest(given, digest):
                tenant = owner
        if tenant is None:
            raise UnauthorizedError("unknown API key")
        if tenant is PROXY:  # a trusted gateway acting for its user: the tenant is the one it names
            named = header_label(headers, "X-Tenant")
            if named is None:
                raise UnauthorizedError("this key is a trusted proxy's: name the tenant in X-Tenant")
            return named
        return tenant
