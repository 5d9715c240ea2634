"""bench/reference_app.py, the floor `kairos bench-router` measures the router against: it must
answer the load generator's requests as the router does (an SSE stream it counts token by token)."""

from __future__ import annotations

from typing import Any

from bench.reference_app import app
from kairos.loadgen import SSEParser, classify


async def _call(method: str, path: str, body: bytes) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    chunks = [{"type": "http.request", "body": body[:5], "more_body": True},
              {"type": "http.request", "body": body[5:], "more_body": False}]

    async def receive() -> dict[str, Any]:
        return chunks.pop(0)

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    await app({"type": "http", "method": method, "path": path}, receive, send)
    return sent


async def test_streams_max_tokens_events_then_done() -> None:
    sent = await _call("POST", "/v1/completions", b'{"prompt": [1, 2], "max_tokens": 3, "stream": true}')
    assert sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream") in sent[0]["headers"]
    parser = SSEParser()
    events = [classify(d) for m in sent[1:] for d in parser.feed(m["body"])]
    assert [e.token for e in events] == [True, True, True, False]
    assert events[2].finish_reason == "length" and events[3].done
    assert sent[-1]["more_body"] is False


async def test_anything_else_is_404_or_400() -> None:
    assert (await _call("GET", "/v1/models", b""))[0]["status"] == 404
    assert (await _call("POST", "/v1/completions", b"not json at all"))[0]["status"] == 400
