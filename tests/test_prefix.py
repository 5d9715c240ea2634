"""Prefix caching without processes: the engines' block cache (Batcher), the router's prefix
index, the workers' heartbeat summaries, the session trace generator, the policies that price
cached prefixes, and `kairos sim` with and without it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from common import messages as m
from common.engines.base import Engine, PrefixEvents
from common.engines.batcher import Batcher, Seq
from common.engines.prefix_cache import PrefixCache
from common.perf_model import load_profile
from common.policy import ClusterView, DecodeView, KairosConfig, PrefillView, RequestSpec, make_policy
from common.policy.prefix_index import PrefixIndex
from common.prefix_hash import block_hashes, chain_ids
from common.prefix_report import PrefixReporter
from common.sessions import KINDS, sessions, write_jsonl
from common.traces import TraceRequest, load_trace
from sim.cli import main as sim_main
from sim.core import SimConfig, simulate
from sim.knobs import Setup, build

BT = 4


def decode_batcher(capacity_tokens: int, budget: int = 64) -> Batcher:
    return Batcher(role="decode", token_budget=budget, max_batch=8, kv_capacity_tokens=capacity_tokens,
                   default_chunk=budget, prefix_cache=PrefixCache(BT, capacity_tokens // BT))


def run_out(b: Batcher) -> int:
    """Step until the batch is empty; the prefill tokens computed."""
    computed = 0
    while (plan := b.plan()) is not None:
        computed += sum(chi for _, chi, _ in plan.chunks)
        b.commit(plan)
    return computed


# ------------------------------------------------------------------------------ the batcher's cache


def test_cache_hits_skip_prefill_work() -> None:
    b = decode_batcher(1000)
    first = list(range(40))
    b.add(Seq("a", 0, prompt_len=40, max_tokens=2, hashes=block_hashes(first, BT)))
    assert run_out(b) == 40
    second = first + list(range(100, 110))  # the first turn, then 10 new tokens
    s = Seq("b", 0, prompt_len=50, max_tokens=2, hashes=block_hashes(second, BT))
    b.add(s)
    assert s.cached == 40 and s.computed == 40
    assert run_out(b) == 10  # only the suffix is prefilled
    # the whole prompt cached: its last token is still computed
    again = Seq("c", 0, prompt_len=50, max_tokens=1, hashes=block_hashes(second, BT))
    b.add(again)
    assert again.cached == 48 and run_out(b) == 2
    # a different first block: nothing in common (hashes name prefixes, not blocks)
    other = Seq("d", 0, prompt_len=40, max_tokens=1, hashes=block_hashes([9, *first[1:]], BT))
    b.add(other)
    assert other.cached == 0


def test_cache_evicts_least_recently_freed_within_kv_capacity() -> None:
    b = decode_batcher(capacity_tokens=64)  # 16 blocks
    stored: list[int] = []
    removed: list[int] = []
    for i in range(6):  # 6 prompts of 4 blocks each, one after the other
        prompt = [1000 * i + k for k in range(16)]
        b.add(Seq(f"r{i}", 0, prompt_len=16, max_tokens=1, hashes=block_hashes(prompt, BT)))
        run_out(b)
        assert b.cache is not None and len(b.cache) <= 16
        s, r = b.cache.take_events()
        stored += s
        removed += r
    cache = b.cache
    assert cache is not None
    # a running request also reserves KV for its output: more went while each one ran
    assert len(stored) == 24 and len(removed) >= 8 and len(cache) == 24 - len(removed)
    early = block_hashes(list(range(16)), BT)
    late = block_hashes([5000 + k for k in range(16)], BT)
    assert cache.match(early) == 0 and cache.match(late) == 4  # the oldest went first
    # a request held reserves KV: cached blocks make room for it
    b.add(Seq("big", 0, prompt_len=40, max_tokens=8, hashes=None))
    assert len(cache) <= 16 - 48 // BT
    assert cache.match(late) == 4  # the most recent survive longest


def test_tail_blocks_evicted_before_the_head() -> None:
    c = PrefixCache(BT, capacity_blocks=8)
    hs = block_hashes(list(range(32)), BT)  # 8 blocks
    c.acquire(hs)
    c.release(hs)
    c.trim(6)
    assert c.match(hs) == 6  # the prefix stays usable


def test_handoff_kv_is_cached_and_shared_blocks_are_counted_once() -> None:
    b = decode_batcher(1000)
    prompt = list(range(20))
    b.add(Seq("h", 0, prompt_len=20, max_tokens=3, computed=20, hashes=block_hashes(prompt, BT)))
    assert b.cache is not None and b.cache.match(block_hashes(prompt, BT)) == 5
    b.add(Seq("h2", 0, prompt_len=21, max_tokens=3, hashes=block_hashes([*prompt, 7], BT)))
    assert b.cache.in_use == 5  # both requests hold the same five blocks
    run_out(b)
    assert b.cache.in_use == 0 and b.cache.cached == 5


# ------------------------------------------------------------------------------ the router's index


def test_index_hits_are_longest_prefixes_per_worker() -> None:
    ix = PrefixIndex()
    for w in ("d0", "d1"):
        ix.join(w, BT, "inc")
    hs = chain_ids([1, 2, 3, 4])
    ix.stored("d0", hs[:3])
    ix.stored("d1", hs[:1] + hs[2:])  # a hole at block 1: only block 0 counts
    assert ix.hits(hs) == {"d0": 3, "d1": 1}
    assert ix.hits(hs, among=["d1"]) == {"d1": 1}
    ix.removed("d0", hs[1:2])
    assert ix.hits(hs) == {"d0": 1, "d1": 1}
    assert ix.hits(chain_ids([9])) == {}


def test_index_stays_bounded_with_many_sessions() -> None:
    ix = PrefixIndex(max_blocks=5000)
    ix.join("d0", 512)
    for s in range(2000):  # 2000 sessions of 10 blocks each
        ix.stored("d0", chain_ids([s * 100 + k for k in range(10)]))
        assert len(ix) <= 5000
    recent = chain_ids([1999 * 100 + k for k in range(10)])
    assert ix.hits(recent) == {"d0": 10}  # the most recent survive
    assert ix.hits(chain_ids(range(10))) == {}  # the oldest were dropped


def test_index_forgets_a_restarted_or_departed_worker() -> None:
    ix = PrefixIndex()
    hs = chain_ids([1, 2, 3])
    ix.join("d0", BT, "first")
    ix.join("d1", BT, "x")
    ix.stored("d0", hs)
    ix.stored("d1", hs)
    ix.join("d0", BT, "first")  # the same incarnation again: nothing lost
    assert ix.hits(hs) == {"d0": 3, "d1": 3}
    ix.join("d0", BT, "second")  # restarted: an empty cache
    assert ix.hits(hs) == {"d1": 3}
    ix.forget("d1")  # departed
    assert ix.hits(hs) == {}
    ix.stored("d0", hs[:2])
    assert ix.hits(hs) == {"d0": 2}
    ix.clear("d0")  # a cleared cache
    assert ix.hits(hs) == {}


# ------------------------------------------------------------------------------ worker summaries


class _EventsEngine:
    """Only what PrefixReporter uses of an engine."""

    def __init__(self) -> None:
        self.next: PrefixEvents | None = None

    def take_prefix_events(self) -> PrefixEvents | None:
        ev, self.next = self.next, None
        return ev


def test_reporter_nets_bounds_and_carries_over() -> None:
    eng = _EventsEngine()
    rep = PrefixReporter(eng)  # type: ignore[arg-type]
    assert rep.summary() is None
    eng.next = PrefixEvents(block_tokens=16, stored=[1, 2, 3], removed=[])
    s = rep.summary()
    assert s is not None and s.stored == [1, 2, 3] and not s.cleared
    assert rep.summary() is None  # nothing new
    n = m.MAX_PREFIX_EVENTS + 10
    eng.next = PrefixEvents(block_tokens=16, stored=list(range(100, 100 + n)), removed=[1])
    first = rep.summary()
    assert first is not None and len(first.stored) + len(first.removed) == m.MAX_PREFIX_EVENTS
    rest = rep.summary()
    assert rest is not None and len(rest.stored) + len(rest.removed) == 11  # the rest, next heartbeat
    assert len(msgspec.msgpack.encode(first)) < 200_000
    eng.next = PrefixEvents(block_tokens=16, cleared=True, stored=[7])
    s = rep.summary()
    assert s is not None and s.cleared and s.stored == [7]


def test_sim_engine_reports_its_prefix_cache() -> None:
    from common.engines.sim import SimEngine

    eng: Engine = SimEngine("decode", load_profile("fast"), prefix_block_tokens=16)
    assert eng.take_prefix_events() == PrefixEvents(block_tokens=16)
    off: Engine = SimEngine("decode", load_profile("fast"))
    assert off.take_prefix_events() is None


def test_a_decode_workers_engine_hashes_a_prompt_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode worker asks its engine what of a deflection's prompt its cache holds, then adds
    the same prompt: the simulated engine hashes it once (on the request's way to its first
    token), a different list with the same ids again, and the request's hashes are the same."""
    from common.engines import sim as sim_engine
    from common.engines.base import EngineRequest

    calls: list[int] = []

    def counted(ids: list[int], bt: int, parent: int = 0) -> list[int]:
        calls.append(len(ids))
        return block_hashes(ids, bt, parent)

    monkeypatch.setattr(sim_engine, "block_hashes", counted)
    eng = sim_engine.SimEngine("decode", load_profile("fast"), prefix_block_tokens=16)
    prompt = list(range(100, 164))
    assert eng.prefix_cached(prompt) == 0 and calls == [64]
    eng.add(EngineRequest(request_id="a", attempt=0, prompt_token_ids=prompt, sampling=m.Sampling(max_tokens=4),
                          mode="deflect"))
    assert calls == [64]
    seq = eng.batcher.get("a")
    assert seq is not None and seq.hashes == block_hashes(prompt, 16)
    eng.add(EngineRequest(request_id="b", attempt=0, prompt_token_ids=list(prompt),
                          sampling=m.Sampling(max_tokens=4), mode="deflect"))
    assert calls == [64, 64]  # not the list it was asked about: hashed


