"""The third path (route "retain", issue 44 item 2): a prefill worker keeps a request and decodes
it itself. In-process, no sockets, no wall clock: the policy on hand-built views, the batcher's
prefill role stepped by hand, the prefill worker core with fake ports, and the simulator end to
end on a tiny trace (simulated time)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from common import messages as m
from common.engines.base import EngineLoad, EngineRequest
from common.engines.batcher import Batcher, Seq
from common.engines.step_error import ChunkGuard, StepErrorEstimator
from common.perf_model import load_profile
from common.policy import ClusterView, DecodeView, KairosConfig, NoDecodeRoom, PrefillView, RequestSpec, make_policy
from common.worker_core import EngineInfo, PrefillCore

PROFILE = load_profile("h100-llama2-70b-tp4")
M = PROFILE.model
SLO = 0.1


def rq(tokens: int = 1024, out: int = 64) -> RequestSpec:
    return RequestSpec(request_id="r", prompt_tokens=tokens, max_tokens=out, ttft_slo=2.0, tbt_slo=SLO)


def full_decode(wid: str = "decode-0") -> DecodeView:
    """A decode worker whose decode step, with one more request, passes the TBT SLO (no room)."""
    return DecodeView(worker_id=wid, batch=256, kv_tokens=600_000, kv_free_tokens=10_000_000,
                      kv_capacity_tokens=10_000_000, resident_prefill_tokens=0, deflections=0,
                      strictest_tbt_slo=SLO, token_budget=2048, model=M)


def prefill(wid: str = "prefill-0", decodes: int = 0, kv: int = 0, queued: int = 0) -> PrefillView:
    return PrefillView(worker_id=wid, queued_tokens=queued, queued_requests=1 if queued else 0, token_budget=2048,
                       model=M, decodes=decodes, decode_kv_tokens=kv, strictest_tbt_slo=SLO if decodes else None,
                       kv_free_tokens=1_000_000)


def decide(view: ClusterView, req: RequestSpec | None = None, **cfg: Any) -> Any:
    k = KairosConfig(**{"decode_room": True, "retain": True, **cfg})
    return make_policy("kairos", kairos=k, default_model=M).decide(req or rq(), view, 0.0)


# ------------------------------------------------------------------ the policy


def test_policy_retains_when_no_decode_worker_has_room_and_a_prefill_worker_can_decode() -> None:
    assert M.decode_time(257, 601_024) > SLO  # the premise: the decode pool has no room
    view = ClusterView(prefill=(prefill("prefill-0", decodes=40, kv=80_000), prefill("prefill-1")),
                       decode=(full_decode(),))
    d = decide(view)
    assert (d.route, d.prefill_worker, d.decode_worker, d.reason) == ("retain", "prefill-1", "prefill-1",
                                                                      "decode_pool_full")
    assert d.ttft_prefill_pred is not None and 0 < d.ttft_prefill_pred < 2.0
    # off: the request waits at the router, as before
    with pytest.raises(NoDecodeRoom):
        decide(view, retain=False)


def test_policy_keeps_the_other_paths_when_a_decode_worker_has_room() -> None:
    roomy = msgspec.structs.replace(full_decode("decode-1"), batch=10, kv_tokens=20_000)
    d = decide(ClusterView(prefill=(prefill(queued=30_000),), decode=(full_decode(), roomy)))
    assert d.route in ("disagg", "deflect") and d.decode_worker == "decode-1"


def test_policy_does_not_retain_past_the_prefill_worker_s_tbt_room_kv_or_ttft() -> None:
    view = ClusterView(prefill=(prefill(decodes=200, kv=500_000),), decode=(full_decode(),))
    assert M.step_time(201, 501_024, [(512, 512)]) > 0.95 * SLO  # its decodes leave no room for a chunk
    with pytest.raises(NoDecodeRoom):
        decide(view)
    tight = msgspec.structs.replace(prefill(), kv_free_tokens=100)
    with pytest.raises(NoDecodeRoom):
        decide(ClusterView(prefill=(tight,), decode=(full_decode(),)))
    deep = prefill(queued=200_000)  # its first token would come after the TTFT SLO
    with pytest.raises(NoDecodeRoom):
        decide(ClusterView(prefill=(deep,), decode=(full_decode(),)))
    with pytest.raises(NoDecodeRoom):  # at most retain_max decodes there
        decide(ClusterView(prefill=(prefill(decodes=4, kv=4000),), decode=(full_decode(),)), retain_max=4)


def test_shipped_settings_open_the_third_path_on_an_a100_too() -> None:
    """The shipped `retain_chunk` is 64, not 512: on the A100 profile a 512-token chunk beside even
    one decode takes longer than the 100 ms TBT SLO, so a prefill worker could never keep room for
    it and the path never opened there (issue 44: under 10 % noise the A100's two decode workers
    held their decode room while the prefill workers sat 60 % idle). The shipped router and the
    simulator take the same setting."""
    from common.config import RouterConfig
    from sim.knobs import Setup, build, shipped

    a100 = load_profile("a100-llama2-70b-tp4")
    am = a100.model
    assert am.step_time(1, 1024, [(512, 512)]) > SLO  # the premise: 512 never fits beside a decode
    assert RouterConfig().retain_chunk == 64
    full = msgspec.structs.replace(full_decode(), model=am)
    assert am.decode_time(257, 601_024) > SLO
    worker = msgspec.structs.replace(prefill(decodes=2, kv=2_000), model=am, token_budget=a100.prefill_token_budget)
    view = ClusterView(prefill=(worker,), decode=(full,))
    req = rq(400, 500)
    policy, _ = build("kairos", shipped("kairos", Setup()), a100)
    d = policy.decide(req, view, 0.0)
    assert (d.route, d.prefill_worker) == ("retain", "prefill-0")
    old, _ = build("kairos", shipped("kairos", Setup(policy={"retain_chunk": 512})), a100)
    with pytest.raises(NoDecodeRoom):
        old.decide(req, view, 0.0)


# ------------------------------------------------------------------ the batcher's prefill role


def batcher(guard: bool = True) -> Batcher:
    return Batcher(role="prefill", token_budget=2048, max_batch=256, kv_capacity_tokens=2_000_000,
                   default_chunk=2048, guard=ChunkGuard(M, StepErrorEstimator()) if guard else None)


def seq(rid: str, prompt: int, out: int = 0, retain: bool = False) -> Seq:
    return Seq(request_id=rid, attempt=0, prompt_len=prompt, max_tokens=out, tbt_slo=SLO, retain=retain)


def run(b: Batcher, steps: int) -> tuple[list[float], dict[str, int], list[str]]:
    """Step `b` (exact model): each step's time while it carried decodes, tokens per request, prefilled ids."""
    times: list[float] = []
    toks: dict[str, int] = {}
    done: list[str] = []
    for _ in range(steps):
        plan = b.plan()
        if plan is None:
            break
        if plan.decodes:
            times.append(M.step_time(len(plan.decodes), plan.kv_tokens, plan.chunk_pairs()))
        out = b.commit(plan)
        for s in out.tokens:
            toks[s.request_id] = toks.get(s.request_id, 0) + 1
        done += [s.request_id for s in out.prefilled]
    return times, toks, done


