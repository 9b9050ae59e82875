"""One attempt placed by two schedulers in different modes (one aggregated, one prefill/decode), on a real
nats-server with real workers and scheduler processes.

The FULL and the DECODE item of an attempt share one dedup id, so the work queue stores one of them and one
stream reaches the client. When the FULL came first, the P/D placement's PREFILL (its own id) is stored all
the same; its scheduler sees its DECODE answered as a duplicate and withdraws that prefill with Cancels naming
the phase: the prefill stops, and the decode worker drops any KV it shipped; a FULL of the request on the same
worker goes on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from tests.clusters import cluster_toml, group, model
from tests.services.test_worker_kv import (
    KV_SECRET,
    MODEL,
    TOK,
    Mesh,
    Tap,
    _run_mesh,
    _tap,
    chunks_of,
    final,
    text_of,
)

from hetmesh import servers, subjects
from hetmesh.bus import Bus, decode, encode
from hetmesh.config import WorkQueueConfig
from hetmesh.engines.sampling import expected_completion
from hetmesh.kvindex.blocks import block_hashes
from hetmesh.metrics import scrape
from hetmesh.protocol import (
    Cancel,
    Heartbeat,
    InferenceRequest,
    Phase,
    Placement,
    SamplingParams,
    SubmitReply,
    TokenChunk,
    WorkItem,
)
from hetmesh.workqueue import MSG_ID, WorkQueue, msg_id

BS = 16
WORKERS = ("agg-0", "pre-0", "dec-0")
AGG, PD = "sched-agg", "sched-pd"  # least_loaded places on the `both` worker; dynamo splits over pre and dec
# llama-3.1-8b at time_scale 0.05: a 2,000-token prefill takes ~0.6 s on the prefill worker, far longer than
# the withdrawal's Cancel needs to reach it; ~2.5 s aggregated on the H100.
PROMPT = "one attempt, two schedulers, two modes: " * 50
METRICS: dict[str, str] = {}  # each worker's /metrics, once the mesh is up


def cluster(policy: str) -> str:
    return cluster_toml(
        mesh={"time_scale": 0.05, "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0},
        scheduler={"policy": policy}, kv_transfer={"max_wire_bytes": 1 << 20},
        models=[model(MODEL, spec="llama-3.1-8b", block_size=BS, max_context=8192)],
        workers=[group("agg", MODEL, "nvidia-h100", role="both"),
                 group("pre", MODEL, "nvidia-rubin-cpx", role="prefill"),
                 group("dec", MODEL, "nvidia-rubin-vr200", role="decode")])


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Mesh]:
    """kv-transfer and three workers (metrics on known ports), then the two schedulers, each on its own
    cluster file (the same but for the policy)."""
    d = tmp_path_factory.mktemp("mixed-modes")
    runs = _run_mesh(d, cluster("least_loaded"), [], HETMESH_KV_SECRET=KV_SECRET, HETMESH_REDIS_URL=redis_url)
    m = next(runs)
    try:
        for wid in WORKERS:
            port = servers.free_port()
            METRICS[wid] = f"http://127.0.0.1:{port}/metrics"
            m.env["HETMESH_METRICS_PORT"] = str(port)
            m.spawn(wid, "hetmesh.worker", "--worker-id", wid)
        del m.env["HETMESH_METRICS_PORT"]
        for inst, policy in ((AGG, "least_loaded"), (PD, "dynamo")):
            m.cluster = d / f"{inst}.toml"
            m.cluster.write_text(cluster(policy))
            m.spawn(inst, "hetmesh.scheduler", "--instance", inst)
        yield m
    finally:
        runs.close()


@pytest.fixture(scope="module")
async def tap(mesh: Mesh) -> AsyncIterator[tuple[Tap, nats.NATS]]:
    async for t in _tap(mesh):
        await asyncio.sleep(0.6)  # the schedulers' views: every worker's heartbeats
        yield t


def request(rid: str, prompt: str = PROMPT, max_tokens: int = 4) -> InferenceRequest:
    toks = TOK.encode(prompt)
    return InferenceRequest(request_id=rid, model=MODEL, prompt_tokens=toks, block_hashes=block_hashes(MODEL, toks, BS),
                            sampling=SamplingParams(max_tokens=max_tokens, seed=7, ignore_eos=True),
                            reply_subject=subjects.reply(rid), arrival_ts=time.time())


async def submit(nc: nats.NATS, instance: str, req: InferenceRequest) -> Placement:
    async with asyncio.timeout(30):
        while True:
            try:
                reply = decode((await nc.request(subjects.sched_submit(instance), encode(req), timeout=10)).data,
                               SubmitReply)
                break
            except nats.errors.NoRespondersError:  # not subscribed yet
                await asyncio.sleep(0.1)
    assert reply.placement is not None, reply.error
    return reply.placement


def latest(t: Tap, wid: str, after: float) -> Heartbeat | None:
    return next((h for h in reversed(t.heartbeats) if h.worker_id == wid and h.ts > after), None)


def unclaimed_kv(wid: str) -> float:
    return scrape(METRICS[wid])[("hetmesh_worker_kv_landed_unclaimed", ())]


async def nothing_left(t: Tap, nc: nats.NATS, since: float) -> None:
    """No slot, KV block, KV wait, landed KV or queued item left on any worker."""
    def idle() -> bool:
        hbs = [latest(t, w, since) for w in WORKERS]
        return all(h is not None and h.running == h.queue_depth == h.kv_blocks_used == 0 for h in hbs)

    await t.until(idle)
    assert [await asyncio.to_thread(unclaimed_kv, w) for w in WORKERS] == [0, 0, 0]
    js = nc.jetstream()
    for w in WORKERS:
        info = await js.consumer_info(subjects.WORK_STREAM, subjects.work_consumer(
            next(h for h in t.heartbeats if h.worker_id == w).work_subject))
        assert info.num_pending == info.num_ack_pending == 0


def events(t: Tap, rid: str, kind: str, service: str = "worker") -> list[dict[str, object]]:
    return [dict(e.detail) for e in t.events if e.request_id == rid and e.kind == kind and e.service == service]


async def placed_twice(t: Tap, nc: nats.NATS, rid: str, first: str, second: str
                       ) -> tuple[WorkItem, str, list[dict[str, object]]]:
    """`rid` submitted to scheduler `first`, then (placed) to `second`: each places it in its mode. Waits for
    its stream to end and checks its text; returns it, its finish reason and the duplicate_placement events."""
    req = request(rid)
    placed = {s: await submit(nc, s, req) for s in (first, second)}
    assert (placed[AGG].mode, placed[AGG].decode_worker) == ("aggregated", "agg-0")
    assert (placed[PD].mode, placed[PD].prefill_worker, placed[PD].decode_worker) == ("disaggregated", "pre-0",
                                                                                      "dec-0")
    item = WorkItem(request=req, phase=Phase.FULL, placement=placed[AGG])  # its reply subject: the stream's
    last = await t.until(lambda: final(t, item))
    ids, text, finish = expected_completion(TOK, req.prompt_tokens, req.sampling)
    assert isinstance(last, TokenChunk) and last.finish_reason == finish and text_of(t, item) == (ids, text)
    return item, finish, await t.until(lambda: events(t, rid, "duplicate_placement", "scheduler"))


async def test_full_first_then_pd_streams_once_and_the_orphan_prefill_is_withdrawn(
        tap: tuple[Tap, nats.NATS]) -> None:
    t, nc = tap
    rid = "mixed-full-first"
    item, finish, dup = await placed_twice(t, nc, rid, AGG, PD)
    assert {c.worker_id for c in chunks_of(t, item)} == {"agg-0"}  # one stream, the FULL's
    # The DECODE was the duplicate; the PREFILL was stored, and withdrawn before it shipped anything.
    assert [(e["phase"], e["worker_id"]) for e in dup] == [("decode", "dec-0")]
    aborted = await t.until(lambda: events(t, rid, "aborted"))
    assert [(e["worker_id"], e["phase"]) for e in aborted] == [("pre-0", "prefill")]

    def ends() -> dict[str, str]:
        return {f.worker_id: f.finish_reason for f in t.finished if f.request_id == rid}

    await t.until(lambda: len(ends()) == 2)
    assert ends() == {"agg-0": finish, "pre-0": "abort"}
    assert "dec-0" not in [e["worker_id"] for e in events(t, rid, "accepted")]
    assert not events(t, rid, "prefill_done") and not events(t, rid, "kv_sent")
    await nothing_left(t, nc, time.time())


async def test_pd_first_then_full_streams_once_and_withdraws_nothing(tap: tuple[Tap, nats.NATS]) -> None:
    t, nc = tap
    rid = "mixed-pd-first"
    item, _, dup = await placed_twice(t, nc, rid, PD, AGG)
    assert {c.worker_id for c in chunks_of(t, item) if c.index == 0} == {"pre-0"}
    assert {c.worker_id for c in chunks_of(t, item)} == {"pre-0", "dec-0"}  # one stream, the P/D one's
    assert [(e["phase"], e["worker_id"]) for e in dup] == [("full", "agg-0")]
    await asyncio.sleep(0.5)  # a second stream or a Cancel would have shown by now
    assert sorted(str(e["worker_id"]) for e in events(t, rid, "accepted")) == ["dec-0", "pre-0"]
    assert not events(t, rid, "aborted")
    await nothing_left(t, nc, time.time())


async def test_kv_shipped_before_the_withdrawal_is_dropped_by_its_decode_worker(tap: tuple[Tap, nats.NATS]) -> None:
    """The orphan window: a withdrawn prefill that already shipped its KV. The decode worker, which will never
    get the decode item, holds it as landed early (for a decode item still on its way) until the Cancel for its
    decode half says none is coming."""
    t, nc = tap
    req = request("orphan-kv", "short", 2)
    rid = req.request_id
    pre, dec = (next(h for h in reversed(t.heartbeats) if h.worker_id == w) for w in ("pre-0", "dec-0"))
    item = WorkItem(request=req, phase=Phase.PREFILL, placement=Placement(
        mode="disaggregated", decode_worker="dec-0", prefill_worker="pre-0", decode_kv_endpoint=dec.kv_endpoint))
    await nc.jetstream().publish(pre.work_subject, encode(item), headers={MSG_ID: msg_id(item)})
    await t.until(lambda: events(t, rid, "kv_sent"))
    await t.until(lambda: unclaimed_kv("dec-0") == 1)
    await nc.publish(subjects.CANCEL, encode(Cancel(request_id=rid, reason="placed_twice", worker_id="dec-0",
                                                    phase=Phase.DECODE, attempt=req.attempt)))
    await t.until(lambda: unclaimed_kv("dec-0") == 0)


async def test_a_withdrawal_leaves_a_full_of_the_same_request_on_the_same_worker_alone(
        tap: tuple[Tap, nats.NATS]) -> None:
    """A `both` worker holding one placement's FULL gets the other's withdrawal Cancels (its prefill, or its
    decode, was placed there): they name another phase, and the FULL streams on to its end."""
    t, nc = tap
    req = request("full-stays", "a FULL that must not be cancelled", 12)
    rid = req.request_id
    agg = next(h for h in reversed(t.heartbeats) if h.worker_id == "agg-0")
    item = WorkItem(request=req, phase=Phase.FULL, placement=Placement(mode="aggregated", decode_worker="agg-0"))
    await nc.jetstream().publish(agg.work_subject, encode(item), headers={MSG_ID: msg_id(item)})
    await t.until(lambda: chunks_of(t, item))
    for phase in (Phase.PREFILL, Phase.DECODE):
        await nc.publish(subjects.CANCEL, encode(Cancel(request_id=rid, reason="placed_twice", worker_id="agg-0",
                                                        phase=phase, attempt=req.attempt)))
    last = await t.until(lambda: final(t, item))
    ids, text, finish = expected_completion(TOK, req.prompt_tokens, req.sampling)
    assert isinstance(last, TokenChunk) and last.finish_reason == finish and text_of(t, item) == (ids, text)
    assert not events(t, rid, "aborted")


async def test_a_withdrawn_item_no_worker_took_yet_leaves_the_stream(nats_url: str) -> None:
    """A withdrawal also takes the item out of the work queue while it waits there: a worker that is down when its
    Cancel goes out would take it on its return. One taken and acked already is the Cancel's alone."""
    bus = await Bus.connect(nats_url, "test-withdraw")
    try:
        q = WorkQueue(bus, WorkQueueConfig(storage="memory"))
        subject = subjects.work_direct("prefill", "nvidia", "nvidia-rubin-cpx", "withdraw-0")
        q.consumers.append((subject, False))  # its worker is down: nothing subscribed to its deliveries
        await q.ensure()
        req = request("withdrawn")
        item = WorkItem(request=req, phase=Phase.PREFILL, placement=Placement(
            mode="disaggregated", decode_worker="dec-x", prefill_worker="withdraw-0"))
        stored = await q.publish(subject, encode(item), {}, msg_id(item))
        consumer = subjects.work_consumer(subject)
        assert (await q.js.consumer_info(subjects.WORK_STREAM, consumer)).num_pending == 1
        assert await q.withdraw(stored)
        assert (await q.js.consumer_info(subjects.WORK_STREAM, consumer)).num_pending == 0
        assert not await q.withdraw(stored)  # gone: nothing to take
    finally:
        await bus.nc.close()
