"""OpenTelemetry tracing of requests, from the client's `traceparent` to the engine.

Off unless an OTLP endpoint is configured (`--otlp-traces-endpoint`, KAIROS_OTLP_TRACES_ENDPOINT):
`from_config` then returns None, nothing of OpenTelemetry is imported, and every call site is one
`if tracing is not None` test. On, a service holds one `Tracing`: an SDK tracer provider with a
batching OTLP/HTTP exporter (or, in tests, the exporter they pass).

Spans are written after the fact, from times the services keep anyway (no span object lives on
the per-token path): the router opens one `kairos.request` span per request at admission, a child
of the client's `traceparent` when it sent one, and sends that span's context to the workers in
the work messages' `traceparent` field; at the request's end it writes `admission`, `queueing`
and `decision` under it. The prefill worker writes `prefill` and `kv_transfer`, the decode worker
`prefill` (a deflected request, prefilled in place) and `decode`, each a child of the router's
span. Times are wall-clock seconds (`time.time()` scale).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from common.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

Attrs = Mapping[str, str | int | float | bool]

# span names (docs/observability.md, "Tracing")
REQUEST, ADMISSION, QUEUEING, DECISION = "kairos.request", "admission", "queueing", "decision"
PREFILL, KV_TRANSFER, DECODE = "prefill", "kv_transfer", "decode"


def _ns(t: float) -> int:
    return int(t * 1e9)


class Tracing:
    """One service's tracer. `exporter`: where spans go (default: OTLP/HTTP to `endpoint`);
    `batch`: export in the background (False: at once, as tests want)."""

    def __init__(self, service_name: str, *, endpoint: str = "", exporter: SpanExporter | None = None,
                 batch: bool = True) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter(endpoint=endpoint)
        self.endpoint = endpoint
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("kairos")
        self._propagator = TraceContextTextMapPropagator()

    def context(self, traceparent: str, tracestate: str = "") -> Any:
        """The OpenTelemetry context a W3C `traceparent` (and `tracestate`) names; an empty or
        malformed one gives an empty context (the span starts a new trace)."""
        if not traceparent:
            return None
        carrier = {"traceparent": traceparent}
        if tracestate:
            carrier["tracestate"] = tracestate
        return self._propagator.extract(carrier)

    def start(self, name: str, start: float, *, traceparent: str = "", tracestate: str = "",
              attrs: Attrs | None = None, server: bool = False) -> Span:
        """A live span, ended by `end`; a child of `traceparent` when given."""
        from opentelemetry.trace import SpanKind
        return self.tracer.start_span(name, context=self.context(traceparent, tracestate),
                                      kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
                                      attributes=attrs, start_time=_ns(start))

    def child(self, parent: Span, name: str, start: float, end: float, attrs: Attrs | None = None) -> None:
        """A finished span under `parent` (a span this process holds)."""
        from opentelemetry.trace import set_span_in_context
        s = self.tracer.start_span(name, context=set_span_in_context(parent), attributes=attrs,
                                   start_time=_ns(start))
        s.end(end_time=_ns(max(start, end)))

    def record(self, name: str, traceparent: str, start: float, end: float, attrs: Attrs | None = None,
               tracestate: str = "") -> None:
        """A finished span under the remote span `traceparent` names (a worker's, under the router's)."""
        s = self.start(name, start, traceparent=traceparent, tracestate=tracestate, attrs=attrs)
        s.end(end_time=_ns(max(start, end)))

    @staticmethod
    def end(span: Span, end: float, *, error: str = "") -> None:
        if error:
            from opentelemetry.trace import Status, StatusCode
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=_ns(end))

    def traceparent(self, span: Span) -> tuple[str, str]:
        """(traceparent, tracestate) that make a remote span a child of `span`."""
        from opentelemetry.trace import set_span_in_context
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=set_span_in_context(span))
        return carrier.get("traceparent", ""), carrier.get("tracestate", "")

    def shutdown(self) -> None:
        """Export what is left (a batch not yet sent) and stop."""
        self.provider.shutdown()


def headers(traceparent: str, tracestate: str = "") -> dict[str, str] | None:
    """The W3C headers an engine's own tracing takes (vLLM's `trace_headers`), or None (untraced)."""
    if not traceparent:
        return None
    return {"traceparent": traceparent, "tracestate": tracestate} if tracestate else {"traceparent": traceparent}


def from_config(cfg: Any, service_name: str) -> Tracing | None:
    """The service's tracer when its config names an OTLP endpoint, else None (tracing off)."""
    endpoint = getattr(cfg, "otlp_traces_endpoint", "")
    if not endpoint:
        return None
    if not endpoint.startswith(("http://", "https://")):
        raise ConfigError(f"otlp_traces_endpoint {endpoint!r}: give the collector's OTLP/HTTP traces URL, e.g. "
                          "http://collector:4318/v1/traces (Kairos exports over HTTP, not gRPC)")
    return Tracing(service_name, endpoint=endpoint)
