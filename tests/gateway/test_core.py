"""The gateway's pure core: reordering token chunks, and the exact bytes clients get."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from hetmesh.gateway.core import DONE, Formatter, Reassembler, sse_error
from hetmesh.protocol import ErrorInfo, TokenChunk, Usage


def chunks_of(text: str, sizes: list[int]) -> list[TokenChunk]:
    out, i = [], 0
    for n in sizes:
        if i >= len(text):
            break
        piece = text[i:i + n]
        out.append(TokenChunk(request_id="r", worker_id="w", index=i, token_ids=list(piece.encode()), text=piece))
        i += len(piece)
    out.append(TokenChunk(request_id="r", worker_id="w", index=i, token_ids=[], text="", finish_reason="stop",
                          usage=Usage(prompt_tokens=3, completion_tokens=i)))
    return out


@settings(deadline=None)  # pure, but on a loaded 2-core box one example can take over hypothesis' 200 ms
@given(st.text(alphabet="abcxyz ", min_size=1, max_size=60), st.lists(st.integers(1, 7), min_size=60, max_size=60),
       st.randoms(use_true_random=False), st.integers(0, 20))
def test_any_arrival_order_with_duplicates_gives_the_text_once(text: str, sizes: list[int], rnd, dups: int) -> None:
    chunks = chunks_of(text, sizes)
    arrivals = chunks + [rnd.choice(chunks) for _ in range(dups)]
    rnd.shuffle(arrivals)
    r = Reassembler()
    out = [c for a in arrivals for c in r.add(a)]
    assert "".join(c.text for c in out) == text
    assert r.done and r.finish_reason == "stop" and r.next_index == len(text)
    assert r.usage is not None and r.usage.completion_tokens == len(text)


def test_gap_holds_later_chunks_back() -> None:
    c = chunks_of("abcdef", [2, 2, 2])
    r = Reassembler()
    assert r.add(c[1]) == [] and r.add(c[2]) == []
    assert [x.text for x in r.add(c[0])] == ["ab", "cd", "ef"]
    assert not r.done
    assert r.add(c[3]) == [c[3]] and r.done


def events(raw: bytes) -> list[dict]:
    return [msgspec.json.decode(e[6:]) for e in raw.split(b"\n\n") if e]


def test_sse_chat_chunks_are_openai_shaped() -> None:
    f = Formatter(True, "chatcmpl-x", "m", 123, include_usage=True)
    role, text = events(f.sse('he"y\n', None, first=True))  # a role-only chunk, then the text
    assert role == {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 123, "model": "m",
                    "system_fingerprint": None, "usage": None,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]}
    assert text["choices"] == [{"index": 0, "delta": {"content": 'he"y\n'}, "logprobs": None, "finish_reason": None}]
    # the last tokens and the finish reason: the text without one, then an empty delta that carries it
    more, last = events(f.sse("ab", "length", first=False))
    assert more["choices"][0]["delta"] == {"content": "ab"} and more["choices"][0]["finish_reason"] is None
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    (only,) = events(f.sse("", "stop", first=False))  # no text left: the final chunk alone
    assert only["choices"][0]["delta"] == {} and only["choices"][0]["finish_reason"] == "stop"
    # a reply of one chunk: role, text, finish
    assert [e["choices"][0]["delta"] for e in events(f.sse("x", "stop", first=True))] == [
        {"role": "assistant", "content": ""}, {"content": "x"}, {}]
    u = msgspec.json.decode(f.sse_usage(Usage(prompt_tokens=5, completion_tokens=2, cached_tokens=4))[6:])
    assert u["choices"] == [] and u["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                                                 "prompt_tokens_details": {"cached_tokens": 4}}
    assert DONE == b"data: [DONE]\n\n"


def test_sse_completion_chunk_and_full_bodies() -> None:
    f = Formatter(False, "cmpl-x", "m", 1, include_usage=False)
    (c,) = events(f.sse("abc", None, first=True))
    assert c["object"] == "text_completion" and "usage" not in c
    assert c["choices"] == [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": None}]
    text, last = events(f.sse("d", "length", first=False))  # the finish reason on a final chunk of its own
    assert text["choices"][0]["text"] == "d" and text["choices"][0]["finish_reason"] is None
    assert last["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]
    full = msgspec.json.decode(f.full("abc", "stop", Usage(prompt_tokens=1, completion_tokens=3)))
    assert full["choices"][0]["text"] == "abc" and full["usage"]["total_tokens"] == 4
    chat = msgspec.json.decode(Formatter(True, "i", "m", 1, False).full("hi", "abort_x", Usage(prompt_tokens=1,
                                                                                                completion_tokens=1)))
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"] == "hi"
    assert chat["choices"][0]["finish_reason"] == "stop"  # unknown mesh reasons map onto OpenAI's


def test_sse_error_event() -> None:
    e = msgspec.json.decode(sse_error(ErrorInfo(message="boom", code="worker_lost", status=502))[6:])
    assert e == {"error": {"message": "boom", "type": "server_error", "param": None, "code": "worker_lost"}}
