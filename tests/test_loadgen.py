"""`kairos bench` (kairos/loadgen.py): SSE parsing, arrival scheduling, a plain OpenAI server
without Kairos extras (in process), and a short replay end to end against a real local cluster."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.traces import TraceRequest
from kairos import demo
from kairos.loadgen import LoadConfig, Replay, SSEParser, classify, dispatch, main, report
from kairos.up import Cluster
from sim.stats import summarize

# ---------------------------------------------------------------------------------- SSE parsing

STREAM = (b'data: {"choices":[{"index":0,"text":" a","finish_reason":null}]}\n\n'
          b": keep-alive comment\r\n\r\n"
          b'data: {"choices":[{"index":0,"text":" b",\r\n'
          b'data: "finish_reason":null}]}\r\n\r\n'
          b"event: message\rid: 7\rdata: [DONE]\r\r\n")
EVENTS = [b'{"choices":[{"index":0,"text":" a","finish_reason":null}]}',
          b'{"choices":[{"index":0,"text":" b",\n"finish_reason":null}]}',
          b"[DONE]"]


def test_sse_whole_stream() -> None:
    assert SSEParser().feed(STREAM) == EVENTS


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_sse_split_anywhere(cut: int) -> None:
    """Split in two at every byte (inside CRLF, inside 'data:', inside the JSON): same events."""
    p = SSEParser()
    assert p.feed(STREAM[:cut]) + p.feed(STREAM[cut:]) == EVENTS


def test_sse_byte_by_byte_and_incomplete_tail() -> None:
    p = SSEParser()
    out = [e for i in range(len(STREAM)) for e in p.feed(STREAM[i:i + 1])]
    assert out == EVENTS
    assert p.feed(b"data: {\"half\": ") == []  # no blank line yet: not an event
    assert p.feed(b"1}\n\n") == [b'{"half": 1}']


def test_classify_completions_and_chat() -> None:
    tok = classify(b'{"choices":[{"index":0,"text":" x","finish_reason":null}]}')
    assert tok.token and tok.finish_reason is None
    # vLLM puts the last token and the finish reason in one event; Kairos sends the reason alone
    last = classify(b'{"choices":[{"index":0,"text":" y","finish_reason":"length"}]}')
    assert last.token and last.finish_reason == "length"
    fin = classify(b'{"choices":[{"index":0,"text":"","finish_reason":"length"}]}')
    assert not fin.token and fin.finish_reason == "length"
    held = classify(b'{"choices":[{"index":0,"text":"","finish_reason":null}]}')  # half a UTF-8 char held back
    assert held.token
    assert not classify(b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}').token
    assert classify(b'{"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}').token
    assert not classify(b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}').token
    usage = classify(b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":9,"total_tokens":12}}')
    assert usage.usage_tokens == 9 and not usage.token
    err = classify(b'{"error":{"message":"worker lost","type":"server_error","code":"unavailable"}}')
    assert err.error == "worker lost" and err.error_code == "unavailable"
    assert classify(b"[DONE]").done
    assert classify(b"{not json").error_code == "bad_event"


# ---------------------------------------------------------------------------------- arrivals


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, d: float) -> None:
        self.sleeps.append(d)
        self.now += d


async def test_dispatch_fires_on_schedule_with_a_fake_clock() -> None:
    clock = FakeClock()
    fired: list[tuple[int, float, float]] = []
    offsets = [0.0, 0.25, 0.25, 0.5, 2.0]
    await dispatch(offsets, lambda i, target: fired.append((i, target, clock.now)), t0=clock.now,
                   clock=clock, sleep=clock.sleep)
    assert [f[0] for f in fired] == [0, 1, 2, 3, 4]
    assert [f[1] - 100.0 for f in fired] == offsets          # the scheduled times
    assert [f[2] - 100.0 for f in fired] == offsets          # fired exactly then
    assert clock.sleeps == [0.25, 0.25, 1.5]                  # no sleep for arrivals already due


async def test_dispatch_late_start_fires_due_arrivals_back_to_back() -> None:
    clock = FakeClock()
    fired: list[float] = []
    await dispatch([0.0, 0.1, 0.2, 3.0], lambda i, t: fired.append(clock.now), t0=clock.now - 1.0,
                   clock=clock, sleep=clock.sleep)
    assert fired[:3] == [100.0, 100.0, 100.0]  # already due: no waiting, no reordering
    assert fired[3] == pytest.approx(102.0)
    assert clock.sleeps == [pytest.approx(2.0)]


async def test_dispatch_is_open_loop_on_the_real_clock() -> None:
    """Slow responses must not delay later arrivals."""
    loop = asyncio.get_running_loop()
    sent: list[float] = []
    tasks: list[asyncio.Task[None]] = []

    def fire(i: int, target: float) -> None:
        sent.append(loop.time() - target)
        tasks.append(asyncio.create_task(asyncio.sleep(0.5)))  # a "request" far longer than the gaps

    offsets = [0.02 * i for i in range(10)]
    await dispatch(offsets, fire, t0=loop.time() + 0.01, clock=loop.time)
    assert len(sent) == 10
    assert max(sent) < 0.1  # every send within 100 ms of its time although none had finished
    assert not any(t.done() for t in tasks)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# ---------------------------------------------------------------------------------- a plain OpenAI server


class PlainServer:
    """vLLM-like: no /v1/kairos/stats (404), no x-kairos headers; the last token carries the
    finish reason; a usage event before [DONE]. Prompt 'BUSY' lengths get 429, 'FAIL' a stream error."""

    def __init__(self, busy_len: int = -1, fail_len: int = -1) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.busy_len, self.fail_len = busy_len, fail_len

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny-llama", "object": "model"}]})
        if path != "/v1/completions":
            return httpx.Response(404, json={"detail": "Not Found"})
        body = json.loads(request.content)
        self.bodies.append(body)
        n = body["max_tokens"]
        if len(body["prompt"]) == self.busy_len:
            return httpx.Response(429, json={"error": {"message": "busy", "code": "overloaded"}})
        fail = len(body["prompt"]) == self.fail_len

        async def events() -> Any:
            for i in range(n):
                await asyncio.sleep(0.002)
                if fail and i == 1:
                    yield b'data: {"error":{"message":"engine died","code":"engine_dead"}}\n\n'
                    return
                fr = '"length"' if i == n - 1 else "null"
                yield f'data: {{"choices":[{{"index":0,"text":" t{i}","finish_reason":{fr}}}]}}\n\n'.encode()
            yield (b'data: {"choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d}}\n\n'
                   % (len(body["prompt"]), n))
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())


async def test_replay_against_a_plain_openai_server() -> None:
    server = PlainServer(busy_len=33, fail_len=44)
    reqs = [TraceRequest(0.01 * i, 10 + i, 3 + i % 4) for i in range(8)] + [
        TraceRequest(0.1, 33, 5), TraceRequest(0.11, 44, 5)]
    reqs.sort(key=lambda r: r.t)
    cfg = LoadConfig(url="http://plain.test/v1", max_concurrency=4, ttft_slo=1.0, tbt_slo=0.5)
    rp = Replay(reqs, cfg, transport=httpx.MockTransport(server))
    await rp.run()
    res = report(rp)
    assert rp.model == "tiny-llama"
    assert res["kairos"] is None  # the stats endpoint answered 404: tolerated
    assert res["requests"] == 10 and res["completed"] == 8
    assert res["errors"] == {"http_429": 1, "stream_error:engine_dead": 1}
    assert res["length_mismatch"] == 0
    assert res["deflection_rate"] == 0.0 and res["ttft_by_route"] == {}
    assert res["concurrency"]["peak"] <= 4
    ok = [r for r in rp.records if r.ok]
    assert all(r.tokens == r.output_length and len(r.gaps) == r.output_length - 1 for r in ok)
    for body in server.bodies:
        assert body["model"] == "tiny-llama" and body["stream"] is True
        assert body["ignore_eos"] is True and body["min_tokens"] == body["max_tokens"]
        assert all(1000 <= t < 2000 for t in body["prompt"])
    asked = sorted((len(b["prompt"]), b["max_tokens"]) for b in server.bodies)
    assert asked == sorted((r.input_length, r.output_length) for r in reqs)
    # the summary keys are exactly those of sim.stats.summarize, plus the load generator's
    assert set(summarize([], ttft_slo=1.0, tbt_slo=0.5)) <= set(res)


class HeldServer(PlainServer):
    """Kairos-like: streams whose prompt length is odd go out while late binding holds them
    (`x-kairos-route: held`), the others say `deflect`; /v1/kairos/stats counts what the router
    decided in the end (`ended`): one held stream was deflected later, one went disaggregated."""

    def __init__(self) -> None:
        super().__init__()
        self.stats_calls = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/kairos/stats":
            self.stats_calls += 1
            ended = {"deflect": 3, "disagg": 1} if self.stats_calls > 1 else {}
            return httpx.Response(200, json={"policy": "kairos", "routes": {"deflect": 3, "disagg": 1},
                                             "ended": ended, "reasons": {}, "counts": {},
                                             "workers": {"decode-0": {"role": "decode", "step_margin": 1.5}},
                                             "delivery_allowance_ms": 4.8})
        resp = await super().__call__(request)
        if request.url.path == "/v1/completions":
            resp.headers["x-kairos-route"] = "held" if len(json.loads(request.content)["prompt"]) % 2 else "deflect"
        return resp


async def test_a_held_streams_route_comes_from_the_routers_count() -> None:
    """The headers of a stream late binding held say "held": the client-side deflection rate
    counts it as not deflected; `deflection_rate_router` (what `kairos demo` compares with the
    simulator) counts every request by the route the router gave it in the end."""
    reqs = [TraceRequest(0.01 * i, 10 + i, 3) for i in range(4)]  # prompt lengths 10, 11, 12, 13
    rp = Replay(reqs, LoadConfig(url="http://kairos.test/v1", ttft_slo=1.0, tbt_slo=0.5),
                transport=httpx.MockTransport(HeldServer()))
    await rp.run()
    res = report(rp)
    assert res["routes"] == {"deflect": 2, "held": 2} and res["deflection_rate"] == 0.5
    assert res["kairos"]["ended"] == {"deflect": 3, "disagg": 1} and res["deflection_rate_router"] == 0.75
    assert res["kairos"]["workers"]["decode-0"]["step_margin"] == 1.5
    assert demo.live_deflection(res) == 0.75 and demo.live_routes(res) == {"deflect": 3, "disagg": 1}
    sim = {"deflection_rate": 0.8}
    gap = demo.deflection_gap(res, sim)
    assert gap is not None and "75.0% live, 80.0% simulated, a gap of -5.0 points (within 5: yes)" in gap
    assert "2 streams went out while late binding held them" in gap and "margins" not in gap
    far = demo.deflection_gap(res, {"deflection_rate": 0.9}) or ""
    assert "(within 5: no)" in far and "margins of up to decode-0 1.50" in far  # outside it, what they planned with
    # ... and the simulation rerun with the live router's delivery allowance, when the demo ran it
    told = demo.deflection_gap(res, {"deflection_rate": 0.9}, {"deflection_rate": 0.82}) or ""
    assert "decode steps to 95.2 of the 100 ms TBT SLO" in told and "with that allowance, kairos deflects 82.0%" in told
    assert "the allowance accounts for -8.0 of the -15.0 points" in told
    res["kairos"]["workers"]["decode-0"]["step_margin"] = 1.01  # a margin near 1 is not named as a cause
    near = demo.deflection_gap(res, {"deflection_rate": 0.9}, {"deflection_rate": 0.82}) or ""
    assert "margins of up to" not in near and "step margins (at most 1.01 during the run)" in near
    # the largest margin of the run counts, not the one it ended with; with the deflections turned away
    res["kairos"]["workers"]["decode-0"]["step_margin_max"] = 1.2
    res["kairos"]["reasons"] = {"disagg:deflect_rejected": 7, "deflect:decode_faster": 3}
    burst = demo.deflection_gap(res, {"deflection_rate": 0.9}, {"deflection_rate": 0.82}) or ""
    assert "margins of up to decode-0 1.20 during the run" in burst and "turned away 7 deflections" in burst
    # without the router's count (a plain server), the headers' figure stands
    assert demo.live_deflection({"deflection_rate": 0.5, "deflection_rate_router": None}) == 0.5


async def test_concurrency_bound_is_counted() -> None:
    server = PlainServer()
    reqs = [TraceRequest(0.0, 8, 6) for _ in range(6)]
    rp = Replay(reqs, LoadConfig(url="http://plain.test/v1", max_concurrency=2),
                transport=httpx.MockTransport(server))
    await rp.run()
    res = report(rp)
    assert res["completed"] == 6
    assert res["concurrency"]["peak"] == 2
    assert res["concurrency"]["bound_hits"] == 4  # six at once, two slots
    assert res["concurrency"]["bound_wait_max"] > 0.005


def test_text_mode_and_chat_need_text() -> None:
    with pytest.raises(Exception, match="chat endpoint takes text"):
        LoadConfig(url="http://x/v1", endpoint="chat")
    from kairos.loadgen import build_body

    body = json.loads(build_body(LoadConfig(url="http://x/v1", prompt_mode="text", endpoint="chat"),
                                 TraceRequest(0.0, 12, 3), 0, None))
    assert len(body["messages"][0]["content"].split()) == 12 and "model" not in body


# ---------------------------------------------------------------------------------- end to end


def test_replay_end_to_end_against_kairos(fast_cluster: Cluster, tmp_path: Path) -> None:
    """~8 s of synthetic load through a real router and workers; the documented keys come back."""
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["--url", fast_cluster.spec.api + "/v1", "--trace", "synthetic", "--rate", "12",
               "--arrival", "poisson", "--duration", "8", "--seed", "3", "--max-input-len", "2048",
               "--max-output-len", "48", "--out", str(out), "--plot", str(png), "--no-progress", "--quiet",
               "--records"])
    assert rc == 0
    res = json.loads(out.read_text())
    n = res["requests"]
    assert n > 40
    assert res["completed"] == n and res["failed"] == 0 and res["errors"] == {}
    for key in ("ttft_p50", "ttft_p95", "ttft_p99", "tbt_p95", "tbt_p99", "ttft_slo_attainment",
                "tbt_slo_attainment", "slo_attainment", "deflection_rate", "goodput", "achieved_rate",
                "offered_rate", "concurrency", "ttft_by_route", "kairos", "send_lag_p99", "length_mismatch"):
        assert key in res, key
    assert 0 < res["ttft_p50"] <= res["ttft_p95"] <= res["ttft_p99"] < 5
    assert res["length_mismatch"] == 0
    assert res["output_tokens"] == sum(r["output_length"] for r in res["records"])
    assert res["achieved_rate"] == pytest.approx(res["offered_rate"], rel=0.1)
    # the router's own counts for the run agree with the per-request headers
    k = res["kairos"]
    assert k["policy"] == "kairos" and sum(k["routes"].values()) == n
    assert k["routes"] == res["routes"]
    assert {r: s["requests"] for r, s in res["ttft_by_route"].items()} == res["routes"]
    assert res["deflection_rate"] == pytest.approx(k["routes"].get("deflect", 0) / n)
    assert k["ended"] == res["routes"] and res["deflection_rate_router"] == pytest.approx(res["deflection_rate"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------- bench-router helpers


async def test_rawclient_streams_chunked_sse_over_keep_alive() -> None:
    """The lean client of `kairos bench-router`: chunked SSE split at odd places, two requests on
    one keep-alive connection, then an error response with a Content-Length body."""
    from bench.rawclient import Pool, post

    served: list[bytes] = []
    handlers_done = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            served.append(await reader.readexactly(length))
            if len(served) == 3:
                body = b'{"error":{"message":"busy","code":"overloaded"}}'
                writer.write(b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                continue
            events = [b'data: {"choices":[{"index":0,"text":" t%d","finish_reason":null}]}\n\n' % i
                      for i in range(3)]
            events += [b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}\n\n', b"data: [DONE]\n\n"]
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-kairos-route: deflect\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            for ev in events:
                chunk = b"%x\r\n%s\r\n" % (len(ev), ev)
                for part in (chunk[:3], chunk[3:11], chunk[11:]):  # split inside the size line and the data
                    writer.write(part)
                    await writer.drain()
                    await asyncio.sleep(0.003)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        writer.close()
        await writer.wait_closed()
        handlers_done.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = Pool("127.0.0.1", port, 1)
    try:
        for i in range(2):
            r = await pool.request(post("127.0.0.1", port, "/v1/completions", b'{"n": %d}' % i), timeout=5)
            assert r.error is None and r.status == 200 and r.route == "deflect"
            assert r.tokens == 3 and r.ttft is not None and r.e2e is not None and r.e2e > r.ttft
            assert r.max_gap >= 0.003
        r = await pool.request(post("127.0.0.1", port, "/v1/completions", b"{}"), timeout=5)
        assert r.error == "http_429" and r.tokens == 0
        assert served == [b'{"n": 0}', b'{"n": 1}', b"{}"]  # one connection served all three
    finally:
        pool.close()
        await asyncio.wait_for(handlers_done.wait(), 5)  # the server side saw the close
        server.close()
        await server.wait_closed()


def test_bench_router_helpers() -> None:
    from bench.router_throughput import modeled_ttft, summarize_stacks
    from bench.steps import parse_cpus, sustained
    from common.perf_model import load_profile

    assert parse_cpus("0,2-4, 7") == {0, 2, 3, 4, 7}
    stacks = ("main (a.py:1);loop (b.py:2);send (zmq/socket.py:713) 30\n"
              "main (a.py:1);loop (b.py:2);parse (http.py:9) 10\n"
              "main (a.py:1);decide (kairos.py:5) 60\n")
    prof = summarize_stacks(stacks)
    assert prof["samples"] == 100
    assert prof["self"][0] == ("decide (kairos.py)", 0.6)
    assert dict(prof["inclusive"])["loop (b.py)"] == 0.4 and dict(prof["inclusive"])["main (a.py)"] == 1.0

    def step(rate: float, sent: int, done_rate: float, p50: float, errors: dict[str, int] | None = None
             ) -> dict[str, object]:
        return {"offered_rate": rate, "sent": sent, "duration_s": 5.0, "completed_rate": done_rate,
                "ttft_p50": p50, "errors": errors or {}}

    steps = [step(100, 510, 101, 0.003), step(500, 2480, 490, 0.006), step(1000, 5000, 990, 0.009),
             step(2000, 10000, 1500, 0.2)]
    assert sustained(steps) is steps[1]  # 1000/s kept up the rate but its TTFT p50 grew past 2x + 2 ms
    steps[1]["errors"] = {"http_503": 1}
    assert sustained(steps) is steps[0]
    fast = load_profile("fast").model
    assert modeled_ttft(fast, "deflect", 128) == pytest.approx(fast.step_time(0, 0, [(128, 0)]))
    assert modeled_ttft(fast, "disagg", 128) > modeled_ttft(fast, "deflect", 128)
