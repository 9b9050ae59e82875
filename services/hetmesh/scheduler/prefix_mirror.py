"""The scheduler's side of the Redis prefix index (hetmesh.kvindex.index), for hetmesh.scheduler.service.

Workers' KV events are mirrored into the index by one writer (each worker's stored/removed events stay in
order), and placement looks prefixes up in it. Redis is optional at run time: while it is unreachable
events are dropped and lookups find nothing (placement runs on load alone), and when it is back (or
restarted empty) every worker is asked to republish its whole prefix cache (`hetmesh.kv.resync`), which
rebuilds the index. Only a failure of Redis itself counts as down: a call that found no free connection in
this process's pool (many placements at once) degrades alone (a lookup finds nothing, the writer tries the
event again), with no resync. Nor does one slow answer (a socket timeout): a lookup that timed out finds
nothing and the writer tries the event again, but Redis counts as down only when the probe times out
PROBE_TIMEOUTS times in a row, so a moment's stall in this process or in Redis neither places the next requests
on load alone nor makes every worker republish its cache. Kept apart from placement and the cluster view,
which only call it.

Of several schedulers, one writes the index (events, a lost worker's entries, the resync when Redis is back):
the one `role` makes the writer, each beat (bookings.Peers.writer); only it subscribes to the events, the
others only look prefixes up. A scheduler that takes the role asks for a resync first, which rebuilds what the events no one
wrote (the old writer dead, not yet timed out) would have changed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from redis.exceptions import TimeoutError as RedisTimeoutError

from hetmesh import metrics, subjects
from hetmesh.bus import Bus, EventBatcher
from hetmesh.kvindex.index import PrefixIndex
from hetmesh.protocol import KvEvent, KvResync, ServiceEvent
from hetmesh.redispool import pool_exhausted

log = logging.getLogger("hetmesh.scheduler")

REDIS_PROBE_S = 1.0  # how often the scheduler checks Redis (down -> up, or restarted empty)
PROBE_TIMEOUTS = 2  # probes in a row that time out before a Redis that answers nothing counts as down


def timed_out(exc: BaseException) -> bool:
    """Redis (or this process) was slow: the call's socket timeout ran out, the connection still open."""
    return isinstance(exc, (RedisTimeoutError, TimeoutError))


class PrefixMirror:
    def __init__(self, bus: Bus, index: PrefixIndex, events: EventBatcher, instance: str) -> None:
        self.bus = bus
        self.index = index
        self.events = events
        self.instance = instance
        self.ok = False  # Redis answered the last probe and no call failed since
        self.run_id = ""  # a different one means Redis restarted (empty: no persistence)
        self.queue: asyncio.Queue[KvEvent] = asyncio.Queue(maxsize=100_000)
        self.busy = 0  # calls that found no free Redis connection in time (not counted as Redis down)
        self.slow = 0  # calls that timed out (not counted as Redis down: the probe decides)
        self.probe_timeouts = 0  # probes in a row that timed out
        self.writing = False  # this scheduler writes the index (`role`)
        self._events: Subscription | None = None  # the workers' KV events, while it writes

    def down(self, exc: BaseException, probe: bool = False) -> None:
        if pool_exhausted(exc):  # busy here, not down there
            self.busy += 1
            return
        if timed_out(exc):
            if not probe:
                self.slow += 1  # this call degrades alone
                return
            self.probe_timeouts += 1
            if self.probe_timeouts < PROBE_TIMEOUTS:
                return
        if self.ok:
            log.warning("Redis unreachable (%s): placing on load alone until it is back", exc)
            self.events.add(ServiceEvent(service="scheduler", instance=self.instance, request_id="",
                                         kind="redis_down", ts=time.time(), detail={"error": str(exc)}))
        self.ok = False

    async def probe(self) -> None:
        try:
            run_id = str((await self.index.r.info("server"))["run_id"])
        except Exception as exc:
            self.down(exc, probe=True)
            return
        self.probe_timeouts = 0
        if not self.ok or run_id != self.run_id:
            # Back, or restarted (and empty): every worker republishes what its cache holds.
            was = "restarted" if self.ok else "up"
            self.ok, self.run_id = True, run_id
            if self.writing:
                await self.resync(f"redis {was}")

    async def resync(self, reason: str) -> None:
        log.info("%s: asking workers to republish their prefix caches", reason)
        await self.bus.publish(subjects.KV_RESYNC, KvResync(reason=reason))
        self.events.add(ServiceEvent(service="scheduler", instance=self.instance, request_id="",
                                     kind="kv_resync", ts=time.time(), detail={"reason": reason}))

    async def role(self, writer: bool) -> None:
        """Take (`writer`) or leave the writer's role. Taking it, first a resync: the index missed the events
        no one wrote. With Redis down the resync waits for it to be back (`probe`)."""
        if writer == self.writing:
            return
        self.writing = writer
        if writer:  # before the resync: the caches republished come in on it
            self._events = await self.bus.subscribe(subjects.KV_EVENTS_ALL, KvEvent, self.on_kv_event)
        elif self._events is not None:
            await self._events.unsubscribe()
            self._events = None
        self.events.add(ServiceEvent(service="scheduler", instance=self.instance, request_id="",
                                     kind="kv_writer", ts=time.time(), detail={"writer": writer}))
        if writer and self.ok:
            await self.resync("new kv index writer")
        elif not writer:
            log.info("another scheduler writes the kv index")

    async def probe_loop(self) -> None:
        while True:
            await asyncio.sleep(REDIS_PROBE_S)
            await self.probe()

    async def on_kv_event(self, ev: KvEvent, _m: Msg) -> None:
        if not (self.ok and self.writing):
            return  # another scheduler writes it; or lost either way, and the resync when Redis is back rebuilds it
        try:
            self.queue.put_nowait(ev)
        except asyncio.QueueFull:
            log.warning("kv index writer behind; dropping an event from %s", ev.worker_id)

    async def writer(self) -> None:
        # One writer keeps each worker's stored/removed events in order.
        while True:
            ev = await self.queue.get()
            while self.ok and self.writing:  # one that left the role drops what it still held
                try:
                    await self.index.apply(ev)
                    break
                except Exception as exc:
                    self.down(exc)  # a full pool or a timeout leaves `ok` set: the same event again, in order

    async def lookup(self, model: str, hashes: Sequence[int], live_workers: Iterable[str]) -> dict[str, int]:
        """Cached blocks per worker for the prompt's block hashes; none while Redis is unreachable."""
        try:
            return await self.index.lookup(model, hashes, live_workers)
        except Exception as exc:
            self.down(exc)
            return {}

    async def drop_worker(self, worker_id: str) -> None:
        if self.ok and self.writing:
            try:
                await self.index.drop_worker(worker_id)
            except Exception as exc:
                self.down(exc)

    def rows(self) -> list[metrics.Row]:
        return [("hetmesh_scheduler_kv_writer", "1 on the scheduler that writes KV events into the Redis prefix "
                 "index (one of the replicas), else 0", "gauge", {}, float(self.writing))]

    async def close(self) -> None:
        await self.index.close()