# ------------------------------------------------------------------------------ traces


def test_sessions_share_their_history_and_are_deterministic(tmp_path: Path) -> None:
    for kind in ("chat", "agent"):
        reqs = sessions(kind, rate=0.2, duration=120, seed=3, block_tokens=512)
        assert reqs == sessions(kind, rate=0.2, duration=120, seed=3, block_tokens=512)
        assert reqs != sessions(kind, rate=0.2, duration=120, seed=4, block_tokens=512)
        assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in reqs)
        # a later turn re-sends an earlier one: the earlier prompt's full blocks, longer than any
        # shared system prompt, are a prefix of the later prompt
        shared = KINDS[kind].system_max // 512 + 1
        later = 0
        for r in reqs:
            for q in reqs:
                k = q.input_length // 512
                if q.t < r.t and k >= shared and q.hash_ids[:k] == r.hash_ids[:k]:
                    later += 1
                    break
        assert later > len(reqs) // 3
        p = tmp_path / f"{kind}.jsonl"
        write_jsonl(reqs, p)
        back = load_trace(p)
        assert [r.hash_ids for r in back] == [r.hash_ids for r in reqs]


# ------------------------------------------------------------------------------ policies


def _views(cached_on: str | None) -> tuple[ClusterView, RequestSpec]:
    prof = load_profile("h100-llama2-70b-tp4")
    p = PrefillView(worker_id="p0", queued_tokens=0, queued_requests=0, token_budget=2048, model=prof.model)
    ds = tuple(DecodeView(worker_id=f"d{i}", batch=8, kv_tokens=8000, kv_free_tokens=10**6, kv_capacity_tokens=10**6,
                          resident_prefill_tokens=0, deflections=0, strictest_tbt_slo=0.1, token_budget=2048,
                          model=prof.model) for i in range(2))
    cached = ((cached_on, 7680),) if cached_on else ()
    req = RequestSpec(request_id="r", prompt_tokens=8000, max_tokens=100, ttft_slo=2.0, tbt_slo=0.1, cached=cached)
    return ClusterView((p,), ds), req


