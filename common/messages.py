"""The wire contract: every message that crosses a process boundary.

Topology (the router binds every socket; workers and the monitor connect)::

    prefill worker  DEALER ──work/results/heartbeats──▶ ROUTER  router   (router.work, tcp://*:5555)
    decode worker   DEALER ──work/tokens/heartbeats───▶ ROUTER  router
    router          PUB ────telemetry──────▶ SUB     monitor  (router.telemetry, tcp://*:5557)
    prefill worker  ──KV bytes over NIXL (WRITE + notification)──▶ decode worker

Frame layouts, written down once:
    ROUTER side:  [identity, payload]      DEALER side: [payload]
    PUB/SUB:      [topic, seq (8-byte big-endian), payload]

Which message arrives where (each inbox has one union alias and one decoder):
    RouterInbox   (ROUTER, from workers)   Hello, PrefillDone, KvWant, KvTarget, TokenBatch, RequestFailed, Goodbye,
                                           PrefillHeartbeat, DecodeHeartbeat (protocol 2: heartbeats travel on the
                                           worker's own connection, so the router knows who sent them)
    PrefillInbox  (DEALER, from router)    Welcome, Refused, Reregister, PrefillWork, KvTarget, Cancel, Drain, SetRole,
                                           PlanBudget
    DecodeInbox   (DEALER, from router)    Welcome, Refused, Reregister, DecodeWork, KvWant, KvReady, Cancel, Drain,
                                           SetRole, QueueHead, PlanBudget
    TelemetryInbox (SUB, from router)      WorkerSeen, WorkerLost, DecisionRecord, RequestRecord, RouterStats

Schema evolution: every field added after version 1 has a default, and decoders ignore
unknown fields, so an older peer can read a newer message. `Hello.protocol` carries
PROTOCOL_VERSION; the router refuses a worker whose major version differs.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PROTOCOL_VERSION = 2  # 2: heartbeats on the work connection (1: on a separate PUB/SUB pair)

Role = Literal["prefill", "decode"]
Route = Literal["disagg", "deflect", "retain"]  # retain: the prefill worker decodes it itself (no KV moves)
DecodeMode = Literal["handoff", "deflect"]


class Msg(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Base of every message on the bus; the tag is the class name."""


class Coeffs(msgspec.Struct, frozen=True, kw_only=True):
    """Step-time model coefficients (see common.perf_model) carried in registrations and heartbeats.

    t = a0 + a6*[step has prefill] + a3*T + a7*max(0, T - knee) + a5*T**2 + a1*B + a2*K
        + a4*sum(chi*(k + chi/2)),
    T = B + sum(chi) the step's total tokens, B its decodes, K their KV tokens, chi a prefill chunk
    over k prefilled tokens; transfer = t0 + L*bytes_per_token/bandwidth. The form of
    common.perf_model (MODEL_FORM 2).
    """

    a0: float
    a1: float
    a2: float
    a3: float
    a4: float
    a5: float = 0.0
    a6: float = 0.0
    a7: float = 0.0
    knee: float = 0.0
    xfer_t0: float = 0.0
    xfer_bandwidth: float = 1e10
    kv_bytes_per_token: int = 0


class KvAgentInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A NIXL agent's identity and the memory it exposes (decode workers: their KV region)."""

    agent_name: str
    metadata: bytes
    region_addr: int = 0
    region_bytes: int = 0
    block_bytes: int = 0
    num_blocks: int = 0


# ---------------------------------------------------------------- membership


class Hello(Msg, frozen=True):
    """Worker -> router: registration. Sent at start and whenever the router asks again."""

    protocol: int
    worker_id: str
    role: Role
    incarnation: str
    engine: str
    model: str
    token_budget: int
    kv_capacity_tokens: int = 0
    max_batch: int = 0
    coeffs: Coeffs | None = None
    kv_transport: str = "modeled"
    kv_agent: KvAgentInfo | None = None
    max_model_len: int = 0        # longest prompt + output the engine takes (0: no limit)
    kv_block_tokens: int = 0      # tokens per KV block, where KV moves in blocks (nixl)
    held: list[str] = []          # request ids the worker holds now (the router answers which to drop)
    fixed_role: bool = False      # its engine cannot change role in place: the role planner never moves it
    # the highest dispatch number it has seen from this router: work of a lower number it no longer
    # holds ended or was refused there, and the router, if it still tracks it, never heard so
    last_dispatch: int = 0
    # it takes PlanBudget (the router tells only such workers: one from before it, mid-upgrade, would
    # drop each as a frame it cannot decode, with a warning)
    plan_budget: bool = False


