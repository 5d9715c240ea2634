"""Error bodies as vLLM's OpenAI server writes them: `{"error": {"message", "type", "param", "code"}}`
with `code` the HTTP status (an integer) and `type` vLLM's name for it (BadRequestError, ...).

Kairos's own reason for an error (`context_length_exceeded`, `overloaded`, `kv_wait_timeout`, ...)
is machine-readable in the `x-kairos-error` response header, and in a stream's error event as
`kairos_error` beside `error` (docs/api.md, "Errors")."""

from __future__ import annotations

from typing import Any

import msgspec

# vLLM's error types by status (vllm/entrypoints/serve/exception_handling); where vLLM has no such
# status, the name of the OpenAI SDK's exception class for it
TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 408: "RequestTimeoutError",
         413: "RequestEntityTooLargeError", 422: "UnprocessableEntityError", 429: "RateLimitError",
         500: "InternalServerError", 501: "NotImplementedError", 503: "ServiceUnavailableError",
         504: "GatewayTimeoutError"}


def error_type(status: int) -> str:
    return TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


def error_object(status: int, message: str, param: str | None = None, type_: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_ or error_type(status), "param": param, "code": status}}


def error_json(status: int, message: str, param: str | None = None) -> bytes:
    return msgspec.json.encode(error_object(status, message, param))