def test_kairos_prices_each_decode_worker_by_its_own_suffix() -> None:
    view, req = _views("d1")
    d = make_policy("kairos").decide(req, view, 0.0)
    assert d.route == "deflect" and d.decode_worker == "d1" and d.cached_tokens == 7680
    assert sum(d.chunk_schedule) == 320  # only the suffix is scheduled
    blind = make_policy("kairos", kairos=KairosConfig(prefix_aware=False)).decide(req, view, 0.0)
    assert blind.decode_worker == "d0" or blind.route == "disagg"  # the whole prompt: no reason to prefer d1
    assert blind.cached_tokens == 0


def test_kv_aware_follows_the_hits() -> None:
    view, req = _views("d1")
    d = make_policy("kv-aware").decide(req, view, 0.0)
    assert d.route == "disagg" and d.decode_worker == "d1"
    view2, req2 = _views(None)
    assert make_policy("kv-aware").decide(req2, view2, 0.0).decode_worker == "d0"


# ------------------------------------------------------------------------------ the simulator


def _chat(n: float = 240) -> list[TraceRequest]:
    return sessions("chat", rate=0.4, duration=n, seed=1, block_tokens=512)


def _sim(trace: list[TraceRequest], policy: str, **kw: object) -> dict[str, object]:
    prof = load_profile("h100-llama2-70b-tp4")
    pol, prof = build(policy, Setup(), prof)
    res = simulate(trace, prof, pol, SimConfig(**kw))  # type: ignore[arg-type]
    return {"records": [dataclasses.asdict(r) for r in res.records], "hit": res.stats["prefix_hit_rate"]}


