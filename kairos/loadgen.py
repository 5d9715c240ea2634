"""`kairos bench`: open-loop replay of a trace against any OpenAI-compatible endpoint.

    kairos bench --url http://127.0.0.1:8000/v1 --trace code --bursty 120 --rate-scale 1 \\
                 --out results.json --plot ttft.png

Requests leave at the trace's timestamps (divided by --rate-scale) whether or not earlier ones
have finished: the load does not slow down when the server does (open loop). Each request asks
for exactly the trace's lengths: the prompt is sent as a list of token ids (random ids in
--token-range, so no two prompts share a prefix and lengths are exact on any server), or as words
with --prompt-mode text; `max_tokens` is the output length, with `ignore_eos` and `min_tokens`
(honoured by vLLM and Kairos) so the server cannot stop early. Responses are streamed, and TTFT
(send to first token) and every gap between tokens are timed here, on the client, with
time.perf_counter.

A concurrency bound (--max-concurrency) caps requests in flight; an arrival that finds it full
waits in the client, which is counted (`concurrency.bound_hits`) and shows in `send_lag_*`. If
that happens often the replay is no longer open loop: raise the bound.

Results: a table on the terminal and, with --out, JSON with the keys of `kairos sim`'s
per-policy results (sim/stats.py `summarize`, where a request that failed counts as not
completed and misses both SLOs) plus:
    errors          {kind: count}: http_<status>, stream_error:<code>, timeout, connect,
                    protocol, read_error, incomplete (stream ended without a finish), cancelled
    error_samples   {kind: first message}
    goodput         requests/s that met both SLOs, over the wall time of the run
    offered_rate    requests/s of the schedule; achieved_rate: requests/s actually sent
    throughput      completed requests/s; output_tokens_per_s: streamed tokens/s
    send_lag_p50/p99/max   seconds between a request's scheduled and actual send
    concurrency     {max, peak, mean, bound_hits, bound_hit_rate, bound_wait_max}
    length_mismatch requests whose streamed token count differs from the asked output length
    ttft_by_route   {route: {requests, ttft_p50, ttft_p95, ttft_p99}} from `x-kairos-route`, which is
                    "held" for a stream whose request late binding still held when its headers went
                    out (its route is decided later, and the client never sees it)
    kairos          the difference of GET /v1/kairos/stats before and after the run
                    (routes and reasons: decisions, a request decided again counting once more;
                    ended: requests by the route that served them; counts; workers: as the run
                    left them), or null when the server has no such endpoint
    deflection_rate_router  the router's: requests that ended deflected over those that ended
                    (kairos.ended), or null without it. `deflection_rate` counts the headers, so
                    a held stream that was deflected later counts as not deflected there; on a
                    server no one else used during the run, this is the one to read
    config          what was run
With --records, every request's timings too.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import httpx
import msgspec
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from common.errors import ConfigError
from common.traces import LENGTHS, TraceRequest, find_bursty_window, load_trace, synthetic, trace_path
from sim.stats import RequestTiming, fmt, summarize

T = TypeVar("T")

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()

# Words for --prompt-mode text: frequent English words, each one token for the simulated engine's
# word tokenizer and (with the leading space) for common BPE vocabularies.
WORDS = ("the of and to in is was for on that with as by at from it an be this are or which have had not but were "
         "they their one all has more been would also its can there who new time year when first two other into "
         "after some only most over such may many these people then what about out them than up so could three "
         "made where between used both each under during while world state city part system well work because "
         "like through life since any how long back number").split()


# ---------------------------------------------------------------------------------- SSE parsing


class SSEParser:
    """Incremental server-sent-events parser: feed it bytes as they arrive, get the `data` of
    each complete event. Lines may end in LF, CRLF or CR and may be split anywhere across
    chunks; comment lines (`:`) and the other fields (event, id, retry) are skipped; several
    `data:` lines of one event are joined with a newline, as the SSE specification says."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk if self._buf else chunk
        out: list[bytes] = []
        if b"\r" in buf:
            # a CR at the very end may be the first half of CRLF: keep it for the next chunk
            keep_cr = buf.endswith(b"\r")
            if keep_cr:
                buf = buf[:-1]
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            if keep_cr:
                buf += b"\r"
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl]
            start = nl + 1
            if not line:
                if self._data:
                    out.append(b"\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
            # comments (":...") and other fields are ignored
        self._buf = buf[start:]
        return out


@dataclass(slots=True)
class StreamEvent:
    """What one SSE data payload means to the timing: a token arrived, the stream finished,
    the server reported an error, or nothing (role header, usage, keep-alive)."""

    token: bool = False
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None
    usage_tokens: int | None = None
    done: bool = False


def classify(data: bytes) -> StreamEvent:
    """Read one SSE data payload of an OpenAI completions or chat stream.

    A choice with text (or delta content) is a token arrival. A choice with empty text counts
    as a token too (a detokenizer holding back half a character still stepped), except when it
    only carries the finish reason or the chat role header. `[DONE]` ends the stream."""
    if data.strip() == b"[DONE]":
        return StreamEvent(done=True)
    try:
        obj = _dec.decode(data)
    except msgspec.DecodeError:
        return StreamEvent(error="undecodable stream event", error_code="bad_event")
    if not isinstance(obj, dict):
        return StreamEvent(error="stream event is not an object", error_code="bad_event")
    ev = StreamEvent()
    err = obj.get("error")
    if err is not None:
        ev.error = str(err.get("message", err)) if isinstance(err, dict) else str(err)
        code = obj.get("kairos_error") or (err.get("code") if isinstance(err, dict) else None)
        ev.error_code = str(code) if code else "error"
        return ev
    usage = obj.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        ev.usage_tokens = usage["completion_tokens"]
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        return ev
    ch = choices[0]
    if not isinstance(ch, dict):
        return ev
    ev.finish_reason = ch.get("finish_reason")
    if "delta" in ch:  # chat
        delta = ch.get("delta") or {}
        content = delta.get("content") if isinstance(delta, dict) else None
        has_text = bool(content)
        header_only = isinstance(delta, dict) and "role" in delta and not content
        ev.token = has_text or not (header_only or ev.finish_reason is not None)
    else:
        text = ch.get("text")
        ev.token = bool(text) or ev.finish_reason is None
    return ev


# ---------------------------------------------------------------------------------- arrivals


Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[Any]]


