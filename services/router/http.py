"""The OpenAI-compatible HTTP API, as a plain ASGI app (served by uvicorn in the router process).

Routes: POST /v1/completions, POST /v1/chat/completions (stream true/false; server-sent events
exactly as the OpenAI API streams them, ending with `data: [DONE]`), GET /v1/models,
POST /tokenize, POST /detokenize, GET /version, GET|POST /ping, GET /load (as vLLM's server has
them), GET /openapi.json (services/router/openapi.py), GET /health (process up), GET /ready (at
least one decode worker), GET /v1/kairos/stats (routes, reasons, workers), GET /metrics (Prometheus).

Request bodies are decoded into the declared schemas of services/router/openai_bodies.py (every
field of vLLM's server: honoured, or refused with a 400 naming it); responses are rendered by
services/router/openai_render.py. docs/api.md has the table of what is supported.

Errors are vLLM's bodies `{"error": {"message", "type", "param", "code"}}` (`code` the status,
`type` vLLM's name for it; Kairos's reason in the `x-kairos-error` header): 400 for bad
requests (and for what no registered worker can serve, such as a prompt over every worker's
max_model_len, or a max_tokens the client set that the context cannot hold beside the prompt, as
vLLM refuses it: at once, never retried), 401 without the API key, 413 for oversized bodies, 429
(overloaded) and 503 (no worker even after holding the request `worker_wait` seconds, shutting
down) with a Retry-After header: Retry-After only where a retry can help. Unknown routes and
methods get vLLM's (FastAPI's) 404/405 `{"detail": ...}`.
Kairos extensions accepted in the body: `ttft_slo` and `tbt_slo` (seconds);
the response carries headers `x-kairos-route`, `x-kairos-reason`, `x-kairos-decode-worker`,
`x-kairos-cached-tokens` (prompt tokens the router's prefix index found cached where the prompt is
prefilled), `x-kairos-router` (the incarnation of the router replica that serves it) and
`x-kairos-request-id` (the router's own id for the request, random; the client's `x-request-id`
is echoed back but is only a label). A stream whose request late binding still holds when its
headers go out says `x-kairos-route: held` and nothing of a route (the log line has it).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import importlib.metadata
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from common.errors import Overloaded, RequestError, Unavailable
from common.router_core.requests import Event, Request
from common.router_core.trust import serving_limit
from services.router import openai_responses as responses
from services.router import openai_schema as schema
from services.router import openai_serve as serve
from services.router import openapi
from services.router.edge import DIRECT, DirectWrite
from services.router.errors import error_object
from services.router.openai_render import Choice
from services.router.service import Router

try:
    KAIROS_VERSION = importlib.metadata.version("kairos-serving")
except importlib.metadata.PackageNotFoundError:  # run from a source tree without installing
    KAIROS_VERSION = "0+unknown"

log = structlog.get_logger()

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_json = msgspec.json.Encoder()
JSON_HEADERS = [(b"content-type", b"application/json")]
ADMIT_SLICE = 16  # sub-requests of a batch admitted between two yields to the event loop
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


class HttpError(Exception):
    """An error answer: vLLM's body (services/router/errors.py), Kairos's reason in `x-kairos-error`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.retry_after, self.type = status, param, code, retry_after, type_

    def body(self) -> bytes:
        return _json.encode(error_object(self.status, str(self), self.param, self.type))


def _closing(send: Send, router: Router) -> Send:
    """`send` that adds `connection: close` to a response started while the router is leaving: the
    client's next request opens a new connection, which a balancer gives to another router. Decided
    when the response starts, not when the request arrived: a request read before SIGTERM can be
    answered (503, shutting down) after it. A plain function returning `send`'s awaitable, not a
    coroutine of its own: no frame more per message on the response's path."""
    def wrapped(message: Any) -> Awaitable[None]:
        if message["type"] == "http.response.start" and router.leaving:
            message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
        return send(message)
    return wrapped


