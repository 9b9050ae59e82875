"""OpenTelemetry set-up: traces go to an OTLP endpoint (Jaeger) when one is configured.

Trace context crosses NATS in message headers (W3C traceparent), so one request's spans in
gateway, scheduler, workers and kv-transfer join into one trace in Jaeger.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

_configured = False


def setup(service: str, instance: str | None = None) -> trace.Tracer:
    """Install the SDK tracer provider once per process when OTEL_EXPORTER_OTLP_ENDPOINT is set.

    Without an endpoint the API's no-op tracer stays: spans cost next to nothing on the hot
    path, and incoming trace context is still passed on in headers.
    """
    global _configured
    if not _configured and os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        attrs = {"service.name": f"hetmesh-{service}"}
        if instance:
            attrs["service.instance.id"] = instance
        provider = TracerProvider(resource=Resource.create(attrs))
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        _configured = True
    return trace.get_tracer(f"hetmesh.{service}")


def inject(headers: MutableMapping[str, str]) -> None:
    propagate.inject(headers)


def extract(headers: Mapping[str, str] | None) -> context.Context:
    return propagate.extract(headers or {})


def tracer(service: str) -> trace.Tracer:
    return trace.get_tracer(f"hetmesh.{service}")
