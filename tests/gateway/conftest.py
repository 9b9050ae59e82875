"""A real nats-server, a real gateway process, and a scripted peer playing scheduler + worker.

The peer is not the system under test: it answers `SUBMIT` and streams `TokenChunk`s on the
request's reply subject the way the real scheduler and workers do, with the misbehaviour a
test asks for (chosen by a keyword in the prompt). It runs its own event loop in a thread so
that sync tests (httpx, the sync openai client) and async ones can both drive the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
from nats.aio.msg import Msg

from hetmesh import servers, subjects
from hetmesh.bus import Bus
from hetmesh.protocol import (
    Cancel,
    ErrorInfo,
    EventBatch,
    Heartbeat,
    InferenceRequest,
    Placement,
    RequestError,
    Role,
    SchedulerStatus,
    ServiceEvent,
    SubmitReply,
    TokenChunk,
    Usage,
    WorkerLost,
    Working,
)

from ..clusters import cluster_toml, group, model

MAX_CONTEXT = 256


def cluster_text(gateway_extra: str = "", extra: str = "") -> str:
    """The test cluster file, with more `[gateway]` settings and more tables (e.g. `[auth]`) when given (TOML)."""
    return cluster_toml(
        mesh={"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.5, "stall_timeout_s": 1.5, "max_attempts": 2},
        gateway={"submit_timeout_s": 1.0, **tomllib.loads(gateway_extra)},
        models=[model("tiny", tokenizer="byte", max_context=MAX_CONTEXT, block_size=16),
                model("dead", tokenizer="byte", max_context=MAX_CONTEXT)],
        workers=[group("fake", "tiny", "nvidia-h100")],
        extra=extra)


ALPHABET = "abcdefghijklmnopqrstuvwxyz"
CACHED = 16  # cached_tokens the fake worker reports


def text_for(n: int) -> str:
    """What the fake worker generates: a deterministic cycle, so tests know the exact text."""
    return "".join(ALPHABET[i % len(ALPHABET)] for i in range(n))


class FakePeer:
    """Scheduler + worker stand-in. Scenario keywords in the prompt text:
    lost-once, error-retry-once, partial-lost, shuffle, reject, noreply, silent, working, slow, fatal."""

    def __init__(self, nats_url: str, scheduler: bool = True) -> None:
        self.nats_url = nats_url
        self.scheduler = scheduler  # False: only heartbeats, nobody answers SUBMIT
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.submits: list[InferenceRequest] = []
        self.cancels: list[Cancel] = []
        self.events: list[ServiceEvent] = []
        self.submit_headers: dict[str, dict[str, str]] = {}
        self.chunk_size = 4
        self._tasks: set[asyncio.Future[None]] = set()
        self.bus: Bus

    def start(self) -> FakePeer:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(15)
        return self

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._hb.cancel)
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.bus.close(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def _start(self) -> None:
        self.bus = await Bus.connect(self.nats_url, "fake-peer")
        if self.scheduler:
            await self.bus.subscribe(subjects.SUBMIT, InferenceRequest, self._on_submit,
                                     queue=subjects.SCHEDULER_QUEUE)
            await self.bus.nc.subscribe(subjects.SCHED_STATUS, queue=subjects.SCHEDULER_QUEUE, cb=self._on_status)
        await self.bus.subscribe(subjects.CANCEL, Cancel, self._on_cancel)
        await self.bus.subscribe(subjects.EVENTS_ALL, EventBatch, self._on_event)
        await self.bus.nc.flush()
        self._hb = asyncio.ensure_future(self._heartbeats())

    async def _heartbeats(self) -> None:
        while True:
            await self.bus.publish(subjects.heartbeat("fake-0"), Heartbeat(
                worker_id="fake-0", model="tiny", accelerator="nvidia-h100", vendor="nvidia", devices=1,
                role=Role.BOTH, engine="fake", work_subject="unused", queue_depth=0, running=0, max_batch=8,
                kv_blocks_total=100, kv_blocks_used=0, block_size=16, ts=time.time()))
            await asyncio.sleep(0.2)

    async def _on_status(self, m: Msg) -> None:
        await self.bus.respond(m, SchedulerStatus(instance="fake-sched", policy="fake", workers=["fake-0"]))

    async def _on_cancel(self, c: Cancel, _m: object) -> None:
        self.cancels.append(c)

    async def _on_event(self, batch: EventBatch, _m: object) -> None:
        self.events.extend(batch)

    async def _on_submit(self, req: InferenceRequest, m: object) -> None:
        self.submits.append(req)
        self.submit_headers[req.request_id] = dict(m.headers or {})  # type: ignore[attr-defined]
        prompt = bytes(t for t in req.prompt_tokens if t < 256).decode(errors="replace")
        if "noreply" in prompt:
            return
        if "reject" in prompt:
            await self.bus.respond(m, SubmitReply(request_id=req.request_id, error=ErrorInfo(  # type: ignore[arg-type]
                message="too busy", type="server_error", code="no_capacity", status=429)))
            return
        await self.bus.respond(m, SubmitReply(request_id=req.request_id, placement=Placement(  # type: ignore[arg-type]
            mode="aggregated", decode_worker="fake-0", policy="fake")))
        t = asyncio.ensure_future(self._work(req, prompt))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _chunks(self, req: InferenceRequest) -> list[TokenChunk]:
        # A migrated request (continued = k) goes on after its first k tokens, as a real worker does.
        k = req.continued
        n = req.sampling.max_tokens + k
        text = text_for(n)
        out = []
        for start in range(k, n, self.chunk_size):
            piece = text[start:start + self.chunk_size]
            last = start + self.chunk_size >= n
            out.append(TokenChunk(
                request_id=req.request_id, worker_id="fake-0", index=start, token_ids=list(piece.encode()),
                text=piece, finish_reason="length" if last else None,
                usage=Usage(prompt_tokens=len(req.prompt_tokens) - k, completion_tokens=n, cached_tokens=CACHED)
                if last else None))
        return out

    async def _work(self, req: InferenceRequest, prompt: str) -> None:
        rs = req.reply_subject
        rid = req.request_id
        await asyncio.sleep(0.01)
        if "silent" in prompt:
            return
        if "working" in prompt:  # a prefill twice the stall timeout that says it is at it every 0.4 s
            for _ in range(8):
                await self.bus.publish(rs, Working(request_id=rid, worker_id="fake-0"))
                await asyncio.sleep(0.4)
        if "fatal" in prompt:
            await self.bus.publish(rs, RequestError(request_id=rid, error=ErrorInfo(
                message="engine exploded", type="server_error", code="engine_error", status=500)))
            return
        if "lost-once" in prompt and req.attempt == 0:
            await self.bus.publish(rs, WorkerLost(request_id=rid, worker_id="fake-0"))
            return
        if "error-retry-once" in prompt and req.attempt == 0:
            await self.bus.publish(rs, RequestError(request_id=rid, retryable=True, error=ErrorInfo(
                message="preempted", status=503)))
            return
        chunks = self._chunks(req)
        if ("partial-lost" in prompt and req.attempt == 0) or "partial-lost-always" in prompt:
            for c in chunks[:2]:
                await self.bus.publish(rs, c)
            if "always" not in prompt:  # always: each loss right behind its tokens, often in the gateway's same read
                await asyncio.sleep(0.05)
            await self.bus.publish(rs, WorkerLost(request_id=rid, worker_id="fake-0"))
            return
        if "shuffle" in prompt:
            # Out of order with copies of delivered chunks before the end: reorder, drop the copies.
            first, mid, last = chunks[:2], chunks[2:-1], chunks[-1]
            for c in [*reversed(first), *first, *reversed(mid), *first, *mid, last, *mid, last]:
                await self.bus.publish(rs, c)
            return
        delay = 0.05 if "slow" in prompt else 0.0
        for c in chunks:
            if delay:
                if any(x.request_id == rid for x in self.cancels):
                    return  # a real worker aborts on Cancel
                await asyncio.sleep(delay)
            await self.bus.publish(rs, c)

    def wait_for(self, what: str, pred: object, timeout_s: float = 10.0) -> object:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for x in list(getattr(self, what)):
                if pred(x):  # type: ignore[operator]
                    return x
            time.sleep(0.02)
        raise AssertionError(f"no matching {what} within {timeout_s}s")


@pytest.fixture(scope="session")
def gw_nats() -> Iterator[str]:
    srv = servers.start_nats()
    try:
        yield srv.url
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def peer(gw_nats: str) -> Iterator[FakePeer]:
    p = FakePeer(gw_nats).start()
    try:
        yield p
    finally:
        p.stop()


class GatewayProc:
    def __init__(self, url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.url = url
        self.proc = proc
        self.log = log

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


@contextlib.contextmanager
def run_gateway(nats_url: str, workdir: Path, instance: str, ready: str = "/ready", cluster_toml: str = "",
                **env: str) -> Iterator[GatewayProc]:
    """A real `python -m hetmesh.gateway` process on a free port, ready (it sees the peer's worker)."""
    cluster = workdir / "cluster.toml"
    cluster.write_text(cluster_toml or cluster_text())
    port = servers.free_port()
    log = workdir / f"{instance}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hetmesh.gateway", "--cluster", str(cluster), "--port",
                                 str(port), "--instance", instance],
                                env=servers.env_with(HETMESH_NATS_URL=nats_url, **env), stdout=out,
                                stderr=subprocess.STDOUT)
    gp = GatewayProc(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"gateway exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"gateway not ready: {log.read_text()[-3000:]}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{gp.url}{ready}", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield gp
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(f"--- {instance} log\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def gateway(gw_nats: str, peer: FakePeer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    with run_gateway(gw_nats, tmp_path_factory.mktemp("gateway"), "gwtest") as gp:
        yield gp


def sse_events(raw: str) -> list[object]:
    """Decode an SSE body into its `data:` payloads ("[DONE]" stays a string)."""
    out: list[object] = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else msgspec.json.decode(payload))
    return out
