"""Redis prefix index: block hash -> workers holding it, with last-use time.

Layout (all keys under `hetmesh:kv:`):
  blk:<model>:<hash>  ZSET member=worker_id score=last-use unix time; key TTL refreshed on store
  wrk:<worker_id>     SET of "<model>:<hash>" the worker holds, so its entries go when it dies
A reader also ignores members older than the TTL, so a worker that vanished without a
goodbye drops out of lookups even before its keys expire.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import redis.asyncio as aioredis

from hetmesh.protocol import KvEvent

KEY = "hetmesh:kv:"


def _blk(model: str, h: int) -> str:
    return f"{KEY}blk:{model}:{h}"


def _wrk(worker_id: str) -> str:
    return f"{KEY}wrk:{worker_id}"


class PrefixIndex:
    def __init__(self, client: aioredis.Redis, ttl_s: float = 600.0) -> None:
        self.r = client
        self.ttl_s = ttl_s

    @classmethod
    def from_url(cls, url: str, ttl_s: float = 600.0) -> PrefixIndex:
        return cls(aioredis.from_url(url, decode_responses=True), ttl_s)

    async def apply(self, ev: KvEvent) -> None:
        now = ev.ts or time.time()
        ttl = int(self.ttl_s) + 1
        pipe = self.r.pipeline(transaction=False)
        if ev.cleared:
            await self.drop_worker(ev.worker_id)
        for h in ev.stored:
            key = _blk(ev.model, h)
            pipe.zadd(key, {ev.worker_id: now})
            pipe.expire(key, ttl)
        if ev.stored:
            pipe.sadd(_wrk(ev.worker_id), *(f"{ev.model}:{h}" for h in ev.stored))
            pipe.expire(_wrk(ev.worker_id), ttl)
        for h in ev.removed:
            pipe.zrem(_blk(ev.model, h), ev.worker_id)
        if ev.removed:
            pipe.srem(_wrk(ev.worker_id), *(f"{ev.model}:{h}" for h in ev.removed))
        await pipe.execute()

    async def lookup(
        self, model: str, hashes: Sequence[int], live_workers: Iterable[str] | None = None, now: float | None = None
    ) -> dict[str, int]:
        """worker_id -> number of leading blocks of `hashes` it holds (prefix hits only)."""
        if not hashes:
            return {}
        cutoff = (now or time.time()) - self.ttl_s
        pipe = self.r.pipeline(transaction=False)
        for h in hashes:
            pipe.zrangebyscore(_blk(model, h), cutoff, "+inf")
        holders: list[list[str]] = await pipe.execute()
        live = set(live_workers) if live_workers is not None else None
        result: dict[str, int] = {}
        alive: set[str] | None = None
        for i, members in enumerate(holders):
            present = set(members) if live is None else set(members) & live
            alive = present if alive is None else alive & present
            if not alive:
                break
            for w in alive:
                result[w] = i + 1
        return result

    async def drop_worker(self, worker_id: str) -> None:
        entries = await self.r.smembers(_wrk(worker_id))
        pipe = self.r.pipeline(transaction=False)
        for entry in entries:
            model, _, h = entry.rpartition(":")
            pipe.zrem(_blk(model, int(h)), worker_id)
        pipe.delete(_wrk(worker_id))
        await pipe.execute()

    async def close(self) -> None:
        await self.r.aclose()
