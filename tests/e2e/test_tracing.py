"""One request is one trace across real processes, exported over OTLP/HTTP (what Jaeger ingests).

A small OTLP receiver runs in the test; the services export to it exactly as they would to
Jaeger. The span tree is checked link by link (parent span ids across process boundaries),
with the attributes operators read: placement candidates and predictions, KV bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from hetmesh import servers
from hetmesh.launcher import Mesh
from hetmesh.metrics import scrape

from ..clusters import cluster_toml, group, model

pytestmark = pytest.mark.mesh  # every test here runs processes (a mesh, or Python with an environment to probe)

# The cost policy with two decode workers: a split placement always, with two candidates to weigh.
CLUSTER = cluster_toml(
    mesh={"time_scale": 100.0, "heartbeat_interval_s": 0.2},
    scheduler={"policy": "cost"},
    models=[model("tiny-pd", spec="tiny-llama")],
    workers=[group("cpx", "tiny-pd", "nvidia-rubin-cpx", role="prefill"),
             group("vr200", "tiny-pd", "nvidia-rubin-vr200", role="decode", count=2)])

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass(frozen=True)
class Span:
    service: str
    instance: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    attrs: dict[str, Any]
    start_ns: int
    end_ns: int


class Collector:
    """An OTLP/HTTP trace receiver (protobuf), like Jaeger's on :4318."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                req = ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    res = {a.key: _value(a.value) for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        collector.spans += [
                            Span(res.get("service.name", ""), res.get("service.instance.id", ""), s.trace_id.hex(),
                                 s.span_id.hex(), s.parent_span_id.hex(), s.name,
                                 {a.key: _value(a.value) for a in s.attributes}, s.start_time_unix_nano,
                                 s.end_time_unix_nano)
                            for s in ss.spans]
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


# (span name, service, parent span name): the whole tree of one disaggregated streamed request.
TREE = [
    ("gateway.request", "hetmesh-gateway", None),  # parent: the client's span
    ("tokenize", "hetmesh-gateway", "gateway.request"),
    ("schedule", "hetmesh-scheduler", "gateway.request"),
    ("placement", "hetmesh-scheduler", "schedule"),
    ("worker.prefill", "hetmesh-worker", "schedule"),
    ("queue_wait", "hetmesh-worker", "worker.prefill"),
    ("prefill", "hetmesh-worker", "worker.prefill"),
    ("kv_send", "hetmesh-worker", "worker.prefill"),
    ("kv_transfer", "hetmesh-kv-transfer", "kv_send"),
    ("worker.decode", "hetmesh-worker", "schedule"),
    ("kv_wait", "hetmesh-worker", "worker.decode"),
    ("decode", "hetmesh-worker", "worker.decode"),
    ("stream", "hetmesh-gateway", "gateway.request"),
]


def test_one_request_is_one_span_tree_across_processes(traced_mesh: tuple[Mesh, Collector]) -> None:
    mesh, col = traced_mesh
    with httpx.stream("POST", f"{mesh.url}/v1/completions", timeout=30,
                      json={"model": "tiny-pd", "prompt": "trace me " * 10, "max_tokens": 6, "stream": True},
                      headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}) as r:
        assert r.status_code == 200
        body = r.read().decode()
    assert body.rstrip().endswith("data: [DONE]")

    # Each process exports on its own schedule: wait until every span of the tree is in.
    want = {name for name, _, _ in TREE}
    deadline = time.monotonic() + 30
    spans: dict[str, Span] = {}
    while time.monotonic() < deadline and not want <= spans.keys():
        time.sleep(0.1)
        spans = {s.name: s for s in list(col.spans) if s.trace_id == TRACE_ID}
    assert want <= spans.keys(), f"missing spans {sorted(want - spans.keys())}; got {sorted(spans)}"

    for name, service, parent in TREE:
        s = spans[name]
        assert s.service == service, (name, s.service)
        expect_parent = CLIENT_SPAN if parent is None else spans[parent].span_id
        assert s.parent_id == expect_parent, f"{name}'s parent is not {parent or 'the client span'}"
        assert s.end_ns >= s.start_ns > 0, name

    # Prefill and decode ran on different workers, each its own process.
    assert spans["worker.prefill"].instance == "cpx-0"
    assert spans["worker.decode"].instance.startswith("vr200-")
    place = spans["placement"].attrs
    assert place["hetmesh.policy"] == "cost" and place["hetmesh.mode"] == "disaggregated"
    assert place["hetmesh.prefill_worker"] == "cpx-0" and place["hetmesh.decode_worker"] == spans["worker.decode"].instance
    assert place["hetmesh.candidate_count"] == 2 and len(place["hetmesh.candidates"]) == 2
    assert all("ttft=" in c and "tpot=" in c for c in place["hetmesh.candidates"])
    assert place["hetmesh.predicted_ttft_s"] > 0 and place["hetmesh.predicted_tpot_s"] > 0
    kv = spans["kv_transfer"].attrs
    assert kv["hetmesh.ok"] is True and kv["hetmesh.bytes_relayed"] == kv["hetmesh.nbytes"] > 0
    assert kv["hetmesh.duration_s"] >= 0
    assert spans["kv_wait"].attrs["hetmesh.nbytes"] == kv["hetmesh.nbytes"]
    assert spans["decode"].attrs["hetmesh.decode_tokens"] == 5  # the 6th came with the prefill
    assert spans["gateway.request"].attrs["http.response.status_code"] == 200
    assert spans["gateway.request"].attrs["hetmesh.completion_tokens"] == 6
    assert spans["tokenize"].attrs["hetmesh.prompt_tokens"] > 0
    # Phases in order on the clock: prefill before the KV moves, decode after it landed.
    assert spans["prefill"].end_ns <= spans["kv_send"].end_ns
    assert spans["kv_wait"].end_ns <= spans["decode"].start_ns + 1000


