"""What every worker core does, whatever its role: who it is (its Hello), what it refuses and
how it says so, what it holds, and its drain (see common/worker_core/__init__.py)."""

from __future__ import annotations

import abc

import msgspec

from common import messages as m
from common.worker_core.ports import NULL_LOG, Log, WorkerPorts


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker's Hello says of its engine: its settings, fixed while it runs."""

    engine: str
    token_budget: int
    kv_capacity_tokens: int = 0
    max_batch: int = 0
    block_size: int = 0     # tokens per KV block (0: not in blocks)
    max_model_len: int = 0  # longest prompt + output it takes (0: no limit)


class WorkerCore(abc.ABC):
    role: m.Role

    def __init__(self, worker_id: str, incarnation: str, info: EngineInfo, ports: WorkerPorts, *,
                 model: str, kv_transport: str = "modeled", log: Log = NULL_LOG) -> None:
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.info = info
        self.ports = ports
        self.model = model                # the served model name it registers with
        self.kv_transport = kv_transport
        self.log = log
        self.seq = 0                      # its last heartbeat's number
        self.last_dispatch = 0            # the highest dispatch number it has seen (heartbeats acknowledge it)
        self.draining = False
        self.new_role: m.Role | None = None  # a role change under way (`set_role`): the role it drains for
        self.keep_running = False  # ... and it keeps its running decodes across it (`set_role(keep=True)`)
        self.counters: dict[str, int] = {"refused": 0}
        self.told: dict[str, m.PlanBudget] = {}  # router -> the delivery allowance it last told (PlanBudget)

    # -- what it holds ----------------------------------------------------------------------
    @abc.abstractmethod
    def held_requests(self) -> list[tuple[str, int]]:
        """(request_id, attempt) of everything it holds: what a drain waits for, then hands back."""

    def held_ids(self) -> list[str]:
        """Every request it holds anything for (Hello.held: the router names the ones it no longer
        tracks, which `drop` then frees)."""
        return [rid for rid, _ in self.held_requests()]

    @abc.abstractmethod
    def drop(self, request_id: str) -> None:
        """Abort a request and free what it holds (KV included); no message to the router."""

    def forget(self, request_id: str) -> None:
        """Drop its own bookkeeping of a request the engine gave up on (the engine holds nothing)."""

    # -- registration -----------------------------------------------------------------------
    def hello(self, *, held: list[str] | None = None, coeffs: m.Coeffs | None = None,
              kv_agent: m.KvAgentInfo | None = None, kv_block_tokens: int | None = None,
              fixed_role: bool = False, last_dispatch: int | None = None) -> m.Hello:
        """What it registers with: its engine's settings, the step-time model it asks to be
        predicted with (`coeffs`; None: the router's profile) and what it holds (`held`; None:
        everything); `fixed_role`: its engine cannot change role in place (the planner leaves it)."""
        i = self.info
        return m.Hello(protocol=m.PROTOCOL_VERSION, worker_id=self.worker_id, role=self.role,
                       incarnation=self.incarnation, engine=i.engine, model=self.model, token_budget=i.token_budget,
                       kv_capacity_tokens=i.kv_capacity_tokens, max_batch=i.max_batch, coeffs=coeffs,
                       kv_transport=self.kv_transport, kv_agent=kv_agent,
                       held=self.held_ids() if held is None else held, max_model_len=i.max_model_len,
                       kv_block_tokens=i.block_size if kv_block_tokens is None else kv_block_tokens,
                       fixed_role=fixed_role, plan_budget=True,
                       last_dispatch=self.last_dispatch if last_dispatch is None else last_dispatch)

    def welcomed(self, drop: list[str]) -> int:
        """The router's Welcome named requests it no longer tracks (it restarted, or re-dispatched
        them): free them. Only those still held: a second Welcome naming the same ones (a Hello
        sent again before the first answer came) frees nothing. Returns how many it freed."""
        if drop:
            held = set(self.held_ids())
            drop = [rid for rid in drop if rid in held]
        for rid in drop:
            self.drop(rid)
        if drop:
            self.ports.beat_now()
        return len(drop)

    # -- refusals -----------------------------------------------------------------------------
    def too_long(self, prompt_tokens: int) -> str:
        """Why the engine can never take a prompt this long (empty: it can)."""
        limit = self.info.max_model_len
        if limit and prompt_tokens >= limit:
            return (f"the prompt has {prompt_tokens} tokens; this worker's max_model_len is {limit} "
                    "(prompt plus at least one output token)")
        return ""

    def fail(self, request_id: str, attempt: int, reason: str, *, invalid: bool = False, code: str = "") -> None:
        """Tell the router this request cannot proceed here: `invalid` if the request itself is at
        fault (no retry anywhere), else retryable (another worker may take it)."""
        self.ports.send(m.RequestFailed(request_id=request_id, attempt=attempt, worker_id=self.worker_id,
                                        reason=reason, retryable=not invalid,
                                        code=code or ("invalid_request" if invalid else "")))

    def refuse(self, request_id: str, attempt: int, reason: str, *, invalid: bool = False) -> None:
        """Turn a request away here: counted, logged, and the router told (see `fail`)."""
        self.counters["refused"] += 1
        self.log.warning("work_refused", request_id=request_id, reason=reason, invalid=invalid)
        self.fail(request_id, attempt, reason, invalid=invalid)

    def engine_failed(self, request_id: str, attempt: int, reason: str, retryable: bool = True) -> None:
        """The engine gave up on a request (it holds nothing of it any more)."""
        self.log.warning("engine_request_failed", request_id=request_id, reason=reason, retryable=retryable)
        self.forget(request_id)
        self.fail(request_id, attempt, reason, invalid=not retryable)

    def saw_dispatch(self, dispatch: int) -> None:
        self.last_dispatch = max(self.last_dispatch, dispatch)

    # -- the TBT budget each request is planned to --------------------------------------------
    def tbt_budget(self, w: m.PrefillWork | m.DecodeWork) -> float:
        """The TBT budget `w`'s steps are planned to now: as its router sent it, or less where that
        router told a larger delivery allowance since (PlanBudget): its own SLO less that allowance."""
        t = self.told.get(self.ports.router_of(w.request_id))
        return w.tbt_slo if t is None else min(w.tbt_slo, t.budget(w.tbt_slo + w.allowance_s))

    def planned_work(self) -> list[m.PrefillWork | m.DecodeWork]:
        """The work in its engine whose steps are planned to a TBT budget (what it decodes or will)."""
        return []

    def on_plan_budget(self, msg: m.PlanBudget) -> int:
        """A router's delivery allowance moved (common/router_core/delivery.py): its requests in
        the engine whose budget is more than their own SLO less it are planned to that from now
        on, as a new dispatch would be, and so is its work that starts later (`tbt_budget`).
        Budgets only fall: the allowance is a high quantile of a window that moves both ways by
        a few milliseconds, and the client's own read, which it does not see, rides on the
        margin a request keeps from the allowance of its dispatch (live floods that raised them
        again when it fell: client TBT lower in four pairs of four). Returns how many moved; a
        heartbeat soon when any did (its strictest TBT SLO is the routers' view of its room)."""
        self.told[msg.router_incarnation] = msg
        moved = 0
        for w in self.planned_work():
            if self.ports.router_of(w.request_id) == msg.router_incarnation and \
                    self.ports.lower_tbt_slo(w.request_id, msg.budget(w.tbt_slo + w.allowance_s)):
                moved += 1
        (self.log.info if moved else self.log.debug)("plan_budget", router=msg.router_incarnation,
                                                      allowance_ms=round(msg.allowance_s * 1000.0, 2), moved=moved)
        if moved:
            self.ports.beat_now()
        return moved

    # -- drain ----------------------------------------------------------------------------------
    def start_drain(self) -> m.Goodbye:
        """It is leaving: it takes no new work (refused "worker_draining") and says so to every router."""
        self.draining = True
        self.ports.beat_now()
        return m.Goodbye(worker_id=self.worker_id, incarnation=self.incarnation)

    def set_role(self, msg: m.SetRole, *, keep: bool = False) -> m.Goodbye | None:
        """The router's role planner moves it to `msg.role`: it drains as for leaving (no new work,
        refused "worker_draining"; what it holds finishes here) and the Goodbye ("role_change") to
        send every router is returned; when `drained`, `hand_back` gives the "drained" Goodbye and
        the shell builds the core of the new role on the same engine and says Hello again. None:
        nothing to do (that is its role already, or it is draining).

        `keep` (the engine keeps running its decodes through the switch): the drain does not wait
        for the requests it decodes now (`kept`): they go on streaming, and the new role's core
        takes them over (`adopt`) as its own running decodes; the drain waits only for what the
        new role cannot do (prefills not started or under way, KV hand-offs in flight)."""
        if msg.role == self.role or self.draining:
            self.log.info("role_change_ignored", role=self.role, to=msg.role, draining=self.draining)
            return None
        self.new_role = msg.role
        self.keep_running = keep
        self.draining = True
        self.log.info("role_change_started", role=self.role, to=msg.role, reason=msg.reason,
                      holding=len(self.held_requests()), keeping=len(self.kept()))
        self.ports.beat_now()
        return m.Goodbye(worker_id=self.worker_id, incarnation=self.incarnation, reason="role_change")

    def leave_instead(self) -> None:
        """The worker is told to stop (SIGTERM) during a role change that keeps its decodes: it
        keeps nothing now; its drain waits for everything it holds and hands back the rest."""
        if self.keep_running:
            self.log.info("role_change_keeps_nothing", role=self.role, to=self.new_role, reason="stopping",
                          running=len(self.running_decodes()))
        self.keep_running = False

    def running_decodes(self) -> list[tuple[str, int]]:
        """(request_id, attempt) of the requests it decodes now, past their first token: what a
        role flip that keeps its decodes hands to the new role's core."""
        return []

    def kept(self) -> list[tuple[str, int]]:
        """What a role change under way keeps running across it (empty unless `set_role(keep=True)`)."""
        if self.new_role is None or not self.keep_running:
            return []
        return self.running_decodes()

    def kept_work(self) -> list[m.PrefillWork | m.DecodeWork]:
        """The work message of each request it keeps across a role change (`kept`), as it took it."""
        return []

    def adopt(self, old: WorkerCore) -> list[str]:
        """Take over `old`'s kept requests (the same engine's core of the other role, drained for
        a flip that keeps its decodes). Returns their ids (the new Hello's `held` names them)."""
        if old.kept():
            raise NotImplementedError(f"a {self.role} worker cannot take over a {old.role} worker's decodes")
        return []

    def drained(self, now: float) -> bool:
        """Whether the drain has nothing left to wait for at `now` (what it keeps across a role
        change, `kept`, it does not wait for)."""
        kept = set(self.kept())
        return not any(h not in kept for h in self.held_requests()) and not self.drain_pending(now)

    def drain_pending(self, now: float) -> bool:
        """Whether the drain must still wait, at `now`, for something beyond `held_requests`."""
        return False

    def hand_back(self) -> m.Goodbye:
        """The drain's time is up: abort what it still holds and hand each back to its router
        (RequestFailed, retryable); the Goodbye to send every router after them: "drained" (it
        leaves), or, when a role change keeps running decodes (`kept`), "role_switch" (it stays
        registered, draining, until its Hello under the new role names them in `held`)."""
        kept = set(self.kept())
        left = [h for h in self.held_requests() if h not in kept]
        for rid, attempt in left:
            self.ports.abort(rid)
            self.fail(rid, attempt, "worker_draining")
        self.log.info("drain_finished", handed_back=len(left), kept=len(kept))
        return m.Goodbye(worker_id=self.worker_id, incarnation=self.incarnation,
                         reason="role_switch" if kept else "drained")
