"""Where one streamed request's router CPU goes, stage by stage, in process: no socket, no HTTP parser.

    python -m bench.request_path                 # 300 one-token streamed completions, 3 repeats

One router (policy kairos, the `fast` profile, 4 decode and 2 prefill workers registered, no bus)
serves --requests streamed completions of 16 prompt tokens and one output token, one after the
other, and times each stage with the process's CPU clock: the body's decode (msgspec, every
field declared), the plan (validation, the Sampling), admission (the router's submit: admission
control, the policy's decision, the dispatch message), the stream's start (its task, the
response headers), the token's receipt with the request's end (TokenBatch decode, the core's
bookkeeping, the record, metrics and telemetry; vLLM's series folded at the end of each run, as a
scrape folds them) and the stream's end (the final chunk and
[DONE]). The workers' ledgers are cleared between requests, as their heartbeats would (none are
sent here). What is not here, and is in `kairos bench-router`'s per-request figure: the HTTP
parser and uvicorn's cycle, the sockets, the load generator's connections.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from bench.token_path import _Outbox
from common import codec, config
from common import logging as logs
from common import messages as m
from services.router import openai_schema as schema
from services.router import openai_serve as serve
from services.router import vllm_metrics
from services.router.openai_render import Choice
from services.router.service import Router

STAGES = ("body decode", "plan", "admission + decision + dispatch", "stream start",
          "token receipt + request end", "stream end")


def _hello(wid: str, role: m.Role) -> m.Hello:
    return m.Hello(protocol=m.PROTOCOL_VERSION, worker_id=wid, role=role, incarnation=f"inc-{wid}", engine="sim",
                   model="kairos-sim", token_budget=2048, kv_capacity_tokens=100_000, max_batch=64)


async def one_run(n: int) -> dict[str, float]:
    """CPU µs per request of each stage, over `n` requests."""
    cfg = config.load(config.RouterConfig, env={}, overrides={"policy": "kairos", "profile": "fast",
                                                              "liveness": 10_000})
    r = Router(cfg, outbox=_Outbox())
    now = time.monotonic()
    for i in range(4):
        r.core.on_message(f"decode-{i}".encode(), _hello(f"decode-{i}", "decode"), now)
    for i in range(2):
        r.core.on_message(f"prefill-{i}".encode(), _hello(f"prefill-{i}", "prefill"), now)
    raw = json.dumps({"model": cfg.served_model_name, "prompt": list(range(100, 116)), "max_tokens": 1,
                      "stream": True}).encode()
    spent = dict.fromkeys(STAGES, 0.0)

    async def send(msg: dict[str, Any]) -> None:
        pass

    clock = time.process_time
    for _ in range(n):
        t0 = clock()
        body = schema.decode(raw, chat=False)
        t1 = clock()
        p = schema.plan(body, cfg, r.tokenizer)
        t2 = clock()
        req = await r.admit(p.prompts[0], p.samplings[0], client="addr:bench")
        t3 = clock()
        task = asyncio.create_task(serve.stream(r, send, p, [Choice(0, 0, req, p, r.tokenizer)], [], "fp"))
        await asyncio.sleep(0)
        t4 = clock()
        wid = req.decode_worker or ""
        frame = [wid.encode(), codec.encode(m.TokenBatch(worker_id=wid, items=[
            m.TokenItem(request_id=req.request_id, attempt=req.attempt, token_ids=[100], finish_reason="length")]))]
        t5 = clock()
        r._on_work_frames(frame)
        t6 = clock()
        await task
        t7 = clock()
        for stage, s in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t6 - t5, t7 - t6), strict=True):
            spent[stage] += s
        for w in r.table.workers.values():  # what the workers' heartbeats would acknowledge
            w.acknowledge(1 << 62)
        if req.prefill_worker:
            raise SystemExit("bench.request_path: a request took the disaggregated route; this bench times the "
                             "deflected one only")
    fold = getattr(vllm_metrics, "fold", None)  # request ends kept for the next scrape: their cost counts here
    if fold is not None:
        t0 = clock()
        fold()
        spent["token receipt + request end"] += clock() - t0
    return {k: v / n * 1e6 for k, v in spent.items()}


async def main_async(a: argparse.Namespace) -> None:
    runs = [await one_run(a.requests) for _ in range(a.repeat)]
    for stage in STAGES:
        xs = [run[stage] for run in runs]
        print(f"{stage:32s} {statistics.median(xs):7.1f} µs (runs {min(xs):.1f}-{max(xs):.1f})")
    totals = [sum(run.values()) for run in runs]
    print(f"{'total':32s} {statistics.median(totals):7.1f} µs (runs {min(totals):.1f}-{max(totals):.1f}), "
          f"{a.requests} requests x {a.repeat} runs")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.request_path", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=300, help="requests per run (default 300)")
    p.add_argument("--repeat", type=int, default=3, help="runs (default 3)")
    a = p.parse_args(argv)
    logs.configure("bench", level="warning")  # as the router configures it (a cached logger per module)
    asyncio.run(main_async(a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
