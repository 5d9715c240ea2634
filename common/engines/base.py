"""The engine interface both worker roles drive, whatever the engine (sim or vllm).

A worker service owns the sockets; the engine owns the batch. The service calls `add`,
`abort` and `load`; the engine calls back `on_tokens` (decode role: new tokens of one step)
and `on_prefilled` (prefill role: a prompt's KV is complete). `run()` is the step loop, a
task the worker watches; it returns when cancelled (an engine that `keeps_decodes` runs it on
through a role switch: the worker of the new role takes the same task over).

What an engine may or may not do is declared here, with defaults that mean "not supported", and
the worker calls it plainly: `on_failed` and `on_kv_fallback` (callbacks an engine that never
fails a request or never loads KV itself simply never calls), `max_model_len` and `block_size`
(0: no limit, not known), `waiting_kv()` (0), `can_refit` with `refit()` and `predict_with()`
(no online refit of the step-time model), `moves_kv` (False: the worker moves the KV, over the
configured kv_transport).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import AsyncIterator, Callable, Collection
from typing import TYPE_CHECKING, ClassVar, Literal

import msgspec

from common.messages import Coeffs, KvHandle, Sampling, TokenItem, TokenLogprobs

if TYPE_CHECKING:
    from common.perf_model import PerfModel

Mode = Literal["prefill", "handoff", "deflect", "retain"]  # retain: a prefill engine decodes it too


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
    trace_headers: dict[str, str] | None = None  # W3C traceparent/tracestate (vLLM's own tracing takes them)


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
    step_err_p50: float | None = None  # the model's live error (common/prediction_error.py); None: not measured
    step_err_p90: float | None = None


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
KvFallbackCallback = Callable[[str, str], None]  # (request_id, reason)
FailedCallback = Callable[..., None]             # (request_id, attempt, reason, retryable=True)


class Engine(abc.ABC):
    role: Literal["prefill", "decode"]
    name: str
    token_budget: int
    max_batch: int
    kv_capacity_tokens: int
    max_model_len: int = 0  # the longest prompt + output it takes (a model's context window); 0: no limit
    block_size: int = 0     # its KV block size in tokens, for the router (Hello.kv_block_tokens); 0: not said
    can_refit: ClassVar[bool] = False  # refit() may return a model: the worker runs its refit loop
    # the engine hands KV between roles itself (vllm's connector): the worker opens no KV sender or
    # receiver of its own, and a KvHandle's transport is the engine's name, not cfg.kv_transport
    moves_kv: ClassVar[bool] = False
    # prefill role: it can decode a request itself after its prefill (mode "retain", route "retain";
    # the simulated engine). One that cannot reports no KV free for it, so no router sends it one
    can_retain: ClassVar[bool] = False
    # it can take the other role in place, holding nothing (`switch_role`; the simulated engine, and
    # vllm started in its kv_both KV role): the worker then drains, switches and registers again
    # under the new role without a restart. An instance may say otherwise than its class (vllm)
    can_switch_role: bool = False
    # ... and it goes on stepping the running decodes it is told to keep through the switch
    # (`switch_role(role, keep=...)` between two steps, `between_steps`), in either role: the
    # worker's role flip then keeps them streaming instead of draining them (common/worker_core
    # `set_role(keep=True)`). An instance may say otherwise than its class (vllm: only in kv_both)
    keeps_decodes: bool = False

    def __init__(self) -> None:
        self.on_tokens: TokensCallback = lambda items, step_s: None
        self.on_prefilled: PrefilledCallback = lambda p: None
        # a request that cannot complete here (retryable=False: the request itself is at fault);
        # never called by an engine that does not fail requests on its own (sim)
        self.on_failed: FailedCallback = lambda request_id, attempt, reason, retryable=True: None
        # decode role, an engine that loads a handed-off request's KV itself (vllm): the KV did not
        # come and the engine prefills the request in place instead
        self.on_kv_fallback: KvFallbackCallback = lambda request_id, reason: None

    async def start(self) -> None:
        """Load weights, allocate caches (may take long; the worker registers only after)."""

    def switch_role(self, role: Literal["prefill", "decode"], keep: Collection[str] = ()) -> str:
        """Take the other role in place, holding nothing (the role planner: the worker drained
        first) but the running decodes named in `keep` (only an engine that `keeps_decodes`, and
        only inside `between_steps`), without a restart. Returns why it cannot ("": it did); this
        one cannot."""
        return self.role_fixed()

    @contextlib.asynccontextmanager
    async def between_steps(self) -> AsyncIterator[None]:
        """Hold the step loop between two steps while the body runs (a role switch that keeps
        running decodes moves them between roles there); no step loop of its own here."""
        yield

    def role_fixed(self) -> str:
        """Why this engine cannot change role in place (`can_switch_role` False), for the worker's
        `role_change_refused` line."""
        return f"the {self.name} engine cannot change role without a restart"

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
    def lower_tbt_slo(self, request_id: str, tbt_slo: float) -> bool:
        """Plan a held request's steps to `tbt_slo` from now on where that is less than its budget
        now (its router's delivery allowance rose: PlanBudget); its load's `strictest_tbt_slo`
        follows. False when it does not hold it or its budget is that or less already."""

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

    def waiting_kv(self) -> int:
        """Decode role: handed-off requests the engine holds whose KV has not landed yet (it loads
        KV itself; DecodeHeartbeat.waiting_kv adds the worker's own). 0 for an engine that does not."""
        return 0

    def refit(self) -> tuple[PerfModel, float] | None:
        """Least-squares refit of the step-time model on this engine's recent measured steps: the
        model and its error on them (MAPE), or None (too few steps, or `can_refit` is False)."""
        return None

    def predict_with(self, model: PerfModel) -> None:
        """Measure step error against `model` from now on (a refit the worker accepted and now
        reports to the routers). Nothing to do for an engine that does not refit."""

    def take_prefix_events(self) -> PrefixEvents | None:
        """The prefix cache's changes since the last call, for the worker to summarise to the
        router; None when this engine keeps no prefix cache (or it is turned off)."""
        return None

    def prefix_cached(self, prompt_token_ids: list[int]) -> int | None:
        """Prompt tokens of this prompt its prefix cache holds now (at most all but the last: one
        is always computed), as it would find them when the request is added; None when this engine
        cannot say (the worker then takes the router's figure)."""
        return None

    async def close(self) -> None:
        """Release engine resources."""
