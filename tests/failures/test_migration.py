"""A stream survives its worker: a worker SIGKILLed mid-decode or drained by SIGTERM, and the client gets
one continuous stream with exactly the undisturbed run's text (the sim engine is deterministic); a client
that goes away in any phase leaves nothing behind on any worker (the engines' own stats, the workers'
KV inboxes, kv-transfer's records).

The mesh is conftest.py's. Each test leaves it whole for the next.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import nats
import pytest

from hetmesh import subjects
from hetmesh.bus import decode, encode
from hetmesh.launcher import Mesh
from hetmesh.metrics import scrape, total
from hetmesh.protocol import Heartbeat, InferenceRequest, Phase, Placement, SchedulerStatus, WorkItem
from hetmesh.workqueue import MSG_ID

from ..e2e.conftest import EventLog
from .conftest import DRAIN_TIMEOUT_S, TOK, Sse, complete, expected_text, first_placed, respawn, stream

# ~0.2 s a decode token at the mesh's time scale: a kill after 3 chunks lands mid-decode
N = 24


async def worker_event(events: EventLog, kind: str, worker_id: str, since: float) -> Any:
    """A worker's own event (no request id) after `since`, e.g. `drained`."""
    async with asyncio.timeout(5):
        while True:
            for e in events.events:
                if e.kind == kind and e.detail.get("worker_id") == worker_id and e.ts >= since:
                    return e
            await asyncio.sleep(0.02)


async def scheduler_status(nc: Any) -> SchedulerStatus:
    return decode((await nc.request(subjects.SCHED_STATUS, b"", timeout=2)).data, SchedulerStatus)


async def victim_of(events: EventLog, sse: Sse) -> str:
    placed = await events.wait_for(sse.request_id, "placed", timeout_s=10)
    return str(placed.detail["decode_worker"])


async def heartbeats(nc: Any) -> dict[str, Heartbeat]:
    """Every worker's last heartbeat on the bus, kept up to date from now on."""
    beats: dict[str, Heartbeat] = {}

    async def on_beat(m: Any) -> None:
        hb = decode(m.data, Heartbeat)
        beats[hb.worker_id] = hb

    await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_beat)
    return beats


async def bridge(mesh: Mesh, nc: Any, last: Heartbeat, going: Callable[[], bool], moving: bool = False,
                 **change: Any) -> None:
    """Keep a worker's heartbeats going for it: `last` again (with `change`, a fresh ts) every heartbeat
    interval while `going()`; `moving`: with one more token generated each time (an engine the scheduler
    sees working), else its counters stand still (an engine wedged). Unnumbered (seq 0): numbered as `last`
    is, they would be dropped as stale, and the worker's own numbers after them too."""
    n = 0
    while going():
        n += moving
        await nc.publish(subjects.heartbeat(last.worker_id), encode(msgspec.structs.replace(
            last, ts=time.time(), tokens_generated=last.tokens_generated + n, seq=0, **change)))
        await asyncio.sleep(mesh.cfg.mesh.heartbeat_interval_s)


async def sigkill_mid_decode(mesh: Mesh, events: EventLog, model: str, prompt: str) -> None:
    """SIGKILL the worker decoding a stream after 3 chunks: the stream goes on elsewhere, same text."""
    victims: list[str] = []

    async def kill_at_3(sse: Sse) -> bool:
        if len(sse.chunks) == 3:
            victims.append(await victim_of(events, sse))
            mesh.kill(f"worker:{victims[0]}")
        return True

    sse = await stream(mesh, model, prompt, N, kill_at_3)
    assert not sse.errors, sse.errors
    assert sse.done and sse.text == expected_text(prompt, N)
    assert sse.chunks[-1]["usage"]["completion_tokens"] == N
    assert sse.chunks[-1]["usage"]["prompt_tokens"] == len(prompt)
    rid = sse.request_id
    moved = await events.wait_for(rid, "migrated", timeout_s=5)
    assert moved.detail["lost_worker"] == victims[0] and int(str(moved.detail["from_index"])) >= 3
    resumed = await events.wait_for(rid, "migration_resumed", timeout_s=5)
    assert resumed.detail["worker_id"] not in (None, victims[0])
    respawn(mesh, f"worker:{victims[0]}")


