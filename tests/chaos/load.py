"""A steady, bounded load for the chaos suite, and the ledger of what happened to each request.

Each request streams; the client honours the server's "retry later" answers (429/503 with
Retry-After, or connection refused while the router restarts) like a well-behaved OpenAI client,
at most `retry_for` seconds. Every request ends in exactly one bucket:

    completed   [DONE] after exactly max_tokens tokens and a finish_reason (and, against the simulated
                engine, exactly the text it generates for that request: no token repeated or missing)
    failed      a clear error: HTTP error status, an error event in the stream, the connection
                dropped (only the router dying does that), or never admitted within retry_for
    lost        a 200 stream that ended without [DONE] and without an error, or a success with
                the wrong number of tokens or the wrong text: the client cannot tell it went wrong
    hung        still running at the deadline
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from common.engines.sim import synthetic_token
from common.tokenizer import SimpleTokenizer

_tok = SimpleTokenizer()


def sim_text(request_id: str, tokens: int) -> str:
    """The text the simulated engine streams for a request (what a correct stream must carry)."""
    return _tok.decode([synthetic_token(request_id, i) for i in range(tokens)])


@dataclass
class Tally:
    accepted: int = 0
    completed: int = 0
    failed: int = 0
    lost: int = 0
    hung: int = 0
    retries: int = 0
    sent: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    ttft: list[float] = field(default_factory=list)    # per accepted request: send to first token, s
    stall: list[float] = field(default_factory=list)   # per accepted request: longest gap between tokens, s
    streaming: Counter[str] = field(default_factory=Counter)  # decode worker -> streams it is sending now
    streaming_at_fault: int = -1  # the faulted decode worker's streams when the fault came (-1: not counted)
    # router replica (x-kairos-router; "" before any header came) -> outcome -> requests
    by_router: dict[str, Counter[str]] = field(default_factory=dict)
    open_by_router: Counter[str] = field(default_factory=Counter)  # router replica -> responses open now

    def outcome(self, router: str, what: str) -> None:
        self.by_router.setdefault(router, Counter())[what] += 1

    def worst(self) -> str:
        """The slowest first token and the longest pause any client saw (what a fault cost)."""
        return (f"ttft_max={max(self.ttft, default=0):.2f}s stall_max={max(self.stall, default=0):.2f}s "
                f"stalls>0.5s={sum(1 for g in self.stall if g > 0.5)}")

    def row(self, name: str) -> str:
        errs = ", ".join(f"{k}={v}" for k, v in sorted(self.errors.items())) or "-"
        return (f"{name:<28} sent={self.sent:<4} accepted={self.accepted:<4} completed={self.completed:<4} "
                f"failed={self.failed:<3} lost={self.lost} hung={self.hung} retries={self.retries:<3} errors: {errs}")


async def one_request(client: httpx.AsyncClient, url: str, tally: Tally, rng: random.Random, *,
                      retry_for: float, check_text: bool = True) -> None:
    tally.sent += 1
    prompt_tokens = int(min(6000, max(16, rng.lognormvariate(6.6, 0.9))))
    max_tokens = rng.randint(8, 48)
    body = {"prompt": [1000 + (i % 997) for i in range(prompt_tokens)], "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    give_up = time.monotonic() + retry_for
    t0 = time.monotonic()
    router = ""
    while True:
        try:
            async with client.stream("POST", url, json=body) as r:
                router = r.headers.get("x-kairos-router", "")
                if r.status_code in (429, 503) and time.monotonic() < give_up:
                    tally.retries += 1
                    await asyncio.sleep(min(1.0, float(r.headers.get("retry-after", "0.2")) * 0.25))
                    continue
                if r.status_code != 200:
                    await r.aread()
                    tally.failed += 1
                    tally.errors[f"http_{r.status_code}"] += 1
                    tally.outcome(router, f"http_{r.status_code}")
                    return
                tally.accepted += 1
                done = tally.completed
                tally.open_by_router[router] += 1
                try:
                    await _consume(r, tally, max_tokens, check_text=check_text, t0=t0,
                                   worker=r.headers.get("x-kairos-decode-worker", ""))
                finally:
                    tally.open_by_router[router] -= 1
                tally.outcome(router, "completed" if tally.completed > done else "not_completed")
                return
        except (httpx.ConnectError, httpx.ConnectTimeout):
            if time.monotonic() < give_up:
                tally.retries += 1
                await asyncio.sleep(0.2)
                continue
            tally.failed += 1
            tally.errors["never_connected"] += 1
            return
        except httpx.ReadTimeout:
            tally.hung += 1
            tally.errors["read_timeout"] += 1
            tally.outcome(router, "read_timeout")
            return
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            tally.failed += 1
            tally.errors[f"connection_dropped:{type(e).__name__}"] += 1
            tally.outcome(router, "connection_dropped")
            return


async def _consume(r: httpx.Response, tally: Tally, max_tokens: int, *, check_text: bool, t0: float,
                   worker: str) -> None:
    times: list[float] = []  # when each text chunk arrived
    try:
        await _read(r, tally, max_tokens, check_text=check_text, times=times, worker=worker)
    finally:
        if times:
            tally.streaming[worker] -= 1
            tally.ttft.append(times[0] - t0)
            tally.stall.append(max((b - a for a, b in itertools.pairwise(times)), default=0.0))


async def _read(r: httpx.Response, tally: Tally, max_tokens: int, *, check_text: bool, times: list[float],
                worker: str) -> None:
    tokens = 0
    finish = None
    text: list[str] = []
    rid = ""
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            if check_text and finish is not None and "".join(text) != sim_text(rid, max_tokens):
                tally.lost += 1
                tally.errors["wrong_text"] += 1
            elif finish is not None and tokens == max_tokens:
                tally.completed += 1
            else:
                tally.lost += 1
                tally.errors[f"bad_completion:{tokens}/{max_tokens}:{finish}"] += 1
            return
        ev = json.loads(data)
        if "error" in ev:
            tally.failed += 1
            tally.errors[ev.get("kairos_error") or ev["error"].get("code") or "stream_error"] += 1
            return
        rid = ev["id"].removeprefix("cmpl-")
        ch = ev["choices"][0]
        if ch.get("text"):
            if not times:
                tally.streaming[worker] += 1
            times.append(time.monotonic())
            tokens += len(ch["text"].split())
            text.append(ch["text"])
        if ch.get("finish_reason"):
            finish = ch["finish_reason"]
    tally.lost += 1
    tally.errors["stream_ended_silently"] += 1


async def run_load(url: str, *, rate: float, duration: float, seed: int, retry_for: float = 20.0,
                   hang_after: float = 60.0, check_text: bool = True, count: int | None = None,
                   tally: Tally | None = None) -> Tally:
    """Poisson arrivals at `rate` for `duration` s (or until `count` requests are sent); then wait up
    to `hang_after` s for stragglers."""
    rng = random.Random(seed)
    tally = tally if tally is not None else Tally()
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(hang_after, connect=2.0), limits=limits) as client:
        tasks: list[asyncio.Task[None]] = []
        end = time.monotonic() + duration
        while time.monotonic() < end and (count is None or len(tasks) < count):
            tasks.append(asyncio.create_task(one_request(client, url, tally, rng, retry_for=retry_for,
                                                         check_text=check_text)))
            await asyncio.sleep(rng.expovariate(rate))
        done, pending = await asyncio.wait(tasks, timeout=hang_after)
        for t in pending:
            t.cancel()
        tally.hung += len(pending)  # plus the read timeouts counted above
        for t in done:
            if t.exception() is not None:
                tally.failed += 1
                tally.errors[f"client_exception:{type(t.exception()).__name__}"] += 1
    return tally