def test_a_retained_request_streams_all_its_tokens_and_frees_its_kv() -> None:
    b = batcher()
    b.add(seq("kept", 3000, out=50, retain=True))
    b.add(seq("other", 1000))
    assert b.kv_free() == 2_000_000 - 3050  # KV kept for the retained one only
    _, toks, done = run(b, 200)
    assert toks == {"kept": 50} and done == ["other"]  # its first token with its last chunk, then 49 steps
    assert len(b) == 0 and b.kv_free() == 2_000_000 and b.plan() is None


def test_the_chunk_plan_keeps_the_retained_decodes_inside_their_tbt_slo() -> None:
    """Eighty retained decodes at 4k context each, then long prompts queued behind them: every
    step that carries the decodes stays within the TBT SLO (the chunks are cut, or wait), and the
    prompts are still prefilled. Without the guard the same queue breaks the SLO."""
    def setup(guard: bool) -> Batcher:
        b = batcher(guard)
        for i in range(80):
            b.add(seq(f"d{i}", 4000, out=400, retain=True))
        run(b, 200)  # all prefilled: 80 decodes
        assert b.decode_batch() == 80
        for i in range(6):
            b.add(seq(f"p{i}", 8000))
        return b

    times, _, done = run(setup(True), 2000)
    assert sorted(done) == [f"p{i}" for i in range(6)]
    assert max(times) <= SLO
    unguarded, _, _ = run(setup(False), 300)
    assert max(unguarded) > SLO  # the test can fail: a full 2048-token chunk beside them overruns


