"""Several gateways and schedulers at once (active-active), and one of each killed with SIGKILL under load.

- A scheduler killed among two: no request is lost (one it held unanswered goes to the other: the gateway
  watches the scheduler's beats), and placements go on through the other.
- A gateway killed among two: only its own clients' connections break; the other gateway's streams go on
  untouched, and the workers cancel what the dead one placed within about a heartbeat timeout (its beats
  stop), rather than decode for nobody.
- The gateway's submit itself, against peers on a real nats-server: a scheduler that takes a request and
  dies before answering is replaced by another live one within the heartbeat timeout; a submit a bus gap
  ate (the scheduler's beat says it reconnected) is sent to it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import nats
import openai
import pytest

from hetmesh import servers, subjects
from hetmesh.bus import decode, encode
from hetmesh.gateway.schedulers import Schedulers
from hetmesh.kvindex.blocks import block_hashes
from hetmesh.launcher import Mesh
from hetmesh.metrics import scrape, total
from hetmesh.protocol import (
    Heartbeat,
    InferenceRequest,
    ResponseEvent,
    SamplingParams,
    SubmitReply,
    TokenChunk,
)

from ..clusters import cluster_toml, group, model
from ..e2e.conftest import EventLog, collect_events, running_mesh
from .conftest import HEARTBEAT_TIMEOUT_S, STEADY_MESH, TOK, expected_text

CLUSTER = cluster_toml(
    mesh=STEADY_MESH,
    scheduler={"policy": "least_loaded"},
    models=[model("m", spec="llama-3.1-8b", max_context=8192, block_size=16)],
    workers=[group("h100", "m", "nvidia-h100", role="both", count=2)])


def ready(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def mesh2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mesh, str]]:
    """The launcher's mesh (gateway, scheduler sched-0) plus a second scheduler and a second gateway."""
    with running_mesh(Path(tmp_path_factory.mktemp("active-active")), CLUSTER) as m:
        cluster = ["--cluster", str(m.cluster_path)]
        m.add("scheduler-1", [sys.executable, "-m", "hetmesh.scheduler", *cluster, "--instance", "sched-1"])
        port = servers.free_port()
        m.add("gateway-b", [sys.executable, "-m", "hetmesh.gateway", *cluster, "--port", str(port),
                            "--instance", "gwb"])
        m.spawn("scheduler-1")
        m.spawn("gateway-b")
        url_b = f"http://127.0.0.1:{port}"
        ready(url_b)
        yield m, url_b


async def schedulers_beating(nats_url: str, want: set[str], timeout_s: float = 20) -> None:
    nc = await nats.connect(nats_url)
    heard: set[str] = set()
    sub = await nc.subscribe(subjects.SCHED_ALIVE_ALL)
    try:
        async with asyncio.timeout(timeout_s):
            while not want <= heard:
                heard.add((await sub.next_msg(timeout=timeout_s)).subject.rsplit(".", 1)[-1])
    finally:
        await nc.close()


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=90)


async def streamed(c: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str:
    s = await c.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, stream=True,
                                   extra_body={"ignore_eos": True})
    return "".join([ch.choices[0].text async for ch in s if ch.choices])


def bad_input(m: Mesh, kind: str) -> float:
    """Both schedulers' hetmesh_scheduler_bad_input{kind}, summed."""
    return sum(total(scrape(m.metrics_urls()[s]), "hetmesh_scheduler_bad_input_total", kind=kind)
               for s in ("scheduler", "scheduler-1"))


