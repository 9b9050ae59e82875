"""Workers heartbeat but no scheduler runs: the gateway waits a bounded time for one (a scheduler
restarting), then answers 503 with Retry-After; a scheduler that shows up in time serves the request."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from hetmesh import servers

from .conftest import FakePeer, GatewayProc, cluster_text, run_gateway

WAIT_S = 2.0


@pytest.fixture(scope="module")
def lonely() -> Iterator[str]:
    srv = servers.start_nats()
    peer = FakePeer(srv.url, scheduler=False).start()
    try:
        yield srv.url
    finally:
        peer.stop()
        srv.stop()


@pytest.fixture(scope="module")
def lonely_gateway(lonely: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    # Not ready without a scheduler, so wait for /health only.
    with run_gateway(lonely, tmp_path_factory.mktemp("lonely"), "gwlonely", ready="/health",
                     cluster_toml=cluster_text(f"scheduler_wait_s = {WAIT_S}")) as gp:
        # ... and until the gateway has seen the workers' heartbeats, so what is missing is the scheduler.
        deadline = time.monotonic() + 30
        while httpx.get(gp.url + "/ready").json()["models"]["tiny"] < 1:
            assert time.monotonic() < deadline, "no worker heartbeats reached the gateway"
            time.sleep(0.05)
        yield gp


@pytest.mark.parametrize("stream", [False, True])
def test_no_scheduler_is_503_after_a_bounded_wait(lonely_gateway: GatewayProc, stream: bool) -> None:
    t0 = time.monotonic()
    r = httpx.post(lonely_gateway.url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": "anyone?"}], "max_tokens": 3, "stream": stream})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "scheduler_unavailable"
    assert int(r.headers["retry-after"]) >= 1
    assert time.monotonic() - t0 >= WAIT_S * 0.9  # it waited for a scheduler first
    assert httpx.get(lonely_gateway.url + "/health").status_code == 200
    ready = httpx.get(lonely_gateway.url + "/ready")  # workers heartbeat, but nobody would place a request
    assert ready.status_code == 503 and ready.json()["scheduler"] is None


def test_request_waits_for_a_scheduler_that_starts(lonely: str, lonely_gateway: GatewayProc) -> None:
    """What a scheduler restart looks like to a new request: no responders, then a scheduler subscribes."""
    result: dict[str, httpx.Response] = {}

    def send() -> None:
        result["r"] = httpx.post(lonely_gateway.url + "/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": "wait for me", "max_tokens": 5})

    t = threading.Thread(target=send)
    t.start()
    time.sleep(WAIT_S / 4)
    assert t.is_alive(), "the request should be waiting for a scheduler"
    sched = FakePeer(lonely).start()
    try:
        t.join(30)
        r = result["r"]
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "abcde"
    finally:
        sched.stop()
