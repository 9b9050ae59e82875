"""End to end through the real gateway with the official openai client."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import nats
import openai
import pytest

from hetmesh import subjects
from hetmesh.engines.sampling import expected_completion
from hetmesh.launcher import Mesh
from hetmesh.protocol import SamplingParams
from hetmesh.tokenizer import ByteTokenizer, render_chat

from .conftest import EventLog

TOK = ByteTokenizer()


def chat_tokens(content: str) -> list[int]:
    return TOK.encode(render_chat([("user", content)]))


def expected(tokens: list[int], max_tokens: int, seed: int | None = None, temperature: float = 1.0,
             stop: list[str] | None = None) -> tuple[list[int], str, str]:
    return expected_completion(TOK, tokens, SamplingParams(max_tokens=max_tokens, seed=seed, temperature=temperature,
                                                           stop=stop or []))


def rid_of(completion_id: str) -> str:
    return completion_id.split("-", 1)[1] if "-" in completion_id else completion_id


def test_models_lists_both(client: openai.OpenAI) -> None:
    ids = {m.id for m in client.models.list().data}
    assert {"tiny-agg", "tiny-pd"} <= ids


def test_chat_non_streaming_text_and_usage(client: openai.OpenAI) -> None:
    content = "What is the capital of France?"
    r = client.chat.completions.create(model="tiny-agg", messages=[{"role": "user", "content": content}],
                                       max_tokens=24, seed=7)
    ids, text, finish = expected(chat_tokens(content), 24, seed=7)
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == finish
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(chat_tokens(content))
    assert r.usage.completion_tokens == len(ids)
    assert r.usage.total_tokens == len(ids) + len(chat_tokens(content))


def test_chat_streaming_with_usage(client: openai.OpenAI) -> None:
    content = "stream me a poem"
    stream = client.chat.completions.create(model="tiny-agg", messages=[{"role": "user", "content": content}],
                                            max_completion_tokens=40, seed=3, stream=True,
                                            stream_options={"include_usage": True})
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    ids, text, exp_finish = expected(chat_tokens(content), 40, seed=3)
    assert "".join(pieces) == text
    assert finish == exp_finish
    assert usage is not None and usage.completion_tokens == len(ids)


def test_completions_with_stop(client: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    _, full, _ = expected(TOK.encode(prompt), 60, seed=11)
    stop = full[10:12]  # a stop string that really occurs in the deterministic output
    r = client.completions.create(model="tiny-agg", prompt=prompt, max_tokens=60, seed=11, stop=[stop])
    _, text, finish = expected(TOK.encode(prompt), 60, seed=11, stop=[stop])
    assert r.choices[0].text == text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == finish == "stop"


async def test_disaggregated_path_prefill_kv_decode(aclient: openai.AsyncOpenAI, events: EventLog) -> None:
    content = "a disaggregated request " * 8
    r = await aclient.chat.completions.create(model="tiny-pd", messages=[{"role": "user", "content": content}],
                                              max_tokens=20, seed=5)
    ids, text, _ = expected(chat_tokens(content), 20, seed=5)
    assert r.choices[0].message.content == text
    assert r.usage is not None and r.usage.completion_tokens == len(ids)
    rid = rid_of(r.id)
    placed = await events.wait_for(rid, "placed")
    assert placed.detail["mode"] == "disaggregated"
    assert placed.detail["prefill_worker"] == "cpx-0" and placed.detail["decode_worker"] == "vr200-0"
    prefill = await events.wait_for(rid, "prefill_done")
    moved = await events.wait_for(rid, "kv_transferred")
    landed = await events.wait_for(rid, "kv_landed")
    done = await events.wait_for(rid, "decode_done")
    assert prefill.service == "worker" and prefill.detail["worker_id"] == "cpx-0"
    assert moved.service == "kv-transfer" and moved.detail["src"] == "cpx-0" and moved.detail["dst"] == "vr200-0"
    assert int(moved.detail["nbytes"]) > 0  # type: ignore[arg-type]
    assert landed.detail["worker_id"] == "vr200-0" and done.detail["worker_id"] == "vr200-0"
    assert prefill.ts <= moved.ts <= done.ts


async def test_prefix_aware_routes_repeat_to_holder(aclient: openai.AsyncOpenAI, events: EventLog) -> None:
    shared = "You are a helpful assistant. " * 20  # many full blocks
    first = await aclient.chat.completions.create(
        model="tiny-agg", messages=[{"role": "system", "content": shared}, {"role": "user", "content": "hi"}],
        max_tokens=4)
    holder = (await events.wait_for(rid_of(first.id), "placed")).detail["decode_worker"]
    await asyncio.sleep(0.5)  # KV events -> scheduler -> Redis
    # Load the holder so least-loaded alone would send the repeat elsewhere.
    busy = [asyncio.create_task(aclient.completions.create(model="tiny-agg", prompt=f"busy {i}", max_tokens=400,
                                                           extra_body={"ignore_eos": True}))
            for i in range(3)]
    await asyncio.sleep(0.3)
    placed_busy = [e for e in events.events if e.kind == "placed" and e.detail.get("decode_worker") == holder]
    assert placed_busy, "expected some busy work on the holder"
    repeat = await aclient.chat.completions.create(
        model="tiny-agg", messages=[{"role": "system", "content": shared}, {"role": "user", "content": "again"}],
        max_tokens=4)
    placed = await events.wait_for(rid_of(repeat.id), "placed")
    assert placed.detail["decode_worker"] == holder
    assert repeat.usage is not None and repeat.usage.prompt_tokens_details is not None
    assert repeat.usage.prompt_tokens_details.cached_tokens >= 16 * 10
    for t in busy:
        t.cancel()


async def test_client_disconnect_aborts_engine_work(mesh: Mesh, events: EventLog) -> None:
    body = {"model": "tiny-agg", "prompt": "long story", "max_tokens": 3000, "stream": True, "ignore_eos": True}
    rid = None
    async with httpx.AsyncClient(base_url=mesh.url, timeout=30) as http:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            n = 0
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    rid = rid or rid_of(json.loads(line[6:])["id"])
                    n += 1
                    if n >= 3:
                        break
    assert rid is not None
    aborted = await events.wait_for(rid, "aborted", timeout_s=10)
    assert aborted.service == "worker"
    generated = int(aborted.detail.get("completion_tokens", 0))  # type: ignore[arg-type]
    assert generated < 3000
    cancelled = await events.wait_for(rid, "cancelled", timeout_s=5)
    assert cancelled.service == "gateway"


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, None),
    (b'{"model": "tiny-agg", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', 400, "temperature"),
    (b'{"model": "tiny-agg", "messages": [{"role": "user", "content": "x"}], "n": 200}', 400, "n"),
    (b'{"model": "tiny-agg", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}', 400, None),
])
def test_bad_requests_are_openai_shaped_and_mesh_stays_up(mesh: Mesh, body: bytes, status: int,
                                                          param: str | None) -> None:
    r = httpx.post(f"{mesh.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param
    assert all(s.alive for s in mesh.services.values())
    assert httpx.get(f"{mesh.url}/health").status_code == 200


async def test_killed_worker_request_is_retried_not_hung(mesh: Mesh, aclient: openai.AsyncOpenAI,
                                                          events: EventLog) -> None:
    """Kill the worker mid-generation: the non-streamed request is resubmitted to the other
    worker and still returns the full deterministic text."""
    prompt = "survive a crash"
    task = asyncio.create_task(aclient.completions.create(model="tiny-agg", prompt=prompt, max_tokens=300,
                                                          seed=1, extra_body={"ignore_eos": True}))
    placed = await events.wait_for("", "placed")
    victim = str(placed.detail["decode_worker"])
    await asyncio.sleep(0.3)
    t0 = time.monotonic()
    mesh.kill(f"worker:{victim}")
    r = await asyncio.wait_for(task, timeout=30)
    _, text, _ = expected_completion(TOK, TOK.encode(prompt), SamplingParams(max_tokens=300, seed=1, ignore_eos=True))
    assert r.choices[0].text == text
    retried = [e for e in events.events if e.kind == "placed" and e.request_id == placed.request_id
               and e.detail.get("attempt") == 1]
    assert retried and retried[0].detail["decode_worker"] != victim
    assert time.monotonic() - t0 < 30
    # Bring the worker back for any later test.
    mesh.spawn(f"worker:{victim}")
    mesh.wait_ready(60)


async def test_garbage_on_every_subject_kills_nothing(mesh: Mesh, aclient: openai.AsyncOpenAI) -> None:
    """What an operator can type with `nats pub` must not take a service down."""
    nc = await nats.connect(mesh.nats_url)
    try:
        reply = await nc.request(subjects.SUBMIT, b"{not json", timeout=5)
        assert "error" in json.loads(reply.data)
        for subject in (subjects.CANCEL, subjects.FINISHED, subjects.heartbeat("h100-0"), subjects.kv_events("h100-0"),
                        subjects.KV_RESYNC, subjects.SCHED_STATUS,
                        subjects.KV_TRANSFER, subjects.kv_landed("vr200-0"), subjects.kv_recv("vr200-0"),
                        subjects.work_direct("both", "nvidia", "nvidia-h100", "h100-0"),
                        subjects.work_pool("decode", "nvidia", "nvidia-rubin-vr200")):
            for body in (b"", b"null", b"[]", b'{"request_id": 5}', b"\xff\xfe"):
                await nc.publish(subject, body)
        await nc.flush()
    finally:
        await nc.close()
    await asyncio.sleep(0.5)
    assert all(s.alive for s in mesh.services.values())
    r = await aclient.completions.create(model="tiny-agg", prompt="still here", max_tokens=3,
                                         extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 3
