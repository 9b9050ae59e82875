"""API keys, per-key rate limits and admission control on a real gateway process (the scripted peer
plays scheduler and workers): 401 / 429 / 503 / 413 in OpenAI's error shape, with Retry-After."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import httpx
import openai
import pytest

from hetmesh.config import hash_key
from hetmesh.gateway.auth import duration

from .conftest import FakePeer, GatewayProc, cluster_text, run_gateway
from .test_gateway_errors import assert_openai_error

OPEN, RPM, TPM, ENV = "sk-open-0123456789", "sk-rpm-0123456789", "sk-tpm-0123456789", "sk-env-0123456789"
BOTH = "sk-both-0123456789"
AUTH = f"""
[[auth.keys]]
name = "open"
sha256 = "{hash_key(OPEN)}"

[[auth.keys]]
name = "rpm3"
sha256 = "{hash_key(RPM)}"
rpm = 3

[[auth.keys]]
name = "tpm"
sha256 = "{hash_key(TPM)}"
tpm = 120

[[auth.keys]]
name = "both"
sha256 = "{hash_key(BOTH)}"
rpm = 10
tpm = 100000
"""
MAX_INFLIGHT = 3
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def authed(gw_nats: str, peer: FakePeer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    toml = cluster_text(f"max_inflight = {MAX_INFLIGHT}\nmax_body_bytes = {MAX_BODY}", AUTH)
    with run_gateway(gw_nats, tmp_path_factory.mktemp("auth"), "gwauth", cluster_toml=toml,
                     HETMESH_API_KEYS=ENV) as gp:
        yield gp


def client(gw: GatewayProc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=20)


def chat(c: openai.OpenAI, content: str = "hello", max_tokens: int = 4) -> str:
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=max_tokens)
    return r.choices[0].message.content or ""


def test_no_key_or_wrong_key_is_401(authed: GatewayProc) -> None:
    for headers in ({}, {"authorization": "Basic abc"}, {"authorization": "Bearer"}):
        r = httpx.post(authed.url + "/v1/chat/completions", headers=headers, timeout=10,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
        assert_openai_error(r, 401)
    with pytest.raises(openai.AuthenticationError) as e:
        chat(client(authed, "sk-wrong-0123456789"))
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert "sk-wrong" not in str(e.value.message)  # the key is not echoed back whole
    r = httpx.get(authed.url + "/v1/models", timeout=10)
    assert_openai_error(r, 401)
    assert httpx.get(authed.url + "/health", timeout=10).status_code == 200  # probes need no key


def test_configured_and_env_keys_work(authed: GatewayProc) -> None:
    assert chat(client(authed, OPEN)) == "abcd"
    assert chat(client(authed, ENV)) == "abcd"
    assert [m.id for m in client(authed, OPEN).models.list().data] == ["tiny", "dead"]


def test_requests_per_minute_is_429_with_retry_after(authed: GatewayProc) -> None:
    c = client(authed, RPM)
    for _ in range(3):
        assert chat(c) == "abcd"
    with pytest.raises(openai.RateLimitError) as e:
        chat(c)
    r = e.value.response
    assert r.status_code == 429 and e.value.code == "rate_limit_exceeded"
    assert r.json()["error"]["type"] == "requests"
    # One request per 20 s comes back: the next is allowed within 20 s.
    assert 1 <= int(r.headers["retry-after"]) <= 20
    assert r.headers["x-ratelimit-limit-requests"] == "3" and r.headers["x-ratelimit-remaining-requests"] == "0"
    assert chat(client(authed, OPEN)) == "abcd"  # other keys are not affected


RESET = re.compile(r"^(\d+ms|(\d+m)?\d+(\.\d+)?s)$")  # OpenAI's: 120ms, 8.64s, 6m0s


def test_successful_responses_carry_the_rate_limit_headers(authed: GatewayProc) -> None:
    c = client(authed, BOTH)
    msgs = [{"role": "user", "content": "hi"}]
    raw = c.chat.completions.with_raw_response.create(model="tiny", messages=msgs, max_tokens=4)  # type: ignore
    h = raw.headers
    assert raw.parse().choices[0].message.content == "abcd"
    assert h["x-ratelimit-limit-requests"] == "10" and h["x-ratelimit-remaining-requests"] == "9"
    assert h["x-ratelimit-reset-requests"] == "6s"  # one request back in 60 / 10 s: the bucket is full again
    assert h["x-ratelimit-limit-tokens"] == "100000"
    prompt = 100000 - int(h["x-ratelimit-remaining-tokens"])
    assert 0 < prompt < 100 and RESET.match(h["x-ratelimit-reset-tokens"]) and h["x-ratelimit-reset-tokens"] != "0s"
    # a stream, and several choices (n), carry them too
    with c.chat.completions.with_streaming_response.create(model="tiny", messages=msgs, max_tokens=4,  # type: ignore
                                                           stream=True) as r:
        assert r.headers["x-ratelimit-remaining-requests"] == "8"
        assert RESET.match(r.headers["x-ratelimit-reset-requests"])
        assert "".join(ch.choices[0].delta.content or "" for ch in r.parse() if ch.choices) == "abcd"
    raw2 = c.completions.with_raw_response.create(model="tiny", prompt="hi", max_tokens=4, n=2)
    assert raw2.headers["x-ratelimit-remaining-requests"] == "7"
    assert RESET.match(raw2.headers["x-ratelimit-reset-tokens"]) and int(raw2.headers["x-ratelimit-remaining-tokens"])
    # no limit on a key: no headers
    assert "x-ratelimit-limit-requests" not in client(authed, OPEN).chat.completions.with_raw_response.create(
        model="tiny", messages=msgs, max_tokens=2).headers  # type: ignore[arg-type]


@pytest.mark.parametrize("seconds,text", [(0, "0s"), (0.12, "120ms"), (0.0004, "1ms"), (1, "1s"), (8.64, "8.64s"),
                                          (59.999, "1m0s"), (360, "6m0s"), (179.56, "2m59.56s")])
def test_reset_is_written_as_openai_does(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_tokens_per_minute_counts_prompt_and_completion(authed: GatewayProc) -> None:
    c = client(authed, TPM)
    # chat template + "hi" is ~20 prompt tokens; 40 completion tokens each
    assert chat(c, "hi", 40) == ("abcdefghijklmnopqrstuvwxyz" * 2)[:40]
    assert chat(c, "hi", 40)  # 120 allowed: the second still starts (prompt fits), then the key is in debt
    with pytest.raises(openai.RateLimitError) as e:
        chat(c, "hi", 40)
    assert e.value.response.json()["error"]["type"] == "tokens"
    assert int(e.value.response.headers["retry-after"]) >= 1


def chat_until_admitted(c: openai.OpenAI, content: str, max_tokens: int) -> None:
    """What a well-behaved client does with a 503: retry (here: at once, to fill the gateway)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            chat(c, content, max_tokens)
            return
        except openai.InternalServerError:
            assert time.monotonic() < deadline
            time.sleep(0.01)


