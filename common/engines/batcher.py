"""Continuous batching with chunked prefill and per-request chunk schedules: a pure class.

No I/O and no clock: the caller asks for a plan, times it (a performance model on the real
clock in the simulated engine, a virtual clock in `kairos sim`), then commits it. The live
simulated engine and the discrete-event simulator share this class, so they batch alike.

Decode role, each step: every running decode gets one token first; then every in-place
(deflected) prefill gets its next chunk, the next entry of its schedule when it has one (the
router sized it for the TBT budget), else up to the engine's default chunk, always within the
remaining token budget (a scheduled chunk cut short continues next step). With a `guard`
(common/engines/step_error.py: the closed-loop TBT protection), every chunk of a prefill the
router planned for the TBT SLO (one that came with a schedule) is also cut to what the step's
predicted time times the worker's measured error margin allows within the strictest TBT SLO of
the decodes in the batch, also once its schedule has run out (the worker's prefix cache held
less of the prompt than the router's index said, so the rest goes at the default chunk). A
prefill sent without a schedule (the baselines') is not cut: those systems have no such guard.
The step that runs a prompt's last chunk also samples its first token, as vLLM does. A handed-off request (KV
from a prefill worker) joins as a decode.

Prefill role, each step: FIFO chunked prefill within the token budget; a request whose prompt
is complete leaves the batch (its KV then goes to a decode worker). The router's replay
predictor (common/engines/replay.py) replays this rule; keep the two in step. A retained
request (`Seq.retain`, route "retain": the prefill worker decodes it itself, no KV moves) samples
its first token with its last chunk, as a deflection does, and stays as a decode (`decoding`):
each step every such decode gets one token first, and the prefill chunks then take what is left
of the token budget, each cut (with a `guard`) to what fits the step within the strictest TBT
SLO of those decodes, times the measured error margin: the same guard as the decode role's; a
step where not one prefill token fits beside them runs the decodes alone (the prefills wait). KV
is reserved (prompt + max_tokens) for retained requests only; the rest leave once prefilled.

Prefix cache (optional, `prefix_cache`; a Seq with `hashes`, its prompt's block hashes): a
request added with its prompt to compute starts at its longest cached prefix (never the whole
prompt: the last token is always computed, as in vLLM), so cache hits skip prefill work; its
blocks are in use while the batch holds it, and stay cached after it leaves, least recently
freed evicted first, within the KV capacity less the KV the held requests reserve. A
handed-off request's KV arrives whole and is cached like the rest.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from common.engines.base import EngineLoad
from common.engines.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from common.engines.step_error import ChunkGuard


@dataclass(slots=True, eq=False)
class Seq:
    request_id: str
    attempt: int
    prompt_len: int
    max_tokens: int
    tbt_slo: float = 0.1
    computed: int = 0
    generated: int = 0
    schedule: deque[int] | None = None
    deflected: bool = False
    arrived: float = 0.0
    admitted: float | None = None
    prefill_started: float | None = None
    user: object = None
    hashes: list[int] | None = None  # the prompt's block hashes (prefix cache); None: not cacheable
    pinned: int = 0                  # leading blocks of `hashes` this request holds in the cache
    cached: int = 0                  # prompt tokens found in the prefix cache when it was added
    retain: bool = False             # prefill role: decoded here after its prefill (route "retain")

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len

    @property
    def kv_tokens(self) -> int:
        return self.computed + self.generated

    @property
    def remaining_prompt(self) -> int:
        return self.prompt_len - self.computed

    @property
    def kv_reserve(self) -> int:
        return self.prompt_len + self.max_tokens


@dataclass(slots=True)
class StepPlan:
    decodes: list[Seq]
    chunks: list[tuple[Seq, int, int]]  # (seq, chunk tokens, context before the chunk)
    kv_tokens: int

    @property
    def batch(self) -> int:
        return len(self.decodes)

    def chunk_pairs(self) -> list[tuple[int, int]]:
        return [(chi, k) for _, chi, k in self.chunks]

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(chi for _, chi, _ in self.chunks)


@dataclass(slots=True)
class StepOutcome:
    tokens: list[Seq] = field(default_factory=list)       # seqs that sampled one new token
    first_tokens: list[Seq] = field(default_factory=list)  # of those, the ones whose first it was
    finished: list[Seq] = field(default_factory=list)     # reached max_tokens
    prefilled: list[Seq] = field(default_factory=list)    # prefill role: prompt complete


class Batcher:
    """The batching state of one engine. See the module docstring for the step rules."""

    def __init__(self, *, role: Literal["prefill", "decode"], token_budget: int, max_batch: int,
                 kv_capacity_tokens: int, default_chunk: int, prefix_cache: PrefixCache | None = None,
                 guard: ChunkGuard | None = None) -> None:
        if token_budget <= 0 or default_chunk <= 0:
            raise ValueError("token_budget and default_chunk must be positive")
        self.role = role
        self.token_budget = token_budget
        self.max_batch = max_batch
        self.kv_capacity = kv_capacity_tokens
        self.default_chunk = default_chunk
        self.running: list[Seq] = []
        self.waiting: deque[Seq] = deque()
        self.decoding: list[Seq] = []  # prefill role: retained requests past their prefill, decoding here
        self._by_id: dict[str, Seq] = {}
        self.kv_reserved = 0
        self.steps = 0
        self.cache = prefix_cache
        self.guard = guard  # decode role: cuts scheduled chunks to the measured step-time error

    # -- membership -----------------------------------------------------------------------
    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, request_id: str) -> Seq | None:
        return self._by_id.get(request_id)

    def kv_free(self) -> int:
        return self.kv_capacity - self.kv_reserved

    def lower_tbt_slo(self, request_id: str, tbt_slo: float) -> bool:
        """Plan `request_id`'s steps (and the chunks beside it) to `tbt_slo` from now on, if less."""
        seq = self._by_id.get(request_id)
        if seq is None or seq.tbt_slo <= tbt_slo:
            return False
        seq.tbt_slo = tbt_slo
        return True

    def can_admit(self, seq: Seq) -> bool:
        return self.kv_reserved + seq.kv_reserve <= self.kv_capacity

    def add(self, seq: Seq) -> None:
        """Queue a request. Prefill role: FIFO. Decode role: joins the running batch at once
        (the worker checked `can_admit`; KV is reserved for the whole prompt plus output)."""
        if seq.request_id in self._by_id:
            raise ValueError(f"request {seq.request_id} is already in this batch")
        self._by_id[seq.request_id] = seq
        if self.role == "prefill":
            self.waiting.append(seq)
            if seq.retain:
                self.kv_reserved += seq.kv_reserve
        else:
            self.kv_reserved += seq.kv_reserve
            self.running.append(seq)
        cache = self.cache
        if cache is None:
            return
        if seq.hashes:
            if seq.computed >= seq.prompt_len:  # its KV arrived whole
                self._pin(seq, len(seq.hashes))
            else:
                hits = cache.match(seq.hashes)
                cached = min(hits * cache.block_tokens, seq.prompt_len - 1)
                if cached > seq.computed:
                    seq.computed = seq.cached = cached
                self._pin(seq, hits)
        self._trim()  # its KV reservation, too, takes room from the cached blocks

    def adopt(self, seq: Seq) -> None:
        """Take over a running decode from this engine's batcher of its other role (a role flip
        that keeps its decodes: the engine holds their KV). It decodes here from the next step:
        decode role, in the running batch; prefill role, as a request it decodes itself (route
        "retain"). Its KV stays reserved; it pins nothing in this batcher's prefix cache (the
        flip's lost prefix cache: what the old role cached is not found here)."""
        if seq.prefilling:
            raise ValueError(f"request {seq.request_id} is still prefilling: only running decodes move")
        if seq.request_id in self._by_id:
            raise ValueError(f"request {seq.request_id} is already in this batch")
        seq.pinned = 0
        seq.schedule = None
        self._by_id[seq.request_id] = seq
        self.kv_reserved += seq.kv_reserve
        if self.role == "prefill":
            seq.retain = True
            self.decoding.append(seq)
        else:
            seq.retain = False
            self.running.append(seq)
        if self.cache is not None:
            self._trim()

    def remove(self, request_id: str) -> Seq | None:
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return None
        if self.role == "decode" or seq.retain:
            self.kv_reserved -= seq.kv_reserve
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.decoding:
            self.decoding.remove(seq)
        else:
            self.waiting.remove(seq)
        if self.cache is not None and seq.hashes and seq.pinned:
            self.cache.release(seq.hashes[:seq.pinned])
            seq.pinned = 0
            self._trim()
        return seq

    def _pin(self, seq: Seq, blocks: int) -> None:
        assert self.cache is not None and seq.hashes is not None
        if blocks > seq.pinned:
            self.cache.acquire(seq.hashes[seq.pinned:blocks])
            seq.pinned = blocks

    def _trim(self) -> None:
        """Cached blocks fit in what the KV capacity leaves beside the held requests."""
        cache = self.cache
        assert cache is not None
        bt = cache.block_tokens
        cache.trim(cache.capacity_blocks - max(cache.in_use, -(-self.kv_reserved // bt)))

    # -- load, as heartbeats report it ---------------------------------------------------
    def queued_tokens(self) -> int:
        """Sum over running and waiting of the prompt tokens not yet prefilled (Equation 1's sum)."""
        return sum(s.remaining_prompt for s in self._by_id.values())

    def decode_batch(self) -> int:
        """Decode role: the running decodes. Prefill role: the retained requests, decoding or to
        decode once prefilled (what its future steps carry)."""
        if self.role == "prefill":
            return len(self.decoding) + sum(1 for s in itertools.chain(self.running, self.waiting) if s.retain)
        return sum(1 for s in self.running if not s.prefilling)

    def kv_tokens(self) -> int:
        """... and their KV (prefill role: a retained request not yet decoding at its whole prompt)."""
        if self.role == "prefill":
            return sum(s.kv_tokens for s in self.decoding) + sum(
                s.prompt_len for s in itertools.chain(self.running, self.waiting) if s.retain)
        return sum(s.kv_tokens for s in self.running if not s.prefilling)

    def resident_prefill_tokens(self) -> int:
        if self.role == "prefill":
            return 0
        return sum(s.remaining_prompt for s in self.running if s.prefilling)

    def deflections(self) -> int:
        if self.role == "prefill":
            return 0
        return sum(1 for s in self.running if s.prefilling)

    def strictest_tbt_slo(self) -> float | None:
        if self.role == "prefill":
            slos = [s.tbt_slo for s in itertools.chain(self.decoding, self.running, self.waiting) if s.retain]
            return min(slos) if slos else None
        slos = [s.tbt_slo for s in self.running]
        return min(slos) if slos else None

    def backlog(self, inflight: StepPlan | None) -> list[tuple[int, int]]:
        """Each held request's (prompt tokens, tokens done) in FIFO order once the step in flight
        (`inflight`, None: none) has run: what the router's replay predictor starts from."""
        ahead = {id(seq): chi for seq, chi, _ in inflight.chunks} if inflight is not None else {}
        out = []
        for seq in itertools.chain(self.running, self.waiting):
            done = seq.computed + ahead.get(id(seq), 0)
            if done < seq.prompt_len:
                out.append((seq.prompt_len, done))
        return out

    def load(self, *, kv_capacity_tokens: int, inflight: StepPlan | None, busy_s: float, step_ms_p50: float = 0.0,
             step_ms_max: float = 0.0, step_margin: float = 1.0, step_bias: float = 1.0) -> EngineLoad:
        """What an engine built on this batcher reports of itself (`Engine.load`): the batch's
        state, and what the engine measured (its step times, error, the step in flight). The live
        simulated engine (common/engines/sim.py) and the simulator's workers (sim/state.py) both
        report this."""
        decode = self.role == "decode"
        return EngineLoad(
            queued_tokens=self.queued_tokens(), queued_requests=len(self), batch=self.decode_batch(),
            kv_tokens=self.kv_tokens(), kv_free_tokens=self.kv_free(),
            kv_capacity_tokens=kv_capacity_tokens, resident_prefill_tokens=self.resident_prefill_tokens(),
            deflections=self.deflections(), strictest_tbt_slo=self.strictest_tbt_slo(), step_ms_p50=step_ms_p50,
            step_ms_max=step_ms_max, steps=self.steps, backlog=None if decode else self.backlog(inflight),
            busy_s=busy_s, step_margin=step_margin, step_bias=step_bias)

    # -- stepping -------------------------------------------------------------------------
    def plan(self) -> StepPlan | None:
        if self.role == "prefill":
            return self._plan_prefill()
        return self._plan_decode()

    def _plan_prefill(self) -> StepPlan | None:
        decodes = self.decoding[:self.max_batch]
        kv = sum(s.kv_tokens for s in decodes)
        budget = self.token_budget - len(decodes)
        chunks: list[tuple[Seq, int, int]] = []
        while self.waiting and len(self.running) < self.max_batch:
            self.running.append(self.waiting.popleft())
        guard = self.guard if decodes else None
        slo = min(s.tbt_slo for s in decodes) if guard is not None else 0.0
        for seq in self.running:
            if budget <= 0:
                break
            chi = min(seq.remaining_prompt, budget)
            if guard is not None:  # retained decodes run beside it: within their TBT SLO, or not this step
                pairs = [(c, k) for _, c, k in chunks]
                chi = guard.fit(len(decodes), kv, pairs, chi, seq.computed, slo)
                if not guard.fits(len(decodes), kv, pairs, chi, seq.computed, slo):
                    break  # not even one token fits beside them: the prefills wait (FIFO) a step
            if chi > 0:
                chunks.append((seq, chi, seq.computed))
                budget -= chi
        if not chunks and not decodes:
            return None
        return StepPlan(decodes=decodes, chunks=chunks, kv_tokens=kv)

    def _plan_decode(self) -> StepPlan | None:
        decodes: list[Seq] = []
        kv = 0
        prefills: list[Seq] = []
        for seq in self.running:
            if seq.prefilling:
                prefills.append(seq)
            elif len(decodes) < self.max_batch:
                decodes.append(seq)
                kv += seq.kv_tokens
        budget = self.token_budget - len(decodes)
        chunks: list[tuple[Seq, int, int]] = []
        guard = self.guard if decodes else None
        slo = min(s.tbt_slo for s in decodes) if guard is not None else 0.0
        for seq in prefills:
            sched = seq.schedule
            if sched:
                # the router sized it for the budget it saw; never past the budget left now
                chi = min(sched[0], seq.remaining_prompt, budget)
            else:  # no schedule, or one that ran out (the cache held less of the prompt than the router thought)
                chi = min(self.default_chunk, seq.remaining_prompt, budget)
            if sched is not None and guard is not None and chi > 0:
                # planned by the router for the TBT SLO: never past what the measured model error allows
                pairs = [(c, k) for _, c, k in chunks]
                chi = guard.fit(len(decodes), kv, pairs, chi, seq.computed, slo)
                if not guard.fits(len(decodes), kv, pairs, chi, seq.computed, slo):
                    # not even one token fits beside the decodes (a step with a chunk costs the
                    # model's fixed a6 more than a decode-only one): the prefill waits a step, as
                    # on a prefill worker, rather than run one token a step over the guard's limit
                    continue
            if chi <= 0:
                continue
            chunks.append((seq, chi, seq.computed))
            budget -= chi
        if not decodes and not chunks:
            return None
        return StepPlan(decodes=decodes, chunks=chunks, kv_tokens=kv)

    def commit(self, plan: StepPlan) -> StepOutcome:
        """Apply a planned step. Sequences removed since `plan()` are skipped, also when a new
        attempt of the same request was added meanwhile (the identity check: the stale sequence
        must neither advance nor remove the new one)."""
        out = StepOutcome()
        self.steps += 1
        live = self._by_id
        for seq in plan.decodes:
            if live.get(seq.request_id) is not seq:
                continue
            seq.generated += 1
            out.tokens.append(seq)
            if seq.generated == 1:
                out.first_tokens.append(seq)
            if seq.generated >= seq.max_tokens:
                out.finished.append(seq)
        for seq, chi, _ in plan.chunks:
            if live.get(seq.request_id) is not seq:
                continue
            seq.computed += chi
            if seq.schedule:
                if chi >= seq.schedule[0]:
                    seq.schedule.popleft()
                else:  # cut short by the token budget: the rest of this chunk comes next step
                    seq.schedule[0] -= chi
            if seq.computed < seq.prompt_len:
                continue
            if self.cache is not None and seq.hashes:
                self._pin(seq, len(seq.hashes))  # the whole prompt's KV is now computed
                self._trim()
            if self.role == "prefill" and not seq.retain:
                out.prefilled.append(seq)
            else:
                if self.role == "prefill":  # retained: it decodes here from now on
                    self.running.remove(seq)
                    self.decoding.append(seq)
                seq.generated += 1
                out.tokens.append(seq)
                out.first_tokens.append(seq)
                if seq.generated >= seq.max_tokens:
                    out.finished.append(seq)
        for seq in out.prefilled:
            self.remove(seq.request_id)
        for seq in out.finished:
            self.remove(seq.request_id)
        return out
