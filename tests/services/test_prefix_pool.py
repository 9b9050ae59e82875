"""The scheduler's prefix index under many concurrent placements (real redis-server and nats-server): more
lookups at once than the Redis pool has connections queue for one, and none of them counts Redis as down."""

from __future__ import annotations

import asyncio
import time

from hetmesh import subjects
from hetmesh.bus import Bus, EventBatcher
from hetmesh.kvindex.blocks import block_hashes
from hetmesh.kvindex.index import PrefixIndex
from hetmesh.protocol import EventBatch, KvEvent
from hetmesh.scheduler.prefix_mirror import PrefixMirror


async def test_a_burst_of_lookups_queues_for_the_pool_and_redis_stays_up(nats_url: str, redis_url: str) -> None:
    bus = await Bus.connect(nats_url, "test-prefix-pool")
    downs: list[str] = []

    async def on_events(batch: EventBatch, _m: object) -> None:
        downs.extend(e.kind for e in batch if e.kind == "redis_down")

    await bus.subscribe(subjects.event("scheduler"), EventBatch, on_events)
    events = EventBatcher(bus, "scheduler")
    mirror = PrefixMirror(bus, PrefixIndex.from_url(redis_url), events, "pool-test")
    writer = asyncio.create_task(mirror.writer())
    try:
        await mirror.probe()
        await mirror.role(True)  # the one scheduler here writes the index
        assert mirror.ok
        tokens = list(range(64))
        hashes = block_hashes("pool-m", tokens, 4)
        wid = f"pool-w-{time.monotonic_ns()}"
        await mirror.index.apply(KvEvent(worker_id=wid, model="pool-m", stored=hashes, ts=time.time()))
        # 300 placements at once (or one request with n = 300): far more than the pool's connections
        found = await asyncio.gather(*(mirror.lookup("pool-m", hashes, [wid]) for _ in range(300)))
        assert all(f == {wid: len(hashes)} for f in found)
        assert mirror.ok
        # the writer shares the pool: events sent during a burst still land, in order
        more = block_hashes("pool-m", [*tokens, *range(100, 164)], 4)
        burst = asyncio.gather(*(mirror.lookup("pool-m", hashes, [wid]) for _ in range(300)))
        await mirror.on_kv_event(KvEvent(worker_id=wid, model="pool-m", stored=more[len(hashes):], ts=time.time()),
                                 None)  # type: ignore[arg-type]
        await burst
        for _ in range(500):  # the writer's turn comes once it gets a connection
            if (await mirror.lookup("pool-m", more, [wid])).get(wid) == len(more):
                break
            await asyncio.sleep(0.02)
        assert (await mirror.lookup("pool-m", more, [wid])).get(wid) == len(more)
        assert mirror.ok
        await events.flush()
        await bus.nc.flush()
        assert downs == []
    finally:
        writer.cancel()
        await events.close()
        await mirror.close()
        await bus.close()
