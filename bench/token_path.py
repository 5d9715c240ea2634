"""The router's CPU per streamed token on its own token path, in process: no socket, no other process.

    python -m bench.token_path                    # 32 streams x 100 tokens, 7 repeats, chat and completions
    python -m bench.token_path --direct off       # the queued path: each stream's task wakes per event
    python -m bench.token_path --worker-text off  # the router decodes each token's text itself
    python -m bench.token_path --tokenizer bytes  # a byte-level tokenizer (as Hugging Face's decode)

One router (the `fast` profile, deflect-all, one decode worker registered, no bus) admits
--streams streaming requests and runs each one's SSE rendering (services/router/openai_serve.py
`stream`) as the HTTP layer does; then --tokens TokenBatch frames, one token per stream each, go
through the router's work-socket handler (`Router._on_work_frames`: msgspec decode, the core's
token bookkeeping, the events to each stream) with the loop turning between frames, as between
two engine steps. What is timed (the process's CPU clock) is that handling and the streams'
rendering and writes; the write itself is a no-op (`--direct on`: the connection's DirectWrite,
services/router/edge.py; `off`: the ASGI send), so the socket's syscall is not in the figure.
Each TokenItem carries its text delta as a decode worker sends it (`--worker-text on`, when the
code has `TokenItem.text`; made before the clock starts: it is the worker's work); `--tokenizer
bytes`: one token per byte, decoded as a byte-level tokenizer decodes (a prefix may end inside a
character), whose streams took the generic path, decoding the whole output at every token, before
the worker sent the text. `kairos bench-router` measures the whole process with its sockets:
`kairos bench-router` measures the whole process with its sockets. Prints the median and the
lowest CPU microseconds per token over --repeat runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from common import codec, config
from common import logging as logs
from common import messages as m
from services.router import openai_schema as schema
from services.router import openai_serve as serve
from services.router.openai_render import Choice
from services.router.service import Router


class _Outbox:
    """Where the core's messages to workers go: nowhere (no bus)."""

    def send(self, identity: bytes, msg: m.Msg) -> bool:
        return True

    def publish(self, msg: m.Msg) -> None:
        pass


class _Bytes:
    """A byte-level tokenizer in miniature: one token per UTF-8 byte (ids 3..258), ids 0-2 special;
    decoding is what a byte-level tokenizer's is (the bytes joined, then read as UTF-8)."""

    vocab_size = 259
    eos_token_id = 2
    fingerprint = "bytes-bench"
    additive = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + b for b in text.encode()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode(errors="replace")

    def token_str(self, token_id: int) -> str:
        return self.decode([token_id])

    def render_chat(self, messages: list[dict[str, object]], **kw: Any) -> str:
        return "\n".join(f"{msg['role']}: {msg.get('content') or ''}" for msg in messages) + "\nassistant:"


_TEXT = "the router writes what the decode worker made, über alles ✓ "


class _Socket:
    """A DirectWrite whose socket takes everything at once."""

    def ready(self) -> bool:
        return True

    def open(self) -> bool:
        return True

    def write(self, body: bytes) -> None:
        pass


