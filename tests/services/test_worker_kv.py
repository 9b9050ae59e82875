"""Worker and kv-transfer processes against a real nats-server, driven like the scheduler drives them.

The test publishes WorkItems straight to the workers' subjects and reads what the services
put on the wire: token chunks, heartbeats, KV events, Finished, and their ServiceEvents.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from tests.clusters import cluster_toml, group, model
from tests.kvpeer import answer_to

from hetmesh import kvstream, servers, subjects
from hetmesh.bus import decode_events, encode
from hetmesh.costmodel import CostModel, accelerator, model_spec
from hetmesh.engines.sampling import expected_completion
from hetmesh.kvindex.blocks import block_hashes
from hetmesh.protocol import (
    Cancel,
    Finished,
    Heartbeat,
    InferenceRequest,
    KvEvent,
    KvTransferDone,
    KvTransferRequest,
    Phase,
    Placement,
    RequestError,
    ResponseEvent,
    SamplingParams,
    ServiceEvent,
    TokenChunk,
    WorkItem,
)
from hetmesh.tokenizer import ByteTokenizer
from hetmesh.workqueue import MSG_ID, msg_id

TOK = ByteTokenizer()
MODEL = "tiny"
BS = 16
KV_LANDED_TIMEOUT_S = 2.0
KV_SECRET = "kv-secret-for-the-test"  # the direct mesh's; the relay mesh has none

CLUSTER = cluster_toml(
    mesh={"time_scale": 1.0, "heartbeat_interval_s": 0.2},
    work_queue={"ack_wait_s": 1.0},  # short: the redelivery test waits for one
    models=[model(MODEL, spec="tiny-llama", block_size=BS)],
    workers=[group("agg", MODEL, "nvidia-h100", role="both"),
             group("pre", MODEL, "nvidia-rubin-cpx", role="prefill"),
             group("dec", MODEL, "nvidia-rubin-vr200", role="decode"),
             group("spare", MODEL, "amd-mi300x", role="both"),
             group("late", MODEL, "nvidia-a100-80g", role="both")])

WORKERS = {"agg-0": ("both", "nvidia", "nvidia-h100"), "pre-0": ("prefill", "nvidia", "nvidia-rubin-cpx"),
           "dec-0": ("decode", "nvidia", "nvidia-rubin-vr200"), "spare-0": ("both", "amd", "amd-mi300x")}
LATE = "late-0"  # not started with the others: work waits in the queue for it


def direct(worker_id: str) -> str:
    if worker_id == LATE:
        return subjects.work_direct("both", "nvidia", "nvidia-a100-80g", LATE)
    return subjects.work_direct(*WORKERS[worker_id], worker_id)


class Mesh:
    def __init__(self, nats_url: str, cluster: Path, logs: Path, **env: str) -> None:
        self.env = env
        self.nats_url = nats_url
        self.cluster = cluster
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        env = servers.env_with(HETMESH_NATS_URL=self.nats_url,
                               HETMESH_KV_LANDED_TIMEOUT_S=str(KV_LANDED_TIMEOUT_S), **self.env)
        out = open(self.logs / f"{name}.log", "wb")  # the child process writes it
        p = subprocess.Popen([sys.executable, "-m", *args, "--cluster", str(self.cluster)], env=env, stdout=out,
                             stderr=subprocess.STDOUT)
        self.procs[name] = p
        return p

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _run_mesh(d: Path, cluster: str, workers: list[str], **env: str) -> Iterator[Mesh]:
    nats_srv = servers.start_nats()
    (d / "cluster.toml").write_text(cluster)
    m = Mesh(nats_srv.url, d / "cluster.toml", d, **env)
    try:
        m.spawn("kv-transfer", "hetmesh.kv_transfer", "--instance", "kvx-test")
        for wid in workers:
            m.spawn(wid, "hetmesh.worker", "--worker-id", wid)
        yield m
    finally:
        m.stop()
        for f in sorted(d.glob("*.log")):
            print(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-20:]))
        nats_srv.stop()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The default data plane: KV streams straight from the prefill worker into the decode worker's KV port."""
    yield from _run_mesh(tmp_path_factory.mktemp("worker-kv"), CLUSTER, list(WORKERS), HETMESH_KV_SECRET=KV_SECRET)