class App:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.created = int(time.time())
        self._auth = f"Bearer {router.cfg.api_key}".encode() if router.cfg.api_key else None
        self._openapi: bytes | None = None  # /openapi.json, built at the first ask
        self._fp: tuple[str, str] | None = None  # (model root, system_fingerprint)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        send = _closing(send, self.router)  # once stopping, this connection's next request goes elsewhere
        try:
            await self._route(scope, receive, send)
        except HttpError as e:
            await self._error(send, e)
        except RequestError as e:
            await self._error(send, HttpError(400, str(e), param=e.param, code=e.code,
                                              type_="Bad Request" if e.validation else None))

    async def _error(self, send: Send, e: HttpError) -> None:
        headers = list(JSON_HEADERS)
        if e.code:
            headers.append((b"x-kairos-error", e.code.encode()))
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
            ok = t.count("decode") > 0 and self.router.accepting and not self.router.leaving
            await self._json(send, 200 if ok else 503, {"ready": ok, "prefill_workers": t.count("prefill"),
                                                        "decode_workers": t.count("decode"),
                                                        "router": self.router.incarnation})
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
            name = self.router.cfg.served_model_name
            await self._json(send, 200, {"object": "list", "data": [
                {"id": name, "object": "model", "created": self.created, "owned_by": "kairos",
                 "root": self._root(), "parent": None, "max_model_len": self._max_model_len(),
                 "permission": [{"id": f"modelperm-{self.router.incarnation}", "object": "model_permission",
                                 "created": self.created, "allow_create_engine": False, "allow_sampling": True,
                                 "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                                 "allow_fine_tuning": False, "organization": "*", "group": None,
                                 "is_blocking": False}]}]})
            return
        if path == "/v1/responses":
            if method != "POST":
                await self._json(send, 405, {"detail": "Method Not Allowed"}, [(b"allow", b"POST")])
                return
            await self._responses(scope, receive, send, await self._body(receive))
            return
        if path.startswith("/v1/responses/") and method in ("GET", "DELETE", "POST"):
            rid = path.removeprefix("/v1/responses/").removesuffix("/cancel")  # nothing is kept (vLLM's default)
            raise HttpError(404, str(responses.not_found(rid)), param="response_id", code="not_found",
                            type_="invalid_request_error")
        if path == "/v1/kairos/stats":
            await self._json(send, 200, self.router.stats())
            return
        if path in ("/v1/completions", "/v1/chat/completions"):
            if method != "POST":
                await self._json(send, 405, {"detail": "Method Not Allowed"}, [(b"allow", b"POST")])  # as vLLM's
                return
            body = await self._body(receive)
            await self._completion(scope, receive, send, body, chat=path.endswith("chat/completions"))
            return
        if path in ("/tokenize", "/detokenize"):
            self._check_auth(scope)
            if method != "POST":
                await self._json(send, 405, {"detail": "Method Not Allowed"}, [(b"allow", b"POST")])  # as vLLM's
                return
            body = await self._body(receive)
            await (self._tokenize if path == "/tokenize" else self._detokenize)(send, body)
            return
        if path == "/ping":  # vLLM's (SageMaker's) liveness route: GET or POST, 200 while the process serves
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        if path == "/load":  # vLLM's: requests in flight here
            await self._json(send, 200, {"server_load": len(self.router.requests)})
            return
        if path == "/openapi.json":
            if self._openapi is None:
                self._openapi = _json.encode(openapi.document(KAIROS_VERSION))
            await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
            await send({"type": "http.response.body", "body": self._openapi})
            return
        if path == "/version":
            await self._json(send, 200, {"version": KAIROS_VERSION})
            return
        await self._json(send, 404, {"detail": "Not Found"})  # what vLLM's server (FastAPI) answers

    def _max_model_len(self) -> int:
        """The longest prompt + output served: the decode workers' max_model_len where they report
        one (what vLLM's server reports), else the router's prompt limit."""
        limit = serving_limit(self.router.table)
        return limit if limit else self.router.cfg.max_prompt_tokens

    def _fingerprint(self) -> str:
        """`system_fingerprint`, in the form of vLLM's (`vllm-<version>-<hash8>`): Kairos's version
        and a hash of what decides the output (the model the engines load, the served name)."""
        root = self._root()
        if self._fp is None or self._fp[0] != root:
            digest = hashlib.sha256(f"{root}\0{self.router.cfg.served_model_name}".encode()).hexdigest()[:8]
            self._fp = (root, f"kairos-{KAIROS_VERSION}-{digest}")
        return self._fp[1]

    def _root(self) -> str:
        """vLLM's `root`: the model the engines load (a decode worker's), else the served name."""
        for w in self.router.table.workers.values():
            if w.role == "decode" and w.hello.model:
                return w.hello.model
        return self.router.cfg.served_model_name

    def _check_auth(self, scope: Scope) -> None:
        if self._auth is None:
            return
        for k, v in scope["headers"]:
            if k == b"authorization" and hmac.compare_digest(v, self._auth):  # constant time
                return
        raise HttpError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    async def _body(self, receive: Receive) -> bytes:
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
        return b"".join(chunks)

    async def _completion(self, scope: Scope, receive: Receive, send: Send, raw: bytes, *, chat: bool) -> None:
        router = self.router
        decoded = schema.decode(raw, chat=chat)
        self._check_model(decoded.model)
        p = schema.plan(decoded, router.cfg, router.tokenizer, router.tool_calling)
        subs = await self._admit(scope, p)
        req = subs[0]
        choices = [Choice(i, i // p.n, r, p, router.tokenizer) for i, r in enumerate(subs)]
        direct = scope.get("extensions", {}).get(DIRECT)
        serve.DIRECT_WRITE.set(direct)  # this request's task only
        watcher = self._watch_disconnect(receive, subs, direct)
        try:
            if p.stream:
                refused = await serve.placed(choices)  # a request waiting at the router: its status waits
                if refused is not None:
                    status, body = refused
                    raise HttpError(status, body["message"], code=body["code"], retry_after=body["retry_after"])
                await serve.stream(router, send, p, choices, self._headers(req), self._fingerprint())
            else:
                status, body = await serve.unary(router, p, choices, self._fingerprint())
                if status != 200:
                    raise HttpError(status, body["message"], code=body["code"], retry_after=body["retry_after"])
                await self._json(send, 200, body, self._headers(req))  # decided by now, held or not
        except OSError:  # the client went away mid-response (uvicorn's ClientDisconnected)
            pass
        finally:
            self._unwatch(watcher, direct)
            for r in subs:
                if not r.done:
                    router.abort(r)

    async def _responses(self, scope: Scope, receive: Receive, send: Send, raw: bytes) -> None:
        """POST /v1/responses (services/router/openai_responses.py)."""
        router = self.router
        try:
            body = responses.decode(raw)
            self._check_model(body.model)
            chat = responses.to_chat(body, router.tool_calling is not None)
        except RequestError as e:  # vLLM's answers about the response store it does not keep
            if e.code in ("not_found", "no_response_store"):
                raise HttpError(404 if e.code == "not_found" else 400, str(e), param=e.param, code=e.code,
                                type_="invalid_request_error") from e
            raise
        p = schema.plan(chat, router.cfg, router.tokenizer, router.tool_calling)
        req = (await self._admit(scope, p, param="input"))[0]
        c = Choice(0, 0, req, p, router.tokenizer)
        s = p.samplings[0]
        answer = responses.Answer(body, p.model, s.max_tokens, s.temperature, s.top_p, s.presence_penalty,
                                  s.frequency_penalty)
        direct = scope.get("extensions", {}).get(DIRECT)
        watcher = self._watch_disconnect(receive, [req], direct)
        try:
            if p.stream:
                refused = await serve.placed([c])  # as a completion's stream: its status waits while it waits
                if refused is not None:
                    status, out = refused
                    raise HttpError(status, out["message"], code=out["code"], retry_after=out["retry_after"])
                await responses.stream(router, send, p, c, answer, self._headers(req))
            else:
                status, out = await responses.unary(router, p, c, answer)
                if status != 200:
                    raise HttpError(status, out["message"], code=out["code"], retry_after=out["retry_after"])
                await self._json(send, 200, out, self._headers(req))
        except OSError:
            pass
        finally:
            self._unwatch(watcher, direct)
            if not req.done:
                router.abort(req)

    async def _admit(self, scope: Scope, p: schema.Plan, param: str | None = None) -> list[Request]:
        """One router request per prompt and choice, all or none; the refusals as HTTP errors."""
        router = self.router
        limit = serving_limit(router.table)
        if p.max_tokens_given and limit:  # as vLLM: a max_tokens the context cannot hold is the client's error
            want = p.samplings[0].max_tokens
            for prompt in p.prompts:
                if len(prompt) < limit < len(prompt) + want:  # a prompt too long alone: admission says so
                    raise HttpError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                    f"requested {len(prompt) + want} tokens ({len(prompt)} in the "
                                    f"{'messages' if p.chat else 'prompt'}, {want} in the completion). Please "
                                    "reduce the length of the messages or completion.", param="max_tokens",
                                    code="context_length_exceeded")
        rid = p.request_id
        client = ""
        tp = ts = ""  # the client's W3C trace context (common/tracing.py)
        for k, v in scope["headers"]:
            if k == b"x-request-id":
                rid = v.decode(errors="replace")[:128]
            elif k == b"authorization" and v != self._auth:  # a client's own key (a gateway's users)
                client = "key:" + hashlib.sha256(v).hexdigest()[:16]
            elif k == b"traceparent":
                tp = v.decode(errors="replace")[:128]
            elif k == b"tracestate":
                ts = v.decode(errors="replace")[:512]
        if not client:
            peer = scope.get("client")
            client = f"addr:{peer[0]}" if peer else "addr:?"
        subs: list[Request] = []
        try:
            for pi, prompt in enumerate(p.prompts):
                for ci, sampling in enumerate(p.samplings):
                    one = rid if rid is None or len(p.prompts) * p.n == 1 else f"{rid}-{pi}-{ci}"
                    subs.append(await router.admit(prompt, sampling, ttft_slo=p.ttft_slo, tbt_slo=p.tbt_slo,
                                                   request_id=one, client=client, traceparent=tp,
                                                   tracestate=ts))
                    if len(subs) % ADMIT_SLICE == 0:
                        await asyncio.sleep(0)  # a batch never holds the loop: other streams go on between slices
        except (Overloaded, Unavailable, RequestError) as e:
            for r in subs:
                router.abort(r, "sibling_refused")
            if isinstance(e, RequestError):  # nothing registered can serve it: a client error, not worth a retry
                where = param or ("messages" if p.chat else "prompt")
                raise HttpError(400, str(e), param=where if e.param == "prompt" else e.param, code=e.code) from e
            if isinstance(e, Overloaded):
                raise HttpError(429, str(e), code=e.code, retry_after=e.retry_after_s) from e
            raise HttpError(503, str(e), code="unavailable", retry_after=e.retry_after_s) from e
        except BaseException:  # cancelled between slices: nothing admitted stays behind
            for r in subs:
                router.abort(r, "sibling_refused")
            raise
        return subs

    def _headers(self, req: Request) -> list[tuple[bytes, bytes]]:
        d = req.decision
        out = [(b"x-request-id", (req.client_request_id or req.request_id).encode()),
               (b"x-kairos-request-id", req.request_id.encode()),
               (b"x-kairos-router", self.router.incarnation.encode())]
        if d is None:  # a stream's headers go out at once: late binding may still be holding it
            return [*out, (b"x-kairos-route", b"held")]
        return [*out, (b"x-kairos-route", d.route.encode()), (b"x-kairos-reason", d.reason.encode()),
                (b"x-kairos-decode-worker", d.decode_worker.encode()),
                (b"x-kairos-cached-tokens", str(d.cached_tokens).encode())]

    def _check_model(self, model: str | None) -> None:
        name = self.router.cfg.served_model_name
        if model is not None and model != name:
            raise HttpError(404, f"The model '{model}' does not exist; this server serves '{name}'",
                            param="model", code="model_not_found")

    def _watch_disconnect(self, receive: Receive, subs: list[Request], direct: DirectWrite | None
                          ) -> asyncio.Task[None] | None:
        """A client that goes before its response is over has its requests aborted (the workers
        told at once): on the router's edge by the connection's own `connection_lost` (no task
        per request, `DirectWrite.on_lost`), elsewhere (another server, an ASGI test client) by a
        task awaiting `receive()`'s `http.disconnect`. `_unwatch` ends either."""
        if direct is not None:
            direct.on_lost(functools.partial(self._client_gone, subs))
            return None
        return asyncio.create_task(self._await_disconnect(receive, subs))

    @staticmethod
    def _unwatch(watcher: asyncio.Task[None] | None, direct: DirectWrite | None) -> None:
        if watcher is not None:
            watcher.cancel()
        elif direct is not None:
            direct.on_lost(None)

    async def _await_disconnect(self, receive: Receive, subs: list[Request]) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                self._client_gone(subs)
                return

    def _client_gone(self, subs: list[Request]) -> None:
        for req in subs:
            self.router.abort(req)
            req.events.put_nowait(Event(error="client disconnected", error_code="client_disconnected"))

    # ------------------------------------------------------------------ vLLM's utility routes
    async def _tokenize(self, send: Send, raw: bytes) -> None:
        tok = self.router.tokenizer
        b = schema.decode_tokenize(raw)
        self._check_model(b.model)
        if b.messages is not None:
            chat = schema.ChatBody(messages=b.messages, add_generation_prompt=b.add_generation_prompt,
                                   continue_final_message=b.continue_final_message,
                                   add_special_tokens=b.add_special_tokens is True,
                                   chat_template_kwargs=b.chat_template_kwargs, tools=b.tools,
                                   tool_choice="none" if b.tools is not None else None)  # rendered, not called
            ids = schema.chat_prompt(chat, tok)[0]
        elif b.prompt is not None:
            ids = tok.encode(b.prompt, add_special_tokens=b.add_special_tokens is not False)
        else:
            raise RequestError("give 'prompt' (a string) or 'messages'", param="prompt")
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self._max_model_len(),
                               "tokens": ids, "token_strs": tok.vocab_pieces(ids) if b.return_token_strs
                               else None}
        await self._json(send, 200, out)

    async def _detokenize(self, send: Send, raw: bytes) -> None:
        tok = self.router.tokenizer
        b = schema.decode_detokenize(raw)
        self._check_model(b.model)
        if any(t < 0 for t in b.tokens):
            raise RequestError("token ids must not be negative", param="tokens", validation=True)
        # ids past the vocabulary decode to nothing, as vLLM's server (its tokenizer) answers them
        ids = [t for t in b.tokens if t < tok.vocab_size]
        await self._json(send, 200, {"prompt": tok.decode(ids, skip_special_tokens=False)})


def new_request_id() -> str:
    return uuid.uuid4().hex


def asgi_app(router: Router, forwarded_allow_ips: str) -> Any:
    """The router's ASGI app as served: `App`, behind uvicorn's X-Forwarded-For handling for the
    proxies `forwarded_allow_ips` names (the router's setting of that name; empty: none, and no
    middleware at all). Built here rather than by uvicorn's own `proxy_headers` so that the
    trusted proxies are the router's setting, not uvicorn's FORWARDED_ALLOW_IPS environment."""
    app = App(router)
    hosts = [h.strip() for h in forwarded_allow_ips.split(",") if h.strip()]
    return ProxyHeadersMiddleware(app, trusted_hosts=hosts) if hosts else app  # type: ignore[arg-type]
