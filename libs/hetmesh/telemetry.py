"""OpenTelemetry set-up: traces go to an OTLP endpoint (Jaeger) when one is configured.

Trace context crosses NATS in message headers (W3C traceparent), so one request's spans in
gateway, scheduler, workers and kv-transfer join into one trace in Jaeger.

Configured by the standard variables only: OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT)
turns tracing on, OTEL_SERVICE_NAME names the process (default `hetmesh-<service>`),
OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG pick the sampler (the SDK reads them), and
OTEL_SDK_DISABLED=true turns it off again. Off, the services make no spans at all (they check
`enabled()`), and only pass an incoming traceparent on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

_configured = False


def enabled() -> bool:
    """True when spans are exported somewhere: an OTLP endpoint is set and the SDK is not disabled."""
    env = os.environ
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return bool(endpoint) and env.get("OTEL_SDK_DISABLED", "").strip().lower() != "true"


def setup(service: str, instance: str | None = None) -> trace.Tracer:
    """Install the SDK tracer provider once per process when tracing is `enabled()`.

    Without it the API's no-op tracer stays: spans cost next to nothing, and incoming trace
    context is still passed on in headers.
    """
    global _configured
    if not _configured and enabled():
        attrs = {"service.namespace": "hetmesh"}
        if not os.environ.get("OTEL_SERVICE_NAME"):  # the SDK's resource detector reads it when set
            attrs["service.name"] = f"hetmesh-{service}"
        if instance:
            attrs["service.instance.id"] = instance
        # TracerProvider() takes its sampler from OTEL_TRACES_SAMPLER (default: parentbased_always_on).
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


def s_to_ns(t: float) -> int:
    """A time.time() stamp as a span start/end time."""
    return int(t * 1e9)
