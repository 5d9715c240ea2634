"""The engine interface both worker roles drive, whatever the engine (sim or vllm).

A worker service owns the sockets; the engine owns the batch. The service calls `add`,
`abort` and `load`; the engine calls back `on_tokens` (decode role: new tokens of one step)
and `on_prefilled` (prefill role: a prompt's KV is complete). `run()` is the step loop, a
task in the service's TaskGroup; it returns when cancelled.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Literal

import msgspec

from common.messages import Coeffs, KvHandle, Sampling, TokenItem, TokenLogprobs

Mode = Literal["prefill", "handoff", "deflect"]


class EngineRequest(msgspec.Struct, kw_only=True):
    request_id: str
    attempt: int
    prompt_token_ids: list[int]
    sampling: Sampling
    mode: Mode
    tbt_slo: float = 0.1
    chunk_schedule: tuple[int, ...] = ()
    kv: KvHandle | None = None
    cached_tokens: int = 0
    resume_tokens: int = 0  # decode: the prompt ends with this many output tokens already sent (migration)


class EngineLoad(msgspec.Struct, kw_only=True):
    """What the heartbeats report; see messages.PrefillHeartbeat / DecodeHeartbeat."""

    queued_tokens: int = 0
    queued_requests: int = 0
    batch: int = 0
    kv_tokens: int = 0
    kv_free_tokens: int = 0
    kv_capacity_tokens: int = 0
    resident_prefill_tokens: int = 0
    deflections: int = 0
    strictest_tbt_slo: float | None = None
    step_ms_p50: float = 0.0
    step_ms_max: float = 0.0
    steps: int = 0
    backlog: list[tuple[int, int]] | None = None  # prefill role: None when the engine cannot say
    busy_s: float = 0.0                           # until the step in flight ends (predicted)
    step_margin: float = 1.0  # measured step error: the ratio (measured / predicted) planned with (step_error.py)
    step_bias: float = 1.0    # its median


class Prefilled(msgspec.Struct, kw_only=True):
    request_id: str
    attempt: int
    queue_s: float
    prefill_s: float
    first_token_id: int | None = None
    kv_params: dict[str, object] = {}
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class PrefixEvents(msgspec.Struct, kw_only=True):
    """What an engine's prefix cache stored and evicted since the last `take_prefix_events`: block
    hashes as `common.prefix_hash.block_hashes` names them, over blocks of `block_tokens` token ids
    (the engine's KV block size). `cleared`: the whole cache was dropped (a reset), so everything
    reported before is gone; `stored`/`removed` then list what came after."""

    block_tokens: int
    stored: list[int] = []
    removed: list[int] = []
    cleared: bool = False


TokensCallback = Callable[[list[TokenItem], float], None]
PrefilledCallback = Callable[[Prefilled], None]


class Engine(abc.ABC):
    role: Literal["prefill", "decode"]
    name: str
    token_budget: int
    max_batch: int
    kv_capacity_tokens: int

    def __init__(self) -> None:
        self.on_tokens: TokensCallback = lambda items, step_s: None
        self.on_prefilled: PrefilledCallback = lambda p: None

    async def start(self) -> None:
        """Load weights, allocate caches (may take long; the worker registers only after)."""

    @abc.abstractmethod
    async def run(self) -> None:
        """The step loop; runs until cancelled."""

    @abc.abstractmethod
    def add(self, req: EngineRequest) -> None:
        """Queue a request. Raises common.errors.Overloaded when it cannot be held."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> bool:
        """Drop a request; True if it was held."""

    @abc.abstractmethod
    def load(self) -> EngineLoad: ...

    @abc.abstractmethod
    def can_admit(self, prompt_tokens: int, max_tokens: int) -> bool:
        """Decode role: is there KV room for this request (prompt plus output)?"""

    def coeffs(self) -> Coeffs | None:
        """The step-time model this engine is timed by or was fitted to, for the router."""
        return None

    def held(self) -> list[str]:
        """Request ids currently held (for drain and hand-back)."""
        return []

    def take_prefix_events(self) -> PrefixEvents | None:
        """The prefix cache's changes since the last call, for the worker to summarise to the
        router; None when this engine keeps no prefix cache (or it is turned off)."""
        return None

    async def close(self) -> None:
        """Release engine resources."""
