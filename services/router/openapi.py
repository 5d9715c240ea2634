"""`GET /openapi.json`: the router's API described for tools (client generators, schemathesis).

The request bodies' schemas are generated from the very msgspec types the router decodes them
with (services/router/openai_bodies.py), so the document cannot drift from what is accepted:
unknown fields are refused there, and `additionalProperties: false` says so here. Response
bodies are described by their media type only (they are vLLM's shapes, docs/api.md).
"""

from __future__ import annotations

from typing import Any

import msgspec

from services.router import openai_responses as responses
from services.router import openai_schema as schema


class _ErrorDetail(msgspec.Struct):
    """vLLM's: `code` is the HTTP status; Kairos's reason is in the x-kairos-error header."""
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    """Every error the router answers: 4xx and 5xx alike."""
    error: _ErrorDetail


_REF = "#/components/schemas/{name}"


def _errors(*codes: int) -> dict[str, Any]:
    why = {400: "the request is invalid (the message names the field)", 401: "missing or wrong API key",
           404: "unknown model or route", 405: "wrong method", 408: "the body did not arrive in time",
           413: "body too large", 429: "overloaded (Retry-After)", 503: "no worker can take it now, or the "
           "router is shutting down (Retry-After)"}
    ref = {"application/json": {"schema": {"$ref": _REF.format(name="ErrorResponse")}}}
    return {str(c): {"description": why[c], "content": ref} for c in codes}


def _json(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"type": "object"}}}}


def _post(ref: str, summary: str, *, stream: bool = False, auth: bool = True) -> dict[str, Any]:
    ok: dict[str, Any] = _json("the answer, as vLLM's server gives it")
    if stream:
        ok["content"]["text/event-stream"] = {"schema": {"type": "string", "description": "with stream: true, "
                                                         "server-sent events ending with data: [DONE]"}}
    op: dict[str, Any] = {"summary": summary,
                          "requestBody": {"required": True,
                                          "content": {"application/json": {"schema": {"$ref": ref}}}},
                          "responses": {"200": ok, **_errors(400, 401, 404, 408, 413, 429, 503)}}
    if auth:
        op["security"] = [{"bearer": []}, {}]
    return {"post": op}


def _get(summary: str, description: str = "OK", media: str = "application/json") -> dict[str, Any]:
    content = {media: {"schema": {"type": "object" if media == "application/json" else "string"}}}
    return {"get": {"summary": summary, "responses": {"200": {"description": description, "content": content}}}}


def document(version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of this router's HTTP API."""
    refs, components = msgspec.json.schema_components(
        [schema.CompletionBody, schema.ChatBody, schema.TokenizeBody, schema.DetokenizeBody,
         responses.ResponsesBody, ErrorResponse], ref_template=_REF)
    completion, chat, tokenize, detokenize, resp, _ = (r["$ref"] for r in refs)
    ready = _get("at least one decode worker and accepting requests (503 otherwise)")
    ready["get"]["responses"]["503"] = _json("not ready: no decode worker, or draining")
    return {
        "openapi": "3.1.0",
        "info": {"title": "Kairos router", "version": version,
                 "description": "The OpenAI-compatible API of Kairos, a router for disaggregated LLM serving. "
                                "Request fields: vLLM's server's; unknown fields are refused (400)."},
        "paths": {
            "/v1/completions": _post(completion, "text completion", stream=True),
            "/v1/chat/completions": _post(chat, "chat completion", stream=True),
            "/v1/responses": _post(resp, "the Responses API (vLLM's semantics; nothing is stored)", stream=True),
            "/tokenize": _post(tokenize, "tokenize a prompt or messages"),
            "/detokenize": _post(detokenize, "token ids to text"),
            "/v1/models": _get("the served model"),
            "/v1/kairos/stats": _get("the router's routes, reasons and workers"),
            "/health": _get("the process is up"),
            "/ready": ready,
            "/ping": {**_get("vLLM's liveness route", media="text/plain"),
                      "post": _get("vLLM's liveness route", media="text/plain")["get"]},
            "/load": _get("requests in flight on this router"),
            "/version": _get("Kairos' version"),
            "/metrics": _get("Prometheus metrics", media="text/plain"),
            "/openapi.json": _get("this document"),
        },
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "when the router has an API key"}}},
    }
