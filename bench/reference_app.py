"""The reference `kairos bench-router` measures the router against: the least an HTTP server can do.

    python -m bench.reference_app --port 8100

A plain ASGI app on uvicorn with the router's own server settings (httptools, no access log,
no lifespan) that answers POST /v1/completions with an OpenAI-style SSE stream of `max_tokens`
one-token events and `[DONE]`, without tokenizing, routing or a bus. Driven by the same load
generator in the same run, its CPU time per request is the floor of this machine's HTTP and
JSON cost that day; the router's cost over it is a ratio that compares across machines and
days, where absolute microseconds do not (other processes, CPU frequency, kernel).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import uvicorn

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_TOKEN = b'data: {"object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'
_LAST = b'data: {"object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":"length"}]}\n\n'
_DONE = b"data: [DONE]\n\n"


# What a router in front of it asks a backend before sending it work (bench/peers.py: sglang-router
# and vllm-router check /health and read the model's path, where they load its tokenizer from:
# `--model-path`, a local directory, so nothing is fetched from anywhere).
_INFO: dict[str, bytes] = {}


def set_model(path: str) -> None:
    info = {"model_path": path, "tokenizer_path": path, "is_generation": True}
    _INFO.update({"/health": b"{}", "/health_generate": b"{}",
                  "/v1/models": msgspec.json.encode({"object": "list", "data": [{"id": path, "object": "model"}]}),
                  "/get_model_info": msgspec.json.encode(info), "/model_info": msgspec.json.encode(info),
                  "/get_server_info": msgspec.json.encode(info), "/server_info": msgspec.json.encode(info)})


class _Body(msgspec.Struct):
    max_tokens: int = 16


_decode = msgspec.json.Decoder(_Body).decode


class _Stream:
    __slots__ = ("done", "left", "send")

    def __init__(self, send: Send, n: int, done: asyncio.Future[None]) -> None:
        self.send, self.left, self.done = send, n, done


class Engine:
    """Paced mode: one step every `step_s` for every stream in flight, one event per stream per step."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.streams: list[_Stream] = []
        self.task: asyncio.Task[None] | None = None

    async def stream(self, send: Send, n: int) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.streams.append(_Stream(send, n, done))
        if self.task is None:
            self.task = asyncio.ensure_future(self._run())
        await done

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        try:
            while self.streams:
                batch, self.streams = self.streams, []  # the step's plan: who arrives now joins the next
                started = loop.time()
                deadline = max(deadline, started - self.step_s) + self.step_s  # the simulated engine's cadence
                await asyncio.sleep(max(0.0, deadline - loop.time()))
                still = []
                for st in batch:
                    st.left -= 1
                    try:
                        if st.left > 0:
                            await st.send({"type": "http.response.body", "body": _TOKEN, "more_body": True})
                            still.append(st)
                            continue
                        await st.send({"type": "http.response.body", "body": _LAST + _DONE, "more_body": False})
                    except Exception as e:
                        if not st.done.done():
                            st.done.set_exception(e)
                        continue
                    if not st.done.done():
                        st.done.set_result(None)
                self.streams = still + self.streams
        finally:
            self.task = None


_engine: Engine | None = None  # set by --step-s


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    if scope["method"] == "GET" and scope["path"] in _INFO:  # a peer router's health and discovery probes
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": _INFO[scope["path"]]})
        return
    if scope["method"] != "POST" or scope["path"] != "/v1/completions":
        await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
        return
    try:
        n = max(1, _decode(body).max_tokens)
    except msgspec.DecodeError:
        await send({"type": "http.response.start", "status": 400, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
        return
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    if _engine is not None:
        await _engine.stream(send, n)
        return
    for _ in range(n - 1):
        await send({"type": "http.response.body", "body": _TOKEN, "more_body": True})
    await send({"type": "http.response.body", "body": _LAST + _DONE, "more_body": False})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.reference_app", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model-path", default="", help="the local directory a peer router loads a tokenizer from")
    p.add_argument("--step-s", type=float, default=0.0, metavar="S",
                   help="write each stream as an engine does: one event per stream every S seconds (default 0: "
                        "every event at once)")
    args = p.parse_args(argv)
    if args.step_s < 0:
        p.error(f"--step-s must be 0 (every event at once) or a step time in seconds, got {args.step_s}")
    global _engine
    _engine = Engine(args.step_s) if args.step_s > 0 else None
    set_model(args.model_path or "reference")
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, lifespan="off", access_log=False,
                                           log_level="warning", http="httptools"))
    asyncio.run(server.serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