class Welcome(Msg, frozen=True):
    """Router -> worker: registration accepted. `drop`: requests of `Hello.held` the router does
    not track (it restarted, or re-dispatched them): abort them and free their KV."""

    router_incarnation: str
    heartbeat_interval_s: float
    drop: list[str] = []


class Refused(Msg, frozen=True):
    """Router -> worker: registration refused (incompatible engine, model or KV transport)."""

    router_incarnation: str
    reason: str


class Reregister(Msg, frozen=True):
    """Router -> worker: I do not know you (I restarted, or declared you dead): say Hello again."""

    router_incarnation: str
    reason: str = ""


class Goodbye(Msg, frozen=True):
    """Worker -> router: I am draining and leaving; send me no new work."""

    worker_id: str
    incarnation: str
    reason: str = "shutdown"


class Drain(Msg, frozen=True):
    """Router -> worker: stop accepting work (router is shutting down or the operator asked)."""

    reason: str = ""


class SetRole(Msg, frozen=True):
    """Router -> worker: the router's role planner (common/router_core/planner.py) moves this
    worker to `role`. The worker drains what the change would break (it takes no new work, says
    Goodbye "role_change" to every router, finishes what it holds), then says Goodbye "drained"
    and Hello again under the new role, on the same engine. Handled by the worker core
    (`WorkerCore.set_role`); the simulator's workers and the live ones act on it (common/worker.py:
    the simulated engine and a vLLM engine in the kv_both KV role change role in place; a vLLM
    engine started as kv_producer/kv_consumer refuses, `role_change_refused`)."""

    role: Role
    reason: str = ""
    router_incarnation: str = ""


# ---------------------------------------------------------------- heartbeats


class QueueDrain(msgspec.Struct, frozen=True, array_like=True):
    """A prefill worker's replay of its own queue (common/engines/replay.py): its last step's
    start, chunks (tokens, tokens already done) and tokens used, and when the queue drains;
    times in seconds after the heartbeat was made."""

    start_s: float
    chunks: list[tuple[int, int]]
    used: int
    end_s: float


class PrefixSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker's prefix cache stored and evicted since its previous heartbeat, as block
    hashes (common/prefix_hash.py) over blocks of `block_tokens` token ids. `cleared`: forget
    everything reported before (the cache was reset, or the worker had more to report than a
    heartbeat carries); the lists then say what came after. At most MAX_PREFIX_EVENTS entries."""

    block_tokens: int
    stored: list[int] = []
    removed: list[int] = []
    cleared: bool = False


MAX_PREFIX_EVENTS = 8192  # block hashes per heartbeat (~150 KB); the rest waits for the next one


class PrefillHeartbeat(Msg, frozen=True):
    """Prefill worker load: what Equation 1 needs (queued prompt tokens and the token budget),
    and what the replay predictor needs: each held request's (prompt tokens, tokens done) in
    FIFO order once the step in flight ends (`busy_s` from now), and the queue's replay."""

    worker_id: str
    incarnation: str
    seq: int
    queued_tokens: int
    queued_requests: int
    token_budget: int
    last_dispatch: int = 0
    missed: list[int] = []  # dispatch numbers skipped, noticed in the last few seconds (RouterLink.missed)
    step_ms_p50: float = 0.0
    steps: int = 0
    coeffs: Coeffs | None = None
    draining: bool = False
    backlog: list[tuple[int, int]] | None = None
    busy_s: float = 0.0
    max_batch: int = 0
    drain: QueueDrain | None = None
    prefix: PrefixSummary | None = None  # None: no prefix cache, or nothing new
    step_bias: float = 1.0  # the median of measured / predicted step time (predicted by `coeffs`, else the profile)
    loop_lag_ms: float = 0.0  # worst event-loop lag since the last heartbeat (common/loop_lag.py)
    # the step-time model's live error: median and p90 of |predicted - measured| / measured over the
    # recent steps (common/prediction_error.py); None: the engine does not measure it
    step_err_p50: float | None = None
    step_err_p90: float | None = None
    # what the third path (route "retain": it decodes requests itself) needs: the requests it
    # decodes now, their KV, the strictest TBT SLO among them, its KV free for more, its step margin
    decodes: int = 0
    decode_kv_tokens: int = 0
    strictest_tbt_slo: float | None = None
    kv_free_tokens: int = 0
    step_margin: float = 1.0
    routers: list[str] = []  # the incarnations of the routers it is registered with (the planner's leader)


