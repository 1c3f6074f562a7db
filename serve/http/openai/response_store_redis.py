"""Stored `/v1/responses` answers in the governance's Redis (serve/governance/shared_state.py), shared by every
ingress replica, with the memory store's semantics and bounds (serve/config.py `ResponseStoreConfig`).

Per tenant (keyed by a digest of the tenant the server authenticated, never by anything the client names):
`…:t:<tenant>:r:<id>` holds the response and its conversation (JSON, PX = ttl_s), `…:t:<tenant>:idx` a sorted set
of its ids by expiry time (so oldest first: every response lives ttl_s), `…:t:<tenant>:bytes` each id's size; and
`…:tenants` a sorted set of tenants by last use. Each operation is one Lua script, so that two replicas storing
for one tenant at once never leave it over its bounds, and every time is Redis's own clock (replicas' clocks may
differ). The scripts derive a tenant's keys from their arguments: a single Redis node, as the governance's client
(`redis.Redis.from_url`) is, not Redis Cluster.

Redis down: a write is skipped with a warning (the answer is returned all the same, and a later lookup of it is a
404 once Redis is back); a lookup is a 503 with Retry-After, since whether the response exists is unknown (a 404
would tell a client to drop a conversation that may still be there).
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from schemas.errors import StoreUnavailableError
from serve.config import ResponseStoreConfig
from serve.governance.config import StateBackend
from serve.governance.shared_state import RedisConnection, SharedStateUnavailable
from serve.http.openai.response_store import MemoryResponseStore, ResponseStore, Stored, stored_nbytes, too_large

log = logging.getLogger(__name__)

PREFIX = "qvpic:rs"
USE = "response_store"  # the connection's log and error metric label

_NOW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
"""
_DROP = """
local function drop(base, ids)
  for _, old in ipairs(ids) do
    redis.call('DEL', base .. ':r:' .. old)
    redis.call('HDEL', base .. ':bytes', old)
    redis.call('ZREM', base .. ':idx', old)
  end
end
"""
# ARGV: prefix, tenant digest, id, value, nbytes, ttl_ms, max count, max bytes, max tenants
PUT = _NOW + _DROP + """
local prefix, tenant, id, value = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local nbytes, ttl_ms = tonumber(ARGV[5]), tonumber(ARGV[6])
local max_count, max_bytes, max_tenants = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local base = prefix .. ':t:' .. tenant
drop(base, {id})
drop(base, redis.call('ZRANGEBYSCORE', base .. ':idx', '-inf', now))
local total = 0
for _, n in ipairs(redis.call('HVALS', base .. ':bytes')) do total = total + tonumber(n) end
while redis.call('ZCARD', base .. ':idx') >= max_count or total + nbytes > max_bytes do
  local oldest = redis.call('ZRANGE', base .. ':idx', 0, 0)[1]
  if not oldest then break end
  total = total - tonumber(redis.call('HGET', base .. ':bytes', oldest) or '0')
  drop(base, {oldest})
end
redis.call('SET', base .. ':r:' .. id, value, 'PX', ttl_ms)
redis.call('ZADD', base .. ':idx', now + ttl_ms, id)
redis.call('HSET', base .. ':bytes', id, nbytes)
redis.call('PEXPIRE', base .. ':idx', ttl_ms)
redis.call('PEXPIRE', base .. ':bytes', ttl_ms)
local tenants = prefix .. ':tenants'
redis.call('ZADD', tenants, now, tenant)
redis.call('ZREMRANGEBYSCORE', tenants, '-inf', now - ttl_ms)  -- untouched for a TTL: its keys have expired
while redis.call('ZCARD', tenants) > max_tenants do  -- the least recently used tenant's responses go
  local old = redis.call('ZRANGE', tenants, 0, 0)[1]
  local old_base = prefix .. ':t:' .. old
  drop(old_base, redis.call('ZRANGE', old_base .. ':idx', 0, -1))
  redis.call('DEL', old_base .. ':idx', old_base .. ':bytes')
  redis.call('ZREM', tenants, old)
end
redis.call('PEXPIRE', tenants, ttl_ms)
return 1
"""
# ARGV: prefix, tenant digest, id
GET = _NOW + """
local base = ARGV[1] .. ':t:' .. ARGV[2]
local value = redis.call('GET', base .. ':r:' .. ARGV[3])
if value then redis.call('ZADD', ARGV[1] .. ':tenants', 'XX', now, ARGV[2]) end
return value
"""
DELETE = _DROP + """
local base = ARGV[1] .. ':t:' .. ARGV[2]
local found = redis.call('EXISTS', base .. ':r:' .. ARGV[3])
drop(base, {ARGV[3]})
return found
"""


def tenant_key(tenant: str) -> str:
    """The tenant as its keys name it: a digest, so no tenant name shapes a key."""
    return hashlib.sha256(tenant.encode()).hexdigest()


class RedisResponseStore:
    def __init__(self, config: ResponseStoreConfig, redis: RedisConnection, prefix: str = PREFIX):
        self.config, self.redis, self.prefix = config, redis, prefix
        client = redis.client
        self._put, self._get, self._delete = (client.register_script(s) for s in (PUT, GET, DELETE))

    async def put(self, tenant: str, response_id: str, body: dict[str, Any], history: list[dict[str, Any]]) -> bool:
        nbytes = stored_nbytes(body, history)
        if too_large(self.config, tenant, response_id, nbytes):
            return False
        value = json.dumps({"body": body, "history": history})
        c = self.config
        args = [self.prefix, tenant_key(tenant), response_id, value, nbytes, int(c.ttl_s * 1e3),
                c.max_responses_per_tenant, c.max_bytes_per_tenant, c.max_tenants]
        try:
            await self.redis.call(USE, lambda client: self._put(args=args, client=client))
        except SharedStateUnavailable as error:  # the answer is returned all the same: only its storing is lost
            log.warning("response %s of tenant %r not stored: redis unavailable (%s)", response_id, tenant, error)
            return False
        return True

    async def get(self, tenant: str, response_id: str) -> Stored | None:
        value = await self._run(self._get, tenant, response_id)
        if value is None:
            return None
        kept = json.loads(value)
        return Stored(kept["body"], kept["history"])

    async def delete(self, tenant: str, response_id: str) -> bool:
        return bool(await self._run(self._delete, tenant, response_id))

    async def _run(self, script, tenant: str, response_id: str):
        args = [self.prefix, tenant_key(tenant), response_id]
        try:
            return await self.redis.call(USE, lambda client: script(args=args, client=client))
        except SharedStateUnavailable:
            raise StoreUnavailableError("stored responses are unavailable (the shared store did not answer); "
                                        "retry later", retry_after_s=self.redis.retry_after_s) from None


def response_store(config: ResponseStoreConfig, redis: RedisConnection | None) -> ResponseStore:
    """The store `config.backend` names: in this replica's memory, or in the governance's Redis."""
    if config.backend is not StateBackend.REDIS:
        return MemoryResponseStore(config)
    if redis is None:
        raise ValueError("responses use backend 'redis' but the governance has no redis_url")
    return RedisResponseStore(config, redis)
