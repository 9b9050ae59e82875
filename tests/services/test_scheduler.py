"""The scheduler service on a real nats-server and redis-server, driven the way workers and the
gateway drive it: heartbeats and KV events in, SUBMIT requests in, WorkItems / WorkerLost out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import msgspec
import pytest
from tests.clusters import cluster_toml, group, model
from tests.schedproc import scheduler_process

from hetmesh import subjects
from hetmesh.bus import Bus
from hetmesh.kvindex.blocks import block_hashes
from hetmesh.protocol import (
    Booked,
    BookedBatch,
    DemandReport,
    Heartbeat,
    InferenceRequest,
    KvEvent,
    ResponseEvent,
    Role,
    SamplingParams,
    SchedulerStatus,
    SubmitReply,
    TurnedAway,
    WorkerLost,
    WorkItem,
)

CLUSTER = cluster_toml(
    mesh={"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 0.6},
    scheduler={"policy": "prefix_aware"},
    planner={"interval_s": 0.3},
    models=[model("m", block_size=4)],
    workers=[group("a", "m", "nvidia-h100", count=2)])


@pytest.fixture(scope="module")
def scheduler(nats_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with scheduler_process(CLUSTER, tmp_path_factory.mktemp("sched"), nats_url, redis_url):
        yield


@pytest.fixture
async def bus(scheduler: None, nats_url: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_url, "test")
    yield b
    await b.close()


def beat(wid: str, running: int = 0) -> Heartbeat:
    return Heartbeat(worker_id=wid, model="m", accelerator="nvidia-h100", vendor="nvidia", devices=1, role=Role.BOTH,
                     engine="sim", work_subject=subjects.work_direct("both", "nvidia", "nvidia-h100", wid),
                     queue_depth=0, running=running, max_batch=8, kv_blocks_total=64, kv_blocks_used=0, block_size=4,
                     ts=time.time())


class Beater:
    def __init__(self, bus: Bus, wids: list[str]) -> None:
        self.bus, self.wids, self.load = bus, set(wids), dict.fromkeys(wids, 0)
        self.task = asyncio.create_task(self.run())

    async def run(self) -> None:
        while True:
            for w in list(self.wids):
                await self.bus.publish(subjects.heartbeat(w), beat(w, self.load[w]))
            await asyncio.sleep(0.1)


def request(rid: str, tokens: list[int]) -> InferenceRequest:
    return InferenceRequest(request_id=rid, model="m", prompt_tokens=tokens, block_hashes=block_hashes("m", tokens, 4),
                            sampling=SamplingParams(max_tokens=4), reply_subject=subjects.reply(rid),
                            arrival_ts=time.time())


async def submit(bus: Bus, req: InferenceRequest) -> SubmitReply:
    for _ in range(50):  # the scheduler subscribes a moment after it starts
        try:
            return await bus.request(subjects.SUBMIT, req, SubmitReply, timeout_s=1)
        except Exception:
            await asyncio.sleep(0.1)
    raise AssertionError("scheduler never answered")


async def test_no_workers_is_a_503(bus: Bus) -> None:
    reply = await submit(bus, request("r0", [1, 2, 3]))
    assert reply.placement is None and reply.error is not None and reply.error.status == 503


async def test_a_request_the_gateway_turned_away_counts_as_demand(bus: Bus) -> None:
    """The gateway refuses a model with no live worker itself; the planner must still see that demand."""
    reports: asyncio.Queue[DemandReport] = asyncio.Queue()

    async def on_report(r: DemandReport, _m: object) -> None:
        await reports.put(r)

    await bus.subscribe(subjects.DEMAND, DemandReport, on_report)
    await bus.publish(subjects.TURNED_AWAY, TurnedAway(model="ghost", prompt_tokens=100, max_tokens=20,
                                                       code="no_workers"))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        r = await asyncio.wait_for(reports.get(), 10)
        ghost = [m for m in r.models if m.model == "ghost"]
        if ghost:
            assert ghost[0].requests == 1 and ghost[0].prompt_mean == 100 and ghost[0].slo_attainment == 0
            return
    raise AssertionError("the turned-away request never showed in a demand report")


async def test_places_publishes_work_and_follows_prefix(bus: Bus) -> None:
    got: asyncio.Queue[tuple[str, WorkItem]] = asyncio.Queue()

    async def on_work(item: WorkItem, m: object) -> None:
        await got.put((m.subject, item))  # type: ignore[attr-defined]

    await bus.subscribe("hetmesh.work.>", WorkItem, on_work)
    beater = Beater(bus, ["a-0", "a-1"])
    await asyncio.sleep(0.3)
    tokens = list(range(16))
    # a-1 holds the prompt's first 3 blocks; a-0 is idle too, so only the index can pick a-1.
    await bus.publish(subjects.kv_events("a-1"), KvEvent(worker_id="a-1", model="m",
                                                          stored=block_hashes("m", tokens, 4)[:3], ts=time.time()))
    await asyncio.sleep(0.3)
    reply = await submit(bus, request("r1", tokens))
    assert reply.placement is not None and reply.placement.decode_worker == "a-1"
    assert reply.placement.expected_cached_tokens == 12
    subject, item = await asyncio.wait_for(got.get(), 5)
    assert subject == subjects.work_direct("both", "nvidia", "nvidia-h100", "a-1")
    assert item.request.request_id == "r1" and item.phase == "full"
    beater.task.cancel()


async def test_placements_are_shared_with_the_other_schedulers(bus: Bus) -> None:
    """Each placement goes out on hetmesh.sched.booked; another scheduler's bookings count on their worker in this
    one's view until the worker's next heartbeat; its own echoes, bookings of workers it does not know and
    bookings from a scheduler never heard beating do not."""
    heard: asyncio.Queue[Booked] = asyncio.Queue()

    async def on_booked(batch: BookedBatch, _m: object) -> None:
        for b in batch:
            await heard.put(b)

    await bus.subscribe(subjects.SCHED_BOOKED, BookedBatch, on_booked)
    beater = Beater(bus, ["a-0", "a-1"])
    await asyncio.sleep(0.3)
    reply = await submit(bus, request("r-booked", [5, 6, 7, 8]))
    assert reply.placement is not None
    b = await asyncio.wait_for(heard.get(), 5)
    while b.request_id != "r-booked":  # an earlier test's placement, still in its batch
        b = await asyncio.wait_for(heard.get(), 5)
    assert (b.request_id, b.decode_worker, b.prefill_worker) == ("r-booked", reply.placement.decode_worker, None)

    async def queued(wid: str) -> tuple[str, int]:
        st = await bus.request(subjects.SCHED_STATUS, b"", SchedulerStatus, timeout_s=2)
        return st.instance, next(d.queue_depth for d in st.details if d.worker_id == wid)

    beater.task.cancel()  # no heartbeat resets the counts meanwhile (the view keeps a worker for 0.6 s)
    await asyncio.sleep(0.05)
    me, before = await queued("a-0")
    assert b.scheduler == me
    await bus.nc.publish(subjects.sched_alive("sched-other"), b"0")
    await bus.publish(subjects.SCHED_BOOKED, [Booked(scheduler="sched-other", request_id=f"o{i}", decode_worker="a-0")
                                              for i in range(3)]
                      + [Booked(scheduler=me, request_id="echo", decode_worker="a-0"),
                         Booked(scheduler="sched-other", request_id="g", decode_worker="ghost"),
                         Booked(scheduler="sched-stranger", request_id="s", decode_worker="a-0")])
    await asyncio.sleep(0.15)
    assert (await queued("a-0"))[1] == before + 3


async def test_a_stale_heartbeat_does_not_replace_a_newer_one(bus: Bus) -> None:
    """Heartbeats of one run heard out of order (a partitioned worker's, delayed): the older one is dropped."""
    async def running(wid: str) -> int | None:
        st = await bus.request(subjects.SCHED_STATUS, b"", SchedulerStatus, timeout_s=2)
        return next((d.running for d in st.details if d.worker_id == wid), None)

    newer = msgspec.structs.replace(beat("late-0", running=3), model="other", instance="run", seq=10)  # not placed on
    await bus.publish(subjects.heartbeat("late-0"), newer)
    await asyncio.sleep(0.1)
    assert await running("late-0") == 3
    await bus.publish(subjects.heartbeat("late-0"), msgspec.structs.replace(newer, running=0, seq=9))
    await asyncio.sleep(0.1)
    assert await running("late-0") == 3


async def test_lost_worker_notifies_the_reply_subject(bus: Bus) -> None:
    lost: asyncio.Queue[ResponseEvent] = asyncio.Queue()

    async def on_reply(ev: ResponseEvent, _m: object) -> None:
        await lost.put(ev)

    await bus.subscribe(subjects.reply("r2"), ResponseEvent, on_reply)
    beater = Beater(bus, ["a-0"])
    await asyncio.sleep(0.3)
    reply = await submit(bus, request("r2", [9, 9, 9, 9, 9]))
    assert reply.placement is not None and reply.placement.decode_worker == "a-0"
    beater.task.cancel()  # a-0 goes silent
    ev = await asyncio.wait_for(lost.get(), 5)
    assert isinstance(ev, WorkerLost) and ev.worker_id == "a-0" and ev.request_id == "r2"
    again = await submit(bus, request("r3", [1]))
    assert again.error is not None  # a-0 left the view


def test_response_union_decodes_each_kind() -> None:
    dec = msgspec.json.Decoder(ResponseEvent)
    raw = msgspec.json.encode(WorkerLost(request_id="x", worker_id="w"))
    assert isinstance(dec.decode(raw), WorkerLost)


async def test_full_pool_is_refused_with_retry_after(bus: Bus) -> None:
    """Admission: a pool whose workers hold max_batch * (1 + queue_factor) requests takes no more."""
    beater = Beater(bus, ["a-0"])
    beater.load["a-0"] = 8 * (1 + 4)  # max_batch 8, default queue_factor 4
    await asyncio.sleep(0.4)
    reply = await submit(bus, request("r-full", [1, 2, 3]))
    assert reply.placement is None and reply.error is not None
    assert reply.error.status == 503 and reply.error.code == "overloaded" and reply.error.retry_after_s
    beater.load["a-0"] = 0
    await asyncio.sleep(0.4)
    reply = await submit(bus, request("r-room", [1, 2, 3]))
    assert reply.placement is not None and reply.placement.decode_worker == "a-0"
    beater.task.cancel()


async def in_flight(bus: Bus) -> int:
    return (await bus.request(subjects.SCHED_STATUS, b"", SchedulerStatus, timeout_s=2)).in_flight


async def until_in_flight(bus: Bus, n: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (got := await in_flight(bus)) != n:
        assert time.monotonic() < deadline, f"{got} requests in flight, expected {n}"
        await asyncio.sleep(0.1)


async def test_in_flight_is_reconciled_with_what_workers_hold(bus: Bus) -> None:
    """A Finished lost on the bus (here: never sent) leaves no request in flight for good: once its worker's
    heartbeats have said for a while that it holds nothing, the scheduler forgets the request; a worker
    that says it is busy keeps its own (its loss still sends WorkerLost for them)."""
    await until_in_flight(bus, 0)  # the other tests' workers have gone silent and were lost
    lost: asyncio.Queue[ResponseEvent] = asyncio.Queue()

    async def on_reply(ev: ResponseEvent, _m: object) -> None:
        await lost.put(ev)

    await bus.subscribe(subjects.reply("r-busy"), ResponseEvent, on_reply)
    beater = Beater(bus, ["a-0", "a-1"])
    beater.load.update({"a-0": 0, "a-1": 30})
    await asyncio.sleep(0.4)
    busy = await submit(bus, request("r-busy", [5, 6, 7]))
    assert busy.placement is not None and busy.placement.decode_worker == "a-0"
    beater.load.update({"a-0": 30, "a-1": 0})
    await asyncio.sleep(0.4)
    idle = await submit(bus, request("r-idle", [8, 9, 10]))
    assert idle.placement is not None and idle.placement.decode_worker == "a-1"
    assert await in_flight(bus) == 2
    await until_in_flight(bus, 1)  # a-1 says it holds nothing: r-idle is over
    assert lost.empty()  # ... and r-busy is the one left (a-0 was not lost meanwhile)
    beater.wids.discard("a-0")  # a-0 goes silent: r-busy was still on the books
    ev = await asyncio.wait_for(lost.get(), 10)
    assert isinstance(ev, WorkerLost) and ev.request_id == "r-busy" and ev.worker_id == "a-0"
    await until_in_flight(bus, 0)
    beater.task.cancel()
