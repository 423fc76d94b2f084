"""Request tracing (issue #19 item 1): the span tree of one request through a live cluster.

conductor, store, prefill and decode run as real processes on 127.0.0.1 with ``--otlp-endpoint``
pointing at a tiny OTLP/HTTP collector this test runs (the SDK's exporter posts protobuf
``ExportTraceServiceRequest``s to its ``/v1/traces``), so every span checked here crossed the
same wire a real collector would see, and every parent link crossed the hop it names: HTTP
``traceparent`` headers (client → conductor → prefill, decode) and data-plane frame metas
(prefill → decode's KV stream, prefill → store).
"""

from __future__ import annotations

import gzip
import json
import signal
import threading
import time
import urllib.request
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.cluster.helpers import wait_until
from tests.conftest import start_role

pytestmark = pytest.mark.timeout(180)

COMMON = ("--block-size", "16")
INSTANCE = ("--model", "tiny", "--threads", "1", "--no-profile", "--heartbeat-interval", "0.3")
PROMPT = "The quick brown fox jumps over the lazy dog; " * 3
MAX_TOKENS = 6
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
# The SDK batches spans for 5 s by default; the roles post every 100 ms here.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


class Collector:
    """Spans posted to ``/v1/traces``, decoded from OTLP protobuf; thread-safe."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == "/v1/traces"
                if ok:
                    collector.add(ExportTraceServiceRequest.FromString(body))
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, request: ExportTraceServiceRequest) -> None:
        found = []
        for rs in request.resource_spans:
            service = {a.key: a.value.string_value for a in rs.resource.attributes}["service.name"]
            for ss in rs.scope_spans:
                for s in ss.spans:
                    found.append({"name": s.name, "service": service, "trace": s.trace_id.hex(),
                                  "id": s.span_id.hex(), "parent": s.parent_span_id.hex() or None,
                                  "attrs": {a.key.removeprefix("mooncake."): _value(a.value) for a in s.attributes},
                                  "error": s.status.code == 2, "events": [e.name for e in s.events],
                                  "start": s.start_time_unix_nano, "end": s.end_time_unix_nano})
        with self.lock:
            self.spans.extend(found)

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace"] == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@pytest.fixture(scope="module")
def traced():
    collector = Collector()
    started = []

    def start(*args):
        started.append(start_role(*args, "--otlp-endpoint", collector.url, env=FAST_EXPORT))
        return started[-1]
    try:
        conductor = start("conductor", "--port", "0", "--model", "tiny", *COMMON)
        url = conductor.url()
        store = start("store", "--port", "0", "--data-port", "0", "--dram", "64MiB", "--conductor", url,
                      "--event-interval", "0.05", *COMMON)
        with ThreadPoolExecutor(2) as pool:
            p = pool.submit(start, "prefill", "--port", "0", "--conductor", url, "--store", store.addresses["data"],
                            *INSTANCE, *COMMON)
            d = pool.submit(start, "decode", "--port", "0", "--data-port", "0", "--conductor", url,
                            *INSTANCE, *COMMON)
            p.result(), d.result()
        # The first request (once both instances are registered) leaves PROMPT's blocks in the
        # store; its write-back span has come back once the store answered the put.
        first = wait_until(lambda: _complete(url, probe=True), "both instances registered")
        wait_until(lambda: _named(collector, first, "store.put"), "the first request's write-back")
        yield url, collector, first
    finally:
        for rp in started:
            rp.send(signal.SIGTERM)
        for rp in reversed(started):
            rp.stop()
        collector.close()


def _complete(url: str, traceparent: str | None = None, probe: bool = False):
    """One greedy completion of PROMPT: (request id, response headers); with ``probe``, None
    while the cluster cannot serve yet (no instance registered)."""
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True}).encode()
    headers = {"Content-Type": "application/json", **({"traceparent": traceparent} if traceparent else {})}
    req = urllib.request.Request(url + "/v1/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.load(resp)["id"]
    except urllib.error.HTTPError as exc:
        if probe and exc.code == 503:
            return None
        raise


def _tree(spans: list[dict]) -> tuple[dict[str, dict], dict[str, list[dict]]]:
    by_id = {s["id"]: s for s in spans}
    children = defaultdict(list)
    for s in spans:
        children[s["parent"]].append(s)
    return by_id, children


def _one(spans: list[dict], name: str) -> dict:
    found = [s for s in spans if s["name"] == name]
    assert len(found) == 1, f"{len(found)} spans named {name}: {[s['name'] for s in spans]}"
    return found[0]


def _kids(children, span: dict, name: str) -> list[dict]:
    return [c for c in children[span["id"]] if c["name"] == name]


def test_one_request_has_one_span_tree_across_every_role(traced):
    url, collector, _ = traced
    client_tp = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    # The probe requests ran PROMPT already: its blocks are in the store, so this one loads a prefix.
    rid = _complete(url, client_tp)
    wanted = ("conductor.request", "decode.request", "decode.steps", "prefill.request", "store.get_layers")
    spans = wait_until(lambda: (s := collector.trace(CLIENT_TRACE)) and all(any(x["name"] == n for x in s)
                                                                        for n in wanted) and s, "the spans")
    time.sleep(0.5)   # the last batches in flight
    spans = collector.trace(CLIENT_TRACE)
    by_id, children = _tree(spans)
    assert not [s for s in spans if s["error"]], [s for s in spans if s["error"]]
    for s in spans:   # a single tree under the client's span: every parent is in it
        assert s["parent"] == CLIENT_SPAN or s["parent"] in by_id, s

    root = _one(spans, "conductor.request")
    assert root["parent"] == CLIENT_SPAN and root["service"] == "mooncake-conductor"
    assert root["attrs"]["request_id"] == rid and root["attrs"]["output_tokens"] == MAX_TOKENS
    assert root["attrs"]["finish_reason"] == "length" and "first_token" in root["events"]

    sched = _one(children[root["id"]], "conductor.schedule")
    assert sched["attrs"]["reason"] and sched["attrs"]["route"] and sched["attrs"]["prefill"].startswith("prefill@")
    assert sched["attrs"]["decode"].startswith("decode@") and sched["attrs"]["predicted_ttft_s"] > 0

    # conductor → prefill (HTTP header) and what the prefill did
    to_prefill = _one(children[root["id"]], "conductor.prefill")
    prefill = _one(children[to_prefill["id"]], "prefill.request")
    assert prefill["service"] == "mooncake-prefill" and prefill["attrs"]["request_id"] == rid
    num_prefix = prefill["attrs"]["prefix_tokens"]
    assert num_prefix > 0 and prefill["attrs"]["computed_tokens"] > 0
    assert _kids(children, prefill, "prefill.queue")
    assert _one(children[prefill["id"]], "store.match")["attrs"]["num_matched"] * 16 == num_prefix
    load = _one(children[prefill["id"]], "prefill.prefix_load")
    assert load["attrs"]["tokens"] == num_prefix and load["attrs"]["recomputed"] is False
    gets = _kids(children, load, "store.get_layers")
    assert len(gets) == _num_layers() and all(g["attrs"]["keys"] == num_prefix // 16 for g in gets)
    chunks = _kids(children, prefill, "prefill.chunk")
    assert sum(c["attrs"]["tokens"] for c in chunks) == prefill["attrs"]["computed_tokens"]
    stream = _one(children[prefill["id"]], "prefill.kv_stream")
    assert stream["attrs"]["frames"] > 0 and stream["attrs"]["bytes"] > 0

    # prefill → decode over the KV stream's frame meta
    received = _one(children[stream["id"]], "decode.kv_receive")
    assert received["service"] == "mooncake-decode" and received["attrs"]["layers"] == _num_layers()

    # conductor → decode (HTTP header) and what the decode did
    to_decode = _one(children[root["id"]], "conductor.decode")
    decode = _one(children[to_decode["id"]], "decode.request")
    assert decode["attrs"]["request_id"] == rid and decode["attrs"]["finish_reason"] == "length"
    admission = _one(children[decode["id"]], "decode.admission")
    assert admission["attrs"]["joined"] is True
    steps = _one(children[decode["id"]], "decode.steps")   # one span for all its steps
    assert steps["attrs"]["num_steps"] == MAX_TOKENS - 1 and steps["attrs"]["mean_batch_size"] >= 1
    assert admission["end"] <= steps["start"] and received["end"] <= steps["start"]


def test_a_request_without_traceparent_starts_a_trace_at_the_conductor(traced):
    url, collector, first = traced
    root = _named(collector, first, "conductor.request")[0]
    assert root["parent"] is None and root["trace"] != CLIENT_TRACE
    spans = collector.trace(root["trace"])
    by_id, children = _tree(spans)
    assert {"conductor.schedule", "prefill.request", "decode.steps"} <= {s["name"] for s in spans}
    # the blocks it computed went to the store from the chunk that filled them
    puts = [s for s in spans if s["name"] == "store.put"]
    assert puts and all(by_id[p["parent"]]["name"] == "prefill.chunk" for p in puts)
    assert sum(p["attrs"]["num_new"] for p in puts) == len(PROMPT) // 16 == sum(p["attrs"]["keys"] for p in puts)
    # Nothing but requests is traced (registration, heartbeats, block events are not): every
    # trace has its conductor.request root.
    rooted = {s["trace"] for s in collector.spans if s["name"] == "conductor.request"}
    assert {s["trace"] for s in collector.spans} <= rooted


def _named(collector: Collector, request_id: str, name: str) -> list[dict]:
    """The spans called ``name`` in the trace of the request ``request_id``."""
    roots = [s for s in list(collector.spans) if s["name"] == "conductor.request"
             and s["attrs"].get("request_id") == request_id]
    return [s for s in collector.trace(roots[0]["trace"]) if s["name"] == name] if roots else []


def _num_layers() -> int:
    from mooncake_lite.model.checkpoint_config import model_args
    return model_args("tiny").num_layers