# ------------------------------------------------------------------ the prefill worker core


class Ports:
    def __init__(self) -> None:
        self.sent: list[m.Msg] = []
        self.started: list[EngineRequest] = []
        self.aborted: list[str] = []

    def send(self, msg: m.Msg) -> None:
        self.sent.append(msg)

    def start(self, req: EngineRequest) -> bool:
        self.started.append(req)
        return True

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def lower_tbt_slo(self, request_id: str, tbt_slo: float) -> bool:
        return False

    def beat_now(self, at_once: bool = False) -> None:
        pass

    def router_of(self, request_id: str) -> str:
        return "router-0"

    def release_kv(self, key: str) -> None:
        pass


def work(rid: str, prompt: int = 100, out: int = 3, retain: bool = True) -> m.PrefillWork:
    return m.PrefillWork(request_id=rid, attempt=0, dispatch=1, prompt_token_ids=[1] * prompt,
                         sampling=m.Sampling(max_tokens=out), decode_worker="prefill-0", deadline_s=10.0,
                         retain=retain, tbt_slo=0.05)


def test_prefill_core_decodes_retained_work_streams_tokens_and_cancels() -> None:
    ports = Ports()
    core = PrefillCore("prefill-0", "inc", EngineInfo(engine="sim", token_budget=2048, kv_capacity_tokens=10_000,
                                                      max_batch=8), ports, model="m")
    assert core.on_work(work("a"), EngineLoad(kv_free_tokens=10_000))
    assert (ports.started[-1].mode, ports.started[-1].tbt_slo) == ("retain", 0.05)
    assert not core.on_work(work("big", prompt=20_000), EngineLoad(kv_free_tokens=10_000))  # no KV room: refused
    failed = ports.sent[-1]
    assert isinstance(failed, m.RequestFailed) and failed.retryable and "kv_full" in failed.reason
    core.on_tokens([m.TokenItem("a", 0, [7])], 0.01)
    core.on_tokens([m.TokenItem("a", 0, [8]), ], 0.01)
    core.on_tokens([m.TokenItem("a", 0, [9], "length")], 0.01)
    batches = [x for x in ports.sent if isinstance(x, m.TokenBatch)]
    assert [it.token_ids for b in batches for it in b.items] == [[7], [8], [9]]
    assert "a" not in core.decoding and "a" not in core.work and core.counters["finished"] == 1
    # cancellation: a retained request the router cancels stops in the engine
    assert core.on_work(work("c"), EngineLoad(kv_free_tokens=10_000))
    assert core.on_cancel(m.Cancel(request_id="c", attempt=0, reason="client_disconnected"))
    assert ports.aborted[-1] == "c" and "c" not in core.decoding
    # its heartbeat carries what the policy needs of its decodes
    hb = core.heartbeat(EngineLoad(batch=3, kv_tokens=900, strictest_tbt_slo=0.05, kv_free_tokens=5000,
                                   step_margin=1.2), None)
    assert (hb.decodes, hb.decode_kv_tokens, hb.strictest_tbt_slo, hb.kv_free_tokens, hb.step_margin) == (
        3, 900, 0.05, 5000, 1.2)


# ------------------------------------------------------------------ end to end in the simulator


