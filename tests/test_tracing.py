"""Tracing in process (common/tracing.py; issue 47, item 5), spans taken by the SDK's in-memory
exporter: the router reads the client's traceparent, hangs its spans under it and sends its own
span's context to the workers; the decode worker writes its spans under that; with no endpoint
configured nothing of it exists. The cross-process trace is tests/test_tracing_live.py's."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common import codec, config, tracing
from common import messages as m
from common.engines.sim import SimEngine
from common.errors import ConfigError
from common.perf_model import load_profile
from services.decode_worker.service import DecodeWorker
from tests.test_trust import SAMPLING, frame, hello, make_router, sent

CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
CLIENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


def traced(service: str) -> tuple[tracing.Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return tracing.Tracing(service, exporter=exporter, batch=False), exporter


async def test_router_spans_hang_under_the_clients_traceparent_and_reach_the_workers() -> None:
    r = make_router("kairos")
    r.tracing, exporter = traced("kairos-router")
    try:
        frame(r, b"decode-0", hello("decode-0"))
        frame(r, b"prefill-0", hello("prefill-0", role="prefill"))
        sent(r)
        req = await r.admit([1, 2, 3] * 100, SAMPLING, traceparent=CLIENT, tracestate="vendor=x")
        work = [msg for _, msg in sent(r) if isinstance(msg, (m.DecodeWork, m.PrefillWork))]
        assert work and req.decision is not None
        span = req.span
        assert span is not None
        ctx = span.get_span_context()  # type: ignore[attr-defined]
        mine = f"00-{CLIENT_TRACE}-{ctx.span_id:016x}-01"
        assert {w.traceparent for w in work} == {mine}  # the workers' spans hang under the router's
        assert {w.tracestate for w in work} == {"vendor=x"}
        frame(r, b"decode-0", m.TokenBatch(worker_id="decode-0", items=[
            m.TokenItem(req.request_id, req.attempt, [7, 7, 7, 7], "length")]))
        assert req.done
        spans = {s.name: s for s in exporter.get_finished_spans()}
        assert set(spans) == {"kairos.request", "admission", "queueing", "decision"}
        root = spans["kairos.request"]
        assert root.parent is not None and root.parent.span_id == int(CLIENT_SPAN, 16)
        assert {s.context.trace_id for s in spans.values()} == {int(CLIENT_TRACE, 16)}
        for name in ("admission", "queueing", "decision"):
            assert spans[name].parent is not None and spans[name].parent.span_id == ctx.span_id, name
            assert root.start_time <= spans[name].start_time <= spans[name].end_time <= root.end_time, name
        d = spans["decision"].attributes
        assert d is not None
        assert d["kairos.route"] == req.decision.route and d["kairos.reason"] == req.decision.reason
        pred = req.decision.ttft_decode_pred if req.decision.route == "deflect" else req.decision.ttft_prefill_pred
        assert pred is not None and d["kairos.predicted_ttft_s"] == pred
        assert root.attributes is not None and root.attributes["kairos.outcome"] == "ok"
    finally:
        r.close()


async def test_without_an_endpoint_nothing_is_traced_and_work_carries_no_context() -> None:
    r = make_router("kairos")
    try:
        assert r.tracing is None
        frame(r, b"decode-0", hello("decode-0"))
        frame(r, b"prefill-0", hello("prefill-0", role="prefill"))
        sent(r)
        req = await r.admit([1, 2, 3] * 100, SAMPLING, traceparent=CLIENT)
        assert req.span is None
        work = [msg for _, msg in sent(r) if isinstance(msg, (m.DecodeWork, m.PrefillWork))]
        assert work and all(w.traceparent == "" for w in work)
    finally:
        r.close()
    cfg = config.load(config.RouterConfig, env={"KAIROS_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1/v1/traces"})
    t = tracing.from_config(cfg, "kairos-router")
    assert t is not None and t.endpoint == "http://127.0.0.1:1/v1/traces"
    t.shutdown()
    with pytest.raises(ConfigError, match="OTLP/HTTP traces URL"):
        tracing.from_config(msgspec.structs.replace(cfg, otlp_traces_endpoint="collector:4317"), "kairos-router")


def test_work_from_an_older_router_without_trace_fields_still_decodes() -> None:
    old = msgspec.json.encode({"type": "DecodeWork", "request_id": "r", "attempt": 0, "dispatch": 1,
                               "mode": "deflect", "prompt_token_ids": [1], "sampling": {"max_tokens": 2},
                               "tbt_slo": 0.1, "deadline_s": 5.0})
    w = msgspec.json.decode(old, type=m.DecodeInbox)
    assert isinstance(w, m.DecodeWork) and w.traceparent == "" and w.tracestate == ""
    back = codec.decode_inbox.decode(codec.encode(msgspec.structs.replace(w, traceparent=CLIENT)))
    assert isinstance(back, m.DecodeWork) and back.traceparent == CLIENT


async def test_decode_worker_writes_prefill_and_decode_spans_under_the_routers() -> None:
    cfg = config.load(config.WorkerConfig, env={}, overrides={"kv_transport": "modeled"})
    w = DecodeWorker(cfg, SimEngine("decode", load_profile("fast")))
    w.tracing, exporter = traced("kairos-decode-worker")
    w.send = lambda msg: None  # type: ignore[method-assign]
    w.on_message(m.DecodeWork(request_id="r", attempt=0, dispatch=1, mode="deflect",
                                    prompt_token_ids=[1] * 50, sampling=m.Sampling(max_tokens=3), tbt_slo=0.1,
                                    deadline_s=5.0, traceparent=CLIENT))
    w.on_message(m.DecodeWork(request_id="u", attempt=0, dispatch=2, mode="deflect",
                                    prompt_token_ids=[1] * 50, sampling=m.Sampling(max_tokens=3), tbt_slo=0.1,
                                    deadline_s=5.0))  # untraced
    tokens = w.engine.on_tokens  # what the engine calls with each step's tokens
    tokens([m.TokenItem("r", 0, [5]), m.TokenItem("u", 0, [5])], 0.01)
    assert [s.name for s in exporter.get_finished_spans()] == ["prefill"]
    await asyncio.sleep(0.001)
    tokens([m.TokenItem("r", 0, [6]), m.TokenItem("u", 0, [6])], 0.01)  # a token mid-stream: no span
    tokens([m.TokenItem("r", 0, [7], "length"), m.TokenItem("u", 0, [7], "length")], 0.01)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert sorted(spans) == ["decode", "prefill"] and len(exporter.get_finished_spans()) == 2  # "u" wrote none
    tokens([m.TokenItem("r", 0, [8], "length")], 0.01)  # the request was let go at its end: nothing more
    assert len(exporter.get_finished_spans()) == 2
    for s in spans.values():
        assert s.context.trace_id == int(CLIENT_TRACE, 16)
        assert s.parent is not None and s.parent.span_id == int(CLIENT_SPAN, 16)
    assert spans["prefill"].end_time <= spans["decode"].start_time <= spans["decode"].end_time
    assert spans["decode"].attributes is not None and spans["decode"].attributes["kairos.finish_reason"] == "length"


async def test_a_malformed_traceparent_starts_a_trace_of_the_routers_own() -> None:
    r = make_router("kairos")
    r.tracing, exporter = traced("kairos-router")
    try:
        frame(r, b"decode-0", hello("decode-0"))
        frame(r, b"prefill-0", hello("prefill-0", role="prefill"))
        req = await r.admit([1, 2, 3] * 100, SAMPLING, traceparent="00-not-a-trace-01")
        r.abort(req)
        root = next(s for s in exporter.get_finished_spans() if s.name == "kairos.request")
        assert root.parent is None and root.context.trace_id != 0
        work = [w for _, w in sent(r) if isinstance(w, (m.DecodeWork, m.PrefillWork))]
        assert work and all(w.traceparent.split("-")[1] == f"{root.context.trace_id:032x}" for w in work)
    finally:
        r.close()
