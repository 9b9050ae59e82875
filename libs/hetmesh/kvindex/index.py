"""Redis prefix index: block hash -> workers holding it, with last-use time.

Layout (all keys under `hetmesh:kv:`):
  blk:<model>:<hash>  ZSET member=worker_id score=last-use unix time; key TTL refreshed on store
  wrk:<worker_id>     SET of "<model>:<hash>" the worker holds, so its entries go when it dies
A reader also ignores members older than the TTL, so a worker that vanished without a
goodbye drops out of lookups even before its keys expire.

Both hot paths are one server-side Lua call each (one round trip, no per-block client
work; the block hashes travel as one packed argument), which keeps the scheduler's cost per
request flat in the prompt length.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis

from hetmesh.config import MeshConfig, redis_connection
from hetmesh.protocol import KvEvent
from hetmesh.redispool import blocking_client

KEY = "hetmesh:kv:"
POOL_WAIT_S = 1.0  # a lookup waits no longer for a free connection (then it finds nothing: load alone)

# ARGV: model, worker, now, ttl, stored, removed (each a space-separated list of block hashes), cleared ("1":
# forget everything the worker held first). One script: a lookup never sees a worker cleared but not yet
# stored again (a resync's first batch).
_APPLY = """
local model, worker, now, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local prefix = KEYS[1]
local wkey = prefix .. 'wrk:' .. worker
if ARGV[7] == '1' then
  for _, entry in ipairs(redis.call('SMEMBERS', wkey)) do
    redis.call('ZREM', prefix .. 'blk:' .. entry, worker)
  end
  redis.call('DEL', wkey)
end
local ns = 0
for h in string.gmatch(ARGV[5], '%S+') do
  local k = prefix .. 'blk:' .. model .. ':' .. h
  redis.call('ZADD', k, now, worker)
  redis.call('EXPIRE', k, ttl)
  redis.call('SADD', wkey, model .. ':' .. h)
  ns = ns + 1
end
if ns > 0 then redis.call('EXPIRE', wkey, ttl) end
for h in string.gmatch(ARGV[6], '%S+') do
  redis.call('ZREM', prefix .. 'blk:' .. model .. ':' .. h, worker)
  redis.call('SREM', wkey, model .. ':' .. h)
end
return ns
"""

# ARGV: model, cutoff, hashes (space-separated), live...  -> flat [worker, blocks, ...]
# No live workers given means any worker counts.
_LOOKUP = """
local model, cutoff = ARGV[1], ARGV[2]
local live = nil
if #ARGV > 3 then
  live = {}
  for i = 4, #ARGV do live[ARGV[i]] = true end
end
local alive = nil
local count = {}
local n = 0
for h in string.gmatch(ARGV[3], '%S+') do
  n = n + 1
  local members = redis.call('ZRANGEBYSCORE', KEYS[1] .. 'blk:' .. model .. ':' .. h, cutoff, '+inf')
  local present = {}
  local any = false
  for _, w in ipairs(members) do
    if (live == nil or live[w]) and (alive == nil or alive[w]) then present[w] = true; any = true end
  end
  if not any then break end
  alive = present
  for w, _ in pairs(alive) do count[w] = n end
end
local out = {}
for w, c in pairs(count) do out[#out + 1] = w; out[#out + 1] = c end
return out
"""


def _packed(hashes: Iterable[int]) -> str:
    # One argument for the whole list: redis-py packs and encodes every argument in Python, which
    # cost the scheduler more than the rest of its request path did (one item per prompt block).
    return " ".join(map(str, hashes))


class PrefixIndex:
    def __init__(self, client: aioredis.Redis, ttl_s: float = 600.0) -> None:
        self.r = client
        self.ttl_s = ttl_s
        self._apply = client.register_script(_APPLY)
        self._lookup = client.register_script(_LOOKUP)

    async def _run(self, script: str, args: list[str]) -> Any:
        # redis-py's Script: EVALSHA, and EVAL again after a NOSCRIPT (e.g. a Redis restart)
        return await (self._lookup if script is _LOOKUP else self._apply)(keys=[KEY], args=args)

    @classmethod
    def from_url(cls, url: str, ttl_s: float = 600.0, **options: Any) -> PrefixIndex:
        """`options`: more redis.asyncio.from_url() arguments (credentials, TLS)."""
        # Short socket timeouts: a lookup against a dead Redis must fail fast so placement goes on. A bounded
        # pool that calls wait on: many concurrent placements queue for a connection rather than fail.
        options = {"socket_connect_timeout": 0.5, "socket_timeout": 1.0, **options}
        return cls(blocking_client(url, wait_s=POOL_WAIT_S, decode_responses=True, **options), ttl_s)

    @classmethod
    def for_mesh(cls, mesh: MeshConfig, ttl_s: float = 600.0) -> PrefixIndex:
        url, options = redis_connection(mesh)
        return cls.from_url(url, ttl_s, **options)

    async def apply(self, ev: KvEvent) -> None:
        if ev.cleared or ev.stored or ev.removed:
            await self._run(_APPLY, [ev.model, ev.worker_id, repr(float(ev.ts or time.time())),
                                     str(int(self.ttl_s) + 1), _packed(ev.stored), _packed(ev.removed),
                                     "1" if ev.cleared else "0"])

    async def lookup(
        self, model: str, hashes: Sequence[int], live_workers: Iterable[str] | None = None, now: float | None = None
    ) -> dict[str, int]:
        """worker_id -> number of leading blocks of `hashes` it holds (prefix hits only)."""
        if not hashes:
            return {}
        cutoff = (now or time.time()) - self.ttl_s
        live = list(live_workers) if live_workers is not None else []
        if live_workers is not None and not live:
            return {}  # nobody alive to hold anything
        flat = await self._run(_LOOKUP, [model, repr(float(cutoff)), _packed(hashes), *live])
        return {flat[i]: int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def drop_worker(self, worker_id: str) -> None:
        await self.apply(KvEvent(worker_id=worker_id, model="", cleared=True))

    async def close(self) -> None:
        await self.r.aclose()