def test_simulator_serves_retained_requests_whole_when_the_decode_pool_is_full() -> None:
    """One decode worker, saturated by long outputs; with the third path on, requests the pool has
    no room for are decoded by the prefill worker, every token served, within TBT."""
    from common.traces import TraceRequest
    from sim.core import SimConfig, simulate

    reqs = [TraceRequest(t=0.01 * i, input_length=1000, output_length=300) for i in range(220)]
    cfg = SimConfig(prefill=1, decode=1, heartbeat_interval=0.1, kv_wait_timeout=60.0)

    def go(retain: bool) -> Any:
        pol = make_policy("kairos", kairos=KairosConfig(decode_room=True, late_binding=True, retain=retain),
                          default_model=M)
        return simulate(reqs, PROFILE, pol, cfg)

    on = go(True)
    kept = [r for r in on.records if r.route == "retain"]
    assert kept, "the prefill worker decoded none"
    assert all(r.output_tokens == 300 and max(r.tbt_gaps) <= SLO for r in kept)
    assert on.stats["decode_steps_over_tbt_slo"]["with_prefill_chunk"] == 0
    off = go(False)
    assert not [r for r in off.records if r.route == "retain"]


def test_live_simulated_prefill_engine_decodes_a_retained_request() -> None:
    """The live simulated engine (common/engines/sim.py) in the prefill role: a request in mode
    "retain" streams every token (no Prefilled, no hand-off), and its KV is kept and freed."""
    import asyncio

    from common.engines.sim import SimEngine

    async def go() -> tuple[list[m.TokenItem], int, int]:
        eng = SimEngine("prefill", PROFILE, time_scale=1e-4)
        items: list[m.TokenItem] = []
        prefilled: list[str] = []
        done = asyncio.Event()

        def on_tokens(batch: list[m.TokenItem], step_s: float) -> None:
            items.extend(batch)
            if any(it.finish_reason for it in batch):
                done.set()

        eng.on_tokens = on_tokens
        eng.on_prefilled = lambda p: prefilled.append(p.request_id)
        eng.add(EngineRequest(request_id="k", attempt=0, prompt_token_ids=[1] * 3000,
                              sampling=m.Sampling(max_tokens=12), mode="retain", tbt_slo=SLO))
        held = eng.load().kv_free_tokens
        task = asyncio.create_task(eng.run())
        try:
            await asyncio.wait_for(done.wait(), 30)
        finally:
            task.cancel()
        assert not prefilled
        return items, held, eng.load().kv_free_tokens

    items, during, after = asyncio.run(go())
    assert [len(it.token_ids) for it in items] == [1] * 12 and items[-1].finish_reason == "length"
    assert after - during == 3012


async def test_prefill_worker_shell_streams_a_retained_request_to_the_router() -> None:
    """The live prefill worker (services/prefill_worker) on the simulated engine: a PrefillWork
    with `retain` comes back as TokenBatches (every token, the last one "length"), no PrefillDone;
    its heartbeat says it decodes one request while it does."""
    import asyncio

    from common import config
    from common.engines.sim import SimEngine
    from services.prefill_worker.service import PrefillWorker

    cfg = config.load(config.WorkerConfig, env={}, overrides={"kv_timeout": 30.0})
    w = PrefillWorker(cfg, SimEngine("prefill", load_profile("fast")))
    sent: list[m.Msg] = []
    w.send = sent.append  # type: ignore[method-assign]
    loop = asyncio.create_task(w.engine.run())
    try:
        w.on_message(work("k", prompt=300, out=6))
        beats = []
        for _ in range(500):
            beats.append(w.heartbeat())
            if any(it.finish_reason for x in sent if isinstance(x, m.TokenBatch) for it in x.items):
                break
            await asyncio.sleep(0.01)
    finally:
        loop.cancel()
    items = [it for x in sent if isinstance(x, m.TokenBatch) for it in x.items]
    assert [it.request_id for it in items] == ["k"] * 6 and items[-1].finish_reason == "length"
    assert not [x for x in sent if isinstance(x, m.PrefillDone)]
    assert max(b.decodes for b in beats) == 1 and "k" not in w.work
