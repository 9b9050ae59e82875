"""With tracing on, the gateway's span joins the client's trace and its context rides to the scheduler."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from hetmesh import servers
from hetmesh.bus import REQUEST_ID

from .conftest import FakePeer, GatewayProc, run_gateway, text_for

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture(scope="module")
def traced_gateway(gw_nats: str, peer: FakePeer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    # An OTLP endpoint nobody listens on: spans are made and exported (and dropped), which is what counts here.
    sink = f"http://127.0.0.1:{servers.free_port()}"
    with run_gateway(gw_nats, tmp_path_factory.mktemp("traced"), "gwtraced", OTEL_EXPORTER_OTLP_ENDPOINT=sink,
                     OTEL_SDK_DISABLED="false") as gp:
        yield gp


def test_trace_context_reaches_the_scheduler(traced_gateway: GatewayProc, peer: FakePeer) -> None:
    r = httpx.post(traced_gateway.url + "/v1/completions", timeout=10,
                   json={"model": "tiny", "prompt": "traced", "max_tokens": 5},
                   headers={"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text_for(5)
    rid = r.json()["id"].split("-", 1)[1]
    headers = peer.submit_headers[rid]
    assert headers[REQUEST_ID] == rid
    _version, trace_id, span_id, _flags = headers["traceparent"].split("-")
    assert trace_id == TRACE_ID and span_id != "00f067aa0ba902b7"  # the gateway's own span, in the client's trace


def test_untraced_gateway_still_tags_the_request(gateway: GatewayProc, peer: FakePeer) -> None:
    r = httpx.post(gateway.url + "/v1/completions", timeout=10, json={"model": "tiny", "prompt": "plain",
                                                                      "max_tokens": 3})
    rid = r.json()["id"].split("-", 1)[1]
    assert peer.submit_headers[rid] == {REQUEST_ID: rid}