async def dispatch(offsets: Sequence[float], fire: Callable[[int, float], None], *, t0: float,
                   clock: Clock = time.perf_counter, sleep: Sleep = asyncio.sleep) -> None:
    """Open loop: call `fire(i, t0 + offsets[i])` at (or as soon as possible after) that time,
    for every i in order. `fire` must not block; nothing here waits for responses. Arrivals
    that are already due are fired back to back without yielding."""
    for i, off in enumerate(offsets):
        target = t0 + off
        delay = target - clock()
        if delay > 0:
            await sleep(delay)
        fire(i, target)


# ---------------------------------------------------------------------------------- one request


@dataclass(slots=True)
class Record:
    """One request as the client saw it. Times are seconds from the start of the run."""

    index: int
    input_length: int
    output_length: int
    scheduled: float = 0.0
    sent: float | None = None
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    usage_tokens: int | None = None
    e2e: float | None = None
    status: int | None = None
    route: str | None = None
    reason: str = ""
    request_id: str = ""  # the router's id for it (x-kairos-request-id): its log lines and records carry it
    finish_reason: str | None = None
    error: str | None = None
    error_message: str = ""
    bound_wait: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None

    def timing(self) -> RequestTiming:
        return RequestTiming(ttft=self.ttft if self.ok else None, tbt_gaps=self.gaps if self.ok else (),
                             route=self.route, reason=self.reason, prompt_tokens=self.input_length,
                             output_tokens=self.usage_tokens if self.usage_tokens is not None else self.tokens,
                             e2e=self.e2e if self.ok else None)


@dataclass(frozen=True, kw_only=True)
class LoadConfig:
    url: str                            # base URL ending in /v1
    model: str | None = None
    api_key: str = ""
    endpoint: str = "completions"       # or "chat"
    prompt_mode: str = "ids"            # or "text"
    token_range: tuple[int, int] = (1000, 2000)
    extensions: bool = True             # ignore_eos, min_tokens, ttft_slo, tbt_slo in the body
    max_concurrency: int = 512
    ttft_slo: float = 2.0
    tbt_slo: float = 0.1
    timeout: float = 300.0              # per request, send to last byte
    seed: int = 0
    kairos_stats: bool = True

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ConfigError(f"endpoint must be completions or chat, got {self.endpoint!r}")
        if self.prompt_mode not in ("ids", "text"):
            raise ConfigError(f"prompt mode must be ids or text, got {self.prompt_mode!r}")
        if self.endpoint == "chat" and self.prompt_mode == "ids":
            raise ConfigError("the chat endpoint takes text: use --prompt-mode text with --endpoint chat")
        lo, hi = self.token_range
        if not 0 <= lo < hi:
            raise ConfigError(f"token range must be 0 <= LO < HI, got {lo}..{hi}")
        if self.max_concurrency < 1:
            raise ConfigError("max concurrency must be >= 1")
        if self.timeout <= 0:
            raise ConfigError("timeout must be positive")