async def test_one_request_placed_by_both_schedulers_is_served_once(mesh2: tuple[Mesh, str]) -> None:
    """The same attempt submitted to both schedulers (a gateway that sent it again elsewhere, the first still
    placing): each places it, the work queue stores its WorkItem once (its dedup id), one worker serves it, one
    stream comes back, and the duplicate is counted."""
    m, _ = mesh2
    await schedulers_beating(m.nats_url, {"sched-0", "sched-1"})
    before = await asyncio.to_thread(bad_input, m, "duplicate_placement")
    prompt, rid = "placed twice, served once", "twice-0"
    tokens = TOK.encode(prompt)
    req = InferenceRequest(request_id=rid, model="m", prompt_tokens=tokens, block_hashes=block_hashes("m", tokens, 16),
                           sampling=SamplingParams(max_tokens=8, ignore_eos=True), reply_subject=subjects.reply(rid),
                           arrival_ts=time.time())
    events = collect_events(m.nats_url)
    log: EventLog = await anext(events)
    nc = await nats.connect(m.nats_url)
    got: list[TokenChunk] = []
    done = asyncio.Event()

    async def on_reply(msg: nats.aio.msg.Msg) -> None:
        ev = decode(msg.data, ResponseEvent)
        if isinstance(ev, TokenChunk):
            got.append(ev)
            if ev.finish_reason:
                done.set()

    await nc.subscribe(req.reply_subject, cb=on_reply)
    replies = await asyncio.gather(*(nc.request(subjects.sched_submit(s), encode(req), timeout=10)
                                     for s in ("sched-0", "sched-1")))
    assert all(decode(r.data, SubmitReply).placement is not None for r in replies)
    await asyncio.wait_for(done.wait(), 30)
    await asyncio.sleep(1.0)  # a second run would have streamed by now
    assert TOK.decode([t for c in sorted(got, key=lambda c: c.index) for t in c.token_ids]) == expected_text(prompt, 8)
    assert len({c.worker_id for c in got}) == 1 and sum(bool(c.finish_reason) for c in got) == 1
    assert len([e for e in log.for_request(rid) if e.kind == "accepted"]) == 1
    assert len([e for e in log.for_request(rid) if e.kind == "duplicate_placement"]) == 1
    assert await asyncio.to_thread(bad_input, m, "duplicate_placement") == before + 1
    await nc.close()
    with contextlib.suppress(StopAsyncIteration):
        await events.aclose()


async def test_worker_back_from_a_partition_serves_nothing_twice(mesh2: tuple[Mesh, str]) -> None:
    """A worker silent past the heartbeat timeout (SIGSTOP: cut off, its process intact) is counted lost and its
    stream moves to the other worker; back with the same run, it rejoins ("rejoined", not "joined") and is told
    to drop the moved request's old attempt (it would decode it to the end for nobody), and what it streamed for
    that attempt meanwhile is dropped by the gateway: the client gets the text once."""
    m, _ = mesh2
    events = collect_events(m.nats_url)
    log: EventLog = await anext(events)
    prompt, n = "cut off mid-stream", 40
    t0 = time.time()
    s = await client(m.url).completions.create(model="m", prompt=prompt, max_tokens=n, stream=True,
                                               extra_body={"ignore_eos": True})
    chunks = aiter(s)
    text = [(await anext(chunks)).choices[0].text]
    placed = [e for e in log.events if e.service == "gateway" and e.kind == "placed" and e.ts >= t0]
    assert len(placed) == 1
    rid, wid = placed[0].request_id, str(placed[0].detail["decode_worker"])
    proc = m.services[f"worker:{wid}"].proc
    assert proc is not None
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        await log.wait_for(rid, "migrated", timeout_s=10)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    await log.wait_for(rid, "aborted", timeout_s=5, worker_id=wid)  # long before its 40 tokens would be done
    text += [ch.choices[0].text async for ch in chunks if ch.choices]
    assert "".join(text) == expected_text(prompt, n)
    back = [e for e in log.events if e.kind == "worker_joined" and e.detail.get("worker_id") == wid and e.ts > t0]
    assert back and {e.detail["how"] for e in back} == {"rejoined"}
    with contextlib.suppress(StopAsyncIteration):
        await events.aclose()


