"""The router process's shell around the router core (common/router_core/core.py).

The core holds every rule: the worker table, the policy's decisions, the wait queue, migration,
membership, trust. This shell gives it what it must not own itself: the bus sockets (it binds
them; workers connect), the clock (every call passes `time.monotonic()`), the loops (the work
socket's reader, the liveness tick every heartbeat interval, telemetry once a second), Prometheus
metrics and log lines at a request's end, the preparation of the policy's view when the event
loop is free, and the admission wait for a worker when none is registered yet. The HTTP layer
(services/router/http.py) calls `admit`, `abort` and `stop_early` here.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import structlog

from common import codec, memory, tracing
from common import messages as m
from common.config import RouterConfig
from common.errors import NoWorkerYet, Unavailable
from common.loop_lag import LoopLag
from common.router_core.core import RouterCore
from common.router_core.planner import RolePlanner, planner_config, planner_on
from common.router_core.ports import Hooks, Outbox
from common.router_core.requests import Request
from common.sockets import Inbox, RouterBus, fingerprint, hand_to_io_thread, send_nowait
from common.tokenizer import make_tokenizer
from services.router import metrics, vllm_metrics
from services.router.openai_tools import ToolCalling

log = structlog.get_logger()


class Router:
    def __init__(self, cfg: RouterConfig, *, outbox: Outbox | None = None) -> None:
        """`outbox`: where the core's messages go instead of the bus (tests of the shell pass
        tests/router_fakes.py's FakeOutbox); by default this router's own sockets."""
        self.cfg = cfg
        # the request_done line: at info level when asked (--log-requests), else at debug level
        # (written only under --log-level debug; its fields are not even computed otherwise)
        self._request_line = "info" if cfg.log_requests else "debug" if cfg.log_level.lower() == "debug" else ""
        self.bus: RouterBus | None = None
        self._inbox: Inbox | None = None
        # set (and replaced) whenever a worker registers: requests waiting for a worker wake up
        self.workers_joined = asyncio.Event()
        self._prepare_queued = False
        self._prepared_at = -1.0  # monotonic time of the last `prepare`
        self._turn: tuple[float, asyncio.TimerHandle] | None = None  # this replica's turn at a heartbeat's room
        self.core = core = RouterCore(
            cfg, outbox if outbox is not None else self, metrics=metrics,  # the module has the Metrics functions
            hooks=Hooks(request_done=self._request_done, views_changed=self.prepare_soon,
                        worker_joined=self._wake_held, retry_later=self._retry_later),
            wall_offset=time.time() - time.monotonic(), opened_at=time.monotonic())
        if planner_on(cfg):  # the role planner: the core ticks it (on the router that leads)
            core.planner = RolePlanner(planner_config(cfg), log=log)
        # the core's parts, named as the HTTP layer, /metrics and the tests read them
        self.incarnation, self.profile, self.policy = core.incarnation, core.profile, core.policy
        self.table, self.prefix, self.requests, self.counts = core.table, core.prefix, core.requests, core.counts
        self.waiting, self.kv_waiting = core.waiting, core.kv_waiting
        self.migration, self.parked, self.membership = core.migration, core.parked, core.membership
        self.gate, self.routes, self.reasons = core.gate, core.routes, core.reasons
        self.delivery = core.delivery  # the streams' writes feed its measured part (openai_serve.py `wrote`)
        self.tokenizer = make_tokenizer(cfg.tokenizer)
        self.tool_calling: ToolCalling | None = None
        if cfg.tool_call_parser:
            self.tool_calling = ToolCalling(cfg.tool_call_parser, cfg.enable_auto_tool_choice, cfg.tokenizer,
                                            cfg.served_model_name)
        self.stop = asyncio.Event()
        self.accepting = True
        self.leaving = False  # after SIGTERM: /ready says 503, each response closes its connection (see __main__)
        vllm_metrics.attach(self)  # vLLM's gauges on /metrics read this router
        # OpenTelemetry (common/tracing.py): None unless an OTLP endpoint is configured
        self.tracing = tracing.from_config(cfg, "kairos-router")
        self.loop_lag = LoopLag("router")  # the event loop's lag: /metrics, RouterStats (common/loop_lag.py)

    # ------------------------------------------------------------------ the core's outbox
    def send(self, identity: bytes, msg: m.Msg) -> bool:
        sent = self._work_send([identity, codec.encode(msg)])
        # on the wire now, not when the loop next sleeps: the handler runs on (the stream's start,
        # the records) while a pinned router's I/O thread waits for the CPU (hand_to_io_thread)
        hand_to_io_thread()
        return sent

    def publish(self, msg: m.Msg) -> None:
        if self.bus is not None:
            self.bus.publish(codec.encode(msg))

    def _work_send(self, frames: list[bytes]) -> bool:
        if self._inbox is not None:
            return self._inbox.send(frames)
        assert self.bus is not None
        return send_nowait(self.bus.work, frames)  # before the loops start

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> None:
        self.bus = RouterBus(self.cfg, on_key_refused=self._on_key_refused)
        self.core.key_ids = self.bus.key_ids
        self.core.opened_at = time.monotonic()
        log.info("router_bus_bound", work=self.cfg.work_port, telemetry=self.cfg.telemetry_port,
                 policy=self.policy.name, incarnation=self.incarnation, curve=bool(self.cfg.curve_keys_dir),
                 worker_keys=len(self.bus.key_ids))
        if not self.cfg.curve_keys_dir:
            log.warning("bus_insecure", detail="CURVE is off: anyone who reaches the work port can register as a "
                        "worker and serve clients' prompts, and anyone who reaches the telemetry port reads it; "
                        "set KAIROS_CURVE_KEYS_DIR (kairos keys DIR) on every service")
        shared = sorted(fingerprint(k) for k, wid in self.bus.key_ids.items() if wid is None)
        if shared:
            log.warning("shared_worker_key", keys=shared, detail="these allowed worker keys are bound to no "
                        "worker id: a holder of one may register as any worker; make one key per worker with "
                        "`kairos keys DIR --add --workers ID,...` and delete the shared one from allowed/worker/")

    def _on_key_refused(self, domain: str, key: str, address: str) -> None:
        """The bus refused a CURVE key at the handshake (unknown, or another role's)."""
        self.counts["keys_refused"] += 1
        metrics.observe_dropped(f"{domain}_key_refused")
        held = self.core.dropped.admit(("key_refused", domain, key))
        if held is not None:
            log.warning("bus_key_refused", socket=domain, key=fingerprint(key), address=address,
                        detail=f"a CURVE key not in allowed/{domain}/ tried to connect", suppressed_since_last=held)

    def close(self) -> None:
        if self.tracing is not None:
            self.tracing.shutdown()  # export the spans still batched
        if self.bus is not None:
            self.bus.close()
            self.bus = None

    def loops(self) -> list[tuple[str, Any]]:
        out = [("work", self._work_loop()), ("liveness", self.liveness_loop()),
               ("telemetry", self.telemetry_loop()), ("loop-lag", self.loop_lag.run())]
        if self.bus is not None and self.bus.monitors:
            out.append(("handshakes", self.bus.handshake_failures(self._on_handshake_failed)))
        return out

    def _on_handshake_failed(self, domain: str, why: str) -> None:
        """A peer failed the bus handshake before any key was checked (under CURVE: most often a
        peer without CURVE): logged like a refused key, at most once per DROP_LOG_S per kind."""
        self.counts["handshakes_failed"] += 1
        metrics.observe_dropped(f"{domain}_handshake_failed")
        held = self.core.dropped.admit(("handshake_failed", domain, why))
        if held is not None:
            log.warning("bus_handshake_failed", socket=domain, reason=why, suppressed_since_last=held,
                        detail="a connection to the bus failed its handshake; the monitor event does not name "
                               "the peer's address: look for clients of this port without CURVE keys")

    async def liveness_loop(self) -> None:
        interval = self.cfg.heartbeat_interval
        last = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            late, last = now - last - interval, now
            if late > self.core.liveness_s / 2:
                # this process did not run for a while (CPU starvation, a pause): the heartbeats
                # of that time may still be unread, so judge no worker before reading them
                log.warning("router_stalled", late_s=round(late, 3))
                self.membership.excuse_stall(now, late)
                continue
            self.core.tick(now)

    async def telemetry_loop(self, every_s: float = 1.0) -> None:
        busy = False  # requests came since memory was last given back
        counts = self.core.counts
        accepted = counts["accepted"]
        while True:
            await asyncio.sleep(every_s)
            self.core.telemetry(time.monotonic(), self.loop_lag.take_max() * 1000.0)
            # idle: none in flight and none came in the whole round. Not merely none in flight at
            # this instant: under a steady load of short requests that is often so (at 200 req/s of
            # 7 ms each, one round in four), and the trim's full collection then stalled the loop
            # every few seconds, mid-load (5 % of the router's CPU at 200 req/s under py-spy)
            came, accepted = counts["accepted"] != accepted, counts["accepted"]
            if self.requests or came:
                busy = True
            elif busy:  # fallen idle after load: give back what the burst took (common/memory.py)
                busy = False
                before = memory.rss_bytes()
                memory.trim()
                log.debug("memory_returned", rss_mb=round(memory.rss_bytes() / 2**20, 1),
                          freed_mb=round((before - memory.rss_bytes()) / 2**20, 1))

    async def drain(self, timeout: float) -> None:
        """Stop intake, then wait for in-flight requests to finish (bounded)."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while self.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for req in list(self.requests.values()):
            self.core.fail(req, "router shutting down", "router_shutdown", time.monotonic())

    # ------------------------------------------------------------------ admission
    def submit(self, prompt_ids: list[int], sampling: m.Sampling, *, ttft_slo: float | None = None,
               tbt_slo: float | None = None, request_id: str | None = None, cached_tokens: int = 0,
               client: str = "", traceparent: str = "", tracestate: str = "") -> Request:
        if not self.accepting:
            metrics.observe_rejected("shutting_down")
            raise Unavailable("router is shutting down", retry_after_s=2.0)
        if self._inbox is not None:
            if not self.requests:
                # idle, the work socket is read only every idle_read_ms: fold in the heartbeats that
                # came since the last read, so that this decision sees the fleet as it is now
                self._inbox.catch_up()
            elif self.cfg.replicas > 1:
                # busy, with replicas: what waits unread (another replica's dispatch, as its worker's
                # heartbeat tells it) is read before this decision, not after it (sockets.py, `read_queued`)
                self._inbox.read_queued()
        return self.core.submit(prompt_ids, sampling, time.monotonic(), ttft_slo=ttft_slo, tbt_slo=tbt_slo,
                                request_id=request_id, cached_tokens=cached_tokens, client=client,
                                traceparent=traceparent, tracestate=tracestate)

    async def admit(self, prompt_ids: list[int], sampling: m.Sampling, *, ttft_slo: float | None = None,
                    tbt_slo: float | None = None, request_id: str | None = None, cached_tokens: int = 0,
                    client: str = "", traceparent: str = "", tracestate: str = "") -> Request:
        """`submit`, but when no worker can take the request yet (the router just restarted and the
        workers are re-registering, or they are all restarting), hold it up to `worker_wait`
        seconds for one to register instead of answering 503 at once. `traceparent`,
        `tracestate`: the client's W3C trace context (used only when tracing is on)."""
        if self.tracing is None:
            return await self._admit(prompt_ids, sampling, ttft_slo, tbt_slo, request_id, cached_tokens, client, "", "")
        t = self.tracing
        start = time.time()
        span = t.start(tracing.REQUEST, start, traceparent=traceparent, tracestate=tracestate, server=True,
                       attrs={"kairos.router": self.incarnation, "kairos.prompt_tokens": len(prompt_ids),
                              "kairos.max_tokens": sampling.max_tokens,
                              "kairos.client_request_id": request_id or ""})
        tp, ts = t.traceparent(span)
        try:
            req = await self._admit(prompt_ids, sampling, ttft_slo, tbt_slo, request_id, cached_tokens, client, tp, ts)
        except Exception as e:
            t.child(span, tracing.ADMISSION, start, time.time(), {"kairos.refused": type(e).__name__})
            t.end(span, time.time(), error=f"{type(e).__name__}: {e}")
            raise
        t.child(span, tracing.ADMISSION, start, time.time())
        span.set_attribute("kairos.request_id", req.request_id)
        req.span = span
        return req

    async def _admit(self, prompt_ids: list[int], sampling: m.Sampling, ttft_slo: float | None,
                     tbt_slo: float | None, request_id: str | None, cached_tokens: int, client: str,
                     traceparent: str, tracestate: str) -> Request:
        deadline = time.monotonic() + self.cfg.worker_wait
        held = False
        while True:
            try:
                req = self.submit(prompt_ids, sampling, ttft_slo=ttft_slo, tbt_slo=tbt_slo, request_id=request_id,
                                  cached_tokens=cached_tokens, client=client, traceparent=traceparent,
                                  tracestate=tracestate)
            except NoWorkerYet:
                left = deadline - time.monotonic()
                if left <= 0 or not self.accepting:
                    self.counts["unavailable"] += 1
                    metrics.observe_rejected("no_worker")
                    if held:
                        metrics.observe_held("timeout")
                    raise
                held = True
                joined = self.workers_joined
                try:
                    await asyncio.wait_for(joined.wait(), timeout=left)
                except TimeoutError:
                    pass
                continue
            if held:
                metrics.observe_held("served")
            return req

    def prepare_soon(self) -> None:
        """A worker's view changed (a heartbeat, a dispatch): have the policy prepare the new
        view once the loop is free (`Kairos.prepare`), so that the next request's decision does
        only its own part. Coalesced, and at most once per `prepare_interval_ms`: a large fleet's
        heartbeats arrive spread out (2,560 a second from 256 workers), and preparing after each
        one costs the whole fleet's views each time; a decision that comes first does the work
        for what changed since itself. While no request is in flight nothing is prepared (unless
        `prepare_when_idle`): an idle fleet's heartbeats cost their own folding only, and the
        next request's decision prepares each changed worker once, however often it beat."""
        if self._prepare_queued:
            return
        self._prepare_queued = True
        wait = self._prepared_at + self.cfg.prepare_interval_ms / 1000.0 - time.monotonic()
        loop = asyncio.get_running_loop()
        if wait > 0:
            loop.call_later(wait, self._prepare_now)
        else:
            loop.call_soon(self._prepare_now)

    def _retry_later(self, delay: float) -> None:
        """The core's `retry_later` hook: this replica's turn at the room a heartbeat shows comes
        in `delay` seconds (common/router_core/waiting.py, `replica_turn`), or the next heartbeat
        retry is due then (`heartbeat_retry_ms`); one timer, the earliest."""
        due = time.monotonic() + delay
        if self._turn is not None:
            if self._turn[0] <= due:
                return
            self._turn[1].cancel()
        self._turn = (due, asyncio.get_running_loop().call_later(delay, self._take_turn))

    def _take_turn(self) -> None:
        self._turn = None
        if self._inbox is not None:  # the turns before this one as the workers' heartbeats tell them, first
            self._inbox.read_queued()
        self.core.retry_now(time.monotonic(), turn=True)

    def _prepare_now(self) -> None:
        self._prepare_queued = False
        if not (self.requests or self.cfg.prepare_when_idle):
            return  # idle: the next decision prepares what changed (each worker once)
        now = self._prepared_at = time.monotonic()
        self.core.prepare(now)

    def _wake_held(self) -> None:
        """A worker registered: requests held at admission try again."""
        joined, self.workers_joined = self.workers_joined, asyncio.Event()
        joined.set()

    # ------------------------------------------------------------------ request end states
    def stop_early(self, req: Request) -> None:
        """The HTTP layer found a stop string: the request is complete; stop its work."""
        self.core.stop_early(req, time.monotonic())

    def abort(self, req: Request, reason: str = "client_disconnected") -> None:
        """The client went away: stop the work on the workers."""
        self.core.abort(req, time.monotonic(), reason)

    def _request_done(self, req: Request, finished_reason: str | None, rec: m.RequestRecord) -> None:
        vllm_metrics.observe_finished(self.cfg.served_model_name, req, finished_reason)
        if req.span is not None and self.tracing is not None:
            self._trace_done(self.tracing, req, rec)
        if not self._request_line:
            return
        write = log.info if self._request_line == "info" else log.debug
        write("request_done", request_id=req.request_id, client_request_id=req.client_request_id or None,
              route=rec.route, reason=rec.reason,
              prefill_worker=rec.prefill_worker, decode_worker=rec.decode_worker,
              prompt_tokens=rec.prompt_tokens, output_tokens=rec.output_tokens,
              ttft_s=round(rec.ttft_s, 4) if rec.ttft_s is not None else None,
              ttft_pred_s=round(rec.ttft_pred_s, 4) if rec.ttft_pred_s is not None else None,
              tbt_p50_s=rec.tbt_p50_s and round(rec.tbt_p50_s, 4),
              tbt_p99_s=rec.tbt_p99_s and round(rec.tbt_p99_s, 4),
              tbt_max_s=rec.tbt_max_s and round(rec.tbt_max_s, 4),
              write_gap_max_s=round(req.write_gap_max, 4) if req.write_gap_max else None, e2e_s=round(rec.e2e_s, 4),
              outcome=rec.outcome, attempts=rec.attempts, migrations=rec.migrations, kv_fallback=rec.kv_fallback,
              waited_for=req.wait_reason or None,
              placed_s=round(req.decided_at - req.arrival, 4) if req.decision is not None else None)

    def _trace_done(self, t: tracing.Tracing, req: Request, rec: m.RequestRecord) -> None:
        """The request's router spans, written at its end from the times the core kept: queueing
        (arrival to its last decision, zero long when it was dispatched at once) and decision,
        under its `kairos.request` span, which ends here."""
        span: Any = req.span
        off = self.core.wall_offset
        end = rec.e2e_s + req.arrival + off
        d = req.decision
        if d is None:  # never placed (it waited until it failed or the client left)
            t.child(span, tracing.QUEUEING, req.arrival + off, end, {"kairos.wait_reason": req.wait_reason})
        else:
            decided = req.decided_at + off
            began = max(req.arrival + off, decided - req.decision_us / 1e6)
            t.child(span, tracing.QUEUEING, req.arrival + off, began,
                    {"kairos.wait_reason": req.wait_reason} if req.wait_reason else None)
            pred = d.ttft_decode_pred if d.route == "deflect" else d.ttft_prefill_pred
            attrs: dict[str, str | int | float | bool] = {
                "kairos.route": d.route, "kairos.reason": d.reason, "kairos.decode_worker": d.decode_worker,
                "kairos.prefill_worker": d.prefill_worker or "", "kairos.attempt": req.attempt,
                "kairos.policy": self.policy.name, "kairos.cached_tokens": d.cached_tokens}
            if pred is not None:
                attrs["kairos.predicted_ttft_s"] = pred
            if d.ttft_prefill_pred is not None:
                attrs["kairos.ttft_prefill_pred_s"] = d.ttft_prefill_pred
            if d.ttft_decode_pred is not None:
                attrs["kairos.ttft_decode_pred_s"] = d.ttft_decode_pred
            t.child(span, tracing.DECISION, began, decided, attrs)
        span.set_attribute("kairos.outcome", rec.outcome)
        span.set_attribute("kairos.output_tokens", rec.output_tokens)
        if rec.ttft_s is not None:
            span.set_attribute("kairos.ttft_s", rec.ttft_s)
        t.end(span, end, error="" if rec.outcome == "ok" or rec.outcome == "client_disconnected" else rec.outcome)

    # ------------------------------------------------------------------ inbox: work socket
    async def _work_loop(self) -> None:
        assert self.bus is not None
        gap = self.cfg.idle_read_ms / 1000.0
        requests, workers = self.requests, self.table.workers
        self._inbox = Inbox(self.bus.work, self._on_work_frames, keyed=bool(self.cfg.curve_keys_dir),
                            idle_gap=(lambda: 0.0 if requests else idle_gap(gap, len(workers))) if gap > 0 else None)
        inbox = self._inbox
        self.membership.sent_after = lambda: inbox.drained_at  # (a heartbeat's age: Membership.sent_after)
        try:
            await inbox.failed  # the reader callback does the work; this ends only on a bug
        finally:
            self.membership.sent_after = None
            inbox.close()
            self._inbox = None

    def _on_work_frames(self, frames: list[bytes], key: str | None = None) -> None:
        """A message from the work socket; `key`: the sender's CURVE public key (None without CURVE)."""
        if len(frames) != 2:
            self.core.drop_frame("work", "bad_frame_dropped", socket="work", frames=len(frames))
            return
        identity, payload = frames
        try:
            msg = codec.router_inbox.decode(payload)
        except codec.DecodeError as e:
            self.core.drop_frame("work", "bad_frame_dropped", socket="work", error=str(e)[:200], bytes=len(payload))
            return
        self.gate.key = key
        if key is not None and not self._key_may_speak(identity, key, msg):
            return
        self.core.on_message(identity, msg, time.monotonic())

    def _key_may_speak(self, identity: bytes, key: str, msg: m.RouterInbox) -> bool:
        """Under CURVE: a Hello only under the id its key is bound to (or any, for a shared key);
        any other message only under the key its connection registered with."""
        assert self.bus is not None
        if isinstance(msg, m.Hello):
            bound = self.bus.key_ids.get(key)
            if bound is not None and bound != msg.worker_id:
                self.membership.refuse(identity, msg, f"key: the key this worker connected with ({fingerprint(key)}) "
                                       f"is bound to worker {bound!r}, not {msg.worker_id!r}: give each worker its "
                                       "own key (kairos keys) or set KAIROS_CURVE_KEY_NAME")
                return False
            return True
        w = self.table.workers.get(identity.decode(errors="replace"))
        if w is not None and w.key is not None and w.key != key:
            self.gate.drop(identity, "message_from_another_key", msg)
            return False
        return True

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, Any]:
        return {**self.core.stats(), **self.cost_model()}

    def cost_model(self) -> dict[str, Any]:
        """The profile in force (for workers that report no coefficients of their own) and the
        `kairos tune` settings the router runs with (kairos up --tuned), if any."""
        return {"profile": self.cfg.profile, "tuned": tuned_settings(self.cfg.tuned)}


IDLE_READ_FLEET = 256  # workers: the fleet whose idle heartbeats `idle_read_ms` was chosen for


def idle_gap(full_s: float, workers: int) -> float:
    """The least time between two reads of an idle router's work socket: `full_s` (`idle_read_ms`)
    for a fleet of IDLE_READ_FLEET workers or more, proportionally less for a smaller one. Spacing
    the reads batches a large fleet's heartbeats (2,560 a second from 256 workers: one wakeup each
    costs more than the 0.1 core issue 47 allows); a small fleet's few (60 a second from six) cost
    next to nothing read as they come, while whatever waits unread when a request arrives is read
    on its first token's path (`Router.submit`, `Inbox.catch_up`): about 30 µs a heartbeat, and with
    50 ms gaps a request at an idle six-worker router found one or two waiting."""
    return full_s * min(1.0, workers / IDLE_READ_FLEET)


def tuned_settings(text: str) -> Any:
    """RouterConfig.tuned (JSON that kairos up writes) as an object; None when unset."""
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return {"file": text}