async def test_aggregated_stream_survives_its_worker_sigkilled_mid_decode(mesh: Mesh, events: EventLog) -> None:
    await sigkill_mid_decode(mesh, events, "agg", "an aggregated stream whose worker dies ")


async def test_disaggregated_stream_survives_its_decode_worker_sigkilled(mesh: Mesh, events: EventLog) -> None:
    await sigkill_mid_decode(mesh, events, "pd", "a disaggregated stream whose decode worker dies ")


async def test_a_worker_back_before_its_heartbeats_expire_still_loses_its_streams(mesh: Mesh,
                                                                                  events: EventLog) -> None:
    """A worker SIGKILLed and back under the same id within the heartbeat timeout (a supervisor or a
    container restart policy; the soak's restarts take ~1.5 s against a 2 s timeout) never goes silent long
    enough to expire, but the new run holds none of the old one's streams: its heartbeats name another
    `instance`, the scheduler counts the old run lost, and the stream moves on at once. So that the restart
    always beats the timeout here, the new run's heartbeats are bridged from the moment the old run dies
    (its last heartbeat with a new instance, every heartbeat interval) until the real process, started
    after the stream, sends its own."""
    nc = await nats.connect(mesh.nats_url)
    beats = await heartbeats(nc)
    victims: list[str] = []
    bridges: list[asyncio.Task[None]] = []

    async def restart_at_3(sse: Sse) -> bool:
        if len(sse.chunks) == 3:
            victims.append(await victim_of(events, sse))
            mesh.kill(f"worker:{victims[0]}")
            last = beats[victims[0]]
            assert last.instance
            # until the real new run heartbeats (a third instance)
            bridges.append(asyncio.create_task(bridge(
                mesh, nc, last, lambda: beats[last.worker_id].instance in (last.instance, "next-run"),
                instance="next-run")))
        return True

    prompt = "a stream whose worker comes straight back "
    try:
        sse = await stream(mesh, "agg", prompt, N, restart_at_3)
        assert not sse.errors, sse.errors
        assert sse.done and sse.text == expected_text(prompt, N)
        moved = await events.wait_for(sse.request_id, "migrated", timeout_s=5)  # not a redelivery to the new run
        assert moved.detail["lost_worker"] == victims[0] and moved.detail["reason"] == "worker_lost"
    finally:
        if victims:
            await asyncio.to_thread(respawn, mesh, f"worker:{victims[0]}")
        for t in bridges:
            await asyncio.wait_for(t, 10)
        await nc.close()


