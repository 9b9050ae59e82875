"""Redis prefix index: block hash -> workers holding it, with last-use time.

Layout (all keys under `hetmesh:kv:`):
  blk:<model>:<hash>  ZSET member=worker_id score=last-use unix time; key TTL refreshed on store
  wrk:<worker_id>     SET of "<model>:<hash>" the worker holds, so its entries go when it dies
A reader also ignores members older than the TTL, so a worker that vanished without a
goodbye drops out of lookups even before its keys expire.

Both hot paths are one server-side Lua call each (one round trip, no per-block client
work), which keeps the scheduler's cost per request flat in the prompt length. They go over
`_ScriptPipe`, one pipelined connection with a hiredis parser: redis-py's per-command machinery
(pool checkout, retries, observability hooks, argument encoding) cost the scheduler ~0.3 ms per
lookup, more than the rest of a placement. Everything else uses the redis-py client.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import hiredis
import redis.asyncio as aioredis
import redis.exceptions

from hetmesh.protocol import KvEvent

KEY = "hetmesh:kv:"

# ARGV: model, worker, now, ttl, stored, removed (each a space-separated list of block hashes)
_APPLY = """
local model, worker, now, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local prefix = KEYS[1]
local wkey = prefix .. 'wrk:' .. worker
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


SCRIPT_TIMEOUT_S = 5.0  # like redis-py's default socket timeout


def _command(args: Sequence[str | bytes]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class _Replies(asyncio.Protocol):
    """Replies of a pipelined connection, matched to their callers in order."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader(encoding="utf-8")
        self.waiters: deque[asyncio.Future[Any]] = deque()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            fut = self.waiters.popleft()
            if not fut.done():  # a caller that timed out still owns its slot in the order
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_exception(redis.exceptions.ConnectionError(f"redis connection lost: {exc}"))

    def send(self, args: Sequence[str | bytes]) -> asyncio.Future[Any]:
        assert self.transport is not None
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        self.transport.write(_command(args))
        return fut


class _ScriptPipe:
    """EVALSHA over one lazily (re)connected, pipelined TCP connection to the redis-py client's server."""

    def __init__(self, host: str, port: int, db: int, username: str | None, password: str | None) -> None:
        self.addr = (host, port)
        self.setup: list[list[str]] = []
        if password:
            self.setup.append(["AUTH", username, password] if username else ["AUTH", password])
        if db:
            self.setup.append(["SELECT", str(db)])
        self.conn: _Replies | None = None
        self._connecting: asyncio.Future[_Replies] | None = None

    @classmethod
    def for_client(cls, client: aioredis.Redis) -> _ScriptPipe | None:
        """None when the client talks other than plain TCP (TLS, a unix socket): redis-py then does it all."""
        pool = client.connection_pool
        kw = pool.connection_kwargs
        if pool.connection_class is not aioredis.Connection or "host" not in kw:
            return None
        return cls(kw["host"], int(kw.get("port", 6379)), int(kw.get("db", 0) or 0), kw.get("username"),
                   kw.get("password"))

    async def _conn(self) -> _Replies:
        if self.conn is not None and self.conn.transport is not None:
            return self.conn
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        try:
            return await asyncio.shield(self._connecting)
        finally:
            if self._connecting.done():
                self._connecting = None

    async def _connect(self) -> _Replies:
        _, conn = await asyncio.get_running_loop().create_connection(_Replies, *self.addr)
        for cmd in self.setup:
            reply = await conn.send(cmd)
            if isinstance(reply, hiredis.ReplyError):
                conn.transport.close()  # type: ignore[union-attr]
                raise redis.exceptions.ResponseError(str(reply))
        self.conn = conn
        return conn

    async def evalsha(self, script: str, sha: str, keys: Sequence[str], args: Sequence[str]) -> Any:
        async with asyncio.timeout(SCRIPT_TIMEOUT_S):
            conn = await self._conn()
            tail = [str(len(keys)), *keys, *args]
            reply = await conn.send(["EVALSHA", sha, *tail])
            if isinstance(reply, hiredis.ReplyError) and str(reply).startswith("NOSCRIPT"):
                reply = await conn.send(["EVAL", script, *tail])  # EVAL also caches it for the next EVALSHA
        if isinstance(reply, hiredis.ReplyError):
            raise redis.exceptions.ResponseError(str(reply))
        return reply

    def close(self) -> None:
        if self.conn is not None and self.conn.transport is not None:
            self.conn.transport.close()
        self.conn = None


def _sha(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


_SHAS = {_APPLY: _sha(_APPLY), _LOOKUP: _sha(_LOOKUP)}


class PrefixIndex:
    def __init__(self, client: aioredis.Redis, ttl_s: float = 600.0) -> None:
        self.r = client
        self.ttl_s = ttl_s
        self._apply = client.register_script(_APPLY)
        self._lookup = client.register_script(_LOOKUP)
        self._pipe = _ScriptPipe.for_client(client)

    async def _run(self, script: str, args: list[str]) -> Any:
        if self._pipe is not None:
            return await self._pipe.evalsha(script, _SHAS[script], [KEY], args)
        return await (self._lookup if script is _LOOKUP else self._apply)(keys=[KEY], args=args)

    @classmethod
    def from_url(cls, url: str, ttl_s: float = 600.0) -> PrefixIndex:
        return cls(aioredis.from_url(url, decode_responses=True), ttl_s)

    async def apply(self, ev: KvEvent) -> None:
        if ev.cleared:
            await self.drop_worker(ev.worker_id)
        if ev.stored or ev.removed:
            await self._run(_APPLY, [ev.model, ev.worker_id, repr(float(ev.ts or time.time())),
                                     str(int(self.ttl_s) + 1), _packed(ev.stored), _packed(ev.removed)])

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
        entries = await self.r.smembers(f"{KEY}wrk:{worker_id}")
        pipe = self.r.pipeline(transaction=False)
        for entry in entries:
            model, _, h = entry.rpartition(":")
            pipe.zrem(f"{KEY}blk:{model}:{h}", worker_id)
        pipe.delete(f"{KEY}wrk:{worker_id}")
        await pipe.execute()

    async def close(self) -> None:
        if self._pipe is not None:
            self._pipe.close()
        await self.r.aclose()
