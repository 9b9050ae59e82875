"""Kill or stop the real processes of a running mesh and check that no accepted request hangs:
it is re-placed and completes with the same (deterministic) text, or it ends with a clear error.

The mesh is conftest.py's (shared with test_migration.py). The tests run in file order and each
leaves the mesh whole for the next.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlparse

import httpx
import nats
import openai
import redis
from nats.js.api import ConsumerInfo, StorageType, StreamInfo

from hetmesh import servers, subjects
from hetmesh.launcher import Mesh
from hetmesh.protocol import ServiceEvent

from ..e2e.conftest import EventLog
from .conftest import complete, expected_text, first_placed, respawn


async def kill_mid_request(mesh: Mesh, aclient: openai.AsyncOpenAI, events: EventLog, prompt: str,
                           max_tokens: int, side: str, moment: Callable[[ServiceEvent], Awaitable[None]]) -> None:
    """Send a (non-streamed) request, SIGKILL its `side` worker once `moment(placed)` returns, and check
    that it is re-placed on another worker and returns the full deterministic text."""
    t0 = time.time()
    task = complete(aclient, prompt, max_tokens)
    placed = await first_placed(events, t0)
    victim = str(placed.detail[side])
    await moment(placed)
    mesh.kill(f"worker:{victim}")
    r = await asyncio.wait_for(task, 90)
    assert r.choices[0].text == expected_text(prompt, max_tokens)  # type: ignore[attr-defined]
    retried = await events.wait_for(placed.request_id, "placed", attempt=1)
    assert retried.detail[side] != victim
    respawn(mesh, f"worker:{victim}")


async def test_prefill_worker_killed_mid_prefill_request_is_replaced(mesh: Mesh, aclient: openai.AsyncOpenAI,
                                                                     events: EventLog) -> None:
    async def mid_prefill(placed: ServiceEvent) -> None:
        await asyncio.sleep(0.3)  # a 6000-token prefill takes ~1.3 s at this time scale
        assert not [e for e in events.for_request(placed.request_id) if e.kind == "prefill_done"], "too late"

    await kill_mid_request(mesh, aclient, events, "p" * 6000, 8, "prefill_worker", mid_prefill)


async def test_decode_worker_killed_mid_decode_request_is_replaced(mesh: Mesh, aclient: openai.AsyncOpenAI,
                                                                   events: EventLog) -> None:
    """Not streamed: nothing reached the client yet, so the gateway re-places it; same text."""
    async def mid_decode(placed: ServiceEvent) -> None:
        await events.wait_for(placed.request_id, "kv_landed", timeout_s=30)
        await asyncio.sleep(0.5)  # 30 tokens take ~6 s

    await kill_mid_request(mesh, aclient, events, "decode me " * 10, 30, "decode_worker", mid_decode)


async def test_scheduler_restart_in_flight_finish_new_ones_wait(mesh: Mesh, aclient: openai.AsyncOpenAI,
                                                               events: EventLog) -> None:
    in_flight = "in flight across a scheduler restart "
    t0 = time.time()
    first = complete(aclient, in_flight, 20)
    await first_placed(events, t0)
    mesh.kill("scheduler")
    newcomer = "sent while no scheduler runs "
    second = complete(aclient, newcomer, 5)
    await asyncio.sleep(1.0)
    assert not second.done(), "the new request should wait for a scheduler, not fail"
    mesh.spawn("scheduler")
    r1, r2 = await asyncio.wait_for(asyncio.gather(first, second), 90)
    assert r1.choices[0].text == expected_text(in_flight, 20)  # type: ignore[attr-defined]
    assert r2.choices[0].text == expected_text(newcomer, 5)  # type: ignore[attr-defined]
    mesh.wait_ready(60)


def _redis_keys(url: str, pattern: str) -> list[str]:
    r = redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=1)
    try:
        return list(r.scan_iter(pattern))
    finally:
        r.close()


async def test_redis_stopped_serving_goes_on_and_index_is_rebuilt(mesh: Mesh, aclient: openai.AsyncOpenAI,
                                                                  events: EventLog) -> None:
    shared = "a shared system prompt for the prefix index " * 4
    await aclient.completions.create(model="pd", prompt=shared + "warm", max_tokens=2, extra_body={"ignore_eos": True})
    await asyncio.sleep(0.5)
    assert _redis_keys(mesh.redis_url, "hetmesh:kv:wrk:*"), "workers' blocks should be in the index"
    idx, rs = next((i, s) for i, s in enumerate(mesh.started_servers) if s.name == "redis-server")
    port = urlparse(rs.url).port
    t0 = time.time()  # before the stop: the scheduler's probe may see Redis go while stop() waits for it
    rs.stop()
    for i in range(3):  # placement runs on load alone
        r = await aclient.completions.create(model="pd", prompt=shared + f"while redis is down {i}", max_tokens=3,
                                             extra_body={"ignore_eos": True})
        assert r.choices[0].text == expected_text(shared + f"while redis is down {i}", 3)
    deadline = time.monotonic() + 10  # service events travel batched
    while not any(e.kind == "redis_down" and e.ts >= t0 for e in events.events):
        assert time.monotonic() < deadline, "the scheduler did not report redis_down"
        await asyncio.sleep(0.1)
    assert all(s.alive for s in mesh.services.values())
    back = servers.start_redis(port)
    mesh._started[idx] = back  # so that the mesh stops this one
    deadline = time.monotonic() + 30
    while not _redis_keys(back.url, "hetmesh:kv:wrk:*"):
        assert time.monotonic() < deadline, "the index was not rebuilt after Redis came back"
        await asyncio.sleep(0.2)
    # the workers' kv_resynced events travel batched, so they may land after the index is rebuilt
    while not any(e.kind == "kv_resynced" and e.ts >= t0 for e in events.events):
        assert time.monotonic() < deadline, "no worker reported kv_resynced"
        await asyncio.sleep(0.1)


async def test_kv_transfer_killed_kv_still_streams_to_the_decode_worker(mesh: Mesh, aclient: openai.AsyncOpenAI,
                                                                       events: EventLog) -> None:
    """kv-transfer only keeps the records of the direct KV stream: a stream under way lands without it, and
    while it is down the next request's KV still goes straight to its decode worker (the port came with the
    placement); only kv-transfer's record of it is lost."""
    prompt = "k" * 2000  # 2000 tokens x 128 KiB of KV, capped at 128 MiB on the wire
    t0 = time.time()
    task = complete(aclient, prompt, 6)
    placed = await first_placed(events, t0)
    await events.wait_for(placed.request_id, "prefill_done", timeout_s=30)
    mesh.kill("kv-transfer-0")
    r = await asyncio.wait_for(task, 90)
    assert r.choices[0].text == expected_text(prompt, 6)  # type: ignore[attr-defined]
    rid = placed.request_id
    assert {e.kind for e in events.for_request(rid)} & {"kv_landed", "kv_fallback"}
    t1 = time.time()
    prompt2 = "q" * 1500
    r2 = await asyncio.wait_for(complete(aclient, prompt2, 6), 90)
    assert r2.choices[0].text == expected_text(prompt2, 6)  # type: ignore[attr-defined]
    placed2 = await first_placed(events, t1)
    landed2 = await events.wait_for(placed2.request_id, "kv_landed", timeout_s=5)
    assert landed2.detail["worker_id"] == placed2.detail["decode_worker"]
    assert "kv_fallback" not in {e.kind for e in events.for_request(placed2.request_id)}
    respawn(mesh, "kv-transfer-0")


