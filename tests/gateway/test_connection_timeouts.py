"""Slow and silent clients against a real gateway process, with raw sockets: a new connection that sends
nothing, a head or body that stalls, a keep-alive connection left idle are all closed (a stalled head or
body with a 408 in OpenAI's error shape), while a slow but moving body and a stream longer than every
timeout are served whole."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import httpx
import pytest

from .conftest import FakePeer, GatewayProc, cluster_text, run_gateway, sse_events, text_for

TIMEOUT_S = 1.0
BOUND_S = 15.0  # generous: a timeout of TIMEOUT_S must have closed the connection well before this


@pytest.fixture(scope="module")
def gw(gw_nats: str, peer: FakePeer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    toml = cluster_text(f"keep_alive_timeout_s = {TIMEOUT_S}\nheader_timeout_s = {TIMEOUT_S}\n"
                        f"body_timeout_s = {TIMEOUT_S}\nsubmit_timeout_s = 10.0")
    with run_gateway(gw_nats, tmp_path_factory.mktemp("timeouts"), "gwtimeouts", cluster_toml=toml) as gp:
        yield gp


def connect(gw: GatewayProc) -> socket.socket:
    u = urlparse(gw.url)
    return socket.create_connection((u.hostname, u.port), timeout=BOUND_S)


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the gateway sends until it closes the connection (a socket timeout fails the test)."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def assert_408(answer: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer[:300]
    assert b"connection: close" in head.lower()
    err = json.loads(body)["error"]
    assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error" and err["message"]


def chat_body(content: str = "hello", max_tokens: int = 4, stream: bool = False) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "stream": stream}).encode()


def post_head(length: int) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(length).encode() + b"\r\n\r\n")


def test_a_new_connection_that_sends_nothing_is_closed(gw: GatewayProc) -> None:
    with connect(gw) as sock:
        assert read_to_close(sock) == b""
    assert gw.alive


def test_a_stalled_head_gets_408_and_is_closed(gw: GatewayProc) -> None:
    with connect(gw) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: appl")
        assert_408(read_to_close(sock))


def test_a_head_trickled_byte_by_byte_is_cut_off(gw: GatewayProc) -> None:
    # slowloris: a byte every 0.2 s resets no clock, the head's deadline runs from its first byte
    head = post_head(10)
    with connect(gw) as sock:
        for i in range(len(head)):
            if select.select([sock], [], [], 0.2)[0]:  # the gateway answered: stop sending
                break
            sock.sendall(head[i:i + 1])
        assert i < len(head) - 1, "the whole trickled head was accepted"
        assert_408(read_to_close(sock))


def test_a_stalled_body_gets_408_and_is_closed(gw: GatewayProc) -> None:
    body = chat_body()
    with connect(gw) as sock:
        sock.sendall(post_head(len(body)) + body[:10])
        assert_408(read_to_close(sock))


def test_an_idle_keep_alive_connection_is_closed_after_its_response(gw: GatewayProc) -> None:
    body = chat_body()
    with connect(gw) as sock:
        sock.sendall(post_head(len(body)) + body)
        answer = read_to_close(sock)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["choices"][0]["message"]["content"] == text_for(4)


def test_a_slow_but_moving_body_and_a_long_stream_are_served_whole(gw: GatewayProc) -> None:
    # the body comes in pieces 0.4 s apart (2.4 s in all, past every timeout), the stream runs ~2.5 s
    body = chat_body("slow", max_tokens=200, stream=True)
    with connect(gw) as sock:
        sock.sendall(post_head(len(body)))
        step = len(body) // 6 + 1
        for i in range(0, len(body), step):
            time.sleep(0.4)
            sock.sendall(body[i:i + step])
        answer = b""
        while not answer.endswith(b"0\r\n\r\n"):  # the chunked stream's end
            chunk = sock.recv(65536)
            assert chunk, answer[-300:]
            answer += chunk
    head, _, raw = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), head
    text = "".join(ev["choices"][0]["delta"].get("content") or ""  # type: ignore[index]
                   for ev in sse_events(dechunk(raw).decode()) if isinstance(ev, dict) and ev.get("choices"))
    assert text == text_for(200)


def dechunk(raw: bytes) -> bytes:
    out = b""
    while raw:
        size, _, rest = raw.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out += rest[:n]
        raw = rest[n + 2:]
    return out


def test_requests_are_served_while_slow_connections_hang(gw: GatewayProc) -> None:
    hanging = [connect(gw) for _ in range(50)]
    try:
        for i, s in enumerate(hanging):
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" if i % 2 else post_head(100) + b"{")
        r = httpx.post(gw.url + "/v1/chat/completions", content=chat_body(), timeout=10,
                       headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        for s in hanging:  # and all of them are closed in the end
            assert_408(read_to_close(s))
    finally:
        for s in hanging:
            s.close()
