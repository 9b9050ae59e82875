"""The scheduler's prefix index under many concurrent placements (real redis-server and nats-server): more
lookups at once than the Redis pool has connections queue for one, and none of them counts Redis as down;
and a Redis that stalls (SIGSTOP) is slow, not down, until the probe times out on it twice."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

from hetmesh import servers, subjects
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


async def test_a_stalled_redis_is_slow_not_down_until_the_probe_times_out_twice(nats_url: str) -> None:
    rs = servers.start_redis()
    bus = await Bus.connect(nats_url, "test-prefix-stall")
    seen: list[tuple[str, str]] = []
    instance = f"stall-{time.monotonic_ns()}"

    async def on_events(batch: EventBatch, _m: object) -> None:
        seen.extend((e.kind, str(e.detail.get("reason", ""))) for e in batch if e.instance == instance)

    await bus.subscribe(subjects.event("scheduler"), EventBatch, on_events)
    events = EventBatcher(bus, "scheduler")
    mirror = PrefixMirror(bus, PrefixIndex.from_url(rs.url), events, instance)
    hashes = block_hashes("stall-m", list(range(32)), 4)
    assert rs.proc is not None
    try:
        await mirror.probe()
        await mirror.role(True)
        await mirror.index.apply(KvEvent(worker_id="w", model="stall-m", stored=hashes, ts=time.time()))
        os.kill(rs.proc.pid, signal.SIGSTOP)  # a stall shorter than two probes
        try:
            assert await mirror.lookup("stall-m", hashes, ["w"]) == {}  # timed out: this placement on load alone
            await mirror.probe()
            assert (mirror.ok, mirror.slow, mirror.probe_timeouts) == (True, 1, 1)
        finally:
            os.kill(rs.proc.pid, signal.SIGCONT)
        await mirror.probe()
        assert mirror.ok and mirror.probe_timeouts == 0
        assert await mirror.lookup("stall-m", hashes, ["w"]) == {"w": len(hashes)}
        await events.flush()
        await bus.nc.flush()
        # taking the writer's role asked for one resync; the stall made it neither down nor ask again
        assert seen == [("kv_writer", ""), ("kv_resync", "new kv index writer")]

        os.kill(rs.proc.pid, signal.SIGSTOP)  # a stall that outlasts two probes
        try:
            await mirror.probe()
            assert mirror.ok
            await mirror.probe()
            assert not mirror.ok
            assert await mirror.lookup("stall-m", hashes, ["w"]) == {}
        finally:
            os.kill(rs.proc.pid, signal.SIGCONT)
        await mirror.probe()  # back: the writer asks every worker to republish
        assert mirror.ok
        await events.flush()
        await bus.nc.flush()
        for _ in range(100):
            if len(seen) >= 4:
                break
            await asyncio.sleep(0.02)
        assert seen[2:] == [("redis_down", ""), ("kv_resync", "redis up")]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rs.proc.pid, signal.SIGCONT)
        await events.close()
        await mirror.close()
        await bus.close()
        rs.stop()