@pytest.fixture(scope="module")
def relay_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The NATS relay data plane, for workers that reach the bus but not each other."""
    yield from _run_mesh(tmp_path_factory.mktemp("worker-kv-relay"), CLUSTER + '\n[kv_transfer]\ndata_plane = "nats"\n',
                         ["pre-0", "dec-0"])


class Tap:
    """Everything the mesh publishes on a few wildcard subjects, decoded."""

    def __init__(self) -> None:
        self.heartbeats: list[Heartbeat] = []
        self.kv_events: list[KvEvent] = []
        self.events: list[ServiceEvent] = []
        self.finished: list[Finished] = []
        self.replies: dict[str, list[Any]] = {}
        self.kv_recv_bytes: dict[str, int] = {}

    async def until(self, pred: Callable[[], Any], timeout_s: float = 15.0) -> Any:
        async with asyncio.timeout(timeout_s):
            while True:
                if v := pred():
                    return v
                await asyncio.sleep(0.01)

    def event(self, rid: str, kind: str) -> ServiceEvent | None:
        return next((e for e in self.events if e.request_id == rid and e.kind == kind), None)


@pytest.fixture(scope="module")
async def tap(mesh: Mesh) -> AsyncIterator[tuple[Tap, nats.NATS]]:
    async for t in _tap(mesh):
        yield t


@pytest.fixture(scope="module")
async def relay_tap(relay_mesh: Mesh) -> AsyncIterator[tuple[Tap, nats.NATS]]:
    async for t in _tap(relay_mesh):
        yield t


async def _tap(mesh: Mesh) -> AsyncIterator[tuple[Tap, nats.NATS]]:
    nc = await nats.connect(mesh.nats_url)
    t = Tap()
    dec = {k: msgspec.json.Decoder(k) for k in (Heartbeat, KvEvent, ServiceEvent, Finished)}
    resp = msgspec.json.Decoder(ResponseEvent)
    finished_dec = msgspec.json.Decoder(list[Finished])

    def sink(lst: list[Any], kind: Any) -> Callable[[Any], Any]:
        async def cb(m: Any) -> None:
            if kind is ServiceEvent:  # event messages carry a batch
                lst.extend(decode_events(m.data))
            elif kind is Finished:  # so do Finished messages
                lst.extend(finished_dec.decode(m.data))
            else:
                lst.append(dec[kind].decode(m.data))
        return cb

    async def on_resp(m: Any) -> None:
        t.replies.setdefault(m.subject, []).append(resp.decode(m.data))

    async def on_recv(m: Any) -> None:
        tid = m.headers["Kv-Transfer"]
        t.kv_recv_bytes[tid] = t.kv_recv_bytes.get(tid, 0) + len(m.data)

    await nc.subscribe(subjects.HEARTBEAT_ALL, cb=sink(t.heartbeats, Heartbeat))
    await nc.subscribe(subjects.KV_EVENTS_ALL, cb=sink(t.kv_events, KvEvent))
    await nc.subscribe(subjects.EVENTS_ALL, cb=sink(t.events, ServiceEvent))
    await nc.subscribe(subjects.FINISHED, cb=sink(t.finished, Finished))
    await nc.subscribe(f"{subjects.PREFIX}.resp.>", cb=on_resp)
    await nc.subscribe(subjects.kv_recv("dec-0"), cb=on_recv)
    await nc.flush()
    # Every worker up (heartbeating) and kv-transfer answering before any test runs.
    await t.until(lambda: {h.worker_id for h in t.heartbeats} >= {w for w in WORKERS if w in mesh.procs},
                  timeout_s=60)
    async with asyncio.timeout(60):
        while True:
            try:
                await nc.request(subjects.KV_TRANSFER, b"{}", timeout=1)  # answered with an error body
                break
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                await asyncio.sleep(0.1)
    yield t, nc
    await nc.close()


def make_item(prompt: str, max_tokens: int, phase: Phase = Phase.FULL, decode_worker: str = "agg-0",
              prefill_worker: str | None = None, kv_endpoint: str = "", **sampling: Any) -> WorkItem:
    rid = uuid.uuid4().hex[:12]
    toks = TOK.encode(prompt)
    sp = SamplingParams(max_tokens=max_tokens, **sampling)
    req = InferenceRequest(request_id=rid, model=MODEL, prompt_tokens=toks, block_hashes=block_hashes(MODEL, toks, BS),
                           sampling=sp, reply_subject=subjects.reply(rid), arrival_ts=0.0)
    mode = "disaggregated" if prefill_worker else "aggregated"
    return WorkItem(request=req, phase=phase, placement=Placement(mode=mode, decode_worker=decode_worker,
                                                                  prefill_worker=prefill_worker,
                                                                  decode_kv_endpoint=kv_endpoint))


def chunks_of(t: Tap, item: WorkItem) -> list[Any]:
    return t.replies.get(item.request.reply_subject, [])


def final(t: Tap, item: WorkItem) -> TokenChunk | RequestError | None:
    return next((c for c in chunks_of(t, item) if isinstance(c, RequestError)
                 or (isinstance(c, TokenChunk) and c.finish_reason)), None)


def text_of(t: Tap, item: WorkItem) -> tuple[list[int], str]:
    cs = sorted((c for c in chunks_of(t, item) if isinstance(c, TokenChunk)), key=lambda c: c.index)
    ids = [i for c in cs for i in c.token_ids]
    assert [c.index for c in cs] == [sum(len(x.token_ids) for x in cs[:k]) for k in range(len(cs))]
    return ids, "".join(c.text for c in cs)


def expected(item: WorkItem) -> tuple[list[int], str, str]:
    return expected_completion(TOK, item.request.prompt_tokens, item.request.sampling)


async def test_heartbeats_advertise_direct_subjects(tap: tuple[Tap, nats.NATS]) -> None:
    t, _ = tap
    for wid, (role, _vendor, accel) in WORKERS.items():
        hb = next(h for h in t.heartbeats if h.worker_id == wid)
        assert hb.work_subject == direct(wid)
        assert hb.role == role and hb.accelerator == accel and hb.model == MODEL and hb.engine == "sim"
        assert hb.kv_blocks_total > 0 and hb.block_size == BS and hb.max_batch == 64
    # A fresh worker tells the index to forget what an earlier incarnation held.
    assert {e.worker_id for e in t.kv_events if e.cleared} >= set(WORKERS)


async def test_full_request_streams_expected_text_and_usage(tap: tuple[Tap, nats.NATS]) -> None:
    t, nc = tap
    item = make_item("Tell me a story about a mesh of accelerators.", 60, seed=3)
    await nc.publish(direct("agg-0"), encode(item))
    last = await t.until(lambda: final(t, item))
    ids, text, finish = expected(item)
    assert isinstance(last, TokenChunk) and last.worker_id == "agg-0"
    assert text_of(t, item) == (ids, text)
    assert last.finish_reason == finish
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(item.request.prompt_tokens), len(ids))
    done = await t.until(lambda: next((f for f in t.finished if f.request_id == item.request.request_id), None))
    assert done.worker_id == "agg-0" and done.completion_tokens == len(ids) and done.finish_reason == finish
    assert (await t.until(lambda: t.event(item.request.request_id, "decode_done"))).detail["phase"] == "full"


async def test_stop_string_and_pool_subject(tap: tuple[Tap, nats.NATS]) -> None:
    t, nc = tap
    probe = make_item("Once upon a time", 60, seed=11, ignore_eos=True)
    _, full, _ = expected(probe)
    stop = full[20:23]
    item = make_item("Once upon a time", 60, seed=11, ignore_eos=True, stop=[stop])
    # The pool subject (queue group): the only `both` H100 takes it.
    await nc.publish(subjects.work_pool("both", "nvidia", "nvidia-h100"), encode(item))
    last = await t.until(lambda: final(t, item))
    assert isinstance(last, TokenChunk) and last.finish_reason == "stop" and last.worker_id == "agg-0"
    assert text_of(t, item)[1] == full[: full.index(stop)] == expected(item)[1]


async def test_repeated_prefix_hits_cache_and_emits_kv_events(tap: tuple[Tap, nats.NATS]) -> None:
    t, nc = tap
    shared = "You are a careful assistant who answers briefly. " * 6  # 300 bytes: 18 full blocks
    a = make_item(shared + "first question", 4)
    await nc.publish(direct("agg-0"), encode(a))
    assert isinstance(await t.until(lambda: final(t, a)), TokenChunk)
    hashes = set(a.request.block_hashes)
    stored = await t.until(lambda: hashes <= {h for e in t.kv_events if e.worker_id == "agg-0" for h in e.stored})
    assert stored
    b = make_item(shared + "second question", 4)
    shared_blocks = len(set(b.request.block_hashes) & hashes)
    assert shared_blocks == len(shared) // BS
    await nc.publish(direct("agg-0"), encode(b))
    last = await t.until(lambda: final(t, b))
    assert isinstance(last, TokenChunk) and last.usage is not None
    assert last.usage.cached_tokens == shared_blocks * BS
    assert text_of(t, b)[1] == expected(b)[1]  # a cache hit changes the time, not the text
    hb = await t.until(lambda: next((h for h in reversed(t.heartbeats)
                                     if h.worker_id == "agg-0" and h.prompt_tokens_cached >= shared_blocks * BS), None))
    assert hb.prompt_tokens_computed > 0


async def test_cancel_stops_the_engine(tap: tuple[Tap, nats.NATS]) -> None:
    t, nc = tap
    item = make_item("a very long story", 3000, ignore_eos=True)  # ~12 s of simulated H100 time at scale 1
    rid = item.request.request_id
    await nc.publish(direct("agg-0"), encode(item))
    await t.until(lambda: chunks_of(t, item))
    await nc.publish(subjects.CANCEL, encode(Cancel(request_id=rid)))
    aborted = await t.until(lambda: t.event(rid, "aborted"))
    assert aborted.detail["worker_id"] == "agg-0"
    assert 0 < int(aborted.detail["completion_tokens"]) < 3000  # type: ignore[arg-type]
    done = await t.until(lambda: next((f for f in t.finished if f.request_id == rid), None))
    assert done.finish_reason == "abort"
    await t.until(lambda: any(h.worker_id == "agg-0" and h.aborted >= 1 and h.running == 0 for h in t.heartbeats))
    # The engine really stopped: the stream ended without a final chunk, and after the abort
    # the worker's token counter stands still across later heartbeats.
    assert final(t, item) is None
    n = len(t.heartbeats)
    await t.until(lambda: sum(h.worker_id == "agg-0" for h in t.heartbeats[n:]) >= 2)
    counts = {h.tokens_generated for h in t.heartbeats[n:] if h.worker_id == "agg-0"}
    assert len(counts) == 1


async def test_misrouted_work_item_gets_a_retryable_error(tap: tuple[Tap, nats.NATS]) -> None:
    t, nc = tap
    item = make_item("wrong model", 5)
    item.request.model = "some-other-model"
    await nc.publish(direct("agg-0"), encode(item))
    err = await t.until(lambda: final(t, item))
    assert isinstance(err, RequestError) and err.retryable and err.error.code == "misrouted"


async def test_cancel_that_beats_its_work_item(tap: tuple[Tap, nats.NATS]) -> None:
    t, nc = tap
    item = make_item("cancelled before it arrived", 50)
    rid = item.request.request_id
    await nc.publish(subjects.CANCEL, encode(Cancel(request_id=rid)))
    await nc.publish(direct("agg-0"), encode(item))
    aborted = await t.until(lambda: t.event(rid, "aborted"))
    assert aborted.detail["before_start"] is True and aborted.detail["worker_id"] == "agg-0"
    done = await t.until(lambda: next((f for f in t.finished if f.request_id == rid), None))
    assert done.finish_reason == "abort" and final(t, item) is None


async def _disaggregated(t: Tap, nc: nats.NATS, kv_endpoint: str = ""
                         ) -> tuple[WorkItem, ServiceEvent, ServiceEvent, ServiceEvent, int]:
    """One P/D request end to end (the placement carrying `kv_endpoint`, as the scheduler's does, or not, as
    an older scheduler's); returns it with its kv_sent, kv_transferred and kv_landed events and the KV size
    the cost model gives it."""
    # ~1.3k tokens: 1.3 MB of tiny-llama KV, more than one NATS message (max_payload 1 MiB) can carry.
    prompt = "a disaggregated request travels across two accelerators " * 23
    pre = make_item(prompt, 30, Phase.PREFILL, decode_worker="dec-0", prefill_worker="pre-0", seed=5,
                    kv_endpoint=kv_endpoint)
    dec = WorkItem(request=pre.request, phase=Phase.DECODE, placement=pre.placement)
    rid = pre.request.request_id
    # As the scheduler does: both halves at once, decode first so it can reserve.
    await nc.publish(direct("dec-0"), encode(dec))
    await nc.publish(direct("pre-0"), encode(pre))
    last = await t.until(lambda: final(t, pre))
    ids, text, finish = expected(pre)
    assert isinstance(last, TokenChunk) and last.worker_id == "dec-0" and last.finish_reason == finish
    assert text_of(t, pre) == (ids, text)
    first = next(c for c in chunks_of(t, pre) if isinstance(c, TokenChunk) and c.index == 0)
    assert first.worker_id == "pre-0" and first.finish_reason is None and len(first.token_ids) == 1
    assert last.usage is not None and last.usage.completion_tokens == len(ids)
    assert last.usage.prompt_tokens == len(pre.request.prompt_tokens)

    prefill = await t.until(lambda: t.event(rid, "prefill_done"))
    sent = await t.until(lambda: t.event(rid, "kv_sent"))
    moved = await t.until(lambda: t.event(rid, "kv_transferred"))
    landed = await t.until(lambda: t.event(rid, "kv_landed"))
    done = await t.until(lambda: t.event(rid, "decode_done"))
    nbytes = CostModel(accelerator("nvidia-rubin-cpx"), model_spec("tiny-llama")).kv_bytes_per_token() * len(
        pre.request.prompt_tokens)
    assert prefill.service == "worker" and prefill.detail["worker_id"] == "pre-0"
    assert sent.detail["worker_id"] == "pre-0" and sent.detail["nbytes"] == nbytes
    assert moved.service == "kv-transfer" and moved.detail["src"] == "pre-0" and moved.detail["dst"] == "dec-0"
    assert moved.detail["nbytes"] == nbytes and moved.detail["ok"] is True
    assert landed.detail["worker_id"] == "dec-0" and landed.detail["bytes_received"] == nbytes
    assert done.detail["worker_id"] == "dec-0" and done.detail["completion_tokens"] == len(ids)
    assert prefill.ts <= landed.ts <= done.ts
    fin = await t.until(lambda: {f.worker_id for f in t.finished if f.request_id == rid} >= {"pre-0", "dec-0"})
    assert fin
    return pre, sent, moved, landed, nbytes


async def test_disaggregated_kv_streams_straight_to_the_decode_worker(tap: tuple[Tap, nats.NATS]) -> None:
    t, nc = tap
    _, sent, moved, landed, _ = await _disaggregated(t, nc)
    # kv-transfer named dec-0's KV port (from its heartbeats) and kept the record; no byte crossed NATS.
    hb = next(h for h in t.heartbeats if h.worker_id == "dec-0")
    assert hb.kv_endpoint.startswith("127.0.0.1:")
    assert not next(h for h in t.heartbeats if h.worker_id == "pre-0").kv_endpoint  # prefill-only: no port
    assert sent.detail["direct"] is True and moved.detail["direct"] is True
    assert moved.detail["chunks"] == sent.detail["chunks"] == landed.detail["chunks"] == 1
    assert str(moved.detail["transfer_id"]) not in t.kv_recv_bytes


async def test_kv_endpoint_in_the_placement_streams_without_asking(tap: tuple[Tap, nats.NATS]) -> None:
    """The scheduler puts the decode worker's KV port in the placement: the prefill worker streams there at
    once and only tells kv-transfer (a notice, no reply expected), which still keeps the record."""
    t, nc = tap
    seen: list[tuple[str, KvTransferRequest]] = []  # what reached kv-transfer's subject: (reply subject, body)
    dec = msgspec.json.Decoder(KvTransferRequest)

    async def on_transfer(m: Any) -> None:
        with contextlib.suppress(msgspec.DecodeError):
            seen.append((m.reply, dec.decode(m.data)))

    sub = await nc.subscribe(subjects.KV_TRANSFER, cb=on_transfer)
    try:
        endpoint = next(h for h in t.heartbeats if h.worker_id == "dec-0").kv_endpoint
        pre, sent, moved, landed, nbytes = await _disaggregated(t, nc, kv_endpoint=endpoint)
    finally:
        await sub.unsubscribe()
    mine = [(reply, r) for reply, r in seen if r.request_id == pre.request.request_id]
    assert len(mine) == 1
    reply, notice = mine[0]
    assert reply == "" and notice.endpoint == endpoint  # told, not asked
    assert sent.detail["direct"] is True and landed.detail["bytes_received"] == nbytes
    assert moved.detail["direct"] is True and moved.detail["ok"] is True and moved.detail["nbytes"] == nbytes
    assert moved.detail["transfer_id"] == sent.detail["transfer_id"] == notice.transfer_id


async def test_kv_transfer_records_a_stream_whose_outcome_overtook_its_notice(tap: tuple[Tap, nats.NATS]) -> None:
    """Notice and outcome reach kv-transfer on two subscriptions, so it may handle the outcome first: the
    record still closes at once with it, not as a failure after the idle timeout."""
    t, nc = tap
    rid = uuid.uuid4().hex[:12]
    notice = KvTransferRequest(transfer_id=f"{rid}.x", request_id=rid, model=MODEL, src_worker="pre-0",
                               dst_worker="dec-0", num_tokens=10, nbytes=4096, chunk_bytes=0, first_token_ids=[1],
                               endpoint="127.0.0.1:9")
    await nc.publish(subjects.KV_DONE, encode(KvTransferDone(transfer_id=notice.transfer_id, request_id=rid,
                                                             nbytes=4096, duration_s=0.001)))
    await nc.flush()
    await asyncio.sleep(0.2)
    await nc.publish(subjects.KV_TRANSFER, encode(notice))
    moved = await t.until(lambda: t.event(rid, "kv_transferred"), timeout_s=5)
    assert moved.detail["ok"] is True and moved.detail["direct"] is True and moved.detail["nbytes"] == 4096


async def test_wrong_kv_endpoint_in_the_placement_fails_over_to_a_local_prefill(tap: tuple[Tap, nats.NATS]) -> None:
    """A placement naming another worker's KV port (e.g. a stale one): that port refuses the stream, the
    prefill worker says so at once, and the decode worker prefills itself without waiting for its timeout."""
    t, nc = tap
    wrong = next(h for h in t.heartbeats if h.worker_id == "agg-0").kv_endpoint
    pre = make_item("a stale endpoint " * 10, 8, Phase.PREFILL, decode_worker="dec-0", prefill_worker="pre-0",
                    kv_endpoint=wrong)
    rid = pre.request.request_id
    await nc.publish(direct("dec-0"), encode(WorkItem(request=pre.request, phase=Phase.DECODE,
                                                      placement=pre.placement)))
    await nc.publish(direct("pre-0"), encode(pre))
    last = await t.until(lambda: final(t, pre), timeout_s=KV_LANDED_TIMEOUT_S - 0.5)  # before the decode's timeout
    assert isinstance(last, TokenChunk) and last.worker_id == "dec-0"
    # Both sent the first token (the gateway drops the second copy); the same one, and the rest follows it.
    firsts = [c for c in chunks_of(t, pre) if isinstance(c, TokenChunk) and c.index == 0]
    assert sorted(c.worker_id for c in firsts) == ["dec-0", "pre-0"]
    assert firsts[0].token_ids == firsts[1].token_ids
    rest = sorted((c for c in chunks_of(t, pre) if isinstance(c, TokenChunk) and c.index > 0), key=lambda c: c.index)
    assert firsts[0].text + "".join(c.text for c in rest) == expected(pre)[1]
    failed = await t.until(lambda: t.event(rid, "kv_failed"))
    assert failed.detail["worker_id"] == "pre-0"
    fallback = await t.until(lambda: t.event(rid, "kv_fallback"))
    assert "pre-0 -> dec-0 failed" in str(fallback.detail["reason"]), fallback.detail
    moved = await t.until(lambda: t.event(rid, "kv_transferred"))
    assert moved.detail["ok"] is False and moved.detail["direct"] is True


async def test_disaggregated_kv_relayed_over_nats(relay_tap: tuple[Tap, nats.NATS]) -> None:
    t, nc = relay_tap
    # Under the relay an endpoint in the placement means nothing: the worker asks kv-transfer as ever.
    _, sent, moved, _, nbytes = await _disaggregated(t, nc, kv_endpoint="127.0.0.1:9")
    assert not next(h for h in t.heartbeats if h.worker_id == "dec-0").kv_endpoint
    assert sent.detail["direct"] is False and moved.detail["direct"] is False
    chunk = int(sent.detail["chunk_bytes"])  # type: ignore[arg-type]
    assert nbytes > chunk and moved.detail["chunks"] == sent.detail["chunks"] == -(-nbytes // chunk)
    assert t.kv_recv_bytes[str(moved.detail["transfer_id"])] == nbytes  # the bytes really crossed the wire


def _kv_port(t: Tap, worker_id: str) -> tuple[str, int]:
    return kvstream.split_endpoint(next(h for h in t.heartbeats if h.worker_id == worker_id).kv_endpoint)


async def test_kv_stream_that_breaks_off_makes_the_decode_prefill_locally(tap: tuple[Tap, nats.NATS]) -> None:
    """The prefill worker dies mid-stream (here: a peer that sends half the bytes and hangs up): the decode
    worker does not wait for a timeout, it prefills itself and the completion is still whole."""
    t, nc = tap
    item = make_item("a stream cut in half " * 20, 12, Phase.DECODE, decode_worker="dec-0", prefill_worker="pre-0")
    rid = item.request.request_id
    await nc.publish(direct("dec-0"), encode(item))
    await t.until(lambda: t.event(rid, "accepted"))
    header = KvTransferRequest(transfer_id=f"{rid}.cut", request_id=rid, model=MODEL, src_worker="pre-0",
                               dst_worker="dec-0", num_tokens=len(item.request.prompt_tokens), nbytes=1 << 20,
                               chunk_bytes=0, first_token_ids=[])
    _, writer = await asyncio.open_connection(*_kv_port(t, "dec-0"))
    writer.write(kvstream.frame_header(header, KV_SECRET.encode()) + bytes(1 << 19))
    await writer.drain()
    writer.close()
    last = await t.until(lambda: final(t, item))
    assert isinstance(last, TokenChunk) and last.finish_reason == "length"
    assert text_of(t, item)[1] == expected(item)[1]
    fallback = await t.until(lambda: t.event(rid, "kv_fallback"))
    # The port's own verdict, not the decode's KV timeout ("did not land within ...").
    assert "broke off" in str(fallback.detail["reason"]), fallback.detail


async def test_garbage_on_the_kv_port_is_refused_and_the_worker_serves_on(tap: tuple[Tap, nats.NATS]) -> None:
    t, nc = tap
    host, port = _kv_port(t, "dec-0")
    wrong = KvTransferRequest(transfer_id="x", request_id="x", model=MODEL, src_worker="p", dst_worker="agg-0",
                              num_tokens=1, nbytes=10, chunk_bytes=0, first_token_ids=[])
    right = msgspec.structs.replace(wrong, dst_worker="dec-0")
    key = KV_SECRET.encode()
    # Well-formed frames are told they are refused: for another worker, or (the same frame as a real
    # transfer's) without the cluster's KV secret or with another one.
    refused = (kvstream.frame_header(wrong, key), kvstream.frame_header(right), kvstream.frame_header(right, b"guess"))
    for junk in (b"\xff" * 64, (1 << 31).to_bytes(4, "big"), (5).to_bytes(4, "big") + b"{nope" + bytes(32), *refused):
        answer = await answer_to(host, port, junk, 15)
        assert answer in (b"", kvstream.ACK_REFUSED)  # never an ACK_OK
        assert (answer == kvstream.ACK_REFUSED) == (junk in refused)
    # Still alive: a P/D request through the same port works.
    await _disaggregated(t, nc)


async def test_disaggregated_max_tokens_one_ends_cleanly_on_both_sides(tap: tuple[Tap, nats.NATS]) -> None:
    t, nc = tap
    pre = make_item("just one token please", 1, Phase.PREFILL, decode_worker="dec-0", prefill_worker="pre-0")
    rid = pre.request.request_id
    await nc.publish(direct("dec-0"), encode(WorkItem(request=pre.request, phase=Phase.DECODE,
                                                      placement=pre.placement)))
    await nc.publish(direct("pre-0"), encode(pre))
    last = await t.until(lambda: final(t, pre))
    assert isinstance(last, TokenChunk) and last.worker_id == "pre-0" and last.finish_reason == "length"
    assert last.usage is not None and last.usage.completion_tokens == 1
    assert text_of(t, pre)[1] == expected(pre)[1]
    done = await t.until(lambda: t.event(rid, "decode_done"))
    assert done.detail["worker_id"] == "dec-0" and done.detail["completion_tokens"] == 1
    await t.until(lambda: {f.worker_id for f in t.finished if f.request_id == rid} >= {"pre-0", "dec-0"})
    assert len([c for c in chunks_of(t, pre) if isinstance(c, TokenChunk)]) == 1  # no duplicate final chunk


async def test_newer_attempt_supersedes_a_decode_still_waiting(tap: tuple[Tap, nats.NATS]) -> None:
    """Attempt 0's prefill worker died before sending KV; the gateway resubmits (attempt 1) and the
    scheduler picks the same decode worker: the new attempt must take over, not be ignored."""
    t, nc = tap
    old = make_item("resubmitted after a prefill crash", 12, Phase.DECODE, decode_worker="dec-0",
                    prefill_worker="pre-0", seed=8)
    rid = old.request.request_id
    await nc.publish(direct("dec-0"), encode(old))
    await t.until(lambda: t.event(rid, "accepted"))
    new_req = msgspec.structs.replace(old.request, attempt=1, reply_subject=subjects.reply(f"{rid}-1"))
    pre = WorkItem(request=new_req, phase=Phase.PREFILL, placement=old.placement)
    await nc.publish(direct("dec-0"), encode(WorkItem(request=new_req, phase=Phase.DECODE,
                                                      placement=old.placement)))
    await nc.publish(direct("pre-0"), encode(pre))
    last = await t.until(lambda: final(t, pre))
    assert isinstance(last, TokenChunk) and last.worker_id == "dec-0"
    assert text_of(t, pre)[1] == expected(pre)[1]
    assert chunks_of(t, old) == []  # the old attempt ended quietly: its client had moved on


async def test_decode_whose_kv_never_lands_prefills_locally(tap: tuple[Tap, nats.NATS]) -> None:
    """No KvLanded within the timeout (kv-transfer or the prefill worker died): the decode worker computes
    the prefill itself and the client still gets the whole deterministic completion."""
    t, nc = tap
    item = make_item("orphan decode", 10, Phase.DECODE, decode_worker="dec-0", prefill_worker="pre-0")
    await nc.publish(direct("dec-0"), encode(item))
    last = await t.until(lambda: final(t, item), timeout_s=KV_LANDED_TIMEOUT_S + 10)
    assert isinstance(last, TokenChunk) and last.finish_reason == "length"
    assert text_of(t, item)[1] == expected(item)[1]
    assert t.event(item.request.request_id, "kv_fallback") is not None
    done = await t.until(lambda: next((f for f in t.finished if f.request_id == item.request.request_id), None))
    assert done.finish_reason == "length"


async def test_work_item_waits_in_the_queue_for_a_worker_not_yet_up(mesh: Mesh, tap: tuple[Tap, nats.NATS]) -> None:
    """Published (and acknowledged by the stream) before its worker ever subscribed: not lost, the worker
    takes it when it comes."""
    t, nc = tap
    item = make_item("queued before its worker was up", 8, decode_worker=LATE)
    stored = await nc.jetstream().publish(direct(LATE), encode(item), headers={MSG_ID: msg_id(item)})
    assert stored.stream == subjects.WORK_STREAM
    await asyncio.sleep(0.5)
    assert final(t, item) is None
    mesh.spawn(LATE, "hetmesh.worker", "--worker-id", LATE)
    last = await t.until(lambda: final(t, item), timeout_s=60)
    assert isinstance(last, TokenChunk) and last.worker_id == LATE
    assert text_of(t, item)[1] == expected(item)[1]


async def test_duplicate_and_redelivered_work_items_run_once(mesh: Mesh, tap: tuple[Tap, nats.NATS]) -> None:
    """The same item published twice with its dedup id is stored once; delivered to a worker that does not
    ack in time (stopped) it is delivered again; published once more under another id the stream cannot
    tell apart. The worker runs it once and acks and drops every copy."""
    t, nc = tap
    js = nc.jetstream()
    item = make_item("only once, please", 6, decode_worker=LATE)
    rid = item.request.request_id
    consumer = subjects.work_consumer(direct(LATE))
    await t.until(lambda: any(h.worker_id == LATE for h in t.heartbeats), timeout_s=60)
    before = (await js.consumer_info(subjects.WORK_STREAM, consumer)).num_redelivered
    proc = mesh.procs[LATE]
    os.kill(proc.pid, signal.SIGSTOP)  # the delivery sits unread in its socket; ack_wait (1 s) runs out
    try:
        first = await js.publish(direct(LATE), encode(item), headers={MSG_ID: msg_id(item)})
        again = await js.publish(direct(LATE), encode(item), headers={MSG_ID: msg_id(item)})
        assert again.duplicate and again.seq == first.seq
        for _ in range(150):
            if (await js.consumer_info(subjects.WORK_STREAM, consumer)).num_redelivered > before:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("JetStream did not redeliver the unacked item")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    await js.publish(direct(LATE), encode(item), headers={MSG_ID: "another-id"})
    last = await t.until(lambda: final(t, item))
    assert isinstance(last, TokenChunk) and text_of(t, item)[1] == expected(item)[1]
    def dups() -> list[ServiceEvent]:
        return [e for e in t.events if e.request_id == rid and e.kind == "duplicate_work"]

    await t.until(lambda: len(dups()) >= 2)  # the redelivery and the copy under another id
    assert any(int(e.detail["deliveries"]) > 1 for e in dups())  # type: ignore[arg-type]
    await asyncio.sleep(0.5)  # a second run would have shown by now
    assert [e.kind for e in t.events if e.request_id == rid].count("accepted") == 1
    assert len([f for f in t.finished if f.request_id == rid]) == 1
    assert len([c for c in chunks_of(t, item) if isinstance(c, TokenChunk) and c.finish_reason]) == 1
    info = await js.consumer_info(subjects.WORK_STREAM, consumer)
    assert info.num_ack_pending == 0 and info.num_pending == 0  # every copy acked: nothing left to redeliver


async def test_sigterm_finishes_in_flight_then_exits(mesh: Mesh, tap: tuple[Tap, nats.NATS]) -> None:
    t, nc = tap
    item = make_item("finish me before you go", 40, ignore_eos=True)
    await nc.publish(direct("spare-0"), encode(item))
    await t.until(lambda: t.event(item.request.request_id, "accepted"))
    proc = mesh.procs["spare-0"]
    os.kill(proc.pid, signal.SIGTERM)
    last = await t.until(lambda: final(t, item))
    assert isinstance(last, TokenChunk) and last.finish_reason == "length"
    assert text_of(t, item)[1] == expected(item)[1]
    assert await asyncio.to_thread(proc.wait, 15) == 0