async def test_a_stream_whose_worker_stops_under_a_live_heartbeat_moves_on_at_the_stall_timeout(
        mesh: Mesh, events: EventLog) -> None:
    """The grayest failure: a worker's stream stops (here the whole process, SIGSTOP) while its heartbeats go
    on and say it works (here bridged: its last heartbeat with one more token each interval), so neither the
    heartbeat timeout nor the scheduler's wedge rule counts it lost. Tokens came, then none for the gateway's
    stall timeout: the stream migrates to another worker and ends with the undisturbed text. The stopped
    worker is let go on after (SIGCONT): its late chunks go to the old attempt's reply subject, which nobody
    reads."""
    nc = await nats.connect(mesh.nats_url)
    beats = await heartbeats(nc)
    stopped: list[str] = []  # while stopped (the bridge runs)
    victims: list[str] = []
    bridges: list[asyncio.Task[None]] = []

    async def stop_at_3(sse: Sse) -> bool:
        if len(sse.chunks) == 3:
            victim = await victim_of(events, sse)
            victims.append(victim)
            stopped.append(victim)
            bridges.append(asyncio.create_task(bridge(mesh, nc, beats[victim], lambda: bool(stopped), moving=True)))
            os.killpg(mesh.services[f"worker:{victim}"].proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
        return True

    prompt = "a stream whose worker freezes "
    try:
        sse = await stream(mesh, "agg", prompt, N, stop_at_3)
    finally:
        for v in stopped:
            os.killpg(mesh.services[f"worker:{v}"].proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
        stopped.clear()
        for t in bridges:
            await asyncio.wait_for(t, 10)
        await nc.close()
    assert not sse.errors, sse.errors
    assert sse.done and sse.text == expected_text(prompt, N)
    moved = await events.wait_for(sse.request_id, "migrated", timeout_s=5)
    assert moved.detail["reason"] == "stalled" and int(str(moved.detail["from_index"])) >= 3
    resumed = await events.wait_for(sse.request_id, "migration_resumed", timeout_s=5)
    assert resumed.detail["worker_id"] not in (None, victims[0])
    assert moved.detail["lost_worker"] is None  # nobody saw it lost: the placement's workers were excluded


async def test_a_wedged_worker_loses_its_requests_before_their_first_token(mesh: Mesh, events: EventLog) -> None:
    """A worker's engine stops mid-prefill (SIGSTOP, just after the placement) while its heartbeats go on and
    say so (bridged: running, counters still). After mesh.wedge_timeout_s the scheduler counts it wedged: the
    request, which has no token yet and would have waited for the gateway's stall timeout and a 504, is
    submitted again elsewhere and streams the undisturbed text; `hetmesh status` marks the worker, and it is
    placed on again once its engine moves (SIGCONT)."""
    nc = await nats.connect(mesh.nats_url)
    beats = await heartbeats(nc)
    stopped: list[str] = []
    prompt = "a prefill that never ends " * 200  # 5,200 tokens: a prefill of ~3 s on an H100 at this time scale
    async with asyncio.timeout(5):
        while True:
            if {"h100-0", "h100-1"} <= beats.keys():
                break
            await asyncio.sleep(0.05)
    since = time.time()
    task = asyncio.create_task(stream(mesh, "agg", prompt, 4))
    try:
        victim = str((await first_placed(events, since)).detail["decode_worker"])
        os.killpg(mesh.services[f"worker:{victim}"].proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
        stopped.append(victim)
        busy = msgspec.structs.replace(beats[victim], running=1)  # it had taken the request by now, or will
        bridged = asyncio.create_task(bridge(mesh, nc, busy, lambda: bool(stopped)))
        sse = await asyncio.wait_for(task, 60)
        assert not sse.errors, sse.errors
        assert sse.done and sse.text == expected_text(prompt, 4)
        retried = await events.wait_for(sse.request_id, "retried", timeout_s=5)
        assert retried.detail["lost_worker"] == victim and retried.detail["reason"] == "worker_lost"
        lost = next(e for e in events.events if e.kind == "worker_lost" and e.detail.get("worker_id") == victim
                    and e.ts >= since)
        assert lost.detail["why"] == "wedged" and lost.detail["requests"] == 1
        st = await scheduler_status(nc)
        assert {w.worker_id: w.wedged for w in st.details}[victim]
    finally:
        for v in stopped:
            os.killpg(mesh.services[f"worker:{v}"].proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
        stopped.clear()
        if "bridged" in locals():
            await asyncio.wait_for(bridged, 10)
    async with asyncio.timeout(10):  # its engine moves again (the old attempt ends): placed on again
        while True:
            if not {w.worker_id: w.wedged for w in (await scheduler_status(nc)).details}.get(victim, True):
                break
            await asyncio.sleep(0.1)
    await nc.close()


async def test_sigterm_drain_hands_an_unfinished_stream_over_and_exits_0(mesh: Mesh, events: EventLog) -> None:
    """Longer than the drain timeout: the worker hands the stream over (retryable error), the gateway
    migrates it, and the worker exits 0."""
    prompt = "a stream longer than the drain "
    since = time.time()
    victims: list[str] = []
    drains: list[asyncio.Task[None]] = []

    async def drain_at_3(sse: Sse) -> bool:
        if len(sse.chunks) == 3:
            victims.append(await victim_of(events, sse))
            drains.append(asyncio.create_task(asyncio.to_thread(mesh.kill, f"worker:{victims[0]}", signal.SIGTERM)))
        return True

    sse = await stream(mesh, "agg", prompt, N, drain_at_3)
    await drains[0]
    assert not sse.errors, sse.errors
    assert sse.done and sse.text == expected_text(prompt, N)
    assert mesh.services[f"worker:{victims[0]}"].proc.returncode == 0  # type: ignore[union-attr]
    rid = sse.request_id
    moved = await events.wait_for(rid, "migrated", timeout_s=5)
    assert moved.detail["reason"] == "worker_draining"
    await events.wait_for(rid, "handed_over", timeout_s=5, worker_id=victims[0])
    drained = await worker_event(events, "drained", victims[0], since)
    assert drained.detail["handed_over"] == 1
    respawn(mesh, f"worker:{victims[0]}")


async def test_sigterm_drain_lets_a_short_request_finish_where_it_is(mesh: Mesh, events: EventLog,
                                                                    aclient: Any) -> None:
    prompt, n = "short enough to finish during the drain ", 2  # well under DRAIN_TIMEOUT_S
    t0 = asyncio.get_running_loop().time()
    since = time.time()
    task = complete(aclient, prompt, n, model="agg")
    placed = await first_placed(events, since)
    victim = str(placed.detail["decode_worker"])
    await events.wait_for(placed.request_id, "accepted", timeout_s=10)
    await asyncio.to_thread(mesh.kill, f"worker:{victim}", signal.SIGTERM)
    r = await asyncio.wait_for(task, 30)
    assert r.choices[0].text == expected_text(prompt, n)
    assert mesh.services[f"worker:{victim}"].proc.returncode == 0  # type: ignore[union-attr]
    assert asyncio.get_running_loop().time() - t0 < 10 * DRAIN_TIMEOUT_S  # sanity: it did not wait it out
    done = await events.wait_for(placed.request_id, "decode_done", timeout_s=5)
    assert done.detail["worker_id"] == victim, [(e.service, e.kind, e.ts, e.detail)
                                                for e in events.for_request(placed.request_id)]
    assert not [e for e in events.for_request(placed.request_id) if e.kind == "migrated"]
    drained = await worker_event(events, "drained", victim, since)
    assert drained.detail["handed_over"] == 0
    respawn(mesh, f"worker:{victim}")


async def test_an_item_reaching_a_draining_worker_is_handed_over_at_once(mesh: Mesh, events: EventLog,
                                                                         aclient: Any) -> None:
    """A placement made just before the scheduler heard of a drain reaches the worker while it drains: the
    worker hands it over at once (retryable `worker_draining`), not leaving it in its consumer for its next
    incarnation or a redelivery; the gateway places it again and it completes on the other worker, and the
    drained worker's consumer is empty when it is gone. The scheduler hears of a drain within milliseconds,
    so the test makes that late placement itself: a copy of a real request's WorkItem, published on the
    draining worker's direct subject (the one its heartbeats name)."""
    prompt, n = "placed on a worker that is draining ", 12
    nc = await nats.connect(mesh.nats_url)
    submitted: asyncio.Future[InferenceRequest] = asyncio.get_running_loop().create_future()
    beats = await heartbeats(nc)

    async def on_submit(m: Any) -> None:
        r = decode(m.data, InferenceRequest)
        if r.attempt == 0 and r.prompt_tokens == TOK.encode(prompt) and not submitted.done():
            submitted.set_result(r)

    await nc.subscribe(subjects.SUBMIT, cb=on_submit)  # any scheduler (queue group) ...
    await nc.subscribe(f"{subjects.SUBMIT}.*", cb=on_submit)  # ... or the one the gateway picked
    victims: list[str] = []
    drains: list[asyncio.Task[None]] = []
    sent = asyncio.Event()

    async def drain_at_3(sse: Sse) -> bool:  # a stream longer than the drain keeps the victim draining
        if len(sse.chunks) == 3:
            victims.append(await victim_of(events, sse))
            drains.append(asyncio.create_task(asyncio.to_thread(mesh.kill, f"worker:{victims[0]}", signal.SIGTERM)))
            sent.set()
        return True

    since = time.time()
    first = "keeps its worker draining "
    long = asyncio.create_task(stream(mesh, "agg", first, N, drain_at_3))
    try:
        await asyncio.wait_for(sent.wait(), 30)
        victim = victims[0]
        await worker_event(events, "draining", victim, since)
        direct = beats[victim].work_subject
        task = complete(aclient, prompt, n, model="agg")
        req = await asyncio.wait_for(submitted, 10)
        item = WorkItem(request=req, phase=Phase.FULL, placement=Placement(mode="aggregated", decode_worker=victim))
        await nc.jetstream().publish(direct, encode(item), headers={MSG_ID: f"late-{req.request_id}"})
        r = await asyncio.wait_for(task, 30)
        await drains[0]
        sse = await long
    finally:
        await nc.close()
    assert r.choices[0].text == expected_text(prompt, n)
    assert sse.done and sse.text == expected_text(first, N), sse.errors
    assert mesh.services[f"worker:{victim}"].proc.returncode == 0  # type: ignore[union-attr]
    rid = req.request_id
    handed = await events.wait_for(rid, "handed_over", timeout_s=5, worker_id=victim, queued=True)
    drained = await worker_event(events, "drained", victim, since)
    assert handed.ts <= drained.ts  # handed over while draining, not left for the next incarnation
    again = [e for e in events.for_request(rid) if e.kind in ("retried", "migrated")]
    assert [e.detail["reason"] for e in again] == ["worker_draining"], again
    done = await events.wait_for(rid, "decode_done", timeout_s=5)
    assert done.detail["worker_id"] != victim
    await events.wait_for(rid, "accepted", timeout_s=5, worker_id=done.detail["worker_id"], attempt=1)
    assert not [e for e in events.events if e.kind == "work_left" and e.ts >= since]
    js = (nc2 := await nats.connect(mesh.nats_url)).jetstream()
    try:  # nothing left for the victim's next incarnation
        info = await js.consumer_info(subjects.WORK_STREAM, subjects.work_consumer(direct))
        assert (info.num_pending, info.num_ack_pending) == (0, 0)
    finally:
        await nc2.close()
    respawn(mesh, f"worker:{victim}")


# --- cancellation in every phase ------------------------------------------------------------------
async def workers_hold_nothing(mesh: Mesh) -> None:
    """Every worker's engine (its heartbeats: queue, running, pinned KV blocks), its KV inbox, and
    kv-transfer's open records all come back to zero once the Cancel went round."""
    nc = await nats.connect(mesh.nats_url)
    last: Any = None
    try:
        async with asyncio.timeout(15):
            while True:
                st = await scheduler_status(nc)
                busy = [(w.worker_id, w.queue_depth, w.running, w.kv_blocks_used) for w in st.details
                        if w.queue_depth or w.running or w.kv_blocks_used]
                urls = mesh.metrics_urls()
                try:
                    inbox = {n: v for n in urls if n.startswith("worker:") and mesh.services[n].alive
                             if (v := _gauge(urls[n], "hetmesh_worker_kv_landed_unclaimed"))}
                    records = _gauge(urls["kv-transfer-0"], "hetmesh_kv_transfer_active")
                except httpx.ConnectError as exc:  # a worker just restarted: its metrics port opens last
                    last = repr(exc)
                    await asyncio.sleep(0.2)
                    continue
                last = (busy, inbox, records)
                if not busy and not inbox and not records:
                    return
                await asyncio.sleep(0.2)
    except TimeoutError:
        pytest.fail(f"something is still held (busy workers, unclaimed KV, open transfers): {last}")
    finally:
        await nc.close()


def _gauge(url: str, name: str) -> float:
    return total(scrape(url), name)


async def hang_up_when(mesh: Mesh, model: str, prompt: str, n: int, when: int) -> Sse:
    """Stream, and go away after `when` chunks."""
    async def at(sse: Sse) -> bool:
        return len(sse.chunks) < when

    return await stream(mesh, model, prompt, n, at)


async def test_cancel_while_prefilling_on_the_prefill_worker(mesh: Mesh, events: EventLog, aclient: Any) -> None:
    since = time.time()
    task = complete(aclient, "p" * 6000, 8)  # ~1.3 s of prefill
    placed = await first_placed(events, since)
    await events.wait_for(placed.request_id, "accepted", timeout_s=10, worker_id=placed.detail["prefill_worker"])
    task.cancel()  # the client goes away
    await events.wait_for(placed.request_id, "cancelled", timeout_s=10)
    await events.wait_for(placed.request_id, "aborted", timeout_s=10, worker_id=placed.detail["prefill_worker"])
    # ... and the decode worker, which was waiting for the KV, let it go at once (not at its KV timeout)
    await events.wait_for(placed.request_id, "aborted", timeout_s=5, worker_id=placed.detail["decode_worker"],
                          waiting_for_kv=True)
    assert "decode_done" not in {e.kind for e in events.for_request(placed.request_id)}
    await workers_hold_nothing(mesh)


async def test_cancel_at_the_first_token(mesh: Mesh, events: EventLog) -> None:
    """Gone at the first token: the prefill worker ships the KV then (128 MiB), the decode worker takes it
    in and starts. On loopback the transfer lands in about 0.1 s, under the gateway's 0.2 s disconnect
    poll, so the Cancel may find it in any of those steps; whichever, nothing may be left behind. (What a
    Cancel does to a KV stream under way is unit-tested: tests/unit/test_migration_state.py.)"""
    sse = await hang_up_when(mesh, "pd", "s" * 4000, 12, when=1)
    rid = sse.request_id
    await events.wait_for(rid, "cancelled", timeout_s=10)
    await workers_hold_nothing(mesh)
    assert "decode_done" not in {e.kind for e in events.for_request(rid)}


async def test_cancel_while_decoding(mesh: Mesh, events: EventLog) -> None:
    sse = await hang_up_when(mesh, "pd", "gone mid decode ", N, when=3)
    placed = await events.wait_for(sse.request_id, "placed", timeout_s=5)
    await events.wait_for(sse.request_id, "aborted", timeout_s=10, worker_id=placed.detail["decode_worker"])
    await workers_hold_nothing(mesh)


async def test_cancel_while_being_migrated(mesh: Mesh, events: EventLog) -> None:
    """The worker dies, the gateway re-places the stream, and the client goes away before the new
    worker's first token: the new worker lets it go too."""
    victims: list[str] = []
    killed = asyncio.Event()

    async def kill_at_3(sse: Sse) -> bool:
        if len(sse.chunks) == 3:
            victims.append(await victim_of(events, sse))
            mesh.kill(f"worker:{victims[0]}")
            killed.set()
        return True

    prompt = "gone while migrating " * 40  # a longer prompt: the new worker's prefill takes a moment
    since = time.time()
    task = asyncio.create_task(stream(mesh, "agg", prompt, N, kill_at_3))
    await asyncio.wait_for(killed.wait(), 30)
    moved = None
    async with asyncio.timeout(15):
        while moved is None:
            moved = next((e for e in events.events if e.kind == "migrated" and e.ts >= since
                          and e.detail["lost_worker"] == victims[0]), None)
            await asyncio.sleep(0.01)
    task.cancel()  # the client goes away
    rid = moved.request_id
    await events.wait_for(rid, "cancelled", timeout_s=10)
    await workers_hold_nothing(mesh)
    respawn(mesh, f"worker:{victims[0]}")
