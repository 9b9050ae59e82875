"""The gateway against a scripted scheduler+worker peer: response shapes (streaming and not),
usage, reordering by index, retries, errors after a partial stream, cancel on disconnect."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from hetmesh.protocol import Cancel, InferenceRequest, ServiceEvent
from hetmesh.tokenizer import ByteTokenizer, render_chat

from ..openai_shape import chat_text, completion_text
from .conftest import CACHED, FakePeer, GatewayProc, sse_events, text_for

TOK = ByteTokenizer()


@pytest.fixture
def client(gateway: GatewayProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=20)


@pytest.fixture
def aclient(gateway: GatewayProc) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=20)


def rid_of(completion_id: str) -> str:
    return completion_id.split("-", 1)[1]


def submits_of(peer: FakePeer, rid: str) -> list[InferenceRequest]:
    return [s for s in peer.submits if s.request_id == rid]


def test_models_health_ready(gateway: GatewayProc, client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny", "dead"]
    assert client.models.retrieve("tiny").id == "tiny"
    assert httpx.get(gateway.url + "/health").json()["status"] == "ok"
    ready = httpx.get(gateway.url + "/ready").json()
    assert ready["models"] == {"tiny": 1, "dead": 0} and ready["workers"] == 1


def test_chat_non_streaming(client: openai.OpenAI, peer: FakePeer) -> None:
    content = "What is the capital of France?"
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=10,
                                       seed=7, temperature=0.5, top_p=0.9, stop=["zz"], user="u1")
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text_for(10)
    assert r.choices[0].finish_reason == "length"
    tokens = TOK.encode(render_chat([("user", content)]))
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(tokens), 10,
                                                                                         len(tokens) + 10)
    assert r.usage.prompt_tokens_details is not None and r.usage.prompt_tokens_details.cached_tokens == CACHED
    # What the scheduler received: the model's tokenization, the mesh's block hashes, the sampling.
    (sub,) = submits_of(peer, rid_of(r.id))
    assert sub.prompt_tokens == tokens
    assert len(sub.block_hashes) == len(tokens) // 16
    s = sub.sampling
    assert (s.max_tokens, s.seed, s.temperature, s.top_p, s.stop) == (10, 7, 0.5, 0.9, ["zz"])
    assert sub.reply_subject == f"hetmesh.resp.gwtest.{sub.request_id}-0"


def test_default_max_tokens_fills_the_context(client: openai.OpenAI, peer: FakePeer) -> None:
    r = client.completions.create(model="tiny", prompt=[1, 2, 3, 4])
    (sub,) = submits_of(peer, rid_of(r.id))
    assert sub.prompt_tokens == [1, 2, 3, 4] and sub.sampling.max_tokens == 256 - 4
    assert r.choices[0].text == text_for(252)


def test_chat_streaming_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "stream"}],
                                            max_completion_tokens=13, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chat_text(chunks, finish="length", usage=True) == text_for(13)
    last = chunks[-1]
    assert last.usage is not None and last.usage.completion_tokens == 13 and last.usage.prompt_tokens_details is not None


def test_raw_sse_shape(gateway: GatewayProc) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "raw"}], "max_tokens": 6, "stream": True}
    r = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    objs = events[:-1]
    for o in objs:
        assert isinstance(o, dict)
        assert set(o) == {"id", "object", "created", "model", "system_fingerprint", "choices"}
        (choice,) = o["choices"]
        assert set(choice) == {"index", "delta", "logprobs", "finish_reason"}
    deltas = [o["choices"][0]["delta"] for o in objs]  # type: ignore[index]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[-1] == {}
    assert "".join(d["content"] for d in deltas[1:-1]) == text_for(6)
    assert [o["choices"][0]["finish_reason"] for o in objs][-1] == "length"  # type: ignore[index]


def test_completions_streaming_and_not(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=9)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == text_for(9) and r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.prompt_tokens == len("Once upon a time")
    stream = client.completions.create(model="tiny", prompt=["Once upon a time"], max_tokens=9, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert completion_text(chunks, finish="length", usage=True) == text_for(9)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 9


def test_out_of_order_and_duplicate_chunks(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="shuffle", max_tokens=21)
    assert r.choices[0].text == text_for(21)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "shuffle"}],
                                            max_tokens=21, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text_for(21)


@pytest.mark.parametrize("stream", [False, True])
def test_retry_when_worker_lost_before_tokens(client: openai.OpenAI, peer: FakePeer, stream: bool) -> None:
    r = client.completions.create(model="tiny", prompt="lost-once", max_tokens=8, stream=stream)
    if stream:
        chunks = list(r)  # type: ignore[arg-type]
        text, cid = "".join(c.choices[0].text for c in chunks), chunks[0].id
    else:
        text, cid = r.choices[0].text, r.id  # type: ignore[union-attr]
    assert text == text_for(8)
    subs = submits_of(peer, rid_of(cid))
    assert [s.attempt for s in subs] == [0, 1]
    assert subs[1].exclude_workers == ["fake-0"]
    assert subs[0].reply_subject != subs[1].reply_subject  # a stale attempt cannot leak into the new one


def test_retry_on_retryable_worker_error(client: openai.OpenAI, peer: FakePeer) -> None:
    r = client.completions.create(model="tiny", prompt="error-retry-once", max_tokens=5)
    assert r.choices[0].text == text_for(5)
    assert [s.attempt for s in submits_of(peer, rid_of(r.id))] == [0, 1]


def test_a_stream_whose_worker_is_lost_migrates_after_its_tokens(gateway: GatewayProc, peer: FakePeer) -> None:
    body = {"model": "tiny", "prompt": "partial-lost", "max_tokens": 40, "stream": True}
    r = httpx.post(gateway.url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert "".join(t["choices"][0]["text"] for t in events[:-1]) == text_for(40)  # type: ignore[index]
    subs = submits_of(peer, rid_of(events[0]["id"]))  # type: ignore[index]
    assert [(s.attempt, s.continued, s.sampling.max_tokens) for s in subs] == [(0, 0, 40), (1, 8, 32)]
    assert subs[1].prompt_tokens == [*subs[0].prompt_tokens, *text_for(8).encode()]
    assert subs[1].exclude_workers == ["fake-0"]


def test_a_stream_lost_past_the_migration_limit_ends_with_an_error_event(gateway: GatewayProc,
                                                                       client: openai.OpenAI) -> None:
    body = {"model": "tiny", "prompt": "partial-lost-always", "max_tokens": 40, "stream": True}
    r = httpx.post(gateway.url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 200
    *tokens, err = sse_events(r.text)
    # 8 tokens from the first attempt and from each of the 3 migrations, then the error: the last attempt's
    # tokens too, though its loss comes right behind them (the error waits until they went out)
    assert "".join(t["choices"][0]["text"] for t in tokens) == text_for(32)  # type: ignore[index]
    assert isinstance(err, dict) and err["error"]["code"] == "migration_limit"
    with pytest.raises(openai.APIError):
        for _ in client.completions.create(model="tiny", prompt="partial-lost-always", max_tokens=40, stream=True):
            pass


def test_non_streaming_partial_then_lost_goes_on_cleanly(client: openai.OpenAI, peer: FakePeer) -> None:
    # The tokens collected so far stay; the next attempt goes on after them; the text must not double up.
    r = client.completions.create(model="tiny", prompt="partial-lost", max_tokens=12)
    assert r.choices[0].text == text_for(12)
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (len("partial-lost"), 12)
    assert [(s.attempt, s.continued) for s in submits_of(peer, rid_of(r.id))] == [(0, 0), (1, 8)]


def test_lost_on_every_attempt_is_502(gateway: GatewayProc) -> None:
    r = httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "partial-lost-always",
                                                          "max_tokens": 100}, timeout=10)
    assert r.status_code == 502 and r.json()["error"]["code"] == "migration_limit"


def test_a_silent_request_starts_over_then_ends_with_error_and_cancel(gateway: GatewayProc, peer: FakePeer) -> None:
    # No token and no `Working` for the stall timeout: it starts over (nothing reached the client) until
    # mesh.max_attempts, then the 504 and a Cancel
    r = httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "silent", "max_tokens": 5},
                   timeout=20)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    rid = [s for s in peer.submits if bytes(s.prompt_tokens) == b"silent"][-1].request_id
    assert [(s.attempt, s.continued) for s in submits_of(peer, rid)] == [(0, 0), (1, 0)]
    c = peer.wait_for("cancels", lambda c: c.request_id == rid)
    assert isinstance(c, Cancel) and c.reason == "stalled"


def test_a_first_token_later_than_the_stall_timeout_is_awaited_while_the_worker_says_it_works(
        gateway: GatewayProc, peer: FakePeer) -> None:
    """3.2 s of `Working` (a long prefill) against a 1.5 s stall timeout, then the tokens: the whole text, no 504
    (the same request silent gets the 504 above)."""
    r = httpx.post(gateway.url + "/v1/completions", json={"model": "tiny", "prompt": "working", "max_tokens": 5},
                   timeout=20)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text_for(5)
    rid = [s for s in peer.submits if bytes(s.prompt_tokens) == b"working"][-1].request_id
    assert not any(c.request_id == rid for c in peer.cancels)


async def test_stream_disconnect_cancels(gateway: GatewayProc, peer: FakePeer) -> None:
    body = {"model": "tiny", "prompt": "slow story", "max_tokens": 200, "stream": True}
    cid = None
    async with httpx.AsyncClient(base_url=gateway.url, timeout=20) as http:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            n = 0
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    cid = cid or json.loads(line[6:])["id"]
                    n += 1
                    if n >= 3:
                        break
    assert cid is not None
    rid = rid_of(cid)
    c = await asyncio.to_thread(peer.wait_for, "cancels", lambda c: c.request_id == rid)
    assert isinstance(c, Cancel) and c.reason == "client_disconnected"
    ev = await asyncio.to_thread(peer.wait_for, "events", lambda e: e.request_id == rid and e.kind == "cancelled")
    assert isinstance(ev, ServiceEvent) and ev.service == "gateway"


async def test_non_streaming_disconnect_cancels(gateway: GatewayProc, peer: FakePeer) -> None:
    body = {"model": "tiny", "prompt": "slow and unary", "max_tokens": 200}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/completions", json=body)
    sub = await asyncio.to_thread(peer.wait_for, "submits", lambda s: bytes(s.prompt_tokens) == b"slow and unary")
    assert isinstance(sub, InferenceRequest)
    c = await asyncio.to_thread(peer.wait_for, "cancels", lambda c: c.request_id == sub.request_id)
    assert isinstance(c, Cancel) and c.reason == "client_disconnected"


async def test_concurrent_streams_do_not_mix(aclient: openai.AsyncOpenAI) -> None:
    async def one(n: int) -> str:
        stream = await aclient.completions.create(model="tiny", prompt=f"concurrent {n}", max_tokens=n, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    lengths = list(range(3, 43))
    texts = await asyncio.gather(*(one(n) for n in lengths))
    assert texts == [text_for(n) for n in lengths]


def test_service_events_for_a_request(client: openai.OpenAI, peer: FakePeer) -> None:
    r = client.completions.create(model="tiny", prompt="events please", max_tokens=4)
    rid = rid_of(r.id)
    peer.wait_for("events", lambda e: e.request_id == rid and e.kind == "finished")
    kinds = [e.kind for e in peer.events if e.request_id == rid and e.service == "gateway"]
    assert kinds == ["received", "placed", "first_token", "finished"]
    fin = next(e for e in peer.events if e.request_id == rid and e.kind == "finished")
    assert fin.detail["completion_tokens"] == 4 and fin.detail["finish_reason"] == "length"