def build_body(cfg: LoadConfig, req: TraceRequest, index: int, model: str | None) -> bytes:
    rng = np.random.default_rng((cfg.seed, index))
    body: dict[str, Any] = {"max_tokens": req.output_length, "stream": True,
                            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if cfg.prompt_mode == "ids":
        lo, hi = cfg.token_range
        prompt: Any = rng.integers(lo, hi, size=req.input_length).tolist()
    else:
        prompt = " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=req.input_length).tolist())
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if cfg.extensions:
        body.update(ignore_eos=True, min_tokens=req.output_length, ttft_slo=cfg.ttft_slo, tbt_slo=cfg.tbt_slo)
    return _enc.encode(body)


def error_kind(e: BaseException) -> str:
    if isinstance(e, httpx.TimeoutException | TimeoutError):
        return "connect" if isinstance(e, httpx.ConnectTimeout) else "timeout"
    if isinstance(e, httpx.ConnectError):
        return "connect"
    if isinstance(e, httpx.RemoteProtocolError):
        return "protocol"
    if isinstance(e, httpx.ReadError | httpx.WriteError):
        return "read_error"
    return type(e).__name__.lower()


# ---------------------------------------------------------------------------------- the replay


class Replay:
    """One run: the schedule, the client, the per-request records and counters. Kept as an
    object so that an interrupted run can still be summarized from what completed."""

    def __init__(self, reqs: Sequence[TraceRequest], cfg: LoadConfig, *,
                 on_done: Callable[[Record], None] | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.reqs = list(reqs)
        self.cfg = cfg
        self.records = [Record(i, r.input_length, r.output_length, scheduled=r.t) for i, r in enumerate(self.reqs)]
        self.on_done = on_done
        self.model: str | None = cfg.model
        self.t0 = 0.0
        self.t_end: float | None = None
        self.in_flight = 0
        self.peak = 0
        self.bound_hits = 0
        self.finished = 0
        self.stats_before: dict[str, Any] | None = None
        self.stats_after: dict[str, Any] | None = None
        self._sem = asyncio.Semaphore(cfg.max_concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._client: httpx.AsyncClient | None = None
        self._transport = transport  # tests: an in-process server

    @property
    def base(self) -> str:
        return self.cfg.url.rstrip("/")

    def client(self) -> httpx.AsyncClient:
        n = self.cfg.max_concurrency
        headers = {"authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        # idle connections expire before the server's keep-alive timeout (uvicorn, and so vLLM and
        # Kairos: 5 s), or a request can go out on a connection the server is closing (ReadError)
        return httpx.AsyncClient(
            headers=headers, transport=self._transport,
            limits=httpx.Limits(max_connections=n, max_keepalive_connections=n, keepalive_expiry=4.0),
            timeout=httpx.Timeout(connect=10.0, read=self.cfg.timeout, write=30.0, pool=self.cfg.timeout))

    async def discover_model(self, client: httpx.AsyncClient) -> str | None:
        """The first model of GET /models (the OpenAI way to find what a server serves)."""
        r = await client.get(self.base + "/models", timeout=10.0)
        if r.status_code != 200:
            return None
        data = r.json().get("data") or []
        return str(data[0]["id"]) if data and isinstance(data[0], dict) and "id" in data[0] else None

    async def kairos_stats(self, client: httpx.AsyncClient) -> dict[str, Any] | None:
        """GET /v1/kairos/stats; None on any server that lacks it (a plain vLLM answers 404)."""
        if not self.cfg.kairos_stats:
            return None
        try:
            r = await client.get(self.base + "/kairos/stats", timeout=5.0)
            body = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return body if isinstance(body, dict) else None

    async def run(self, *, lead: float = 0.05) -> None:
        async with self.client() as client:
            self._client = client
            if self.model is None:
                self.model = await self.discover_model(client)
            self.stats_before = await self.kairos_stats(client)
            self.t0 = time.perf_counter() + lead
            try:
                await dispatch([r.t for r in self.reqs], self._fire, t0=self.t0)
                while self._tasks:
                    await asyncio.wait(set(self._tasks))
            finally:
                for t in self._tasks:
                    t.cancel()
                if self._tasks:
                    await asyncio.gather(*self._tasks, return_exceptions=True)
                self.t_end = time.perf_counter()
            self.stats_after = await self.kairos_stats(client)

    def _fire(self, i: int, scheduled: float) -> None:
        task = asyncio.create_task(self._one(self.records[i], self.reqs[i]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _one(self, rec: Record, req: TraceRequest) -> None:
        if self._sem.locked():
            self.bound_hits += 1
        waited = time.perf_counter()
        try:
            async with self._sem:
                rec.bound_wait = time.perf_counter() - waited
                self.in_flight += 1
                self.peak = max(self.peak, self.in_flight)
                try:
                    async with asyncio.timeout(self.cfg.timeout):
                        await self._send(rec, req)
                except asyncio.CancelledError:
                    rec.error = rec.error or "cancelled"
                    raise
                except Exception as e:  # every failure is a counted outcome, never a crash
                    rec.error = rec.error or error_kind(e)
                    rec.error_message = rec.error_message or f"{type(e).__name__}: {e}"[:300]
                finally:
                    self.in_flight -= 1
        finally:
            if rec.sent is None and rec.error is None:
                rec.error = "cancelled"
            self.finished += 1
            if self.on_done is not None:
                self.on_done(rec)

    async def _send(self, rec: Record, req: TraceRequest) -> None:
        assert self._client is not None
        cfg = self.cfg
        body = build_body(cfg, req, rec.index, self.model)
        path = "/chat/completions" if cfg.endpoint == "chat" else "/completions"
        request = self._client.build_request("POST", self.base + path, content=body,
                                             headers={"content-type": "application/json"})
        clock = time.perf_counter
        t_send = clock()
        rec.sent = t_send - self.t0
        resp = await self._client.send(request, stream=True)
        try:
            rec.status = resp.status_code
            rec.route = resp.headers.get("x-kairos-route")
            rec.reason = resp.headers.get("x-kairos-reason", "")
            rec.request_id = resp.headers.get("x-kairos-request-id", "")
            if resp.status_code != 200:
                raw = await resp.aread()
                rec.error = f"http_{resp.status_code}"
                rec.error_message = raw[:300].decode(errors="replace")
                return
            parser = SSEParser()
            last: float | None = None
            finished = False
            async for chunk in resp.aiter_raw():
                now = clock()
                for data in parser.feed(chunk):
                    ev = classify(data)
                    if ev.error is not None:
                        rec.error = f"stream_error:{ev.error_code}"
                        rec.error_message = ev.error[:300]
                        return
                    if ev.usage_tokens is not None:
                        rec.usage_tokens = ev.usage_tokens
                    if ev.token:
                        if last is None:
                            rec.ttft = now - t_send
                        else:
                            rec.gaps.append(now - last)
                        last = now
                        rec.tokens += 1
                    if ev.finish_reason is not None:
                        rec.finish_reason = ev.finish_reason
                        finished = True
                    if ev.done:
                        finished = True
            rec.e2e = clock() - t_send
            if not finished or rec.ttft is None:
                rec.error = "incomplete"
                rec.error_message = f"stream ended after {rec.tokens} tokens without a finish"
        finally:
            await resp.aclose()


# ---------------------------------------------------------------------------------- results


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


def _diff(after: Any, before: Any) -> Any:
    if isinstance(after, dict):
        b = before if isinstance(before, dict) else {}
        out = {k: _diff(v, b.get(k)) for k, v in after.items()}
        return {k: v for k, v in out.items() if v not in (0, {}, None)}
    if isinstance(after, int | float) and not isinstance(after, bool):
        return after - (before if isinstance(before, int | float) else 0)
    return None


def kairos_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the router counted during the run: after minus before, for routes, reasons, counts."""
    if after is None:
        return None
    out: dict[str, Any] = {"policy": after.get("policy")}
    for key in ("routes", "ended", "reasons", "counts"):
        out[key] = _diff(after.get(key) or {}, (before or {}).get(key) or {})
    if after.get("workers"):
        out["workers"] = after["workers"]  # as the run left them
    if "delivery_allowance_ms" in after:
        out["delivery_allowance_ms"] = after["delivery_allowance_ms"]  # ... and the TBT budget's delivery part
    return out


def router_deflection_rate(delta: dict[str, Any] | None) -> float | None:
    """Requests that ended deflected over all that ended, as the router counted them in `delta`
    (`kairos_delta`); None when it has no such counts."""
    ended = (delta or {}).get("ended") or {}
    n = sum(ended.values())
    return ended.get("deflect", 0) / n if n else None


def report(rp: Replay, *, config: dict[str, Any] | None = None, records: bool = False) -> dict[str, Any]:
    """The results dict of a run (see the module docstring for the keys)."""
    cfg = rp.cfg
    recs = [r for r in rp.records if r.sent is not None or r.error is not None]  # fired (all, unless interrupted)
    out = summarize([r.timing() for r in recs], ttft_slo=cfg.ttft_slo, tbt_slo=cfg.tbt_slo)
    sent = [r for r in recs if r.sent is not None]
    ok = [r for r in recs if r.ok]
    t_end = rp.t_end if rp.t_end is not None else time.perf_counter()
    wall = max(t_end - rp.t0, 1e-9)
    span = (rp.reqs[-1].t - rp.reqs[0].t) if len(rp.reqs) > 1 else 0.0
    sent_at = [r.sent for r in sent if r.sent is not None]
    send_span = max(sent_at) - min(sent_at) if len(sent_at) > 1 else 0.0
    both = sum(1 for r in ok if r.ttft is not None and r.ttft <= cfg.ttft_slo
               and (max(r.gaps) if r.gaps else 0.0) <= cfg.tbt_slo)
    lags = [r.sent - r.scheduled for r in sent if r.sent is not None]
    errors = Counter(r.error for r in recs if r.error is not None)
    samples: dict[str, str] = {}
    for r in recs:
        if r.error is not None and r.error not in samples:
            samples[r.error] = r.error_message
    busy = sum(r.e2e for r in ok if r.e2e is not None)
    k = kairos_delta(rp.stats_before, rp.stats_after)
    by_route: dict[str, dict[str, Any]] = {}
    for route in sorted({r.route for r in ok if r.route}):
        vals = [r.ttft for r in ok if r.route == route and r.ttft is not None]
        by_route[route] = {"requests": len(vals), "ttft_p50": _pct(vals, 50), "ttft_p95": _pct(vals, 95),
                           "ttft_p99": _pct(vals, 99)}
    out.update({
        "errors": dict(sorted(errors.items())),
        "error_samples": samples,
        "goodput": both / wall,
        "offered_rate": (len(rp.reqs) - 1) / span if span > 0 else None,
        "achieved_rate": (len(sent) - 1) / send_span if send_span > 0 else None,
        "throughput": len(ok) / wall,
        "output_tokens_per_s": sum(r.tokens for r in ok) / wall,
        "wall_s": wall,
        "send_lag_p50": _pct(lags, 50),
        "send_lag_p99": _pct(lags, 99),
        "send_lag_max": max(lags) if lags else None,
        "concurrency": {"max": cfg.max_concurrency, "peak": rp.peak, "mean": busy / wall,
                        "bound_hits": rp.bound_hits, "bound_hit_rate": rp.bound_hits / len(recs) if recs else 0.0,
                        "bound_wait_max": max((r.bound_wait for r in recs), default=0.0)},
        "length_mismatch": sum(1 for r in ok if (r.usage_tokens if r.usage_tokens is not None else r.tokens)
                               != r.output_length),
        "ttft_by_route": by_route,
        "kairos": k,
        "deflection_rate_router": router_deflection_rate(k),
        "model": rp.model,
    })
    if config is not None:
        out["config"] = config
    if records:
        out["records"] = [asdict(r) for r in recs]
    return out


def table(res: dict[str, Any], title: str = "") -> Table:
    tab = Table(title=title or None, title_justify="left", show_header=False)
    tab.add_column("", style="bold")
    tab.add_column("", justify="right")
    c = res["concurrency"]
    rows = [
        ("requests (completed / failed)", f"{res['requests']} ({res['completed']} / {res['failed']})"),
        ("offered / achieved rate, req/s", f"{fmt(res['offered_rate'], 'n')} / {fmt(res['achieved_rate'], 'n')}"),
        ("throughput req/s, tokens/s", f"{fmt(res['throughput'], 'n')}, {fmt(res['output_tokens_per_s'], 'n')}"),
        ("TTFT p50 / p95 / p99, s", f"{fmt(res['ttft_p50'])} / {fmt(res['ttft_p95'])} / {fmt(res['ttft_p99'])}"),
        ("TBT p50 / p95 / p99, ms", f"{fmt(res['tbt_p50'], 'ms')} / {fmt(res['tbt_p95'], 'ms')} / "
                                    f"{fmt(res['tbt_p99'], 'ms')}"),
        (f"SLO attainment TTFT<={res['ttft_slo']:g}s / TBT<={res['tbt_slo'] * 1000:g}ms / both",
         f"{fmt(res['ttft_slo_attainment'], '%')} / {fmt(res['tbt_slo_attainment'], '%')} / "
         f"{fmt(res['slo_attainment'], '%')}"),
        ("goodput, req/s meeting both SLOs", fmt(res["goodput"], "n")),
        ("deflection rate", fmt(res["deflection_rate"], "%") + (
            f" (router: {fmt(res['deflection_rate_router'], '%')}; held streams' routes are known only to it)"
            if res.get("deflection_rate_router") is not None and "held" in res["ttft_by_route"] else "")),
        ("concurrency peak / bound, bound hits", f"{c['peak']} / {c['max']}, {c['bound_hits']}"),
        ("send lag p50 / p99, ms", f"{fmt(res['send_lag_p50'], 'ms')} / {fmt(res['send_lag_p99'], 'ms')}"),
        ("errors", ", ".join(f"{k} {v}" for k, v in res["errors"].items()) or "none"),
    ]
    if res["length_mismatch"]:
        rows.append(("output length != asked", str(res["length_mismatch"])))
    for route, s in res["ttft_by_route"].items():
        rows.append((f"route {route}: n, TTFT p50 / p95 / p99 s",
                     f"{s['requests']}, {fmt(s['ttft_p50'])} / {fmt(s['ttft_p95'])} / {fmt(s['ttft_p99'])}"))
    if res.get("kairos"):
        k = res["kairos"]
        rows.append((f"router ({k.get('policy')}): reasons", ", ".join(f"{r} {n}" for r, n in k["reasons"].items())
                     or "-"))
    for name, value in rows:
        tab.add_row(name, value)
    return tab


def plot(runs: Mapping[str, Sequence[Record]], path: str, *, ttft_slo: float | None = None, title: str = "") -> None:
    """TTFT CDF of each run, and TTFT against arrival time (deflected requests marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for label, recs in runs.items():
        v = np.sort([r.ttft for r in recs if r.ok and r.ttft is not None])
        if v.size:
            ax1.plot(v, np.arange(1, v.size + 1) / v.size, label=f"{label} (p95 {np.percentile(v, 95):.2f}s)")
        pts = [(r.sent, r.ttft) for r in recs if r.ok and r.sent is not None]
        line = ax2.scatter([p[0] for p in pts], [p[1] for p in pts], s=6, alpha=0.6, label=label)
        dfl = [(r.sent, r.ttft) for r in recs if r.ok and r.route == "deflect" and r.sent is not None]
        if dfl:
            ax2.scatter([p[0] for p in dfl], [p[1] for p in dfl], s=14, facecolors="none",
                        edgecolors=line.get_facecolor()[0], linewidths=0.6, label=f"{label}: deflected")
    if ttft_slo:
        ax1.axvline(ttft_slo, color="grey", ls="--", lw=1, label=f"TTFT SLO {ttft_slo:g}s")
        ax2.axhline(ttft_slo, color="grey", ls="--", lw=1)
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT (s, log scale)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("TTFT CDF")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8, loc="lower right")
    ax2.set_yscale("log")
    ax2.set_xlabel("send time (s from start)")
    ax2.set_ylabel("TTFT (s, log scale)")
    ax2.set_title("TTFT over the run")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=8, loc="upper left", markerscale=2)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------- trace selection


def select_trace(args: argparse.Namespace) -> tuple[list[TraceRequest], dict[str, Any]]:
    """The requests to send, as `kairos sim` selects them (same flags, same meaning)."""
    info: dict[str, Any] = {"trace": args.trace, "rate_scale": args.rate_scale}
    if args.rate_scale <= 0 or not math.isfinite(args.rate_scale):
        raise ConfigError("--rate-scale must be a positive number")
    if args.trace == "synthetic":
        duration = args.duration or 60.0
        base = synthetic(rate=args.rate, duration=duration, arrival=args.arrival, cv=args.cv, seed=args.seed,
                         **LENGTHS[args.lengths])  # type: ignore[arg-type]
        reqs = [TraceRequest(t=r.t / args.rate_scale, input_length=r.input_length, output_length=r.output_length)
                for r in base]
        info.update(rate=args.rate, arrival=args.arrival, cv=args.cv, lengths=args.lengths, seed=args.seed,
                    start=0.0, duration=duration)
    else:
        path = trace_path(args.trace)
        start, duration = args.start, args.duration
        if args.bursty is not None:
            start, duration = find_bursty_window(load_trace(path), args.bursty), args.bursty
        reqs = load_trace(path, start=start, duration=duration, rate_scale=args.rate_scale)
        info.update(trace_path=str(path), start=start, duration=duration)
    if args.max_input_len or args.max_output_len:
        mi, mo = args.max_input_len or 1 << 30, args.max_output_len or 1 << 30
        clipped = sum(1 for r in reqs if r.input_length > mi or r.output_length > mo)
        reqs = [TraceRequest(r.t, min(r.input_length, mi), min(r.output_length, mo)) for r in reqs]
        info.update(max_input_len=args.max_input_len, max_output_len=args.max_output_len, clipped=clipped)
    if args.max_requests:
        reqs = reqs[:args.max_requests]
    if reqs and reqs[0].t > 0:  # start the replay at the first arrival, not at an empty stretch
        t0 = reqs[0].t
        info["skipped_idle_s"] = t0
        reqs = [TraceRequest(r.t - t0, r.input_length, r.output_length) for r in reqs]
    return reqs, info


# ---------------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(prog="kairos bench", description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=doc.split("\n\n", 1)[1])
    s = p.add_argument_group("server")
    s.add_argument("--url", default="http://127.0.0.1:8000/v1",
                   help="base URL of the OpenAI API (default %(default)s)")
    s.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    s.add_argument("--api-key", default="", help="sent as 'Authorization: Bearer KEY'")
    s.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="completions (default) or chat (needs --prompt-mode text)")
    s.add_argument("--prompt-mode", choices=("ids", "text"), default="ids",
                   help="ids: the prompt is a list of token ids, exact lengths (default); text: words, about one "
                        "token each")
    s.add_argument("--token-range", default="1000,2000", metavar="LO,HI",
                   help="token ids are drawn from [LO, HI) (default 1000,2000)")
    s.add_argument("--no-extensions", action="store_true",
                   help="do not send ignore_eos, min_tokens, ttft_slo, tbt_slo (for strict servers; output lengths "
                        "are then up to the model)")
    s.add_argument("--no-kairos-stats", action="store_true", help="do not call GET /v1/kairos/stats")
    t = p.add_argument_group("trace (as in kairos sim)")
    t.add_argument("--trace", default="code",
                   help="a CSV or JSON-lines file, 'code' or 'conv' (the Azure 2023 traces), or 'synthetic' "
                        "(default: code)")
    t.add_argument("--start", type=float, default=0.0, help="slice start, seconds of trace time (default 0)")
    t.add_argument("--duration", type=float, default=None,
                   help="slice length, seconds of trace time (default: to the end; synthetic: 60)")
    t.add_argument("--bursty", type=float, default=None, metavar="S",
                   help="replay the S-second window with the most prompt tokens (overrides --start/--duration)")
    t.add_argument("--rate-scale", type=float, default=1.0, help="time compression, 2 = twice the rate (default 1)")
    t.add_argument("--rate", type=float, default=2.57, help="synthetic: mean requests/s (default 2.57)")
    t.add_argument("--arrival", choices=("gamma", "poisson", "onoff"), default="onoff",
                   help="synthetic: arrival process (default onoff)")
    t.add_argument("--cv", type=float, default=2.2, help="synthetic: inter-arrival CV (default 2.2)")
    t.add_argument("--lengths", choices=tuple(LENGTHS), default="code", help="synthetic: length fits (default code)")
    t.add_argument("--seed", type=int, default=0, help="synthetic trace and prompt ids seed (default 0)")
    t.add_argument("--max-requests", type=int, default=0, help="send only the first N requests")
    t.add_argument("--max-input-len", type=int, default=0, help="clip prompt lengths (small models)")
    t.add_argument("--max-output-len", type=int, default=0, help="clip output lengths")
    r = p.add_argument_group("run and output")
    r.add_argument("--max-concurrency", type=int, default=512, help="requests in flight at most (default 512)")
    r.add_argument("--timeout", type=float, default=300.0, help="per-request limit, seconds (default 300)")
    r.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT SLO, seconds (default 2.0)")
    r.add_argument("--tbt-slo", type=float, default=0.1, help="TBT SLO, seconds (default 0.1)")
    r.add_argument("--out", default=None, help="write results JSON here")
    r.add_argument("--records", action="store_true", help="include every request's timings in the JSON")
    r.add_argument("--plot", default=None, metavar="FILE.png", help="TTFT CDF and TTFT over time")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--quiet", action="store_true", help="no table on the terminal")
    return p


def parse_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--token-range must be LO,HI, got {text!r}") from None
    return lo, hi


async def run_with_progress(rp: Replay, console: Console, *, show: bool, label: str = "replay") -> None:
    if not show:
        await rp.run()
        return
    errors = 0
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[status]}"), console=console, transient=False) as prog:
        task = prog.add_task(label, total=len(rp.reqs), status="")

        def done(rec: Record) -> None:
            nonlocal errors
            errors += rec.error is not None
            prog.update(task, advance=1, status=f"in flight {rp.in_flight}  errors {errors}")

        rp.on_done = done
        await rp.run()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Console(quiet=args.quiet)
    err = Console(stderr=True)
    try:
        reqs, info = select_trace(args)
        cfg = LoadConfig(url=args.url, model=args.model, api_key=args.api_key, endpoint=args.endpoint,
                         prompt_mode=args.prompt_mode, token_range=parse_range(args.token_range),
                         extensions=not args.no_extensions, max_concurrency=args.max_concurrency,
                         ttft_slo=args.ttft_slo, tbt_slo=args.tbt_slo, timeout=args.timeout, seed=args.seed,
                         kairos_stats=not args.no_kairos_stats)
    except ConfigError as e:
        err.print(f"[red]kairos bench: {e}[/]")
        return 2
    if not reqs:
        err.print("[red]kairos bench: the selected trace slice holds no request[/]")
        return 2
    span = reqs[-1].t
    err.print(f"replaying {len(reqs)} requests over {span:.1f} s against {cfg.url} "
              f"({info['trace']}, rate scale {args.rate_scale:g}, concurrency bound {cfg.max_concurrency})")
    rp = Replay(reqs, cfg)
    interrupted = False
    try:
        run_loop(run_with_progress(rp, err, show=not args.no_progress and err.is_terminal))
    except KeyboardInterrupt:
        interrupted = True
        err.print("[yellow]interrupted: summarizing what was sent[/]")
    except httpx.HTTPError as e:
        err.print(f"[red]kairos bench: cannot reach {cfg.url}: {type(e).__name__}: {e}[/]")
        return 1
    config = {**info, "url": cfg.url, "endpoint": cfg.endpoint, "prompt_mode": cfg.prompt_mode,
              "max_concurrency": cfg.max_concurrency, "extensions": cfg.extensions, "timeout": cfg.timeout,
              "date": datetime.date.today().isoformat(), "interrupted": interrupted}
    res = report(rp, config=config, records=args.records)
    out.print(table(res, f"kairos bench: {res['model'] or 'model ?'} at {cfg.url}"))
    c = res["concurrency"]
    if c["bound_hits"]:
        err.print(f"[yellow]{c['bound_hits']} arrivals ({100 * c['bound_hit_rate']:.1f}%) found "
                  f"{c['max']} requests in flight and waited up to {c['bound_wait_max']:.2f}s: "
                  f"raise --max-concurrency for a true open loop[/]")
    if res["send_lag_p99"] is not None and res["send_lag_p99"] > 0.05 and not c["bound_hits"]:
        err.print(f"[yellow]the client sent late (send lag p99 {1000 * res['send_lag_p99']:.0f} ms): it is short "
                  f"of CPU; timings include that[/]")
    if args.out:
        with open(args.out, "wb") as f:
            f.write(msgspec.json.format(_enc.encode(res), indent=2))
        err.print(f"results: {args.out}")
    if args.plot:
        plot({res["kairos"]["policy"] if res.get("kairos") else "run": rp.records}, args.plot,
             ttft_slo=cfg.ttft_slo, title=f"{info['trace']} x{args.rate_scale:g}, {len(reqs)} requests")
        err.print(f"plot: {args.plot}")
    return 130 if interrupted else 0


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on uvloop when installed (less client overhead per request)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
    return uvloop.run(coro)


if __name__ == "__main__":
    sys.exit(main())