async def test_a_stream_no_request_waits_for_is_dropped_and_counted(mesh2: tuple[Mesh, str]) -> None:
    """Chunks on a gateway's reply subject for an attempt it no longer reads (a worker back from a partition,
    still streaming an attempt that was re-placed) reach no client and are counted."""
    m, url_b = mesh2

    def stray() -> float:
        return scrape(f"{url_b}/metrics").get(("hetmesh_gateway_stray_replies_total", ()), 0.0)

    before = await asyncio.to_thread(stray)
    nc = await nats.connect(m.nats_url)
    chunk = TokenChunk(request_id="gone", worker_id="h100-0", index=3, token_ids=[104], text="h")
    await nc.publish(subjects.reply_to("gwb", "gone-0"), encode(chunk))
    await nc.flush()
    await nc.close()
    for _ in range(50):
        if await asyncio.to_thread(stray) == before + 1:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"stray replies {await asyncio.to_thread(stray)}, expected {before + 1}")

async def test_scheduler_killed_among_two_loses_nothing(mesh2: tuple[Mesh, str]) -> None:
    m, url_b = mesh2
    await schedulers_beating(m.nats_url, {"sched-0", "sched-1"})
    clients = [client(m.url), client(url_b)]
    events = collect_events(m.nats_url)
    log: EventLog = await anext(events)
    n, gate, done = 40, asyncio.Semaphore(8), asyncio.Event()
    finished = 0

    async def one(i: int) -> None:
        nonlocal finished
        async with gate:
            prompt = f"steady load {i}"
            assert await streamed(clients[i % 2], prompt, 8) == expected_text(prompt, 8), i
            finished += 1
            if finished == n // 4:
                done.set()

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    await asyncio.wait_for(done.wait(), 60)
    killed = time.time()
    m.kill("scheduler")
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
    assert not [r for r in results if isinstance(r, BaseException)], results
    # placements went on: the gateways' first placement after the kill came soon after it
    after = sorted(e.ts for e in log.events if e.service == "gateway" and e.kind == "placed" and e.ts > killed)
    assert after, "no placement after the kill"
    print(f"first placement {after[0] - killed:.3f}s after the kill; submits sent again: "
          f"{sum(e.kind == 'scheduler_lost' for e in log.events)}")
    assert after[0] - killed < 5.0
    with contextlib.suppress(StopAsyncIteration):
        await events.aclose()


async def wait_load(nats_url: str, done: Callable[[int], bool], timeout_s: float) -> None:
    """Until `done(requests the workers hold)`, by their heartbeats (running + queued, every worker heard)."""
    nc = await nats.connect(nats_url)
    sub = await nc.subscribe(subjects.HEARTBEAT_ALL)
    got: dict[str, int] = {}
    try:
        async with asyncio.timeout(timeout_s):
            while len(got) < 2 or not done(sum(got.values())):
                hb = decode((await sub.next_msg(timeout=timeout_s)).data, Heartbeat)
                got[hb.worker_id] = hb.running + hb.queue_depth
    finally:
        await nc.close()


