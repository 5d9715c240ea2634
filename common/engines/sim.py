"""The simulated engine: the shared Batcher, timed by the performance model on the real clock.

Each step sleeps for the modeled step time (times `time_scale`) and then commits the plan, so
a worker running this engine has GPU-like timing on any laptop. Output tokens are synthetic but
deterministic: a function of the request's seed (its request id when it has none) and the
position, in the simple tokenizer's word range, so the router can stream readable text and tests
can check them (a seeded request is reproducible). A request resumed on another worker
(`resume_tokens`: its prompt ends with the output already streamed) continues at the position
where the first worker stopped, as a greedy real engine would.

With `prefix_block_tokens` > 0 it keeps a prefix cache (the Batcher's, with block hashes of the
token ids, common/prefix_hash.py): a prompt starts at its longest cached prefix, and the cache's
changes go to the router in heartbeats (`take_prefix_events`).

Sampling parameters keep their response shapes with synthetic values: `stop_token_ids` end a
request when a synthetic token is one of them (after `min_tokens`); `logprobs` report the chosen
token at rank 1 with logprob -0.25 and each alternative i (1..k) as another synthetic token with
logprob -0.25 - i at rank i + 1; `prompt_logprobs` report every prompt token but the first the
same way (logprob -1.0). Temperature and penalties do not change the synthetic tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Collection
from typing import Literal

from common.engines.base import Engine, EngineLoad, EngineRequest, Prefilled, PrefixEvents
from common.engines.batcher import Batcher, Seq, StepPlan
from common.engines.prefix_cache import PrefixCache
from common.engines.step_error import TARGET, ChunkGuard, StepError, StepErrorEstimator
from common.errors import Overloaded
from common.messages import Coeffs, Sampling, TokenItem, TokenLogprobs
from common.perf_model import Profile, StepSample
from common.precise_timer import PreciseTimer
from common.prediction_error import STEP_ERROR_MAXLEN, STEP_ERROR_WINDOW_S, ErrorWindow
from common.prefix_hash import block_hashes
from common.tokenizer import SimpleTokenizer

_tok = SimpleTokenizer()


def synthetic_token(key: str, position: int) -> int:
    """The simulated engine's output token at `position` (0 = the first output token) of the
    request keyed `key`: its sampling seed when it has one (a seeded request is reproducible, as
    with a real engine), else its request id."""
    return _tok.output_token(zlib.crc32(key.encode()) + 7919 * position)


def token_key(request_id: str, seed: int | None) -> str:
    return request_id if seed is None else f"seed:{seed}"


def synthetic_logprobs(request_id: str, position: int, token: int, k: int, chosen: float = -0.25) -> TokenLogprobs:
    """The simulated engine's logprobs at one position (see the module docstring)."""
    ids, lps = [token], [chosen]
    for i in range(1, k + 1):
        ids.append(synthetic_token(request_id, position + 100_003 * i))
        lps.append(chosen - i)
    return TokenLogprobs(ids, lps, list(range(1, k + 2)))


def synthetic_prompt_logprobs(request_id: str, prompt: list[int], k: int) -> list[TokenLogprobs | None]:
    return [None] + [synthetic_logprobs(request_id, -1 - j, t, k, chosen=-1.0) for j, t in enumerate(prompt[1:])]