@pytest.mark.parametrize("policy", ["kairos", "kv-aware", "conditional-disagg"])
def test_prefix_cache_off_is_the_old_behaviour(policy: str) -> None:
    trace = _chat()
    bare = [msgspec.structs.replace(r, hash_ids=()) for r in trace]
    off = _sim(trace, policy, prefix_cache=False)
    assert off["hit"] is None
    assert off["records"] == _sim(bare, policy, prefix_cache=False)["records"]
    assert off["records"] == _sim(bare, policy)["records"]  # no hash_ids: nothing to hit
    on = _sim(trace, policy)
    assert isinstance(on["hit"], float) and on["hit"] > 0.3
    assert on["records"] != off["records"]


def test_kairos_sim_reports_prefix_hit_rate(tmp_path: Path) -> None:
    p = tmp_path / "chat.jsonl"
    write_jsonl(_chat(120), p)
    out = tmp_path / "r.json"
    assert sim_main(["--trace", str(p), "--policy", "kairos", "--policy", "kv-aware", "--out", str(out),
                     "--quiet"]) == 0
    res = json.loads(out.read_text())
    assert res["policies"]["kairos"]["prefix_hit_rate"] > 0.3
    assert res["policies"]["kv-aware"]["prefix_hit_rate"] > 0.3
    assert sim_main(["--trace", str(p), "--policy", "kairos", "--prefix-cache", "off", "--out", str(out),
                     "--quiet"]) == 0
    assert json.loads(out.read_text())["policies"]["kairos"]["prefix_hit_rate"] is None


# ------------------------------------------------------------------------------ the live router's index


def _hb(worker: str, inc: str, seq: int, stored: list[int] | None = None, removed: list[int] | None = None,
        cleared: bool = False) -> m.DecodeHeartbeat:
    summary = None if stored is None and removed is None and not cleared else \
        m.PrefixSummary(block_tokens=BT, stored=stored or [], removed=removed or [], cleared=cleared)
    return m.DecodeHeartbeat(worker_id=worker, incarnation=inc, seq=seq, batch=0, kv_tokens=0, kv_free_tokens=0,
                             kv_capacity_tokens=0, resident_prefill_tokens=0, deflections=0, strictest_tbt_slo=None,
                             token_budget=1, prefix=summary)


def test_router_index_follows_heartbeats_and_forgets() -> None:
    from common.router_core.prefix import RouterPrefix

    rp = RouterPrefix()
    prompt = list(range(20))
    hs = block_hashes(prompt, BT)
    assert rp.lookup(prompt) == ((), {})  # no worker has reported a cache yet
    rp.on_heartbeat(_hb("d0", "a", 1, stored=hs))
    rp.on_heartbeat(_hb("d1", "b", 1, stored=hs[:2]))
    cached, by_bt = rp.lookup(prompt)
    assert dict(cached) == {"d0": 20, "d1": 8} and by_bt == {BT: hs}
    rp.on_heartbeat(_hb("d0", "a", 2, removed=hs[3:]))  # evicted its tail
    assert dict(rp.lookup(prompt)[0]) == {"d0": 12, "d1": 8}
    rp.on_heartbeat(_hb("d1", "b", 4))  # heartbeat 3 was lost: evictions may be missing
    assert dict(rp.lookup(prompt)[0]) == {"d0": 12}
    rp.dispatched(["d1"], by_bt, 20, 0)  # the router's own dispatch: d1 will hold the prompt
    assert dict(rp.lookup(prompt)[0]) == {"d0": 12, "d1": 20}
    rp.on_heartbeat(_hb("d0", "a2", 1, stored=[]))  # restarted: a new incarnation, an empty cache
    assert dict(rp.lookup(prompt)[0]) == {"d1": 20}
    rp.forget("d1")  # lost or departed
    assert rp.lookup(prompt)[0] == ()
    off = RouterPrefix(enabled=False)
    off.on_heartbeat(_hb("d0", "a", 1, stored=hs))
    assert off.lookup(prompt) == ((), {})


