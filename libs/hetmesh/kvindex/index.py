"""Redis prefix index: block hash -> workers holding it, with last-use time.

Layout (all keys under `hetmesh:kv:`):
  blk:<model>:<hash>  ZSET member=worker_id score=last-use unix time; key TTL refreshed on store
  wrk:<worker_id>     SET of "<model>:<hash>" the worker holds, so its entries go when it dies
A reader also ignores members older than the TTL, so a worker that vanished without a
goodbye drops out of lookups even before its keys expire.

Both hot paths are one server-side Lua call each (one round trip, no per-block client
work), which keeps the scheduler's cost per request flat in the prompt length.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import redis.asyncio as aioredis

from hetmesh.protocol import KvEvent

KEY = "hetmesh:kv:"

# ARGV: model, worker, now, ttl, n_stored, stored..., removed...
_APPLY = """
local model, worker, now, ttl, ns = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local prefix = KEYS[1]
local wkey = prefix .. 'wrk:' .. worker
for i = 6, 5 + ns do
  local k = prefix .. 'blk:' .. model .. ':' .. ARGV[i]
  redis.call('ZADD', k, now, worker)
  redis.call('EXPIRE', k, ttl)
  redis.call('SADD', wkey, model .. ':' .. ARGV[i])
end
if ns > 0 then redis.call('EXPIRE', wkey, ttl) end
for i = 6 + ns, #ARGV do
  redis.call('ZREM', prefix .. 'blk:' .. model .. ':' .. ARGV[i], worker)
  redis.call('SREM', wkey, model .. ':' .. ARGV[i])
end
return ns
"""

# ARGV: model, cutoff, n_live, live..., hashes...  -> flat [worker, blocks, ...]
_LOOKUP = """
local model, cutoff, nl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local live = nil
if nl >= 0 then
  live = {}
  for i = 4, 3 + nl do live[ARGV[i]] = true end
end
local first = 4 + math.max(nl, 0)
local alive = nil
local count = {}
for i = first, #ARGV do
  local members = redis.call('ZRANGEBYSCORE', KEYS[1] .. 'blk:' .. model .. ':' .. ARGV[i], cutoff, '+inf')
  local present = {}
  local any = false
  for _, w in ipairs(members) do
    if (live == nil or live[w]) and (alive == nil or alive[w]) then present[w] = true; any = true end
  end
  if not any then break end
  alive = present
  for w, _ in pairs(alive) do count[w] = i - first + 1 end
end
local out = {}
for w, n in pairs(count) do out[#out + 1] = w; out[#out + 1] = n end
return out
"""


class PrefixIndex:
    def __init__(self, client: aioredis.Redis, ttl_s: float = 600.0) -> None:
        self.r = client
        self.ttl_s = ttl_s
        self._apply = client.register_script(_APPLY)
        self._lookup = client.register_script(_LOOKUP)

    @classmethod
    def from_url(cls, url: str, ttl_s: float = 600.0) -> PrefixIndex:
        return cls(aioredis.from_url(url, decode_responses=True), ttl_s)

    async def apply(self, ev: KvEvent) -> None:
        if ev.cleared:
            await self.drop_worker(ev.worker_id)
        if ev.stored or ev.removed:
            await self._apply(keys=[KEY], args=[ev.model, ev.worker_id, ev.ts or time.time(), int(self.ttl_s) + 1,
                                                len(ev.stored), *ev.stored, *ev.removed])

    async def lookup(
        self, model: str, hashes: Sequence[int], live_workers: Iterable[str] | None = None, now: float | None = None
    ) -> dict[str, int]:
        """worker_id -> number of leading blocks of `hashes` it holds (prefix hits only)."""
        if not hashes:
            return {}
        cutoff = (now or time.time()) - self.ttl_s
        live = list(live_workers) if live_workers is not None else None
        args: list[str | int | float] = [model, cutoff, -1 if live is None else len(live), *(live or ()), *hashes]
        flat = await self._lookup(keys=[KEY], args=args)
        return {flat[i]: int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def drop_worker(self, worker_id: str) -> None:
        entries = await self.r.smembers(f"{KEY}wrk:{worker_id}")
        pipe = self.r.pipeline(transaction=False)
        for entry in entries:
            model, _, h = entry.rpartition(":")
            pipe.zrem(f"{KEY}blk:{model}:{h}", worker_id)
        pipe.delete(f"{KEY}wrk:{worker_id}")
        await pipe.execute()

    async def close(self) -> None:
        await self.r.aclose()