class HeldDeflection(msgspec.Struct, frozen=True, array_like=True):
    """A deflection a decode worker admitted and is still prefilling: which router sent it (its
    incarnation) and the step time and token budget it reserves (its largest chunk's cost, as the
    router's ledger reserves it). Routers add the ones other routers sent to their view."""

    router: str
    reserved_s: float
    largest_chunk: int


class RouterQueue(msgspec.Struct, frozen=True, array_like=True):
    """A router replica's wait queue as it last told a decode worker (`QueueHead`): its
    incarnation, the arrival (wall clock, seconds) of the request it would decide first (0.0:
    none waits), whether that one can no longer meet its TTFT SLO, how many wait and their prompt
    tokens (what the other replicas' admission counts before a new request of theirs)."""

    router: str
    oldest_at: float
    late: bool
    waiting: int
    waiting_tokens: int = 0
    first_tokens: int = 0  # that first request's prompt tokens (a wait order by size compares them)


class DecodeHeartbeat(Msg, frozen=True):
    """Decode worker TBT-slack heartbeat: what Algorithm 1 needs."""

    worker_id: str
    incarnation: str
    seq: int
    batch: int
    kv_tokens: int
    kv_free_tokens: int
    kv_capacity_tokens: int
    resident_prefill_tokens: int
    deflections: int
    strictest_tbt_slo: float | None
    token_budget: int
    waiting_kv: int = 0
    last_dispatch: int = 0
    missed: list[int] = []  # as PrefillHeartbeat's
    step_ms_p50: float = 0.0
    step_ms_max: float = 0.0
    tbt_slack_ms: float | None = None
    steps: int = 0
    coeffs: Coeffs | None = None
    draining: bool = False
    busy_s: float = 0.0  # until the step in flight ends
    prefix: PrefixSummary | None = None  # None: no prefix cache, or nothing new
    held: list[HeldDeflection] = []  # deflections admitted and not yet prefilled, from every router
    step_margin: float = 1.0  # measured / predicted step time the worker plans chunks with (its 99th percentile)
    step_bias: float = 1.0    # the median of measured / predicted step time
    loop_lag_ms: float = 0.0  # worst event-loop lag since the last heartbeat (common/loop_lag.py)
    routers: list[str] = []  # the incarnations of the routers it is registered with (the planner's leader)
    queues: list[RouterQueue] = []  # the request each router replica would decide first, as each last said (QueueHead)
    step_err_p50: float | None = None  # as PrefillHeartbeat's
    step_err_p90: float | None = None


# ---------------------------------------------------------------- work


