"""Per-key rate limits shared by every gateway replica, in Redis.

The buckets are those of `auth.TokenBucket` (a minute's allowance, refilled continuously; requests
and prompt tokens taken at admission, all or nothing; completion tokens charged when they are
known, so a key may go into debt), kept as one Redis hash per key and kind and updated by one Lua
call per admission, so that N gateways behind a load balancer grant a key its limit once, not N
times. The clock is Redis's own (`TIME`), shared by every replica. A bucket expires once it would
be full again, and a missing bucket reads as full.

When Redis does not answer, the gateway falls back to its own buckets for `DOWN_S` and logs it:
requests keep flowing, limited per replica, rather than failing because of a metadata store. Those
buckets follow the shared levels each answer reports, so a fallback starts from the shared state last
seen (a key never seen starts empty), never from a full bucket. Calls share a bounded pool and wait for
a free connection, so a burst of admissions queues rather than failing; a call that finds none within
the pool's wait uses the local buckets once, without counting Redis as down. So does a call that times
out while others still succeed: under a burst this process's own event loop, busy with hundreds of
requests, reads Redis's answers late. Only a refused or broken connection, or calls that time out for
`DOWN_AFTER_S` with none succeeding, count as Redis down.
"""

from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from hetmesh.config import MeshConfig, redis_connection
from hetmesh.redispool import blocking_client, pool_exhausted

from .auth import KeyState, Take, refill_s, take_local, wants

log = logging.getLogger("hetmesh.gateway")

PREFIX = "hetmesh:rl:"
DOWN_S = 5.0  # after a Redis failure, use the local buckets this long before trying Redis again
TIMEOUT_S = 0.5  # an admission waits no longer than this for Redis
DOWN_AFTER_S = 2.0  # calls timing out this long, none succeeding meanwhile: Redis is down (hung, cut off)

# KEYS: one bucket per kind. ARGV: mode ("admit": all or nothing | "charge": always), now (unix s;
# "" = the Redis server's clock), then per_minute and amount for each key. Returns wait and level
# (after the take) for each key, as strings (Lua numbers would come back truncated to integers).
_TAKE = """
local now = tonumber(ARGV[2])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local levels, waits, worst = {}, {}, 0
for i, key in ipairs(KEYS) do
  local pm, n = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
  local v = redis.call('HMGET', key, 'level', 't')
  local level, t = tonumber(v[1]), tonumber(v[2])
  if level == nil then
    level = pm
  else
    level = math.min(pm, level + math.max(now - t, 0) * pm / 60)
  end
  local need = math.min(n, pm) - level
  local wait = 0
  if need > 0 then wait = need * 60 / pm end
  levels[i], waits[i] = level, wait
  if wait > worst then worst = wait end
end
local take = ARGV[1] == 'charge' or worst <= 0
local out = {}
for i, key in ipairs(KEYS) do
  local pm, n = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
  if take then levels[i] = levels[i] - n end
  redis.call('HSET', key, 'level', tostring(levels[i]), 't', tostring(now))
  redis.call('EXPIRE', key, math.ceil((pm - levels[i]) * 60 / pm) + 1)
  out[#out + 1] = tostring(waits[i])
  out[#out + 1] = tostring(levels[i])
end
return out
"""


def _timed_out(e: BaseException) -> bool:
    """A call that waited too long for its answer (the connection itself held)."""
    return isinstance(e, (RedisTimeoutError, TimeoutError)) or isinstance(e.__cause__, TimeoutError)


def bucket_key(s: KeyState, kind: str) -> str:
    # the hash tag keeps a key's buckets in one Redis Cluster slot (one script call touches both)
    return f"{PREFIX}{{{s.key.sha256.lower()}}}:{kind}"


class SharedBuckets:
    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self._script = client.register_script(_TAKE)
        self.down_until = 0.0
        self.fallbacks = 0  # admissions and charges served by the local buckets because Redis failed
        self._busy_logged = 0.0  # when a full pool or a late answer was last logged (once per DOWN_S)
        self._timing_out = 0.0  # when calls began timing out with none succeeding since (0: the last one did)

    @classmethod
    def from_mesh(cls, mesh: MeshConfig) -> SharedBuckets | None:
        """None where the cluster has no Redis (a gateway run on its own): limits stay per process."""
        if not mesh.redis_url:
            return None
        url, options = redis_connection(mesh)
        return cls(blocking_client(url, decode_responses=True, socket_timeout=TIMEOUT_S,
                                   socket_connect_timeout=TIMEOUT_S, **options))

    async def close(self) -> None:
        await self.client.aclose()

    async def _call(self, mode: str, items: list[tuple[str, float, int]], now: str = "") -> list[float] | None:
        """items: (key, per_minute, amount). Flat [wait, level, ...], or None when Redis failed."""
        if time.monotonic() < self.down_until:
            return None
        args: list[str | float | int] = [mode, now]
        for _, pm, n in items:
            args += [pm, n]
        try:
            out = await self._script(keys=[k for k, _, _ in items], args=args)
        except (RedisError, OSError) as e:
            now = time.monotonic()
            busy = pool_exhausted(e)
            if not busy and _timed_out(e):
                self._timing_out = self._timing_out or now
                busy = now - self._timing_out < DOWN_AFTER_S
            if busy:  # this process is busy, Redis is not down: only this call goes local
                if now - self._busy_logged > DOWN_S:
                    self._busy_logged = now
                    log.warning("rate limits: Redis answered late or no connection was free (%r); limiting this "
                                "admission locally", e)
                return None
            self.down_until = now + DOWN_S
            self._timing_out = 0.0
            log.warning("rate limits: Redis failed (%r); limiting per gateway for %.0f s", e, DOWN_S)
            return None
        self._timing_out = 0.0
        return [float(x) for x in out]

    async def take(self, s: KeyState, prompt_tokens: int, now: float, clock: str = "") -> list[Take]:
        """Admission against the key's shared buckets, all or nothing. `now` is this process's monotonic
        clock, for the local fallback; `clock` overrides Redis's clock (unix seconds; tests)."""
        ws = wants(s, prompt_tokens)
        if not ws:
            return []
        out = await self._call("admit", [(bucket_key(s, kind), b.per_minute, n) for kind, b, n in ws], clock)
        if out is None:
            self.fallbacks += 1
            for _, b, _ in ws:
                b.start_empty(now)
            return take_local(s, prompt_tokens, now)
        for i, (_, b, _) in enumerate(ws):
            b.follow(out[2 * i + 1], now)  # what a fallback would start from
        return [Take(kind, b.per_minute, out[2 * i], max(int(out[2 * i + 1]), 0), refill_s(b.per_minute, out[2 * i + 1]))
                for i, (kind, b, _) in enumerate(ws)]

    async def charge(self, s: KeyState, completion_tokens: int, now: float, clock: str = "") -> None:
        """Charge a finished completion's tokens (no check: the key may go into debt)."""
        b = s.tokens
        if b is None or completion_tokens <= 0:
            return
        out = await self._call("charge", [(bucket_key(s, "tokens"), b.per_minute, completion_tokens)], clock)
        if out is None:
            self.fallbacks += 1
            b.start_empty(now)
            b.take(completion_tokens, now)
        else:
            b.follow(out[1], now)