def test_the_index_version_moves_with_every_change_hits_could_see_and_only_then() -> None:
    idx = PrefixIndex(max_blocks=4)

    def moved(op: Callable[[], object]) -> bool:
        v = idx.version
        op()
        return idx.version != v

    assert moved(lambda: idx.join("d0", BT, "a"))
    assert not moved(lambda: idx.join("d0", BT, "a"))  # the same incarnation again
    assert moved(lambda: idx.stored("d0", [1, 2, 3]))
    assert not moved(lambda: idx.stored("d0", [1, 2, 3]))  # held already (only their recency moves)
    assert not moved(lambda: idx.hits([1, 2, 3]))
    assert moved(lambda: idx.removed("d0", [3]))
    assert not moved(lambda: idx.removed("d0", [3]))
    assert moved(lambda: idx.stored("d0", [5, 6, 7]))  # past max_blocks: block 1 evicted
    assert idx.hits([1, 2]) == {}
    assert moved(lambda: idx.clear("d0"))
    assert moved(lambda: idx.forget("d0"))
    assert not moved(lambda: idx.forget("d0"))


def _count_walks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """[how many times PrefixIndex.hits has walked the index since]"""
    walks = [0]
    real_hits = PrefixIndex.hits

    def counted(self: PrefixIndex, hs: list[int], among: object = None) -> dict[str, int]:
        walks[0] += 1
        return real_hits(self, hs, among)  # type: ignore[arg-type]

    monkeypatch.setattr(PrefixIndex, "hits", counted)
    return walks


