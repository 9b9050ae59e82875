"""Workers heartbeat but no scheduler runs: the gateway answers 503 at once (NATS: no responders)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from hetmesh import servers

from .conftest import FakePeer, GatewayProc, run_gateway


@pytest.fixture(scope="module")
def lonely_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    srv = servers.start_nats(jetstream=False)
    peer = FakePeer(srv.url, scheduler=False).start()
    try:
        # Not ready without a scheduler, so wait for /health only.
        with run_gateway(srv.url, tmp_path_factory.mktemp("lonely"), "gwlonely", ready="/health") as gp:
            # ... and until the gateway has seen the workers' heartbeats, so what is missing is the scheduler.
            deadline = time.monotonic() + 30
            while httpx.get(gp.url + "/ready").json()["models"]["tiny"] < 1:
                assert time.monotonic() < deadline, "no worker heartbeats reached the gateway"
                time.sleep(0.05)
            yield gp
    finally:
        peer.stop()
        srv.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_no_scheduler_is_503(lonely_gateway: GatewayProc, stream: bool) -> None:
    r = httpx.post(lonely_gateway.url + "/v1/chat/completions", timeout=10, json={
        "model": "tiny", "messages": [{"role": "user", "content": "anyone?"}], "max_tokens": 3, "stream": stream})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "scheduler_unavailable"
    assert httpx.get(lonely_gateway.url + "/health").status_code == 200
    ready = httpx.get(lonely_gateway.url + "/ready")  # workers heartbeat, but nobody would place a request
    assert ready.status_code == 503 and ready.json()["scheduler"] is None
