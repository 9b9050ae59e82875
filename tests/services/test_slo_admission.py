"""SLO-aware admission in the live scheduler (real nats-server): a request the cost model predicts over its
model's SLO because of the queue ahead of it is refused with 429 + Retry-After; a model with admission off is
placed all the same."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from tests.clusters import cluster_toml, group, model
from tests.schedproc import scheduler_process

from hetmesh import subjects
from hetmesh.bus import Bus
from hetmesh.protocol import Heartbeat, InferenceRequest, Role, SamplingParams, SubmitReply

# A 32K-token prompt of Llama-3.1-70B takes seconds to prefill on one 8xH100 server, and the TTFT SLO is that
# long: the first request is within it, the second waits behind the first (2x its SLO). "strict" refuses it at
# the default margin (1.0), "lax" has admission off for itself.
CLUSTER = cluster_toml(
    mesh={"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 0.6},
    scheduler={"policy": "cost", "retry_after_s": 0.5},
    models=[model("strict", spec="llama-3.1-70b", max_context=65536, ttft_slo_s=1.0),
            model("lax", spec="llama-3.1-70b", max_context=65536, ttft_slo_s=1.0, admission_margin=0.0),
            model("held", spec="llama-3.1-70b", ttft_slo_s=2.0, tpot_slo_s=0.1)],
    workers=[group("h", "held", "nvidia-h100", devices=8),
             group("s", "strict", "nvidia-h100", devices=8),
             group("l", "lax", "nvidia-h100", devices=8)])


@pytest.fixture(scope="module")
def scheduler(nats_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with scheduler_process(CLUSTER, tmp_path_factory.mktemp("sched-slo"), nats_url, redis_url):
        yield


@pytest.fixture
async def bus(scheduler: None, nats_url: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_url, "test-slo")
    yield b
    await b.close()


def beat(wid: str, model: str, running: int = 0, queue: int = 0) -> Heartbeat:
    return Heartbeat(worker_id=wid, model=model, accelerator="nvidia-h100", vendor="nvidia", devices=8, role=Role.BOTH,
                     engine="sim", work_subject=subjects.work_direct("both", "nvidia", "nvidia-h100", wid),
                     queue_depth=queue, running=running, max_batch=8, kv_blocks_total=4096, kv_blocks_used=0,
                     block_size=16, ts=time.time())


async def submit(bus: Bus, rid: str, model: str) -> SubmitReply:
    for _ in range(50):  # the scheduler subscribes a moment after it starts
        # stamped at each try: the policy's clock is the arrival, and the backlog drains by it
        req = InferenceRequest(request_id=rid, model=model, prompt_tokens=list(range(32_000)), block_hashes=[],
                               sampling=SamplingParams(max_tokens=4), reply_subject=subjects.reply(rid),
                               arrival_ts=time.time())
        try:
            return await bus.request(subjects.SUBMIT, req, SubmitReply, timeout_s=1)
        except Exception:
            await asyncio.sleep(0.1)
    raise AssertionError("scheduler never answered")


async def submit_short(bus: Bus, rid: str, waited_s: float = 0.0) -> tuple[SubmitReply, float]:
    """A 100-token prompt of model "held", 16 tokens out; `waited_s`: its client's earlier tries. The reply and
    how long it took."""
    req = InferenceRequest(request_id=rid, model="held", prompt_tokens=list(range(100)), block_hashes=[],
                           sampling=SamplingParams(max_tokens=16), reply_subject=subjects.reply(rid),
                           arrival_ts=time.time(), waited_s=waited_s)
    t0 = time.monotonic()
    reply = await bus.request(subjects.SUBMIT, req, SubmitReply, timeout_s=5)
    return reply, time.monotonic() - t0


async def test_refused_with_429_and_retry_after_unless_the_model_turns_it_off(bus: Bus) -> None:
    async def beats() -> None:
        while True:
            await bus.publish(subjects.heartbeat("s-0"), beat("s-0", "strict"))
            await bus.publish(subjects.heartbeat("l-0"), beat("l-0", "lax"))
            await asyncio.sleep(0.1)

    task = asyncio.create_task(beats())
    try:
        await asyncio.sleep(0.4)
        for rid in ("r-lax-1", "r-lax-2"):  # admission off: placed, backlog or not (and the scheduler is up)
            reply = await submit(bus, rid, "lax")
            assert reply.error is None and reply.placement is not None and reply.placement.decode_worker == "l-0"
        reply = await submit(bus, "r-strict-1", "strict")
        assert reply.error is None and reply.placement is not None
        assert reply.placement.predicted_ttft_s is not None and 0 < reply.placement.predicted_ttft_s
        reply = await submit(bus, "r-strict-2", "strict")
        assert reply.placement is None and reply.error is not None
        assert reply.error.status == 429 and reply.error.code == "slo_unattainable"
        assert reply.error.retry_after_s is not None and reply.error.retry_after_s >= 0.5
        assert "admission" in reply.error.message
    finally:
        task.cancel()


async def test_a_refusal_for_tpot_is_held_and_placed_when_the_batch_drains(bus: Bus) -> None:
    """A full batch and a queue 3x as deep: every token of a new decode waits four rounds for a slot (TPOT
    over its 0.1 s SLO; 0.03 s alone), the prompt is short (TTFT well within): the scheduler holds the
    request and places it again; once the worker reports the queue drained it is placed, within the one
    submit. Still full: refused when the hold could no longer meet its TTFT SLO (2 s), with the 429."""
    busy = True

    async def beats() -> None:
        while True:
            await bus.publish(subjects.heartbeat("h-0"), beat("h-0", "held", *((8, 24) if busy else (0, 0))))
            await asyncio.sleep(0.05)

    task = asyncio.create_task(beats())
    try:
        await asyncio.sleep(0.4)
        reply, took = await submit_short(bus, "r-held-refused")
        assert reply.placement is None and reply.error is not None and reply.error.status == 429
        assert reply.error.code == "slo_unattainable" and 1.0 < took < 2.5  # held while 2 s could still be met

        async def drain() -> None:
            nonlocal busy
            await asyncio.sleep(0.6)
            busy = False

        drained = asyncio.create_task(drain())
        reply, took = await submit_short(bus, "r-held-placed")
        await drained
        assert reply.error is None and reply.placement is not None and reply.placement.decode_worker == "h-0"
        assert 0.5 < took < 2.0  # placed after the drain, not before
    finally:
        task.cancel()


async def test_a_retry_is_judged_by_its_wait_since_its_first_send(bus: Bus) -> None:
    """The gateway hands on how long a retrying client already waited (InferenceRequest.waited_s): on an idle
    worker a short request is placed, but the same request that waited past its TTFT SLO on earlier tries is
    refused at once (served now, it would reach its user late), not held."""
    async def beats() -> None:
        while True:
            await bus.publish(subjects.heartbeat("h-0"), beat("h-0", "held"))
            await asyncio.sleep(0.05)

    task = asyncio.create_task(beats())
    try:
        await asyncio.sleep(0.4)
        reply, _ = await submit_short(bus, "r-fresh")
        assert reply.error is None and reply.placement is not None
        reply, _ = await submit_short(bus, "r-retry-in-time", 1.0)  # 1 s of its 2 s SLO gone: still within it
        assert reply.error is None and reply.placement is not None
        reply, took = await submit_short(bus, "r-retry-late", 3.0)
        assert reply.placement is None and reply.error is not None and reply.error.code == "slo_unattainable"
        assert "waited already" in reply.error.message and took < 1.0
    finally:
        task.cancel()