class StructuredOutputs(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A grammar the sampling engine constrains the output with (vLLM's StructuredOutputsParams).

    Exactly one constraint is set; `json` is the JSON schema as JSON text. Only the engine that
    samples every output token uses it: the decode worker, on both routes."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # the OpenAI API's sampling parameters, applied by whichever engine samples (defaults: off)
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = {}
    allowed_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None         # top logprobs per output token (0: the sampled token's only)
    prompt_logprobs: int | None = None  # the same for every prompt token (reported by whoever prefills)
    structured: StructuredOutputs | None = None  # response_format / structured_outputs / tool_choice
    # a streamed answer the router writes as text deltas: its tokenizer's fingerprint
    # (common/tokenizer.py `fingerprint`); a decode worker whose own tokenizer has the same one sends
    # each TokenItem's text delta with its ids (`TokenItem.text`), so the router does not decode
    # them; "": ids only. `text_keep_special`: decode with the special tokens (skip_special_tokens off)
    text: str = ""
    text_keep_special: bool = False


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Logprobs at one position: the chosen token first, then the top ones (vLLM's order), with ranks."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


class KvHandle(msgspec.Struct, frozen=True, kw_only=True):
    """Where a request's KV cache is and how to get it."""

    transport: str
    source_worker: str
    tokens: int
    nbytes: int = 0
    transfer_s: float = 0.0
    params: dict[str, object] = {}


class PrefillWork(Msg, frozen=True):
    """Router -> prefill worker: prefill this prompt, then hand the KV to `decode_worker`."""

    request_id: str
    attempt: int
    dispatch: int
    prompt_token_ids: list[int]
    sampling: Sampling
    decode_worker: str
    deadline_s: float
    cached_tokens: int = 0
    traceparent: str = ""  # W3C trace context of the router's span for this request ("": not traced)
    tracestate: str = ""
    # route "retain": no hand-off; it decodes the request itself and streams its tokens to the
    # router as a decode worker does (TokenBatch), its running decodes within `tbt_slo`
    retain: bool = False
    tbt_slo: float = 0.1
    # what the router took off the request's TBT SLO for the serving path when it sent this (its
    # delivery allowance then; the request's own SLO is tbt_slo + allowance_s): a later PlanBudget
    # with a larger allowance lowers its budget by how much more it is
    allowance_s: float = 0.0
    # route "retain" of a migrated request: the last resume_tokens prompt ids are output already
    # streamed (as DecodeWork.resume_tokens; the engine continues the stream at that position)
    resume_tokens: int = 0


class PrefillDone(Msg, frozen=True):
    """Prefill worker -> router: prefilled; KV pushed (or ready to be pulled)."""

    request_id: str
    attempt: int
    worker_id: str
    kv: KvHandle
    queue_s: float
    prefill_s: float
    first_token_id: int | None = None
    kv_error: str = ""
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # when Sampling.prompt_logprobs asked


class DecodeWork(Msg, frozen=True):
    """Router -> decode worker. mode="handoff": KV comes from a prefill worker (await KvReady).

    mode="deflect": prefill in place, one chunk of `chunk_schedule` per step (empty: the engine's
    default chunking). `step_budget_s` > 0: the step time every chunk was planned to fit; the
    worker admits the deflection only if the schedule fits its live state (common/policy/admission.py),
    else it answers RequestFailed(code="deflect_rejected") at once and the router decides again
    without that worker (another decode worker's deflection, or the disaggregated path).
    """

    request_id: str
    attempt: int
    dispatch: int
    mode: DecodeMode
    prompt_token_ids: list[int]
    sampling: Sampling
    tbt_slo: float
    deadline_s: float
    chunk_schedule: tuple[int, ...] = ()
    prefill_worker: str = ""
    cached_tokens: int = 0
    resume_tokens: int = 0  # the last resume_tokens prompt ids are output already streamed (a migrated request)
    step_budget_s: float = 0.0  # deflect: the step budget the schedule assumes (0: admit unchecked)
    model_bias: float = 1.0  # deflect: the router planned with this worker's model x this (its measured bias)
    traceparent: str = ""  # W3C trace context of the router's span for this request ("": not traced)
    tracestate: str = ""
    allowance_s: float = 0.0  # as PrefillWork.allowance_s: the request's own TBT SLO is tbt_slo + allowance_s


class KvWant(Msg, frozen=True):
    """Prefill worker -> router -> decode worker: this request's KV is ready to push; reserve
    landing blocks now (late reservation: blocks are held only for the transfer itself, not
    while the request waits in the prefill queue) and answer with a KvTarget."""

    request_id: str
    attempt: int
    tokens: int


class KvTarget(Msg, frozen=True):
    """Decode worker -> router -> prefill worker: where to WRITE the KV of a handoff request."""

    request_id: str
    attempt: int
    decode_worker: str
    agent_name: str = ""
    block_ids: list[int] = []
    error: str = ""
    kv_agent: KvAgentInfo | None = None  # the decode worker's agent, so a restarted peer is re-added


class KvReady(Msg, frozen=True):
    """Router -> decode worker: the prefill side finished; the KV is in place (or failed)."""

    request_id: str
    attempt: int
    kv: KvHandle | None
    error: str = ""


class QueueHead(Msg, frozen=True):
    """Router -> decode workers, from a router with replicas (`RouterConfig.replicas` > 1): the
    request its wait queue would decide first changed. Decode heartbeats echo every router's
    (`DecodeHeartbeat.queues`), so that replicas take turns at the room a heartbeat shows in one
    router's retry order (common/router_core/waiting.py, `replica_turn`)."""

    router_incarnation: str
    oldest_at: float  # its arrival, wall clock, seconds; 0.0: nothing waits
    late: bool        # it can no longer meet its TTFT SLO (late binding decides those last)
    waiting: int
    waiting_tokens: int = 0  # the prompt tokens of the requests waiting (the others' admission counts them)
    first_tokens: int = 0    # the first one's prompt tokens: the turns of a wait order by size compare them


def planned_tbt(slo: float, allowance_s: float, cap: float) -> float:
    """The TBT budget a request of TBT SLO `slo` is planned to: the SLO less the delivery allowance,
    which is at most `cap` x the SLO (the router's dispatch and a worker's PlanBudget both use it)."""
    return slo - min(allowance_s, cap * slo) if allowance_s > 0.0 else slo


class PlanBudget(Msg, frozen=True):
    """Router -> every worker: its TBT delivery allowance moved (common/router_core/delivery.py).
    The requests this router sent that a worker still runs were planned with the allowance of their
    dispatch (`DecodeWork.allowance_s`, `PrefillWork.allowance_s`); each whose budget is more than
    its own SLO less this allowance (at most `cap` x its SLO) is planned to that from now on, as a
    new dispatch would be (budgets only fall: common/worker_core/base.py, `on_plan_budget`). A
    worker applies it to work that reaches it later too (a handoff whose KV lands after it)."""

    router_incarnation: str
    allowance_s: float  # configured + measured, not capped
    cap: float          # the allowance taken off a request's SLO is at most this fraction of it

    def budget(self, slo: float) -> float:
        """What a request whose own TBT SLO is `slo` is planned to now (DeliveryAllowance.plan_slo)."""
        return planned_tbt(slo, self.allowance_s, self.cap)


class Cancel(Msg, frozen=True):
    """Router -> worker: abandon this request (client gone, deadline passed, re-dispatched)."""

    request_id: str
    attempt: int = -1
    reason: str = ""


class TokenItem(msgspec.Struct, frozen=True, array_like=True):
    """One request's new tokens from one engine step (array_like: compact on the hot path)."""

    request_id: str
    attempt: int
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # parallel to token_ids, when Sampling.logprobs asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # once, deflected requests only
    # with an attempt's first tokens: prompt tokens the engine found in its prefix cache (vLLM's
    # RequestOutput.num_cached_tokens; for a handoff, the prefill engine's hits); None: not reported
    cached_tokens: int | None = None
    cache_created_tokens: int | None = None  # ... and the prompt tokens it added to that cache
    # the text these tokens add to the output as the router would stream it (Sampling.text asked it
    # and the worker's tokenizer matches): the ids' decode, less a character still incomplete at the
    # end (it comes with a later item); None: the router decodes the ids itself
    text: str | None = None
    # the output position of token_ids[0] (0 = the request's first output token; a migrated
    # attempt continues at the position the stream reached): the router checks that nothing was
    # lost or repeated between worker and router (a bus connection that broke drops what was in
    # flight); -1: not reported (an older worker)
    pos: int = -1


class TokenBatch(Msg, frozen=True):
    """Decode worker -> router: new tokens of every request that produced some in one step."""

    worker_id: str
    items: list[TokenItem]
    step_s: float = 0.0
    kv_fallback: list[str] = []
    kv_fallback_reasons: list[str] = []  # parallel to kv_fallback


class RequestFailed(Msg, frozen=True):
    """Worker -> router: this request cannot proceed here."""

    request_id: str
    attempt: int
    worker_id: str
    reason: str
    retryable: bool = True
    code: str = ""  # "invalid_request": the request itself is at fault (HTTP 400), not the worker;
    # "deflect_rejected": a decode worker's admission turned a deflection away (the router decides again)


# ---------------------------------------------------------------- telemetry (router -> monitor)


class WorkerSeen(Msg, frozen=True):
    worker_id: str
    role: Role
    incarnation: str
    engine: str
    state: dict[str, float]
    at: float


class RoleFlip(Msg, frozen=True):
    """Router -> monitor: the role planner moves a worker (phase "started": the SetRole was sent;
    "done": it said Hello under its new role, `took_s` after; "abandoned": it did not come back
    in time). `evidence`: the measured load that decided it (common/router_core/planner.py)."""

    worker_id: str
    frm: Role
    to: Role
    reason: str
    phase: str
    at: float
    evidence: dict[str, float] = {}
    took_s: float = 0.0


class WorkerLost(Msg, frozen=True):
    worker_id: str
    role: Role
    reason: str
    at: float


class DecisionRecord(Msg, frozen=True):
    """One routing decision with its reason and both predictions."""

    request_id: str
    policy: str
    route: Route
    prefill_worker: str | None
    decode_worker: str
    reason: str
    prompt_tokens: int
    ttft_prefill_pred: float | None
    ttft_decode_pred: float | None
    chunk_schedule: tuple[int, ...]
    decision_us: float
    at: float
    attempt: int = 0
    client_request_id: str = ""  # the client's x-request-id (request_id is the router's own)


class RequestRecord(Msg, frozen=True):
    """The canonical per-request outcome, as logged by the router."""

    request_id: str
    route: Route | None
    reason: str
    prefill_worker: str | None
    decode_worker: str | None
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None
    ttft_pred_s: float | None
    tbt_p50_s: float | None
    tbt_p99_s: float | None
    tbt_max_s: float | None
    e2e_s: float
    outcome: str
    attempts: int = 1
    kv_fallback: bool = False
    at: float = 0.0
    tbt_gaps_s: list[float] = []
    kv_bytes: int = 0
    kv_transfer_s: float | None = None
    kv_error: str = ""
    prefill_queue_s: float | None = None
    prefill_s: float | None = None
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    migrations: int = 0  # times resumed on another decode worker after its tokens had started streaming
    client_request_id: str = ""  # the client's x-request-id (request_id is the router's own)


class RouterStats(Msg, frozen=True):
    at: float
    in_flight: int
    accepted: int
    completed: int
    failed: int
    rejected: int
    loop_lag_ms: float = 0.0  # the router's event loop: its worst wake-up lag since the last RouterStats
    delivery_allowance_ms: float = 0.0  # the part of the TBT SLO left for delivery now: steps are planned to the rest


RouterInbox = (Hello | PrefillDone | KvWant | KvTarget | TokenBatch | RequestFailed | Goodbye | PrefillHeartbeat
               | DecodeHeartbeat)
HeartbeatInbox = PrefillHeartbeat | DecodeHeartbeat
PrefillInbox = Welcome | Refused | Reregister | PrefillWork | KvTarget | Cancel | Drain | SetRole | PlanBudget
DecodeInbox = (Welcome | Refused | Reregister | DecodeWork | KvWant | KvReady | Cancel | Drain | SetRole
               | QueueHead | PlanBudget)
TelemetryInbox = WorkerSeen | WorkerLost | RoleFlip | DecisionRecord | RequestRecord | RouterStats

ALL_MESSAGES: tuple[type[Msg], ...] = (
    Hello, Welcome, Refused, Reregister, Goodbye, Drain, SetRole, PrefillHeartbeat, DecodeHeartbeat, PrefillWork,
    PrefillDone, DecodeWork, KvWant, KvTarget, KvReady, Cancel, QueueHead, PlanBudget, TokenBatch, RequestFailed,
    WorkerSeen, WorkerLost, RoleFlip, DecisionRecord, RequestRecord, RouterStats,
)
