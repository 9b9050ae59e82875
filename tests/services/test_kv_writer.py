"""One scheduler of several writes the workers' KV events into the Redis prefix index: the one with the smallest
instance id among those beating (bookings.Peers.writer); only it subscribes to them. Two scheduler processes on
real nats-server and redis-server: the events land once, and nats-server (its monitor) shows one subscriber;
the writer killed (SIGKILL), the other takes the role
within a heartbeat timeout and asks every worker to republish its prefix cache, which brings back what was
published while no one wrote."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis
from tests.schedproc import scheduler_process
from tests.services.test_scheduler import CLUSTER

from hetmesh import servers, subjects
from hetmesh.bus import Bus
from hetmesh.kvindex.blocks import block_hashes
from hetmesh.kvindex.index import PrefixIndex
from hetmesh.metrics import scrape
from hetmesh.protocol import KvEvent, KvResync
from hetmesh.scheduler.bookings import Peers

TIMEOUT_S = 0.6  # CLUSTER's heartbeat timeout (beats every 0.1 s)
WID = "kvw-worker"


def test_the_smallest_instance_heard_beating_writes() -> None:
    p = Peers(timeout_s=1.0)
    assert p.writer("b", 0.0)  # alone
    p.heard("c", 0.0)
    assert p.writer("b", 0.5)
    p.heard("a", 0.2)
    assert not p.writer("b", 0.5) and p.writer("a", 0.5)
    assert p.writer("b", 1.3)  # a's beats stopped a timeout ago: b takes over (c's too: it does not count)


class Worker:
    """A worker's side of the index: what its cache holds, republished whole on `hetmesh.kv.resync`."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.held: list[int] = []
        self.resyncs: list[float] = []  # when each was heard (monotonic)

    async def store(self, hashes: list[int]) -> None:
        self.held += hashes
        await self.bus.publish(subjects.kv_events(WID), KvEvent(worker_id=WID, model="m", stored=hashes,
                                                                ts=time.time()))

    async def on_resync(self, _r: KvResync, _m: object) -> None:
        self.resyncs.append(time.monotonic())
        await self.bus.publish(subjects.kv_events(WID), KvEvent(worker_id=WID, model="m", stored=list(self.held),
                                                                cleared=True, ts=time.time()))


def kv_subscribers(monitor_port: int) -> set[str]:
    """The connections nats-server delivers the workers' KV events to (by connection name)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/connz?subs=detail", timeout=2) as r:
        conns = json.load(r)["connections"]
    return {c.get("name", "") for c in conns for s in c.get("subscriptions_list_detail", [])
            if s["subject"] == subjects.KV_EVENTS_ALL}


def writer_gauge(port: int) -> float | None:
    try:
        return scrape(f"http://127.0.0.1:{port}/metrics").get(("hetmesh_scheduler_kv_writer", ()))
    except Exception:  # not listening yet
        return None


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> float:
    """Seconds until `check()` held."""
    t0 = time.monotonic()
    while not await check():
        assert time.monotonic() - t0 < timeout_s, what
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


def zadds(r: redis.Redis) -> int:
    """ZADDs Redis ran: one per stored block an event wrote (the index's script counts its own commands)."""
    return int(r.info("commandstats").get("cmdstat_zadd", {}).get("calls", 0))


@pytest.mark.mesh  # starts its own nats-server and redis-server
async def test_one_scheduler_writes_and_the_other_takes_over_when_it_dies(tmp_path: Path) -> None:
    srv = servers.start_redis()  # its own: its command counts are the two schedulers' alone
    monitor = servers.free_port()
    nats = servers.start_nats(monitor_port=monitor)  # its own: its monitor lists the subscriptions
    nats_url = nats.url
    r = redis.Redis.from_url(srv.url)
    index = PrefixIndex.from_url(srv.url)
    bus = await Bus.connect(nats_url, "test-kv-writer")
    worker = Worker(bus)
    await bus.subscribe(subjects.KV_RESYNC, KvResync, worker.on_resync)
    hashes = block_hashes("m", list(range(4 * 12)), 4)

    async def indexed(n: int) -> bool:
        return (await index.lookup("m", hashes[:n], [WID])).get(WID) == n

    def gauges(want_a: float | None, want_b: float | None) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            got = await asyncio.gather(*(asyncio.to_thread(writer_gauge, p) for p in ports))
            return got == [want_a, want_b]
        return check

    ports = [servers.free_port(), servers.free_port()]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    try:
        with scheduler_process(CLUSTER, tmp_path / "a", nats_url, srv.url, "kvw-a",
                               HETMESH_METRICS_PORT=str(ports[0])) as a:
            await until(gauges(1.0, None), 30, "kvw-a, alone, never wrote")
            await until(lambda: asyncio.sleep(0, bool(worker.resyncs)), 5, "kvw-a took the role without a resync")
            with scheduler_process(CLUSTER, tmp_path / "b", nats_url, srv.url, "kvw-b",
                                   HETMESH_METRICS_PORT=str(ports[1])):
                await until(gauges(1.0, 0.0), 30, "kvw-b never settled as the one that does not write")
                await asyncio.sleep(0.3)  # a resync kvw-b may have asked for while it heard no one: written by now
                calls = await asyncio.to_thread(zadds, r)
                for i in range(8):
                    await worker.store(hashes[i:i + 1])
                await until(lambda: indexed(8), 10, "the events never reached the index")
                await asyncio.sleep(0.3)  # a second writer would have written them by now too
                assert await asyncio.to_thread(zadds, r) - calls == 8  # each event (one block) written once
                assert await asyncio.to_thread(kv_subscribers, monitor) == {"scheduler-kvw-a"}

                a.kill()
                killed, heard = time.monotonic(), len(worker.resyncs)
                await worker.store(hashes[8:10])  # while no one writes (kvw-b has not timed kvw-a out yet)
                took = await until(lambda: asyncio.sleep(0, len(worker.resyncs) > heard), 10,
                                   "kvw-b took the role without a resync")
                print(f"kvw-b asked for a resync {took:.2f}s after kvw-a was killed")
                assert worker.resyncs[heard] - killed < TIMEOUT_S + 1.0
                await until(gauges(None, 1.0), 5, "kvw-b's gauge does not say it writes")
                await until(lambda: indexed(10), 5, "the resync did not bring back what no one wrote")
                await worker.store(hashes[10:12])
                await until(lambda: indexed(12), 5, "new events after the take-over never reached the index")
                assert await asyncio.to_thread(kv_subscribers, monitor) == {"scheduler-kvw-b"}
    finally:
        await bus.close()
        await index.close()
        r.close()
        srv.stop()
        nats.stop()
