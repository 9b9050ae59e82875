"""One request's spans from every service join one trace, exported over OTLP/HTTP (what Jaeger ingests).

A small OTLP collector runs in the test; the services export to it exactly as they would to Jaeger.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from hetmesh import servers
from hetmesh.launcher import Mesh

CLUSTER = """
[mesh]
time_scale = 100.0
heartbeat_interval_s = 0.2
[scheduler]
policy = "round_robin"
[[models]]
name = "tiny-pd"
spec = "tiny-llama"
[[workers]]
name = "cpx"
model = "tiny-pd"
accelerator = "nvidia-rubin-cpx"
role = "prefill"
[[workers]]
name = "vr200"
model = "tiny-pd"
accelerator = "nvidia-rubin-vr200"
role = "decode"
"""

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"


class Collector:
    def __init__(self) -> None:
        self.spans: list[tuple[str, str, str]] = []  # (service.name, trace id hex, span name)
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                req = ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    svc = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                    for ss in rs.scope_spans:
                        collector.spans += [(svc, s.trace_id.hex(), s.name) for s in ss.spans]
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def traced_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mesh, Collector]]:
    col = Collector()
    d: Path = tmp_path_factory.mktemp("traced")
    (d / "cluster.toml").write_text(CLUSTER)
    m = Mesh(d / "cluster.toml", gateway_port=servers.free_port(), log_dir=d / "logs",
             env={"OTEL_EXPORTER_OTLP_ENDPOINT": col.url, "OTEL_BSP_SCHEDULE_DELAY": "100"})
    m.start(ready_timeout_s=90)
    yield m, col
    m.stop()
    col.server.shutdown()


def test_one_trace_spans_gateway_scheduler_workers_and_kv_transfer(traced_mesh: tuple[Mesh, Collector]) -> None:
    mesh, col = traced_mesh
    r = httpx.post(f"{mesh.url}/v1/completions", timeout=30,
                   json={"model": "tiny-pd", "prompt": "trace me " * 10, "max_tokens": 6},
                   headers={"traceparent": f"00-{TRACE_ID}-b7ad6b7169203331-01"})
    assert r.status_code == 200
    want = {"hetmesh-gateway", "hetmesh-scheduler", "hetmesh-worker", "hetmesh-kv-transfer"}

    def complete(spans: set[tuple[str, str]]) -> bool:
        worker = {name for svc, name in spans if svc == "hetmesh-worker"}
        return (want <= {svc for svc, _ in spans} and any("prefill" in n for n in worker)
                and any("decode" in n for n in worker))

    # Each process exports on its own schedule: wait for the whole trace, not the first span of each.
    deadline = time.monotonic() + 20
    in_trace: set[tuple[str, str]] = set()
    while time.monotonic() < deadline and not complete(in_trace):
        time.sleep(0.1)
        in_trace = {(svc, name) for svc, tid, name in col.spans if tid == TRACE_ID}
    assert complete(in_trace), sorted(in_trace)
