"""A placement withdrawn with its booking, on a real mesh (nats-server, gateway, scheduler, two sim workers).

Two schedulers place on views a bus delay apart: a scheduler that hears another's booking placed before one
of its own on the same worker places its own again knowing of it, and takes it back where that changes the
choice (hetmesh.placement.withdrawal). Staged here with a fake peer scheduler: it beats (so its bookings
count) and, as soon as the real scheduler books a request that waits in a busy worker's queue, books a long
prefill on that worker placed just before it. The worker, the arbiter, drops the waiting item; the gateway
places the request anew (an attempt it does not count) and the client gets the whole completion once.
Aggregated (the FULL item withdrawn) and prefill/decode (the PREFILL withdrawn, and the DECODE half that waits
for its KV on the decode worker cancelled by the prefill worker).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nats
import openai
import pytest

from hetmesh import subjects
from hetmesh.bus import decode, encode
from hetmesh.launcher import Mesh
from hetmesh.metrics import scrape
from hetmesh.protocol import Booked, BookedBatch, Booking

from ..clusters import cluster_toml, group, model
from ..e2e.conftest import EventLog, collect_events, running_mesh
from .conftest import expected_text

PEER = "sched-peer"
# llama-3.1-8b at time scale 0.05: a 2,000-token prefill holds an H100's only batch slot for ~2.5 s, a 6,000-token
# one a Rubin CPX's for well over a second
CLUSTER = cluster_toml(
    mesh={"time_scale": 0.05, "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 2.0, "stall_timeout_s": 30.0,
          "max_attempts": 1},  # a withdrawal must not need a second attempt
    scheduler={"policy": "cost", "admission_margin": 0.0},
    models=[model("m", spec="llama-3.1-8b", max_context=8192, block_size=16),
            model("pd", spec="llama-3.1-8b", max_context=8192, block_size=16)],
    workers=[group("h100", "m", "nvidia-h100", role="both", count=2, max_batch=1),
             group("cpx", "pd", "nvidia-rubin-cpx", role="prefill", count=2, max_batch=1),
             group("vr", "pd", "nvidia-rubin-vr200", role="decode")])
LONG = "a long prompt that fills the only batch slot of its worker for a while. "


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with running_mesh(Path(tmp_path_factory.mktemp("withdrawal")), CLUSTER) as m:
        yield m


async def staged(mesh: Mesh, model: str, long_len: int) -> tuple[EventLog, Booked, str]:
    """Two long prompts of `model` take its two (prefill) workers' one batch slot each; a third request waits
    in one of their queues, and the fake peer books a long prefill there placed just before it. Returns the
    events, the third request's booking and the worker its placement computed on first."""
    nc = await nats.connect(mesh.nats_url)
    events = collect_events(mesh.nats_url)
    log: EventLog = await anext(events)
    real: list[Booked] = []  # the real scheduler's bookings of this model's requests, in order
    target: asyncio.Future[Booked] = asyncio.get_running_loop().create_future()
    two = asyncio.Event()

    async def beat() -> None:
        while True:
            await nc.publish(subjects.sched_alive(PEER), b"0")
            await asyncio.sleep(0.2)

    async def on_booked(m: nats.aio.msg.Msg) -> None:
        for b in decode(m.data, BookedBatch):
            if b.scheduler == PEER or b.withdrawn or not b.decode_worker.startswith("vr" if model == "pd" else "h100"):
                continue
            real.append(b)
            if len(real) == 2:
                two.set()
            if len(real) == 3 and b.booking is not None:  # the third request, queued behind a long prompt
                # Another scheduler's long prefill on the same worker, placed a moment before it.
                on = b.prefill_worker or b.decode_worker
                peer = Booked(scheduler=PEER, request_id=f"peer-{model}", decode_worker=b.decode_worker,
                              prefill_worker=b.prefill_worker,
                              booking=Booking(prefill_s=60.0, placed_at=b.booking.placed_at - 0.001),
                              placed_at=b.placed_at - 0.001)
                await nc.publish(subjects.SCHED_BOOKED, encode([peer]))
                target.set_result(msgspec.structs.replace(b, decode_worker=on))

    beats = asyncio.create_task(beat())
    await nc.subscribe(subjects.SCHED_BOOKED, cb=on_booked)
    await asyncio.sleep(1.0)  # the scheduler hears the peer beating
    client = openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=90)
    try:
        busy = [asyncio.create_task(client.completions.create(model=model, prompt=f"{i} " + LONG * long_len,
                                                              max_tokens=4, extra_body={"ignore_eos": True}))
                for i in range(2)]
        await asyncio.wait_for(two.wait(), 20)
        for b in real[:2]:
            await log.wait_for(b.request_id, "accepted", timeout_s=20, worker_id=b.prefill_worker or b.decode_worker)
        prompt = f"{model}: queued behind a long prompt, then moved"
        third = await client.completions.create(model=model, prompt=prompt, max_tokens=6,
                                                extra_body={"ignore_eos": True})
        assert third.choices[0].text == expected_text(prompt, 6)
        for t in busy:
            assert (await t).choices[0].finish_reason == "length"
        placed = await asyncio.wait_for(target, 5)
        return log, placed, placed.decode_worker
    finally:
        beats.cancel()
        with contextlib.suppress(Exception):
            await events.aclose()
        await nc.close()


def attempt_1_on(log: EventLog, rid: str) -> list[str]:
    return [str(e.detail["worker_id"]) for e in log.for_request(rid)
            if e.kind == "accepted" and e.detail.get("attempt") == 1]


async def test_a_placement_an_earlier_booking_moves_is_withdrawn_and_served_once_elsewhere(mesh: Mesh) -> None:
    log, placed, first = await staged(mesh, "m", 28)
    rid = placed.request_id
    # the scheduler took it back from the worker it had placed it on, which dropped it before it started
    await log.wait_for(rid, "withdrawn", worker_id=first)
    kinds = {(e.service, e.kind, e.detail.get("worker_id")) for e in log.for_request(rid)}
    assert ("scheduler", "withdrawn", first) in kinds and ("worker", "withdrawn", first) in kinds
    # placed anew as attempt 1 on the other worker: an attempt the gateway did not count (max_attempts 1)
    again = attempt_1_on(log, rid)
    assert len(again) == 1 and again[0] != first
    assert not [e for e in log.for_request(rid) if e.kind == "decode_done" and e.detail.get("worker_id") == first]
    samples = await asyncio.to_thread(scrape, mesh.metrics_urls()["scheduler"])
    assert samples[("hetmesh_scheduler_rechecked_total", (("outcome", "withdrawn"),))] >= 1


async def test_a_withdrawn_prefill_takes_its_decode_half_with_it(mesh: Mesh) -> None:
    log, placed, first = await staged(mesh, "pd", 80)
    rid = placed.request_id
    assert placed.prefill_worker == first and first.startswith("cpx")
    await log.wait_for(rid, "withdrawn", worker_id=first)
    # the decode worker's DECODE half of attempt 0, waiting for KV that never comes, ended with the withdrawal
    # (not at the KV wait's timeout), and attempt 1 went through the other prefill worker
    await log.wait_for(rid, "withdrawn", worker_id="vr-0", phase="decode")
    again = attempt_1_on(log, rid)
    assert sorted(again) == sorted([w for w in ("cpx-0", "cpx-1") if w != first] + ["vr-0"])
