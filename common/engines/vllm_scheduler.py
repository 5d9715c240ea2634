"""The vLLM scheduler Kairos runs inside each vLLM engine core (`scheduler_cls`).

It changes three things in vLLM 0.32.0's `Scheduler` and leaves the rest alone:

1. **Per-request chunk schedules.** A request whose `SamplingParams.extra_args` carries
   `kairos_chunks` (the router's schedule, in prompt tokens) gets exactly the next chunk of
   it in every step until its prompt is prefilled: chunk i ends at the prompt position
   base + c1 + ... + ci, where base is what was already computed when the request was first
   scheduled (a prefix-cache hit). The cap is applied in `_reserve_prefill_lookahead`, the
   one hook vLLM calls for every request after its own budget clamps (running and waiting
   alike), so the chunk can only shrink there; the token budget is sized so that it does
   not (see 3). After the schedule is used up (or for requests without one) vLLM's own
   chunking applies.
2. **Decodes first.** `self.running` is stably sorted each step: requests needing one token
   (decodes, and handed-off requests whose KV has landed and that recompute their last prompt
   token), then scheduled prefills, then other prefills. vLLM walks `running` in list order,
   so without this a chunked prefill admitted earlier can eat the budget of a later decode.
   As a consequence, under KV pressure FCFS preemption (it takes `running[-1]`) hits a
   prefill before a decode.
3. **Budget for the others.** Prefills without a schedule get only what is left of the
   step's token budget after the decodes, the handed-off requests and the scheduled chunks,
   so they never squeeze a scheduled chunk.
4. **Resumed grammars.** A migrated request (the router's mid-stream migration) arrives with
   the output already streamed at the end of its prompt; `extra_args["kairos_resume_tokens"]`
   says how many. With structured outputs its grammar must continue from there, not start
   over: when vLLM promotes the request from waiting for its grammar
   (`_handle_blocked_waiting_request`), the grammar accepts those tokens first. If it refuses
   them (they were produced under another grammar), the request ends with vLLM's grammar error
   rather than an output the grammar does not describe.

Per-step records. vLLM's iteration details time only `future.result()` of the model call; with
the in-process (uniproc) executor that CPU engines use the forward pass has already run by
then, so `elapsed_ms` is the sampler's time alone (measured: ~0.1 ms for a ~2 ms step). This
scheduler therefore times each step itself, from the start of `schedule()` to the end of
`update_from_output()` (the whole engine iteration, which is what a decode's TBT feels), and
sends one `StepRecord` per model step (same numbering as vLLM's iteration index; with the
thread's CPU time too, which other processes on a shared machine cannot inflate) to the
engine wrapper over a ZeroMQ PUSH socket (non-blocking; a full queue drops records and counts
them). The address comes from `additional_config["kairos"]["step_channel"]`.

One step in flight, or several: vLLM's engine core calls `schedule()` then
`update_from_output()` for the same step, except with a batch queue (pipeline parallelism,
async scheduling), where it schedules step N+1 before it records step N. Each step's pending
record is therefore kept by its `SchedulerOutput` and completed by the `update_from_output`
of that same output, never by whichever step came last. Async scheduling itself is refused
(the engine wrapper turns it off): it needs vLLM's `AsyncScheduler` bookkeeping (output
placeholders), which this plain-`Scheduler` subclass does not do, and its overlapped steps
would make the per-step times meaningless for the step-time model.

Prefix cache events. When the engine enables vLLM's KV cache events (with the "null" publisher:
no socket), this scheduler replaces that publisher with one that keeps each step's events in the
process, translates them into `common.prefix_hash` block hashes (vllm_prefix.py) and sends the
net change with the step's record (`prefix_stored`, `prefix_removed`, `prefix_cleared`). Events of
a step that scheduled no tokens (a cache reset while idle) wait for the next record.

Prefix-cache hits and chunk schedules. vLLM looks up a waiting request's cached prefix before it
calls `_reserve_prefill_lookahead`, so the `num_computed_tokens` seen there on the request's first
scheduling is its cache hit (a multiple of the block size; at most prompt - 1, since the last
prompt token is always recomputed); that is the schedule's `base`, so the chunks cover only the
uncached suffix and end at prompt boundaries counted from the hit, never from 0.

This module is imported in the engine-core process (vLLM spawns it on CPU), so it must stay
importable from there: it is part of the installed project, no path tricks needed.
Not a public vLLM interface: pinned to vLLM 0.32.0.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import NullEventPublisher
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from common.engines.vllm_prefix import PrefixTranslator

CHUNKS_KEY = "kairos_chunks"
RESUME_KEY = "kairos_resume_tokens"
ID_KEY = "kairos_id"


class StepRecord(msgspec.Struct, array_like=True, frozen=True):
    """One engine step as the scheduler planned and timed it.

    `chunks`: (request key, chunk tokens, tokens computed before the chunk) for every request
    that computed prompt tokens (a 1-token chunk at k = prompt - 1 is a handed-off request
    finishing its prompt after the KV load). `kv_tokens`: KV tokens the decodes attend over
    (the common.perf_model convention: prompt plus tokens generated so far). `misses`:
    (request key, scheduled chunk, chunk run) for scheduled chunks vLLM could not run whole.
    """

    index: int
    started: float  # time.monotonic() in the engine-core process (CLOCK_MONOTONIC, host-wide)
    seconds: float
    decodes: int
    kv_tokens: int
    chunks: list[tuple[str, int, int]]
    decode_keys: list[str]
    misses: list[tuple[str, int, int]]
    dropped: int = 0
    cpu_seconds: float = 0.0  # the engine-core thread's CPU time over the step (not slowed by other processes)
    prefix_stored: list[int] = []   # prefix-cache blocks stored since the last record (prefix_hash names)
    prefix_removed: list[int] = []  # ... and evicted
    prefix_cleared: bool = False    # the whole prefix cache was dropped before the two lists above


def request_key(request: Any) -> str:
    """The wrapper's id for a request (`extra_args[kairos_id]`), else vLLM's internal id."""
    sp = request.sampling_params
    extra = sp.extra_args if sp is not None and sp.extra_args else None
    if extra and ID_KEY in extra:
        return str(extra[ID_KEY])
    return str(request.request_id)


def chunk_schedule(request: Any) -> tuple[int, ...]:
    sp = request.sampling_params
    extra = sp.extra_args if sp is not None and sp.extra_args else None
    if not extra or CHUNKS_KEY not in extra:
        return ()
    return tuple(int(c) for c in extra[CHUNKS_KEY])


def next_scheduled_chunk(schedule: tuple[int, ...], base: int, computed: int, prompt: int) -> int | None:
    """Tokens to run next under `schedule` (chunk boundaries base+c1, base+c1+c2, ...), or None
    when the schedule is used up. Pure; shared with the tests."""
    end = base
    for c in schedule:
        end += c
        if end > computed:
            return min(end, prompt) - computed
    return None


class _KeepEvents(NullEventPublisher):  # type: ignore[misc]  # vllm is untyped for mypy
    """Stands in for vLLM's KV event publisher: hands each step's events to the translator."""

    def __init__(self, translator: PrefixTranslator) -> None:
        super().__init__()
        self.translator = translator

    def publish(self, events: Any) -> None:
        self.translator.feed(list(events.events))


class KairosScheduler(Scheduler):  # type: ignore[misc]  # vllm is untyped for mypy
    """See the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.vllm_config.scheduler_config.async_scheduling:
            raise ValueError("KairosScheduler needs async_scheduling=False (it subclasses Scheduler, not "
                             "AsyncScheduler); pass --no-async-scheduling / AsyncEngineArgs(async_scheduling=False)")
        cfg = (self.vllm_config.additional_config or {}).get("kairos", {})
        self.prefix: PrefixTranslator | None = None
        events_cfg = self.vllm_config.kv_events_config
        if self.enable_kv_cache_events and events_cfg.publisher == "null":  # the engine wrapper asked for them
            cache = self.vllm_config.cache_config
            blocks = int(cache.num_gpu_blocks or 0)
            self.prefix = PrefixTranslator(int(cache.block_size), limit=2 * blocks + 1024)
            self.kv_event_publisher.shutdown()  # type: ignore[has-type]  # vllm is untyped for mypy
            self.kv_event_publisher = _KeepEvents(self.prefix)
        self._bases: dict[str, int] = {}
        self._others_left = 0
        self._model_steps = 0
        self._dropped = 0
        # steps scheduled and not yet recorded, by id() of their SchedulerOutput (alive until then)
        self._pending: dict[int, tuple[float, float, StepRecord]] = {}
        self._ctx: zmq.Context[Any] | None = None
        self._sock: zmq.Socket[Any] | None = None
        addr = cfg.get("step_channel")
        if addr:
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.PUSH)
            self._sock.setsockopt(zmq.SNDHWM, 100_000)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(addr)

    # -- ordering and budgets -----------------------------------------------------------------
    @staticmethod
    def _needs_one(request: Any) -> bool:
        return bool(request.num_tokens_with_spec - request.num_computed_tokens <= 1)

    def _order(self, request: Any) -> int:
        if self._needs_one(request):
            return 0
        if request.num_computed_tokens < request.num_prompt_tokens and chunk_schedule(request):
            return 1
        return 2

    def _planned_chunk(self, request: Any, computed: int) -> int | None:
        schedule = chunk_schedule(request)
        if not schedule or computed >= request.num_prompt_tokens:
            return None
        base = self._bases.get(request.request_id, computed)
        return next_scheduled_chunk(schedule, base, computed, request.num_prompt_tokens)

    def schedule(self, throttle_prefills: bool = False) -> Any:
        started = time.monotonic()
        cpu_started = time.thread_time()
        if self._bases:
            for rid in [r for r in self._bases if r not in self.requests]:
                del self._bases[rid]
        self.running.sort(key=self._order)
        reserved = 0
        for request in self.running:
            if self._needs_one(request):
                reserved += 1
            else:
                reserved += self._planned_chunk(request, request.num_computed_tokens) or 0
        reserved += len(self.kv_holding_waiting)  # handed-off requests: one token each once loaded
        for request in self.waiting:
            reserved += self._planned_chunk(request, request.num_computed_tokens) or 0
        self._others_left = max(self.max_num_scheduled_tokens - reserved, 0)

        out = super().schedule(throttle_prefills)

        if out.total_num_scheduled_tokens > 0:
            self._pending[id(out)] = (started, cpu_started, self._record(out, started))
        return out

    def _reserve_prefill_lookahead(self, request: Any, num_computed_tokens: int, num_new_tokens: int) -> int:
        n: int = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        if n <= 1 or num_computed_tokens >= request.num_prompt_tokens:
            return n  # a decode, or a one-token prompt tail: never held back
        if chunk_schedule(request):
            self._bases.setdefault(request.request_id, num_computed_tokens)
            cap = self._planned_chunk(request, num_computed_tokens)
            if cap is not None:
                return min(n, cap)
        n = min(n, self._others_left)
        self._others_left -= n
        return n

    # -- resumed grammars ------------------------------------------------------------------------
    def _handle_blocked_waiting_request(self, request: Any) -> bool:
        grammar_wait = request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        ready: bool = super()._handle_blocked_waiting_request(request)
        n = int((request.sampling_params.extra_args or {}).get(RESUME_KEY) or 0) if ready and grammar_wait else 0
        if n > 0:
            so = request.structured_output_request
            resumed = list(request.prompt_token_ids[-n:])
            if not so.grammar.accept_tokens(request.request_id, resumed):
                so.grammar = ValueError(f"the {n} resumed output tokens do not fit this request's grammar")
                request.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
                self.grammar_compile_error_reqs.add(request.request_id)  # finished with an error next step
                return False
        return ready

    # -- per-step records -----------------------------------------------------------------------
    def _record(self, out: Any, started: float) -> StepRecord:
        decodes = 0
        kv = 0
        chunks: list[tuple[str, int, int]] = []
        decode_keys: list[str] = []
        misses: list[tuple[str, int, int]] = []
        for rid, n in out.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is None:
                continue
            k = request.num_computed_tokens - n  # schedule() has already advanced it
            key = request_key(request)
            if k >= request.num_prompt_tokens:
                decodes += 1
                kv += k + 1
                decode_keys.append(key)
                continue
            chunks.append((key, n, k))
            if chunk_schedule(request):
                want = self._planned_chunk(request, k)
                if want is not None and want != n:
                    misses.append((key, want, n))
        record = StepRecord(index=self._model_steps, started=started, seconds=0.0, decodes=decodes,
                            kv_tokens=kv, chunks=chunks, decode_keys=decode_keys, misses=misses,
                            dropped=self._dropped)
        self._model_steps += 1
        return record

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        result = super().update_from_output(scheduler_output, model_runner_output)
        pending = self._pending.pop(id(scheduler_output), None)
        if pending is not None and self._sock is not None:
            started, cpu_started, record = pending
            stored: list[int] = []
            removed: list[int] = []
            cleared = False
            if self.prefix is not None:
                stored, removed, cleared = self.prefix.take()
            record = msgspec.structs.replace(record, seconds=time.monotonic() - started,
                                             cpu_seconds=time.thread_time() - cpu_started,
                                             prefix_stored=stored, prefix_removed=removed, prefix_cleared=cleared)
            try:
                self._sock.send(msgspec.msgpack.encode(record), zmq.NOBLOCK)
            except zmq.Again:
                self._dropped += 1
                if self.prefix is not None:  # not lost: they go with the next record
                    self.prefix.put_back(stored, removed, cleared)
        return result

    def shutdown(self) -> None:
        super().shutdown()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
