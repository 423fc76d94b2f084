"""Request tracing with OpenTelemetry: one trace per request across every role, exported over OTLP.

Off unless a role runs with ``--otlp-endpoint``: then :func:`setup` builds the SDK's tracer
(spans batched and posted as OTLP/HTTP protobuf to ``<endpoint>/v1/traces``). Off, every helper
here returns at its first line on a module-level ``None`` check — no span objects, no OTel no-op
machinery, and the SDK is not even imported — and nothing is added to any message.

Propagation is W3C trace context. Across HTTP hops the ``traceparent`` header
(:func:`headers`; :func:`remote_parent` is the server side, a middleware installed by
``common/service.py`` only while tracing is on). Across data-plane frames a ``"tp"`` key in the
frame's meta holding the same ``traceparent`` string (the KV stream's layer and end frames, the
store ops a request causes). Inside a process a span is made current (:func:`span`,
:func:`activate`) so the work it starts — tasks inherit the context — is parented under it;
work that outlives its handler (a decode batch) passes parents explicitly.

Span attributes are namespaced ``mooncake.<name>`` (:func:`start_span`'s keyword arguments);
every request-level span carries ``mooncake.request_id``, the id its log lines carry too.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
META_KEY = "tp"              # a data-plane frame meta's traceparent
_NULL = contextlib.nullcontext()
# The live tracer while --otlp-endpoint is set; None means off (the one check every helper makes).
_active: _Tracing | None = None


class _Tracing:
    """The SDK objects of a process that traces (imported only when tracing is on)."""

    def __init__(self, role: str, exporter) -> None:
        from opentelemetry import context, trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.context, self.trace = context, trace
        self.kinds = {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER, "client": SpanKind.CLIENT}
        self.error = lambda message: Status(StatusCode.ERROR, message)
        self.propagator = TraceContextTextMapPropagator()
        self.provider = TracerProvider(resource=Resource.create({"service.name": f"mooncake-{role}"}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("mooncake_lite")

    def parent_context(self, parent: Any):
        """The context a new span starts in: a span's, a ``traceparent`` string's (a new root
        when it does not parse), or the current one (``parent`` None)."""
        if parent is None:
            return None
        if isinstance(parent, str):
            return self.propagator.extract({TRACEPARENT: parent})
        return self.trace.set_span_in_context(parent)

    def traceparent(self, span: Any) -> str | None:
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, self.trace.set_span_in_context(span))
        return carrier.get(TRACEPARENT)


def otlp_url(endpoint: str) -> str:
    """``--otlp-endpoint`` is the collector's base URL (as ``OTEL_EXPORTER_OTLP_ENDPOINT``);
    traces go to its ``/v1/traces``. A URL already naming that path is kept."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else f"{endpoint}/v1/traces"


def setup(role: str, endpoint: str | None = None, *, exporter=None) -> None:
    """Turn tracing on for this process when ``endpoint`` (OTLP/HTTP) or ``exporter`` (an SDK
    span exporter, e.g. in tests) is given; otherwise leave it off. The SDK flushes what is
    batched when the process exits (and at :func:`shutdown`)."""
    global _active
    if endpoint is None and exporter is None:
        return
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        exporter = OTLPSpanExporter(endpoint=otlp_url(endpoint))
    _active = _Tracing(role, exporter)
    log.info("tracing on: spans exported %s", f"to {otlp_url(endpoint)}" if endpoint else "in process")


def shutdown() -> None:
    """Flush and turn tracing off (tests; a role's exit flushes by itself)."""
    global _active
    if _active is not None:
        _active.provider.shutdown()
        _active = None


def is_enabled() -> bool:
    return _active is not None


def start_span(name: str, parent: Any = None, *, kind: str = "internal", **attributes: Any):
    """A started span (None when tracing is off), a child of ``parent`` (a span, a
    ``traceparent`` string, or None for the current context). End it with :func:`end_span`."""
    if _active is None:
        return None
    return _active.tracer.start_span(name, context=_active.parent_context(parent), kind=_active.kinds[kind],
                                     attributes=_attributes(attributes))


def child_span(name: str, *, kind: str = "internal", **attributes: Any):
    """Like :func:`start_span` under the current span, but None when there is no current span:
    for work (a store op) that belongs in a trace only when a traced request caused it."""
    if _active is None or not _active.trace.get_current_span().get_span_context().is_valid:
        return None
    return _active.tracer.start_span(name, kind=_active.kinds[kind], attributes=_attributes(attributes))


def end_span(span, error: str | None = None, **attributes: Any) -> None:
    """Set ``attributes`` and end ``span``; ``error`` marks it failed. No-op on None or on a
    span already ended (a request's teardown may reach it twice)."""
    if span is None or not span.is_recording():
        return
    if attributes:
        span.set_attributes(_attributes(attributes))
    if error is not None:
        span.set_status(_active.error(error[:500]) if _active is not None else None)
    span.end()


def set_attributes(span, **attributes: Any) -> None:
    if span is not None and span.is_recording():
        span.set_attributes(_attributes(attributes))


def add_event(span, name: str, **attributes: Any) -> None:
    if span is not None and span.is_recording():
        span.add_event(name, _attributes(attributes))


def span(name: str, parent: Any = None, *, kind: str = "internal", **attributes: Any):
    """Context manager: a span made current for the block (tasks started inside inherit it),
    ended after it; an exception marks it failed. Yields the span (None when off)."""
    if _active is None:
        return _NULL
    return _active.tracer.start_as_current_span(name, context=_active.parent_context(parent),
                                                kind=_active.kinds[kind], attributes=_attributes(attributes))


def activate(span_or_none):
    """Context manager: make an already started span current for the block (e.g. around
    starting tasks that belong under it)."""
    if _active is None or span_or_none is None:
        return _NULL
    return _active.trace.use_span(span_or_none, end_on_exit=False)


def traceparent(span_or_none=None) -> str | None:
    """The W3C ``traceparent`` naming ``span`` (default: the current span) as the parent; None
    when off or when there is no span."""
    if _active is None:
        return None
    span_ = span_or_none if span_or_none is not None else _active.trace.get_current_span()
    if not span_.get_span_context().is_valid:
        return None
    return _active.traceparent(span_)


def headers(span_or_none=None) -> dict[str, str]:
    """HTTP headers carrying ``span`` (default: the current span) to the next hop; {} when off."""
    if _active is None:
        return {}
    tp = traceparent(span_or_none)
    return {TRACEPARENT: tp} if tp else {}


def add_to_meta(meta: dict, tp: str | None) -> dict:
    """A frame meta with the ``traceparent`` under :data:`META_KEY` (unchanged when ``tp`` is None)."""
    if tp is not None:
        meta[META_KEY] = tp
    return meta


@contextlib.contextmanager
def _attached(ctx) -> Iterator[None]:
    token = _active.context.attach(ctx)
    try:
        yield
    finally:
        _active.context.detach(token)


def remote_parent_middleware():
    """aiohttp middleware: a request that carries a ``traceparent`` header runs its handler in
    that remote context, so the spans it starts join the caller's trace."""
    from aiohttp import web

    @web.middleware
    async def remote_parent(request, handler):
        tp = request.headers.get(TRACEPARENT)
        if tp is None or _active is None:
            return await handler(request)
        with _attached(_active.propagator.extract({TRACEPARENT: tp})):
            return await handler(request)
    return remote_parent


def _attributes(attributes: dict[str, Any]) -> dict[str, Any]:
    """``mooncake.``-namespaced attributes; None values are left out (OTel refuses them)."""
    return {f"mooncake.{k}": v for k, v in attributes.items() if v is not None}
