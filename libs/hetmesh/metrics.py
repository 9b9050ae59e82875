"""Prometheus metrics: one registry per service instance, served on an HTTP port of its own.

Names follow the Prometheus conventions (`hetmesh_<service>_<what>_<unit>`, `_total` on
counters, base units: seconds and bytes). Engine load (queue depth, running batch, KV blocks,
prefix hits) is read from the engine when Prometheus scrapes, so it costs the request path
nothing; the request path only pays for a few histogram observations per request.

The gateway serves /metrics on its API port; the scheduler, workers and kv-transfer serve
/metrics, /health and /ready on `$HETMESH_METRICS_PORT` (unset or empty: no HTTP port) at
`$HETMESH_METRICS_HOST` (default 0.0.0.0).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

log = logging.getLogger("hetmesh.metrics")

PORT_ENV = "HETMESH_METRICS_PORT"
HOST_ENV = "HETMESH_METRICS_HOST"  # default 0.0.0.0 (containers); the local launcher uses 127.0.0.1

disable_created_metrics()  # no `_created` series next to every counter and histogram

# From sub-millisecond mesh hops up to minute-long generations.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
BYTES_BUCKETS = tuple(float(1 << k) for k in range(10, 34, 2))  # 1 KiB .. 8 GiB
# From a tenth of a millisecond (a bus hop between schedulers: the window in which two place on views that miss
# each other) up to a tenth of a second.
BOOKING_LAG_BUCKETS = (0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.1)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter("hetmesh_gateway_requests", "Completion requests by model and HTTP status",
                                ["model", "status"], registry=r)
        self.in_flight = Gauge("hetmesh_gateway_requests_in_flight", "Requests being served now", registry=r)
        self.ttft = Histogram("hetmesh_gateway_time_to_first_token_seconds",
                              "Arrival to the first token, as the client sees it", ["model"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("hetmesh_gateway_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request", ["model"],
                              buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("hetmesh_gateway_request_duration_seconds", "Arrival to the last token", ["model"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.completion_tokens = Counter("hetmesh_gateway_completion_tokens", "Tokens sent to clients", ["model"],
                                         registry=r)
        self.migrations = Counter("hetmesh_gateway_migrations", "Streams moved to another worker after some tokens",
                                  ["model", "reason"], registry=r)
        self.migration_gap = Histogram("hetmesh_gateway_migration_gap_seconds",
                                       "A migrated stream's pause: last token before the move to the first after",
                                       ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.stray_replies = Counter("hetmesh_gateway_stray_replies",
                                     "Messages on this gateway's reply subjects that no request waits for (an attempt "
                                     "since re-placed, a request over): dropped", registry=r)

    def finished(self, model: str, status: int, duration_s: float, ttft_s: float | None = None,
                 completion_tokens: int = 0) -> None:
        self.requests.labels(model, str(status)).inc()
        if status != 200:
            return
        self.e2e.labels(model).observe(duration_s)
        self.completion_tokens.labels(model).inc(completion_tokens)
        if ttft_s is not None:
            self.ttft.labels(model).observe(ttft_s)
            if completion_tokens > 1:
                self.tpot.labels(model).observe((duration_s - ttft_s) / (completion_tokens - 1))


BAD_INPUT = ("stale_heartbeat", "unknown_scheduler", "unknown_worker", "duplicate_placement")


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.placements = Counter("hetmesh_scheduler_placements", "Placements by policy and kind",
                                  ["policy", "mode"], registry=r)
        self.rejected = Counter("hetmesh_scheduler_rejected", "Requests the scheduler could not place",
                                ["reason"], registry=r)
        self.rejected.labels("no_capacity")  # exported at 0 from the start: dashboards and alerts see it
        self.held = Counter("hetmesh_scheduler_held", "Placements held by SLO-aware admission and tried again",
                            registry=r)
        # Own placements judged again on hearing another scheduler's earlier booking on their workers
        # (hetmesh.placement.withdrawal): kept (the same choice knowing of it) or withdrawn (placed anew)
        self.rechecked = Counter("hetmesh_scheduler_rechecked", "Own placements judged again on an earlier "
                                 "booking heard late, by outcome", ["outcome"], registry=r)
        for outcome in ("kept", "withdrawn"):
            self.rechecked.labels(outcome)
        # How stale the views are that schedulers place on: another scheduler's placement heard this long after
        # it was made (its placed_at; across hosts this includes their clocks' offset)
        self.booking_lag = Histogram("hetmesh_scheduler_booking_lag_seconds",
                                     "Another scheduler's booking, from its placement to this one handling it",
                                     buckets=BOOKING_LAG_BUCKETS, registry=r)
        self.placement_seconds = Histogram("hetmesh_scheduler_placement_duration_seconds",
                                           "Prefix lookup, policy and dispatch of one request",
                                           buckets=LATENCY_BUCKETS, registry=r)
        self.predicted = Histogram("hetmesh_scheduler_predicted_seconds",
                                   "The cost model's prediction for the chosen placement (engine time)",
                                   ["phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.workers_lost = Counter("hetmesh_scheduler_workers_lost",
                                    "Workers counted lost: heartbeats stopped, process restarted, or engine wedged",
                                    registry=r)
        # What the scheduler heard on the bus and set aside, by kind: stale_heartbeat (older than one already
        # folded in, or from a run since replaced), unknown_scheduler (a booking from a scheduler not heard
        # beating: not booked), unknown_worker (a booking of a worker not in the view: not booked),
        # duplicate_placement (a WorkItem the work queue already held under its dedup id: stored and served once)
        self.bad_input = Counter("hetmesh_scheduler_bad_input", "Messages heard on the bus and set aside, by kind",
                                 ["kind"], registry=r)
        for kind in BAD_INPUT:
            self.bad_input.labels(kind)  # exported at 0 from the start


class WorkerMetrics:
    """Observed phase times per request; the engine's load is collected at scrape time (`engine_collector`)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.phase = Histogram("hetmesh_worker_phase_duration_seconds",
                               "Observed time per phase: queue (before the engine's first step), prefill "
                               "(to the first token), decode (first to last token), kv_wait (decode side)",
                               ["phase"], buckets=LATENCY_BUCKETS, registry=r)
        # Predicted and observed side by side, same buckets, in wall seconds (predictions are engine
        # time; a simulated cluster at time_scale k runs k x wall time, so they are divided by k).
        self.ttft = Histogram("hetmesh_worker_time_to_first_token_seconds",
                              "Work item to first token on this worker: source=predicted (cost model) or observed",
                              ["source"], buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("hetmesh_worker_time_per_output_token_seconds",
                              "Decode time per token on this worker: source=predicted or observed",
                              ["source"], buckets=TOKEN_BUCKETS, registry=r)
        self.requests = Counter("hetmesh_worker_requests", "Work items served, by phase and finish reason",
                                ["phase", "finish_reason"], registry=r)
        self.kv_transfer_seconds = Histogram("hetmesh_worker_kv_transfer_duration_seconds",
                                             "Prefill side: accept + send of one request's KV",
                                             buckets=LATENCY_BUCKETS, registry=r)


class KvTransferMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.transfers = Counter("hetmesh_kv_transfer_transfers", "KV transfers by result", ["result"], registry=r)
        self.bytes = Counter("hetmesh_kv_transfer_bytes", "KV bytes relayed", registry=r)
        self.seconds = Histogram("hetmesh_kv_transfer_duration_seconds", "Accept to last chunk relayed",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.size = Histogram("hetmesh_kv_transfer_size_bytes", "Bytes per transfer", buckets=BYTES_BUCKETS,
                              registry=r)
        self.active = Gauge("hetmesh_kv_transfer_active", "Transfers in progress", registry=r)


Row = tuple[str, str, str, dict[str, str], float]  # name, help, "counter" | "gauge", labels, value


class Snapshot(Collector):
    """A collector that asks `read()` for rows at scrape time: values the service keeps anyway
    (engine stats, byte counts, its cluster view) cost nothing until someone looks."""

    def __init__(self, read: Callable[[], Iterable[Row]]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for name, doc, kind, labels, value in self.read():
            fam = families.get(name)
            if fam is None:
                cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                fam = families[name] = cls(name, doc, labels=list(labels))
            fam.add_metric(list(labels.values()), value)
        yield from families.values()


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # scrapes every few seconds: no access log
        pass


class MetricsServer:
    """/metrics, /health and /ready on a port, in a thread: no work on the service's event loop.

    `ready()` runs in the server thread; it should only read plain attributes of the service.
    """

    def __init__(self, registry: CollectorRegistry, port: int, ready: Callable[[], dict[str, object]],
                 host: str = "0.0.0.0") -> None:
        metrics_app = make_wsgi_app(registry)

        def app(environ: dict[str, object], start_response: Callable[..., object]) -> list[bytes]:
            path = environ.get("PATH_INFO", "/")
            if path in ("/health", "/ready"):
                body = ready() if path == "/ready" else {"status": "ok"}
                ok = path == "/health" or bool(body.get("ready"))
                start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "application/json")])
                return [json.dumps(body).encode()]
            if path == "/metrics":
                return metrics_app(environ, start_response)  # type: ignore[no-any-return]
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: /metrics, /health, /ready\n"]

        self.httpd = make_server(host, port, app, ThreadingWSGIServer, handler_class=_Quiet)
        self.port = self.httpd.server_port
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics-http", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve_from_env(registry: CollectorRegistry, ready: Callable[[], dict[str, object]]) -> MetricsServer | None:
    """Start the HTTP port named by $HETMESH_METRICS_PORT, if any (0: a free port)."""
    port = os.environ.get(PORT_ENV, "").strip()
    if not port:
        return None
    try:
        server = MetricsServer(registry, int(port), ready, os.environ.get(HOST_ENV) or "0.0.0.0")
    except OSError as exc:  # a busy port costs the metrics, not the service
        log.error("no metrics port: cannot listen on %s: %s", port, exc)
        return None
    log.info("metrics on :%d/metrics", server.port)
    return server


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, timeout_s: float = 5.0) -> Samples:
    """A /metrics endpoint's samples, keyed by (name, sorted labels): how benchmarks, tests and tools read a
    running service. A page that is not Prometheus text is an error."""
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        if r.headers.get_content_type() != "text/plain":
            raise ValueError(f"{url}: not Prometheus text ({r.headers.get_content_type()})")
        return parse(r.read().decode())


def parse(text: str) -> Samples:
    """Prometheus text as samples keyed by (name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def histogram_quantile(q: float, samples: Iterable[Samples], name: str) -> float | None:
    """The q-quantile of histogram `name` summed over `samples` (several services' scrapes), interpolated
    linearly within its bucket as Prometheus' histogram_quantile does; None with no observations."""
    counts: dict[float, float] = {}
    for s in samples:
        for (n, labels), v in s.items():
            if n == f"{name}_bucket":
                le = float(dict(labels)["le"])
                counts[le] = counts.get(le, 0.0) + v
    bounds = sorted(counts)
    if not bounds or counts[bounds[-1]] <= 0:
        return None
    rank = q * counts[bounds[-1]]
    lo, below = 0.0, 0.0
    for le in bounds:
        if counts[le] >= rank:
            if math.isinf(le):
                return lo  # past the last finite bucket: its bound is all that is known
            return lo + (le - lo) * (rank - below) / max(counts[le] - below, 1e-12)
        lo, below = le, counts[le]
    return lo