def test_past_max_inflight_is_503_with_retry_after(authed: GatewayProc) -> None:
    c = client(authed, OPEN)
    slow: list[threading.Thread] = []
    for i in range(MAX_INFLIGHT):  # the peer streams "slow" requests at 4 tokens per 50 ms: ~2.5 s each
        t = threading.Thread(target=chat_until_admitted, args=(c, f"slow {i}", 200))
        t.start()
        slow.append(t)
    deadline = time.monotonic() + 10
    while True:
        try:
            chat(c, "one more")
        except openai.InternalServerError as e:
            r = e.response
            break
        assert time.monotonic() < deadline, "the gateway never refused past max_inflight"
        time.sleep(0.05)
    assert_openai_error(r, 503, code="overloaded", type_="server_error")
    assert int(r.headers["retry-after"]) >= 1
    for t in slow:
        t.join(30)
    assert chat(c) == "abcd"  # capacity is back once they are done


def test_oversized_body_is_413(authed: GatewayProc) -> None:
    body = b'{"model": "tiny", "prompt": "' + b"x" * (MAX_BODY + 1) + b'"}'
    r = httpx.post(authed.url + "/v1/completions", content=body, timeout=10,
                   headers={"authorization": f"Bearer {OPEN}", "content-type": "application/json"})
    assert_openai_error(r, 413, code="request_too_large")
    assert authed.alive


def raw_exchange(url: str, head: bytes) -> bytes:
    """Send a request head over a plain socket (as much of it as the gateway reads) and return its answer."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
        with contextlib.suppress(OSError):  # the gateway may close before the whole head is sent
            sock.sendall(head)
        out = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                out += chunk
    return out


def test_oversized_headers_are_431_with_a_short_body(authed: GatewayProc) -> None:
    big = "x" * (100 << 10)
    r = httpx.post(authed.url + "/v1/chat/completions", timeout=10, headers={"x-filler": big},
                   json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert_openai_error(r, 431, code="request_header_fields_too_large")
    assert len(r.content) < 300
    # a 20 MB Authorization header is cut off once past the limit, not read whole and echoed
    answer = raw_exchange(authed.url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-"
                          + b"k" * (20 << 20) + b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 431 ") and len(answer) < 500, answer[:500]
    # headers under the limit are served as before
    r = httpx.get(authed.url + "/v1/models", headers={"authorization": f"Bearer {OPEN}", "x-filler": "y" * (32 << 10)},
                  timeout=10)
    assert r.status_code == 200
    assert authed.alive


def test_a_wrong_key_is_echoed_only_by_its_first_characters(authed: GatewayProc) -> None:
    key = "sk-abcdef" + "z" * (40 << 10)
    r = httpx.get(authed.url + "/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=10)
    err = assert_openai_error(r, 401, code="invalid_api_key")
    assert "sk-ab..." in str(err["message"]) and "sk-abc" not in str(err["message"]) and len(r.content) < 300