def test_workers_report_predicted_and_observed_phase_times(traced_mesh: tuple[Mesh, Collector]) -> None:
    mesh, _ = traced_mesh
    r = httpx.post(f"{mesh.url}/v1/completions", timeout=30,
                   json={"model": "tiny-pd", "prompt": "predict me " * 20, "max_tokens": 8})
    assert r.status_code == 200
    urls = mesh.metrics_urls()
    deadline = time.monotonic() + 10
    while True:
        pre = scrape(urls["worker:cpx-0"])
        dec = [scrape(urls[f"worker:vr200-{i}"]) for i in range(2)]
        ttft = {src: pre.get(("hetmesh_worker_time_to_first_token_seconds_count", (("source", src),)), 0)
                for src in ("predicted", "observed")}
        tpot = {src: sum(d.get(("hetmesh_worker_time_per_output_token_seconds_count", (("source", src),)), 0)
                         for d in dec) for src in ("predicted", "observed")}
        if min(*ttft.values(), *tpot.values()) >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert ttft["predicted"] >= 1 and ttft["observed"] >= 1, ttft
    assert tpot["predicted"] >= 1 and tpot["observed"] >= 1, tpot
    sched = scrape(urls["scheduler"])
    assert sched[("hetmesh_scheduler_predicted_seconds_count", (("phase", "ttft"),))] >= 1
    assert sched[("hetmesh_scheduler_placements_total", (("mode", "disaggregated"), ("policy", "cost")))] >= 1


SAMPLER_PROBE = """
from opentelemetry import trace
from hetmesh import telemetry
telemetry.setup("probe", "p-1")
p = trace.get_tracer_provider()
print(p.resource.attributes["service.name"], p.sampler.get_description(), telemetry.enabled())
"""


@pytest.mark.parametrize(("env", "expect"), [
    ({}, "hetmesh-probe ParentBased{root:AlwaysOnSampler,remoteParentSampled:AlwaysOnSampler,"
         "remoteParentNotSampled:AlwaysOffSampler,localParentSampled:AlwaysOnSampler,"
         "localParentNotSampled:AlwaysOffSampler} True"),
    ({"OTEL_SERVICE_NAME": "edge-gw", "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"},
     "edge-gw TraceIdRatioBased{0.25} True"),
])
def test_standard_otel_variables_name_the_service_and_pick_the_sampler(env: dict[str, str], expect: str) -> None:
    full = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    full.update(env, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{servers.free_port()}")
    out = subprocess.run([sys.executable, "-c", SAMPLER_PROBE], env=full, capture_output=True, text=True, timeout=60,
                         check=True).stdout.strip()
    assert out == expect


def test_tracing_is_off_without_an_endpoint_or_when_the_sdk_is_disabled() -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    probe = "from hetmesh import telemetry; print(telemetry.enabled())"
    for extra, want in [({}, "False"), ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_SDK_DISABLED": "true"},
                                        "False")]:
        out = subprocess.run([sys.executable, "-c", probe], env={**base, **extra}, capture_output=True, text=True,
                             timeout=60, check=True).stdout.strip()
        assert out == want, extra