async def test_slow_client_does_not_stall_the_others(mesh: Mesh, aclient: openai.AsyncOpenAI) -> None:
    """A client that opens a long stream and never reads it: everyone else is still served."""
    body = json.dumps({"model": "pd", "prompt": "never read", "max_tokens": 2000, "stream": True,
                       "ignore_eos": True}).encode()
    u = urlparse(mesh.url)
    sock = socket.create_connection((u.hostname, u.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        await asyncio.sleep(1.0)
        prompts = [f"meanwhile {i}" for i in range(4)]
        rs = await asyncio.wait_for(asyncio.gather(*(complete(aclient, p, 3) for p in prompts)), 60)
        assert [r.choices[0].text for r in rs] == [expected_text(p, 3) for p in prompts]  # type: ignore[attr-defined]
    finally:
        sock.close()


async def _work_stream(url: str) -> tuple[StreamInfo, list[ConsumerInfo]]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        return await js.stream_info(subjects.WORK_STREAM), await js.consumers_info(subjects.WORK_STREAM)
    finally:
        await nc.close()


async def test_nats_server_restart_services_reconnect(mesh: Mesh, aclient: openai.AsyncOpenAI) -> None:
    """The bus goes away and comes back on the same port with its JetStream store (a restart): every
    service reconnects (with backoff); requests accepted before the restart and requests sent while the
    bus is down finish with their text; the work-queue stream is still there with what it held, and in the
    end every WorkItem in it was taken and acked; no service died."""
    idx, ns = next((i, s) for i, s in enumerate(mesh.started_servers) if s.name == "nats-server")
    in_flight = [f"in flight over a bus restart {i} " for i in range(3)]
    tasks = [complete(aclient, p, 20) for p in in_flight]
    await asyncio.sleep(1.5)
    before, _ = await _work_stream(ns.url)
    assert before.state.last_seq >= 2 * len(in_flight)  # their WorkItems (disaggregated: two each) went through it
    ns.stop(keep_files=True)
    late = [f"sent while the bus is down {i} " for i in range(2)]
    tasks += [complete(aclient, p, 4) for p in late]
    await asyncio.sleep(1.0)
    ns.start()  # same port, same store
    rs = await asyncio.wait_for(asyncio.gather(*tasks), 90)
    assert [r.choices[0].text for r in rs] == [  # type: ignore[attr-defined]
        *(expected_text(p, 20) for p in in_flight), *(expected_text(p, 4) for p in late)]
    assert all(s.alive for s in mesh.services.values())
    after, consumers = await _work_stream(ns.url)
    assert after.config.storage == StorageType.FILE and after.state.last_seq > before.state.last_seq  # kept, went on
    assert after.state.messages == 0  # work-queue retention: acked items leave the stream
    assert consumers and all(c.num_ack_pending == 0 and c.num_pending == 0 for c in consumers)
    assert mesh.started_servers[idx] is ns


async def test_nats_restart_mid_stream_loses_no_token(mesh: Mesh) -> None:
    """A stream that has sent tokens cannot start over when the bus restarts under it. Chunks published
    while the bus was away are lost, so the gateway asks the workers to publish them again (Resume),
    and the client gets every token, in order, once."""
    ns = next(s for s in mesh.started_servers if s.name == "nats-server")
    prompt, n = "a stream across a bus restart ", 40  # about 0.2 s a token
    body = {"model": "pd", "prompt": prompt, "max_tokens": n, "stream": True, "ignore_eos": True}
    got: list[dict] = []
    done = False
    async with httpx.AsyncClient(base_url=mesh.url, timeout=90) as http:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    got.append(json.loads(line[6:]))
                    if len(got) == 3:
                        ns.stop(keep_files=True)
                        await asyncio.sleep(1.5)  # tokens keep coming out of the engine meanwhile
                        ns.start()
    assert all("error" not in c for c in got), [c for c in got if "error" in c]
    assert done
    assert "".join(c["choices"][0]["text"] for c in got) == expected_text(prompt, n)
    assert all(s.alive for s in mesh.services.values())
