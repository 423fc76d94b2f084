"""common/tracing.py: off it costs a flag check and imports nothing; on, W3C traceparents parent
spans across hops. The span tree of a live request is in tests/pd/test_tracing.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mooncake_lite.common import tracing
from mooncake_lite.common.config import ConfigError, load_config
from mooncake_lite.conductor.config import Config as ConductorConfig
from tests.conftest import REPO

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_TP = f"00-{TRACE}-00f067aa0ba902b7-01"


@pytest.fixture
def exported():
    exporter = InMemorySpanExporter()
    tracing.setup("test", exporter=exporter)
    try:
        yield lambda: (tracing._active.provider.force_flush(), exporter.get_finished_spans())[1]
    finally:
        tracing.shutdown()


def test_off_every_helper_is_a_no_op():
    assert not tracing.is_enabled()
    assert tracing.start_span("x", CLIENT_TP) is None and tracing.child_span("x") is None
    with tracing.span("x") as span, tracing.activate(None):
        assert span is None
    assert tracing.traceparent() is None and tracing.headers() == {}
    assert tracing.add_to_meta({"tid": "t"}, tracing.traceparent()) == {"tid": "t"}
    tracing.end_span(None, "error", a=1)   # accepted, nothing to do


def test_off_the_roles_do_not_import_opentelemetry():
    code = ("import sys; import mooncake_lite.cli, mooncake_lite.common.service, mooncake_lite.conductor.flight.flight, "
            "mooncake_lite.store.client; print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_a_client_traceparent_parents_the_span_and_a_bad_one_starts_a_trace(exported):
    ok = tracing.start_span("conductor.request", CLIENT_TP, kind="server", request_id="cmpl-1", skipped=None)
    bad = tracing.start_span("conductor.request", "00-not-a-trace-01", kind="server")
    tracing.end_span(ok)
    tracing.end_span(bad, "failed")
    tracing.end_span(bad, "twice")          # a second end is ignored
    first, second = exported()
    assert first.context.trace_id == int(TRACE, 16) and first.parent.span_id == 0x00f067aa0ba902b7
    assert dict(first.attributes) == {"mooncake.request_id": "cmpl-1"}
    assert second.parent is None and second.context.trace_id != int(TRACE, 16)
    assert not second.status.is_ok and second.status.description == "failed"


def test_a_traceparent_not_sampled_is_followed_downstream(exported):
    unsampled = f"00-{TRACE}-00f067aa0ba902b7-00"
    with tracing.span("prefill.request", unsampled) as span:
        assert not span.is_recording() and tracing.traceparent().endswith("-00")
        tracing.end_span(tracing.child_span("store.get"))
    assert exported() == ()


def test_the_current_span_parents_children_and_the_traceparent_names_it(exported):
    assert tracing.child_span("store.get") is None   # no request in context: not traced
    with tracing.span("prefill.request") as parent:
        tp = tracing.traceparent()
        assert tracing.headers() == {"traceparent": tp} and tracing.add_to_meta({}, tp) == {"tp": tp}
        tracing.end_span(tracing.child_span("store.get", kind="client", keys=3), num_matched=2)
    remote = tracing.start_span("decode.kv_receive", tp)
    tracing.end_span(remote)
    child, parent_span, receive = exported()
    assert tp.startswith(f"00-{parent.get_span_context().trace_id:032x}-{parent.get_span_context().span_id:016x}-")
    assert child.parent.span_id == parent_span.context.span_id == receive.parent.span_id
    assert dict(child.attributes) == {"mooncake.keys": 3, "mooncake.num_matched": 2}


def test_otlp_endpoint_flag():
    assert tracing.otlp_url("http://c:4318") == tracing.otlp_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert tracing.otlp_url("https://c/v1/traces") == "https://c/v1/traces"
    assert _conductor("--otlp-endpoint", "http://127.0.0.1:4318").otlp_endpoint == "http://127.0.0.1:4318"
    assert _conductor().otlp_endpoint is None
    with pytest.raises(ConfigError, match="otlp-endpoint"):
        _conductor("--otlp-endpoint", "127.0.0.1:4318")


def _conductor(*argv: str) -> ConductorConfig:
    return load_config(ConductorConfig, argv, prog="mooncake --role conductor", section="conductor", env={})