async def test_gateway_stopped_for_a_while_keeps_its_streams(mesh2: tuple[Mesh, str]) -> None:
    """A gateway silent for 3 heartbeat timeouts (SIGSTOP: an event loop running late) still holds its reply
    subscription, so the workers keep its requests, and its clients get their whole streams."""
    m, url_b = mesh2
    b = client(url_b)
    streams = [asyncio.create_task(streamed(b, f"paused gateway's stream {i}", 40)) for i in range(2)]
    await wait_load(m.nats_url, lambda held: held >= 2, 30)
    gw = m.services["gateway-b"].proc
    assert gw is not None
    os.kill(gw.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(3 * HEARTBEAT_TIMEOUT_S)
        await wait_load(m.nats_url, lambda held: held >= 2, 10)  # still held: not cancelled
    finally:
        os.kill(gw.pid, signal.SIGCONT)
    for i, t in enumerate(streams):
        assert await asyncio.wait_for(t, 60) == expected_text(f"paused gateway's stream {i}", 40)


async def test_gateway_killed_its_work_is_cancelled_others_go_on(mesh2: tuple[Mesh, str]) -> None:
    m, url_b = mesh2
    a, b = client(m.url), client(url_b)
    keep = asyncio.create_task(streamed(a, "gateway a's stream", 60))
    doomed = [asyncio.create_task(streamed(b, f"gateway b's stream {i}", 60)) for i in range(3)]
    await wait_load(m.nats_url, lambda held: held >= 4, 30)
    m.kill("gateway-b")
    killed = time.monotonic()
    for t in doomed:  # its clients' connections break
        with pytest.raises(openai.APIError):
            await asyncio.wait_for(t, 30)
    await wait_load(m.nats_url, lambda held: held <= 1, 15)  # the workers cancel its three; gateway a's goes on
    print(f"the dead gateway's work cancelled on the workers {time.monotonic() - killed:.2f}s after the kill")
    assert not keep.done()  # still streaming: it would not have ended by now on its own
    assert await asyncio.wait_for(keep, 60) == expected_text("gateway a's stream", 60)


async def test_submit_goes_to_another_scheduler_when_its_own_dies(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    loop = asyncio.get_running_loop()
    watch = Schedulers(timeout_s=0.6, check_s=0.1)
    now = loop.time()
    watch.heard("dead", now)
    answered: list[str] = []

    async def dead_one(msg: object) -> None:  # takes the request and never answers (killed mid-placement)
        answered.append("dead took it")

    async def live_one(msg: nats.aio.msg.Msg) -> None:
        answered.append("live answered")
        await msg.respond(b"placed")

    await nc.subscribe(subjects.sched_submit("dead"), cb=dead_one)
    await nc.subscribe(subjects.sched_submit("live"), cb=live_one)
    lost: list[str] = []

    async def send(subject: str) -> bytes:
        return (await nc.request(subject, b"req", timeout=10)).data

    async def beats() -> None:  # only the live one beats on
        while True:
            watch.heard("live", loop.time())
            await asyncio.sleep(0.1)

    beat = asyncio.create_task(beats())
    watch._rng.choice = lambda xs: "dead" if "dead" in xs else xs[0]  # type: ignore[method-assign]
    t0 = loop.time()
    assert await send_via(watch, send, lost) == b"placed"
    assert lost == ["dead"] and answered == ["dead took it", "live answered"]
    assert loop.time() - t0 < 5.0
    beat.cancel()
    await nc.close()


async def send_via(watch: Schedulers, send: object, lost: list[str]) -> bytes:
    return await watch.submit(send, lambda: True, lost.append)  # type: ignore[arg-type]


async def test_submit_sent_again_when_its_scheduler_reconnected(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    loop = asyncio.get_running_loop()
    watch = Schedulers(timeout_s=5.0, check_s=0.05)
    epoch = [b"0"]
    got: list[bytes] = []

    async def scheduler(msg: nats.aio.msg.Msg) -> None:  # the first copy is lost in its bus gap
        got.append(msg.data)
        if len(got) > 1:
            await msg.respond(b"placed")

    await nc.subscribe(subjects.sched_submit("s"), cb=scheduler)

    async def beats() -> None:
        while True:
            watch.heard("s", loop.time(), epoch[0])
            await asyncio.sleep(0.05)

    watch.heard("s", loop.time(), epoch[0])
    beat = asyncio.create_task(beats())

    async def send(subject: str) -> bytes:
        return (await nc.request(subject, b"req", timeout=10)).data

    async def reconnect_soon() -> None:
        await asyncio.sleep(0.3)
        epoch[0] = b"1"

    gap = asyncio.create_task(reconnect_soon())
    assert await watch.submit(send, lambda: True, lambda _s: None) == b"placed"
    assert len(got) == 2 and watch.resent == 1 and watch.lost == 0
    beat.cancel()
    await gap
    await nc.close()