@pytest.mark.parametrize("seed", range(6))
def test_a_lookup_kept_between_decisions_answers_as_a_fresh_one_and_walks_the_index_only_after_a_change(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiting request is decided again at every heartbeat: its prefix lookup is kept (`Seen`)
    while the index is unchanged. Random heartbeats, dispatches, evictions, restarts and lost
    heartbeats: after each, the kept answer is the fresh one, and asking twice in a row walks the
    index at most once (a burst of 6,000-token prompts held the router's loop for tens of seconds
    walking it per waiting request per heartbeat)."""
    import random

    from common.router_core.prefix import RouterPrefix, Seen

    rng = random.Random(seed)
    rp = RouterPrefix(max_blocks=12)
    prompts = [list(range(k, k + 24)) for k in (0, 0, 100)]  # two alike, one apart
    prompts[1][17] = -1  # ... alike up to their fifth block
    hashes = [block_hashes(p, BT) for p in prompts]
    seen = [Seen() for _ in prompts]
    seq = {"d0": 0, "d1": 0}
    inc = {"d0": "a", "d1": "b"}
    walks = _count_walks(monkeypatch)
    for _ in range(120):
        w = rng.choice(["d0", "d1"])
        op = rng.randrange(7)
        i = rng.randrange(len(prompts))
        hs = hashes[i][:rng.randrange(1, len(hashes[i]) + 1)]
        if op == 0:
            seq[w] += 1
            rp.on_heartbeat(_hb(w, inc[w], seq[w], stored=hs))
        elif op == 1:
            seq[w] += 1
            rp.on_heartbeat(_hb(w, inc[w], seq[w], removed=hs[rng.randrange(len(hs)):]))
        elif op == 2:
            seq[w] += 2  # one lost: the worker's entries are forgotten
            rp.on_heartbeat(_hb(w, inc[w], seq[w]))
        elif op == 3:
            added = rp.dispatched([w], {BT: hashes[i]}, 24, 0)
            if rng.random() < 0.5 and w in added:
                rp.undo(w, added[w])
        elif op == 4:
            inc[w] += "'"  # restarted
            seq[w] = 1
            rp.on_heartbeat(_hb(w, inc[w], 1, stored=[]))
        elif op == 5:
            rp.forget(w)
        for k, p in enumerate(prompts):
            fresh = rp.lookup(p)
            before = walks[0]
            kept = rp.lookup(p, {BT: hashes[k]}, seen[k])
            again = rp.lookup(p, {BT: hashes[k]}, seen[k])
            assert dict(kept[0]) == dict(fresh[0]) and kept == again
            assert walks[0] - before <= 1, "a lookup kept while the index did not change walked it again"


def test_router_index_takes_back_a_dispatch_turned_away_unless_a_heartbeat_came_between() -> None:
    from common.router_core.prefix import RouterPrefix

    prompt = list(range(20))
    for beat_between in (False, True):
        rp = RouterPrefix()
        rp.on_heartbeat(_hb("d0", "a", 1, stored=[]))
        _, by_bt = rp.lookup(prompt)
        added = rp.dispatched(["d0"], by_bt, 20, 0)
        assert dict(rp.lookup(prompt)[0]) == {"d0": 20}
        if beat_between:  # it may have reported these blocks stored (another request computed them)
            rp.on_heartbeat(_hb("d0", "a", 2, stored=[]))
        rp.undo("d0", added["d0"])  # its admission turned the work away
        assert dict(rp.lookup(prompt)[0]) == ({"d0": 20} if beat_between else {})


def test_a_waiting_request_hashes_its_prompt_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request waiting at the router is decided again at every freed slot and heartbeat; its
    prompt's block hashes are computed once, not at each try (a third of the router's CPU in a
    burst of long prompts when they were), and again only for a new prompt after a migration."""
    from common.router_core import prefix as router_prefix
    from tests.router_fakes import hello, make_core

    calls: list[int] = []

    def counted(ids: list[int], bt: int, parent: int = 0) -> list[int]:
        calls.append(len(ids))
        return block_hashes(ids, bt, parent)

    monkeypatch.setattr(router_prefix, "block_hashes", counted)
    now = 1000.0
    r, _ = make_core("deflect-all")
    # a decode worker with a prefix cache, full for now: the request waits for KV room
    r.on_message(b"decode-0", hello("decode-0", "decode"), now)
    r.on_message(b"decode-0", msgspec.structs.replace(_hb("decode-0", "inc-decode-0", 1, stored=[]),
                                                      kv_capacity_tokens=100_000, kv_free_tokens=100), now)
    req = r.submit(list(range(400)), m.Sampling(max_tokens=4), now)
    assert req in r.waiting.queue and calls == [400]
    for _ in range(5):
        now += 0.1
        r.retry_waiting(now)
    assert req in r.waiting.queue and calls == [400]  # tried again five times, hashed once
    req.resume_from, req.out_ids = 2, [7, 7]  # as after a migration: the work prompt grew
    r.retry_waiting(now + 0.1)
    assert calls == [400, 402]


def test_a_waiting_request_decided_again_at_every_heartbeat_walks_the_index_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The router core keeps a waiting request's lookup (Request.prefix_seen): forty heartbeats
    that change nothing in the index decide it again forty times and walk its blocks once."""
    from tests.test_migrate import NOW, make_router

    r, _ = make_router("disagg-least-loaded")
    walks = _count_walks(monkeypatch)

    def beat(w: str, seq: int, summary: m.PrefixSummary | None = None) -> m.DecodeHeartbeat:
        return m.DecodeHeartbeat(worker_id=w, incarnation=f"inc-{w}", seq=seq, batch=0, kv_tokens=0,
                                 kv_free_tokens=0, kv_capacity_tokens=100_000, resident_prefill_tokens=0,
                                 deflections=0, strictest_tbt_slo=None, token_budget=2048, prefix=summary)

    for w in ("decode-0", "decode-1"):  # no KV room anywhere: it waits
        r.on_message(w.encode(), beat(w, 1, m.PrefixSummary(block_tokens=16, stored=[], removed=[])), NOW)
    req = r.submit(list(range(6000)), m.Sampling(max_tokens=4), NOW)
    assert not req.done and req in r.waiting.queue and walks[0] == 1
    lookups = 0
    real_lookup = r.prefix.lookup

    def counted_lookup(*a: object) -> object:
        nonlocal lookups
        lookups += 1
        return real_lookup(*a)  # type: ignore[arg-type]

    monkeypatch.setattr(r.prefix, "lookup", counted_lookup)
    for k in range(2, 22):
        for w in ("decode-0", "decode-1"):
            r.on_message(w.encode(), beat(w, k), NOW + 0.1 * k)
    assert lookups >= 40 and not req.done  # decided again at each heartbeat
    assert walks[0] == 1, f"walked the index {walks[0]} times for one waiting request"
    r.on_message(b"decode-0", beat("decode-0", 22, m.PrefixSummary(block_tokens=16, stored=[7], removed=[])), NOW + 3)
    assert walks[0] == 2  # the index changed: looked up again
