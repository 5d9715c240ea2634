"""The OpenAI-compatible HTTP API, as a plain ASGI app (served by uvicorn in the router process).

Routes: POST /v1/completions, POST /v1/chat/completions (stream true/false; server-sent events
exactly as the OpenAI API streams them, ending with `data: [DONE]`), GET /v1/models,
GET /health (process up), GET /ready (at least one decode worker), GET /v1/kairos/stats
(routes, reasons, workers), GET /metrics (Prometheus).

Errors are OpenAI-style bodies `{"error": {"message", "type", "param", "code"}}`: 400 for bad
requests (and for what no registered worker can serve, such as a prompt over every worker's
max_model_len: at once, never retried), 401 without the API key, 404/405 for unknown routes, 413
for oversized bodies, 429 (overloaded) and 503 (no worker even after holding the request
`worker_wait` seconds, shutting down) with a Retry-After header: Retry-After only where a retry
can help.
Kairos extensions accepted in the body: `ttft_slo` and `tbt_slo` (seconds), `ignore_eos`;
the response carries headers `x-kairos-route`, `x-kairos-reason`, `x-kairos-decode-worker`, and
`x-kairos-request-id` (the router's own id for the request, random; the client's `x-request-id`
is echoed back but is only a label).
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog

from common import messages as m
from common.errors import Overloaded, RequestError, Unavailable
from services.router.requests import Event, Request
from services.router.service import Router

log = structlog.get_logger()

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_json = msgspec.json.Encoder()
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


class HttpError(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.retry_after = status, type_, param, code, retry_after

    def body(self) -> bytes:
        return _json.encode({"error": {"message": str(self), "type": self.type, "param": self.param,
                                       "code": self.code}})


# ---------------------------------------------------------------------------- request parsing


def _int(body: dict[str, Any], key: str, default: int | None, *, lo: int, hi: int) -> int | None:
    v = body.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"'{key}' must be an integer", param=key)
    if not lo <= v <= hi:
        raise RequestError(f"'{key}' must be between {lo} and {hi}, got {v}", param=key)
    return v


def _float(body: dict[str, Any], key: str, default: float | None, *, lo: float, hi: float) -> float | None:
    v = body.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RequestError(f"'{key}' must be a number", param=key)
    if not lo <= float(v) <= hi:
        raise RequestError(f"'{key}' must be between {lo} and {hi}, got {v}", param=key)
    return float(v)


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"'{key}' must be true or false", param=key)
    return v


class Parsed(msgspec.Struct, kw_only=True):
    chat: bool
    prompt_ids: list[int]
    sampling: m.Sampling
    stream: bool
    include_usage: bool
    ttft_slo: float | None
    tbt_slo: float | None
    model: str


def parse(router: Router, body: dict[str, Any], *, chat: bool) -> Parsed:
    cfg = router.cfg
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    if model is not None and model != cfg.served_model_name:
        raise HttpError(404, f"The model '{model}' does not exist; this server serves '{cfg.served_model_name}'",
                        param="model", code="model_not_found")
    n = _int(body, "n", 1, lo=1, hi=1_000_000)
    if n != 1:
        raise RequestError("only n=1 is supported", param="n")
    tok = router.tokenizer
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise RequestError("'messages' must be a non-empty array", param="messages")
        flat: list[dict[str, str]] = []
        for i, msg in enumerate(msgs):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
                raise RequestError(f"messages[{i}] must be an object with a 'role'", param="messages")
            content = msg.get("content", "")
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                raise RequestError(f"messages[{i}].content must be a string or an array of parts", param="messages")
            flat.append({"role": msg["role"], "content": content})
        prompt_ids = tok.encode(tok.render_chat(flat))
        max_tokens = _int(body, "max_completion_tokens", None, lo=1, hi=cfg.max_output_tokens)
        if max_tokens is None:
            max_tokens = _int(body, "max_tokens", None, lo=1, hi=cfg.max_output_tokens)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            prompt_ids = tok.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt_ids = list(prompt)
            if any(t < 0 or t >= tok.vocab_size for t in prompt_ids):
                raise RequestError(f"token ids in 'prompt' must be in [0, {tok.vocab_size})", param="prompt")
        elif prompt is None:
            raise RequestError("'prompt' is required", param="prompt")
        else:
            raise RequestError("'prompt' must be a string, an array of token ids, or an array of one of those "
                               "(batches of several prompts are not supported)", param="prompt")
        max_tokens = _int(body, "max_tokens", None, lo=1, hi=cfg.max_output_tokens)
    if not prompt_ids:
        raise RequestError("the prompt is empty", param="prompt" if not chat else "messages")
    if len(prompt_ids) > cfg.max_prompt_tokens:
        raise RequestError(f"the prompt has {len(prompt_ids)} tokens; the maximum is {cfg.max_prompt_tokens}",
                           param="prompt" if not chat else "messages", code="context_length_exceeded")
    temperature = _float(body, "temperature", 1.0, lo=0.0, hi=2.0)
    top_p = _float(body, "top_p", 1.0, lo=0.0, hi=1.0)
    seed = _int(body, "seed", None, lo=-(2**63), hi=2**63 - 1)
    stream = _bool(body, "stream", False)
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise RequestError("'stream_options' must be an object", param="stream_options")
    include_usage = bool(so and so.get("include_usage"))
    sampling = m.Sampling(max_tokens=max_tokens or cfg.default_max_tokens, temperature=temperature or 0.0,
                          top_p=top_p if top_p is not None else 1.0, ignore_eos=_bool(body, "ignore_eos", False),
                          seed=seed)
    return Parsed(chat=chat, prompt_ids=prompt_ids, sampling=sampling, stream=stream, include_usage=include_usage,
                  ttft_slo=_float(body, "ttft_slo", None, lo=0.001, hi=3600.0),
                  tbt_slo=_float(body, "tbt_slo", None, lo=0.001, hi=60.0), model=cfg.served_model_name)


# ---------------------------------------------------------------------------- the app


class Detokenizer:
    """Turns a stream of ids into text deltas; byte-level tokenizers need the whole prefix."""

    def __init__(self, router: Router) -> None:
        self.tok = router.tokenizer
        self.simple = type(self.tok).__name__ == "SimpleTokenizer"
        self.ids: list[int] = []
        self.text = ""

    def push(self, ids: list[int]) -> str:
        if self.simple:
            return self.tok.decode(ids)
        self.ids.extend(ids)
        full = self.tok.decode(self.ids)
        if full.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character: wait for the next token
        delta, self.text = full[len(self.text):], full
        return delta


class App:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.created = int(time.time())
        self._auth = f"Bearer {router.cfg.api_key}".encode() if router.cfg.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            await self._route(scope, receive, send)
        except HttpError as e:
            await self._error(send, e)
        except RequestError as e:
            await self._error(send, HttpError(400, str(e), param=e.param, code=e.code))

    async def _error(self, send: Send, e: HttpError) -> None:
        headers = list(JSON_HEADERS)
        if e.retry_after is not None:
            headers.append((b"retry-after", str(max(1, round(e.retry_after))).encode()))
        await send({"type": "http.response.start", "status": e.status, "headers": headers})
        await send({"type": "http.response.body", "body": e.body()})

    async def _json(self, send: Send, status: int, obj: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS + (headers or [])})
        await send({"type": "http.response.body", "body": _json.encode(obj)})

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        if path == "/health":
            await self._json(send, 200, {"status": "ok", "accepting": self.router.accepting})
            return
        if path == "/ready":
            t = self.router.table
            ok = t.count("decode") > 0 and self.router.accepting
            await self._json(send, 200 if ok else 503, {"ready": ok, "prefill_workers": t.count("prefill"),
                                                        "decode_workers": t.count("decode")})
            return
        if path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode())]})
            await send({"type": "http.response.body", "body": generate_latest()})
            return
        if path.startswith("/v1/"):
            self._check_auth(scope)
        if path == "/v1/models":
            await self._json(send, 200, {"object": "list", "data": [
                {"id": self.router.cfg.served_model_name, "object": "model", "created": self.created,
                 "owned_by": "kairos", "max_model_len": self.router.cfg.max_prompt_tokens}]})
            return
        if path == "/v1/kairos/stats":
            await self._json(send, 200, self.router.stats())
            return
        if path in ("/v1/completions", "/v1/chat/completions"):
            if method != "POST":
                raise HttpError(405, f"{path} takes POST", code="method_not_allowed")
            body = await self._body(receive)
            await self._completion(scope, receive, send, body, chat=path.endswith("chat/completions"))
            return
        raise HttpError(404, f"no route {method} {path}", code="not_found")

    def _check_auth(self, scope: Scope) -> None:
        if self._auth is None:
            return
        for k, v in scope["headers"]:
            if k == b"authorization" and hmac.compare_digest(v, self._auth):  # constant time
                return
        raise HttpError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                        type_="authentication_error", code="invalid_api_key")

    async def _body(self, receive: Receive) -> dict[str, Any]:
        limit = self.router.cfg.max_body_bytes
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise HttpError(400, "client disconnected")
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise HttpError(413, f"request body over {limit} bytes", code="body_too_large")
            chunks.append(chunk)
            if not msg.get("more_body"):
                break
        try:
            body = msgspec.json.decode(b"".join(chunks))
        except msgspec.DecodeError as e:
            raise RequestError(f"the body is not valid JSON: {e}", code="invalid_json") from e
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object", code="invalid_json")
        return body

    async def _completion(self, scope: Scope, receive: Receive, send: Send, body: dict[str, Any], *,
                          chat: bool) -> None:
        router = self.router
        p = parse(router, body, chat=chat)
        rid = None
        for k, v in scope["headers"]:
            if k == b"x-request-id":
                rid = v.decode(errors="replace")[:128]
        try:
            req = await router.admit(p.prompt_ids, p.sampling, ttft_slo=p.ttft_slo, tbt_slo=p.tbt_slo,
                                     request_id=rid)
        except RequestError as e:  # nothing registered can serve it: a client error, not worth a retry
            raise HttpError(400, str(e), param="messages" if p.chat and e.param == "prompt" else e.param,
                            code=e.code) from e
        except Overloaded as e:
            raise HttpError(429, str(e), type_="rate_limit_error", code="overloaded",
                            retry_after=e.retry_after_s) from e
        except Unavailable as e:
            raise HttpError(503, str(e), type_="service_unavailable", code="unavailable",
                            retry_after=e.retry_after_s) from e
        d = req.decision
        headers = [(b"x-request-id", (req.client_request_id or req.request_id).encode()),
                   (b"x-kairos-request-id", req.request_id.encode())]
        if d is not None:
            headers += [(b"x-kairos-route", d.route.encode()), (b"x-kairos-reason", d.reason.encode()),
                        (b"x-kairos-decode-worker", d.decode_worker.encode())]
        watcher = asyncio.create_task(self._watch_disconnect(receive, req))
        try:
            if p.stream:
                await self._stream(send, req, p, headers)
            else:
                await self._unary(send, req, p, headers)
        except OSError:  # the client went away mid-response (uvicorn's ClientDisconnected)
            pass
        finally:
            watcher.cancel()
            if not req.done:
                router.abort(req)

    async def _watch_disconnect(self, receive: Receive, req: Request) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                self.router.abort(req)
                req.events.put_nowait(Event(error="client disconnected", error_code="client_disconnected"))
                return

    def _base(self, req: Request, p: Parsed) -> tuple[str, str]:
        return (("chatcmpl-" if p.chat else "cmpl-") + req.request_id,
                "chat.completion.chunk" if p.chat else "text_completion")

    async def _unary(self, send: Send, req: Request, p: Parsed, headers: list[tuple[bytes, bytes]]) -> None:
        detok = Detokenizer(self.router)
        parts: list[str] = []
        finish = None
        while finish is None:
            for ev in await req.events.take():
                if ev.token_ids:
                    parts.append(detok.push(ev.token_ids))
                if ev.error is not None:
                    raise _end_error(ev)
                if ev.finish_reason is not None:
                    finish = ev.finish_reason
                    break
        text = "".join(parts)
        cid, _ = self._base(req, p)
        usage = {"prompt_tokens": len(p.prompt_ids), "completion_tokens": req.n_out,
                 "total_tokens": len(p.prompt_ids) + req.n_out}
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if p.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        d = req.decision
        await self._json(send, 200, {
            "id": cid, "object": "chat.completion" if p.chat else "text_completion", "created": int(time.time()),
            "model": p.model, "choices": [choice], "usage": usage,
            "kairos": {"route": d.route if d else None, "reason": d.reason if d else None,
                       "decode_worker": req.decode_worker, "prefill_worker": req.prefill_worker,
                       "ttft_s": (req.first_token_at - req.arrival) if req.first_token_at else None,
                       "attempts": req.attempt + 1, "kv_fallback": req.kv_fallback}}, headers)

    async def _stream(self, send: Send, req: Request, p: Parsed, headers: list[tuple[bytes, bytes]]) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS + headers})
        cid, obj = self._base(req, p)
        created = int(time.time())
        detok = Detokenizer(self.router)
        head = f'{{"id":"{cid}","object":"{obj}","created":{created},"model":{_json.encode(p.model).decode()},'
        if p.chat:
            first = head + '"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,' \
                           '"finish_reason":null}]}'
            await send({"type": "http.response.body", "body": f"data: {first}\n\n".encode(), "more_body": True})
        events = req.events
        # every token event is the same bytes around the text: build those once per request
        if p.chat:
            tok_pre = f'data: {head}"choices":[{{"index":0,"delta":{{"content":'.encode()
            tok_post = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            tok_pre = f'data: {head}"choices":[{{"index":0,"text":'.encode()
            tok_post = b',"logprobs":null,"finish_reason":null}]}\n\n'
        while True:
            batch = await events.take()
            out: list[bytes] = []
            end = False
            for ev in batch:
                if ev.token_ids:
                    out += (tok_pre, _json.encode(detok.push(ev.token_ids)), tok_post)
                if ev.error is not None:
                    err = {"error": {"message": ev.error, "type": "server_error", "param": None,
                                     "code": ev.error_code}}
                    out.append(b"data: " + _json.encode(err) + b"\n\n")
                    end = True
                    break
                if ev.finish_reason is not None:
                    fr = _json.encode(ev.finish_reason).decode()
                    if p.chat:
                        out.append(f'data: {head}"choices":[{{"index":0,"delta":{{}},"logprobs":null,'
                                   f'"finish_reason":{fr}}}]}}\n\n'.encode())
                    else:
                        out.append(f'data: {head}"choices":[{{"index":0,"text":"","logprobs":null,'
                                   f'"finish_reason":{fr}}}]}}\n\n'.encode())
                    if p.include_usage:
                        usage = {"prompt_tokens": len(p.prompt_ids), "completion_tokens": req.n_out,
                                 "total_tokens": len(p.prompt_ids) + req.n_out}
                        out.append(f'data: {head}"choices":[],"usage":{_json.encode(usage).decode()}}}\n\n'.encode())
                    end = True
                    break
            if end:
                out.append(b"data: [DONE]\n\n")
            if out:
                await send({"type": "http.response.body", "body": b"".join(out), "more_body": not end})
            if end:
                return


def _end_error(ev: Event) -> HttpError:
    """The HTTP error for a request that failed after admission (unary responses)."""
    code = ev.error_code
    if code == "invalid_request":  # a worker found the request itself at fault: retrying cannot help
        return HttpError(400, ev.error or "", code=code)
    if code == "deadline_exceeded":
        return HttpError(504, ev.error or "", type_="server_error", code=code)
    if code == "router_shutdown":  # another router (or this one, restarted) can take it
        return HttpError(503, ev.error or "", type_="server_error", code=code, retry_after=2.0)
    if code == "kv_wait_timeout":  # no KV room anywhere for a while: room frees as requests end
        return HttpError(503, ev.error or "", type_="server_error", code=code, retry_after=2.0)
    if code in ("unavailable", "retries_exhausted"):
        return HttpError(503, ev.error or "", type_="server_error", code=code)
    return HttpError(500, ev.error or "", type_="server_error", code=code)


def new_request_id() -> str:
    return uuid.uuid4().hex
