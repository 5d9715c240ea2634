"""The error hierarchy, drawn as a tree.

KairosError
├── ConfigError            bad configuration; the process exits with a clear message
├── ProtocolError          a peer spoke a version or message we do not accept
├── RequestError           a client request we refuse (HTTP 400)
├── Unavailable            no live worker of a needed kind, or draining (HTTP 503, retryable)
│   └── NoWorkerYet        no worker can take it now; the router may hold it for one to register
├── Overloaded             admission control refused (HTTP 429, retryable)
├── WorkerLostError        a worker died holding a request
└── KvTransferError        a KV-cache transfer failed or timed out (fallback: prefill in place)
"""

from __future__ import annotations


class KairosError(Exception):
    """Base of every error Kairos raises on purpose."""


class ConfigError(KairosError):
    """What the operator must change. `event`: the log event a start-up failure is written as
    (common/startup.py); `fix`: what to do; `fields`: the facts that locate it (key, port, path)."""

    def __init__(self, message: str, *, event: str = "config_invalid", fix: str = "", **fields: object) -> None:
        super().__init__(message)
        self.event = event
        self.fix = fix or "change the setting the error names (every service's --help lists them), then start again"
        self.fields = fields


class ProtocolError(KairosError):
    pass


class RequestError(KairosError):
    """A client request that is invalid. `param` names the offending field. `validation`: the body
    does not have the declared shape (a wrong type), which vLLM's server reports as its schema
    validation's "Bad Request" rather than a "BadRequestError"."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_request",
                 validation: bool = False) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.validation = validation


class Unavailable(KairosError):
    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NoWorkerYet(Unavailable):
    pass


class Overloaded(KairosError):
    """`code`: what is short, the client's `x-kairos-error` (`overloaded`: requests in flight;
    `client_share`; `prefill_busy`, `decode_busy`, `kv_full`: a wait predicted past its budget)."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0, code: str = "overloaded") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.code = code


class WorkerLostError(KairosError):
    pass


class KvTransferError(KairosError):
    pass