class SimEngine(Engine):
    name = "sim"
    can_retain = True
    can_switch_role = True
    keeps_decodes = True

    def __init__(self, role: Literal["prefill", "decode"], profile: Profile, *, time_scale: float = 1.0,
                 max_queue_requests: int = 1024, prefix_block_tokens: int = 0, step_error: StepError | None = None,
                 closed_loop: bool = True, overrun_target: float = TARGET, seed: str = "",
                 max_model_len: int = 0) -> None:
        super().__init__()
        self.max_model_len = max_model_len  # prompt + output, as a model's context window (0: none)
        self.profile = profile
        self.model = profile.model
        self.time_scale = time_scale
        self.max_batch = profile.max_batch
        self.max_queue_requests = max_queue_requests
        self.prefix_block_tokens = prefix_block_tokens
        # model error: injected (StepError: steps run otherwise than the profile says), and measured
        # (every step against its prediction: the decode role's chunk guard plans with it)
        self.error = (step_error or StepError()).source(0, random.Random(zlib.crc32(seed.encode())))
        self.exact = step_error is None or step_error.exact
        self.estimator = StepErrorEstimator(target=overrun_target)
        self.step_errors = ErrorWindow(window_s=STEP_ERROR_WINDOW_S, maxlen=STEP_ERROR_MAXLEN)
        planned = self.model.scaled(time_scale) if time_scale != 1.0 else self.model
        # the prefill role's guard acts only beside the requests it decodes itself (route "retain")
        self.guard = ChunkGuard(planned, self.estimator) if closed_loop else None
        self._step_ms: deque[float] = deque(maxlen=64)
        self._take_role(role)
        self._wake = asyncio.Event()
        self.samples: deque[StepSample] = deque(maxlen=4096)
        self._t0: dict[str, float] = {}
        self._inflight: StepPlan | None = None
        self._inflight_end = 0.0  # time.monotonic() when the step in flight ends, as modeled
        self._resume: dict[str, int] = {}  # request -> output tokens streamed before it came here
        self._reqs: dict[str, EngineRequest] = {}
        self._step = asyncio.Lock()  # held by the step loop for a step (plan to emit): `between_steps`
        # the last prompt `prefix_cached` hashed, and its hashes: the decode worker asks it about a
        # DecodeWork's prompt just before `add`ing the same list (one hashing per prompt, not two)
        self._hashed: tuple[list[int], list[int]] | None = None

    def _take_role(self, role: Literal["prefill", "decode"]) -> None:
        """What the role decides: the token budget, the KV it offers, and a new batcher (with an
        empty prefix cache: a flipped worker's cache starts cold, as the simulator models it)."""
        profile = self.profile
        self.role = role
        self.token_budget = profile.prefill_token_budget if role == "prefill" else profile.decode_token_budget
        self.kv_capacity_tokens = profile.kv_capacity_tokens if role == "decode" else 0
        block = self.prefix_block_tokens
        cache = PrefixCache(block, profile.kv_capacity_tokens // block) if block > 0 else None
        self.batcher = Batcher(role=role, token_budget=self.token_budget, max_batch=self.max_batch,
                               kv_capacity_tokens=max(profile.kv_capacity_tokens, 1),
                               default_chunk=profile.decode_default_chunk if role == "decode"
                               else self.token_budget, prefix_cache=cache, guard=self.guard)
        self._step_ms.clear()  # the other role's step times say nothing of this one's

    def switch_role(self, role: Literal["prefill", "decode"], keep: Collection[str] = ()) -> str:
        """Take `role` in place: a new batcher (its prefix cache empty). The running decodes named
        in `keep` move to it (`Batcher.adopt`: their KV stays reserved, their output goes on at the
        same position, token for token) and decode there from the next step; anything else held
        refuses the switch. With its step loop running, call it only inside `between_steps`."""
        if role == self.role:
            return ""
        old = self.batcher
        moving = [s for s in (*old.running, *old.waiting, *old.decoding) if s.request_id in keep]
        if len(moving) != len(old):
            return (f"the engine still holds {len(old) - len(moving)} requests it does not keep "
                    "(the worker drains before it changes role)")
        if self._inflight is not None:
            return "a step is in flight (switch between steps)"
        if busy := [s.request_id for s in moving if s.prefilling]:
            return f"requests {busy[:3]} are still prefilling: only running decodes move to the new role"
        for seq in moving:
            old.remove(seq.request_id)
        self._take_role(role)
        for seq in moving:
            self.batcher.adopt(seq)
        kept = {s.request_id for s in moving}
        self._reqs = {rid: r for rid, r in self._reqs.items() if rid in kept}
        self._resume = {rid: n for rid, n in self._resume.items() if rid in kept}
        if moving:
            self._wake.set()
        return ""

    @contextlib.asynccontextmanager
    async def between_steps(self) -> AsyncIterator[None]:
        """Hold the step loop between two steps (the step in flight, if any, ends first)."""
        async with self._step:
            yield

    # -- Engine interface -----------------------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        if len(self.batcher) >= self.max_queue_requests:
            raise Overloaded(f"{self.role} engine holds {len(self.batcher)} requests (limit {self.max_queue_requests})")
        prompt_len = len(req.prompt_token_ids)
        computed = 0
        if req.mode == "handoff":
            computed = prompt_len
        elif req.cached_tokens:
            computed = min(req.cached_tokens, prompt_len - 1)
        max_tokens = req.sampling.max_tokens if self.role == "decode" or req.mode == "retain" else 1
        if self.max_model_len:  # generation stops at the end of the context, as an engine's does
            max_tokens = max(1, min(max_tokens, self.max_model_len - prompt_len))
        seq = Seq(request_id=req.request_id, attempt=req.attempt, prompt_len=prompt_len,
                  max_tokens=max_tokens,
                  tbt_slo=req.tbt_slo, computed=computed,
                  schedule=deque(req.chunk_schedule) if req.chunk_schedule else None,
                  deflected=req.mode == "deflect", arrived=time.monotonic(), retain=req.mode == "retain",
                  user=token_key(req.request_id, req.sampling.seed),
                  hashes=self._hashes(req.prompt_token_ids) if self.batcher.cache is not None else None)
        if (self.role == "decode" or seq.retain) and not self.batcher.can_admit(seq):
            raise Overloaded(f"{self.role} engine KV full ({self.batcher.kv_free()} tokens free, "
                             f"{seq.kv_reserve} needed)")
        self.batcher.add(seq)
        if req.resume_tokens:
            self._resume[req.request_id] = req.resume_tokens
        self._reqs[req.request_id] = req
        self._wake.set()

    def abort(self, request_id: str) -> bool:
        self._resume.pop(request_id, None)
        self._reqs.pop(request_id, None)
        return self.batcher.remove(request_id) is not None

    def can_admit(self, prompt_tokens: int, max_tokens: int) -> bool:
        return self.batcher.kv_free() >= prompt_tokens + max_tokens

    def lower_tbt_slo(self, request_id: str, tbt_slo: float) -> bool:
        return self.batcher.lower_tbt_slo(request_id, tbt_slo)  # (the batcher's Seq is what steps read)

    def held(self) -> list[str]:
        return [s.request_id for s in (*self.batcher.running, *self.batcher.waiting, *self.batcher.decoding)]

    def take_prefix_events(self) -> PrefixEvents | None:
        cache = self.batcher.cache
        if cache is None:
            return None
        stored, removed = cache.take_events()
        return PrefixEvents(block_tokens=cache.block_tokens, stored=stored, removed=removed)

    def prefix_cached(self, prompt_token_ids: list[int]) -> int | None:
        cache = self.batcher.cache
        if cache is None:
            return 0
        hashes = block_hashes(prompt_token_ids, self.prefix_block_tokens)
        self._hashed = (prompt_token_ids, hashes)
        hits = cache.match(hashes)
        return max(0, min(hits * cache.block_tokens, len(prompt_token_ids) - 1))

    def _hashes(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt's block hashes: those `prefix_cached` just made when it is the very same
        list (a message's prompt is not changed after it is decoded), else computed."""
        hashed, self._hashed = self._hashed, None
        if hashed is not None and hashed[0] is prompt_token_ids:
            return hashed[1]
        return block_hashes(prompt_token_ids, self.prefix_block_tokens)

    def cached_tokens(self, request_id: str) -> int:
        """Prompt tokens of a held request its prefix cache held when it was added."""
        seq = self.batcher.get(request_id)
        return seq.cached if seq is not None else 0

    def coeffs(self) -> Coeffs:
        # what the worker models (its KV hand-off sleeps the transfer time of these) and the router
        # predicts with: every modeled time x time_scale, the KV transfer's too
        return self.model.slowed(self.time_scale).to_coeffs() if self.time_scale != 1.0 else self.model.to_coeffs()

    def load(self) -> EngineLoad:
        steps = sorted(self._step_ms)
        return self.step_errors.fill(self.batcher.load(
            kv_capacity_tokens=self.kv_capacity_tokens, inflight=self._inflight,
            busy_s=max(0.0, self._inflight_end - time.monotonic()) if self._inflight is not None else 0.0,
            step_ms_p50=steps[len(steps) // 2] if steps else 0.0, step_ms_max=steps[-1] if steps else 0.0,
            step_margin=self.estimator.margin(), step_bias=self.estimator.bias()), time.monotonic())

    # -- the step loop ----------------------------------------------------------------------
    async def run(self) -> None:
        # time.monotonic(), not loop.time(): uvloop's is whole milliseconds, cached per loop turn
        deadline = time.monotonic()
        timer = PreciseTimer()  # asyncio.sleep waits whole milliseconds: a 0.5 ms step would take 1 ms
        try:
            await self._steps(deadline, timer)
        finally:
            timer.close()

    async def _steps(self, deadline: float, timer: PreciseTimer) -> None:
        while True:
            async with self._step:  # (a role switch waits here for the step in flight: `between_steps`)
                plan = self.batcher.plan()
                if plan is not None:
                    deadline = await self._run_step(timer, plan, deadline)
                    continue
                self._wake.clear()
            await self._wake.wait()
            deadline = time.monotonic()

    async def _run_step(self, timer: PreciseTimer, plan: StepPlan, deadline: float) -> float:
        """One step: sleep its modeled time, then commit it. Returns the next step's deadline."""
        pred = self.model.step_time(plan.batch, plan.kv_tokens, plan.chunk_pairs()) * self.time_scale
        started = time.monotonic()
        dt = pred if self.exact else pred * self.error.factor(started)
        self._inflight, self._inflight_end = plan, started + dt
        if self.role == "prefill":
            t_now = time.monotonic()
            for seq, _, _ in plan.chunks:
                if seq.prefill_started is None:
                    seq.prefill_started = t_now
        # keep the modeled cadence: sleep to an absolute deadline so callback time is not added
        deadline = max(deadline, started - dt) + dt
        await timer.sleep_until(deadline)
        end = time.monotonic()
        elapsed = end - started
        self._inflight = None
        self._emit(plan, elapsed)  # its tokens on their way first; then what the step measured
        self.estimator.observe(pred, elapsed)  # the real clock: event-loop lag counts as error too
        self.step_errors.observe(pred, elapsed, end)
        self._step_ms.append(elapsed * 1000.0)
        self.samples.append(StepSample(plan.batch, plan.kv_tokens, plan.chunk_pairs(), max(elapsed, 1e-6)))
        return deadline

    def _emit(self, plan: StepPlan, step_s: float) -> None:
        out = self.batcher.commit(plan)
        now = time.monotonic()
        if self.role == "prefill":
            for seq in out.prefilled:
                started = seq.prefill_started or seq.arrived
                req = self._reqs.pop(seq.request_id, None)
                k = req.sampling.prompt_logprobs if req is not None else None
                self.on_prefilled(Prefilled(request_id=seq.request_id, attempt=seq.attempt,
                                            queue_s=started - seq.arrived, prefill_s=now - started,
                                            first_token_id=synthetic_token(str(seq.user), 0),
                                            prompt_logprobs=None if k is None or req is None else
                                            synthetic_prompt_logprobs(seq.request_id, req.prompt_token_ids, k)))
        if not out.tokens:  # (prefill role: tokens only of the requests it decodes itself, route "retain")
            return
        finished = {id(s) for s in out.finished}
        resume = self._resume
        first = {id(s) for s in out.first_tokens}
        items = []
        for s in out.tokens:
            req = self._reqs.get(s.request_id)
            pos = resume.get(s.request_id, 0) + s.generated - 1
            tok = synthetic_token(str(s.user), pos)
            finish = "length" if id(s) in finished else None
            sp = req.sampling if req is not None else Sampling(max_tokens=s.max_tokens)
            if finish is None and tok in sp.stop_token_ids and s.generated >= sp.min_tokens:
                finish = "stop"
                self.batcher.remove(s.request_id)
            lps = None if sp.logprobs is None else [synthetic_logprobs(s.request_id, pos, tok, sp.logprobs)]
            plps = None
            if req is not None and id(s) in first and req.mode != "handoff" and sp.prompt_logprobs is not None:
                plps = synthetic_prompt_logprobs(s.request_id, req.prompt_token_ids, sp.prompt_logprobs)
            if finish is not None:
                self._reqs.pop(s.request_id, None)
                resume.pop(s.request_id, None)
            items.append(TokenItem(s.request_id, s.attempt, [tok], finish, lps, plps, pos=pos))
        self.on_tokens(items, step_s)
