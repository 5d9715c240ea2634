"""One request followed from the client through router and workers (issue 47, item 5): a local
cluster of processes on the simulated engine exports its spans over OTLP/HTTP to a tiny collector
this test runs on 127.0.0.1; each request is one trace, a child of the client's `traceparent`,
with every span the router, the prefill worker and the decode worker write."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.conftest import start_cluster

ROUTER_SPANS = {"kairos.request", "admission", "queueing", "decision"}


class Collector:
    """An OTLP/HTTP trace receiver: every span it was sent, with its service's name."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest.FromString(body)
                got = []
                for rs in req.resource_spans:
                    service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            got.append({"service": service, "name": s.name, "trace": s.trace_id.hex(),
                                        "span": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                                        "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                                        "attrs": {a.key: a.value for a in s.attributes}})
                with collector.lock:
                    collector.spans += got
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["trace"] == trace_id]


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.server.shutdown()
    c.server.server_close()


def test_one_request_is_one_trace_across_router_prefill_and_decode_workers(tmp_path: Path,
                                                                           collector: Collector) -> None:
    fast_export = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # export each batch after 0.1 s, not 5 s
    c = start_cluster(tmp_path, prefill=1, decode=1, profile="fast", policy="disagg-least-loaded",
                      kv_transport="modeled", otlp_traces_endpoint=collector.url, router_env=fast_export,
                      worker_env=fast_export)
    try:
        clients = [(f"{i + 1:032x}", f"{i + 0xa1:016x}") for i in range(2)]  # (trace id, client span id)
        with httpx.Client(base_url=c.spec.api, timeout=30) as http:
            for trace_id, parent in clients:
                r = http.post("/v1/completions", json={"model": "kairos-sim", "prompt": "hello " * 40,
                                                       "max_tokens": 4, "stream": True},
                              headers={"traceparent": f"00-{trace_id}-{parent}-01", "tracestate": "vendor=x"})
                assert r.status_code == 200, r.text
        want = ROUTER_SPANS | {"prefill", "kv_transfer", "decode"}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all({s["name"] for s in collector.trace(t)} >= want for t, _ in clients):
                break
            time.sleep(0.1)
    finally:
        c.stop(15)
    for trace_id, parent in clients:
        spans = collector.trace(trace_id)
        by_name = {s["name"]: s for s in spans}
        assert set(by_name) == want, sorted(by_name)
        assert len(spans) == len(want)  # one of each: one attempt, one trace per request
        root = by_name["kairos.request"]
        assert root["parent"] == parent and root["service"] == "kairos-router"  # the client's span is its parent
        for name in want - {"kairos.request"}:
            s = by_name[name]
            assert s["parent"] == root["span"], name  # every other span hangs under the router's
            assert root["start"] <= s["start"] <= s["end"] <= root["end"] + 50_000_000, name  # within it (50 ms)
        assert {by_name[n]["service"] for n in ROUTER_SPANS} == {"kairos-router"}
        assert by_name["prefill"]["service"] == by_name["kv_transfer"]["service"] == "kairos-prefill-worker"
        assert by_name["decode"]["service"] == "kairos-decode-worker"
        d = by_name["decision"]["attrs"]
        assert d["kairos.route"].string_value == "disagg"
        assert d["kairos.reason"].string_value
        assert d["kairos.policy"].string_value == "disagg-least-loaded"  # (predicts no TTFT: test_tracing.py's does)
        assert d["kairos.decode_worker"].string_value and d["kairos.prefill_worker"].string_value
        assert by_name["kv_transfer"]["start"] >= by_name["prefill"]["end"] - 1_000_000