async def one_run(chat: bool, streams: int, tokens: int, direct: bool, worker_text: bool = True,
                  tokenizer: str = "simple") -> float:
    """CPU µs per token of one run."""
    cfg = config.load(config.RouterConfig, env={}, overrides={"policy": "deflect-all", "profile": "fast",
                                                              "liveness": 10_000})
    r = Router(cfg, outbox=_Outbox())
    if tokenizer == "bytes":
        r.tokenizer = _Bytes()  # type: ignore[assignment]
    r.core.on_message(b"decode-0", m.Hello(protocol=m.PROTOCOL_VERSION, worker_id="decode-0", role="decode",
                                           incarnation="inc-0", engine="sim", model="kairos-sim", token_budget=2048,
                                           kv_capacity_tokens=1_000_000, max_batch=streams), time.monotonic())
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": [5, 6, 7]}
    body.update(model=cfg.served_model_name, max_tokens=tokens + 1, stream=True)
    p = schema.plan(schema.decode(json.dumps(body).encode(), chat=chat), cfg, r.tokenizer)

    async def send(msg: dict[str, Any]) -> None:
        pass

    reqs, tasks = [], []
    for _ in range(streams):
        req = await r.admit(p.prompts[0], p.samplings[0])
        if req.decode_worker != "decode-0":
            raise SystemExit(f"bench.token_path: a request was not placed on the decode worker ({req.decode_worker})")
        reqs.append(req)
        kw: dict[str, Any] = {"direct": _Socket()} if direct else {}  # (off: also runs against a tree from before it)
        tasks.append(asyncio.create_task(serve.stream(r, send, p, [Choice(0, 0, req, p, r.tokenizer)], [], "fp",
                                                      **kw)))
    await asyncio.sleep(0)
    out = r.tokenizer.encode(_TEXT) if tokenizer == "bytes" else [100 + k for k in range(50)]
    ids = [out[k % len(out)] for k in range(tokens)]
    texts: list[str | None] = [None] * tokens
    stream_text = getattr(p.samplings[0], "text", "")
    if worker_text and stream_text:  # what the decode worker sends with each token (common/worker_core/decode.py)
        from common.tokenizer import TextStream  # (only in trees that have it)

        ts = TextStream(r.tokenizer, skip_special_tokens=not p.samplings[0].text_keep_special)
        texts = [ts.push([t]) for t in ids]
    kw_text: list[dict[str, Any]] = [{"text": t} if t is not None else {} for t in texts]
    if "pos" in m.TokenItem.__struct_fields__:  # positions, checked by the router (trees that have them)
        kw_text = [{**kw, "pos": k} for k, kw in enumerate(kw_text)]
    frames = [[b"decode-0", codec.encode(m.TokenBatch(worker_id="decode-0", items=[
        m.TokenItem(request_id=q.request_id, attempt=q.attempt, token_ids=[ids[k]], **kw_text[k]) for q in reqs]))]
        for k in range(tokens)]
    t0 = time.process_time()
    for f in frames:
        r._on_work_frames(f)
        for _ in range(3):  # the streams' turn, as between two engine steps
            await asyncio.sleep(0)
    spent = time.process_time() - t0
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return spent / (tokens * streams) * 1e6


async def main_async(a: argparse.Namespace) -> None:
    for chat in (True, False):
        xs = [await one_run(chat, a.streams, a.tokens, a.direct == "on", a.worker_text == "on", a.tokenizer)
              for _ in range(a.repeat)]
        print(f"{'chat' if chat else 'completions'}: {statistics.median(xs):.2f} µs of CPU per token (median of "
              f"{a.repeat}; lowest {min(xs):.2f}), {a.streams} streams x {a.tokens} tokens, direct {a.direct}, "
              f"worker text {a.worker_text}, tokenizer {a.tokenizer}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.token_path", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=32, help="streams at once (default 32)")
    p.add_argument("--tokens", type=int, default=100, help="tokens per stream (default 100)")
    p.add_argument("--repeat", type=int, default=7, help="runs per endpoint (default 7)")
    p.add_argument("--direct", choices=("on", "off"), default="on",
                   help="write plain token chunks the direct way (on, as the router does) or the ASGI way")
    p.add_argument("--worker-text", choices=("on", "off"), default="on",
                   help="tokens come with their text from the decode worker (on, as a worker that has the "
                        "model's tokenizer sends them) or as ids only, decoded by the router (off)")
    p.add_argument("--tokenizer", choices=("simple", "bytes"), default="simple",
                   help="simple: the word tokenizer (tokens decode one by one); bytes: a byte-level one, as a "
                        "Hugging Face model's")
    a = p.parse_args(argv)
    logs.configure("bench", level="warning")  # as the router configures it (a cached logger per module)
    asyncio.run(main_async(a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
