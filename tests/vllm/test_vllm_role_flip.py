"""The role planner on the vLLM tier (issue 44 item 3): `kairos up --engine vllm` with two prefill
workers and one decode worker, each its own vLLM engine in the kv_both KV role (the default,
vllm_kv_both). While requests stream, the router's planner finds the decode pool short and sends
one prefill worker a SetRole; the worker drains, its engine takes the decode role in place (same
process, same AsyncLLM, no second model load) and it registers as a decode worker; it then
decodes requests whose KV the other prefill worker hands it over NIXL (the new direction: it
produced KV before, it consumes it now). Every request completes.

Not timing-sensitive, as tests/test_role_flip_live.py on the simulated engine: the TBT SLO is far
below any decode step, so once anything has been decoded the decode pool is short on every
sample whatever the machine's load, and planner_min_prefill keeps the last prefill worker. One
cluster of three engines (about a minute to start on 2 shared cores), this module's own: the
session's clusters (conftest.py `kairos_vllm`) keep their roles for the modules that share them.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from kairos.up import Cluster, ClusterSpec
from tests.vllm.helpers import PD, VLLM_MISSING, request

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(bool(VLLM_MISSING), reason=VLLM_MISSING or "")]

MAX_TOKENS = 12
# docs/reference/vllm.md section 5: greedy ids of the tiny model (as tests/vllm/test_vllm_engine.py)
PROMPT_A, WANT_A = list(range(10, 40)), [865, 713, 713, 713, 713, 713, 713, 986, 8, 565, 159, 188, 593, 425, 515, 620]
PROMPT_B, WANT_B = [5, 6, 7, 8, 9], [515, 273, 598, 515, 468, 550, 515, 550, 515, 981, 118, 725, 550, 515, 598, 515]


def test_an_engine_started_in_a_fixed_kv_role_refuses_to_switch(tiny_model: Path) -> None:
    with warnings.catch_warnings():  # vLLM's modules import with deprecation warnings (errors in this suite)
        warnings.simplefilter("ignore")
        import common.engines.vllm as vllm_engine

    fixed = vllm_engine.VllmEngine("prefill", model=str(tiny_model), kv_both=False)
    assert not fixed.can_switch_role and fixed.kv_role == "kv_producer"
    assert "kv_producer" in fixed.switch_role("decode") and fixed.role == "prefill"
    assert "kv_consumer" in vllm_engine.VllmEngine("decode", model=str(tiny_model), kv_both=False).role_fixed()
    both = vllm_engine.VllmEngine("prefill", model=str(tiny_model))
    assert both.can_switch_role and both.kv_role == "kv_both"
    kw = both.engine_kwargs(True, "ipc://x", None, lambda **_: None)
    assert kw["skip_tokenizer_init"] is False  # it may decode later: structured outputs need the tokenizer
    assert fixed.engine_kwargs(True, "ipc://x", None, lambda **_: None)["skip_tokenizer_init"] is True


async def _idle(*engines: Any) -> None:
    """Until the engines hold nothing (a finished request leaves the engine just after its last token)."""
    for _ in range(200):
        if not any(e.held() for e in engines):
            return
        await asyncio.sleep(0.01)
    raise AssertionError([e.held() for e in engines])


@pytest.mark.asyncio(loop_scope="session")
async def test_two_engines_swap_roles_in_place_and_hand_kv_the_other_way(pd: PD) -> None:
    """The session's prefill and decode engines (kv_both, the default) swap roles without a
    restart: KV the prefill engine produced before its switch is still read from it after, and the
    KV then goes the other way (the former decode engine produces, the former prefill engine reads
    it over NIXL). Swapped back at the end for the modules that share the engines."""
    p, d, out = pd.prefill, pd.decode, pd.out
    saved = (p.on_tokens, p.on_kv_fallback, p.on_prefilled, d.on_tokens, d.on_kv_fallback, d.on_prefilled)
    llms = (p._llm, d._llm)
    # the session's engine pair is shared: other modules' tests leave their own (deliberate) KV
    # failures in these lists, so only what this test adds is checked
    seen = (len(out.fallbacks), len(out.failed), len(pd.prefill_failed))
    try:
        before = await pd.run_prefill("swap-before", PROMPT_A)
        assert p.switch_role("decode") == "" and p.role == "decode"
        assert await pd.run_decode(request("swap-before", PROMPT_A, kv_params=before.kv_params, mode="handoff")) \
            == WANT_A  # read from the engine that has meanwhile become a decode engine
        await _idle(d)
        assert d.switch_role("prefill") == "" and d.role == "prefill"
        p.on_tokens, p.on_kv_fallback = d.on_tokens, d.on_kv_fallback
        d.on_prefilled = p.on_prefilled
        # best effort: vLLM refuses the reset while a producer still pins blocks for a reader that
        # never came (test_vllm_engine's hung transfer, until NIXL's abort timeout); PROMPT_B is
        # shorter than a block, so no cache can serve it and the chunk check below holds either way
        await p.reset_prefix_cache()
        await d.reset_prefix_cache()
        pd.prefill, pd.decode = d, p  # run_prefill / run_decode on the new roles
        after = await pd.run_prefill("swap-after", PROMPT_B)
        assert after.kv_params["remote_port"] == d.side_channel_port  # produced by the former decode engine
        assert await pd.run_decode(request("swap-after", PROMPT_B, kv_params=after.kv_params, mode="handoff")) \
            == WANT_B
        # the former prefill engine computed only the last prompt token: the rest came over NIXL
        assert [(chi, k) for r in p.step_records for (key, chi, k) in r.chunks if key == "swap-after:0"] \
            == [(1, len(PROMPT_B) - 1)]
        assert (out.fallbacks[seen[0]:], out.failed[seen[1]:], pd.prefill_failed[seen[2]:]) == ([], [], [])
        assert (p._llm, d._llm) == llms and not p._llm.errored and not d._llm.errored  # the same engines, alive
    finally:
        pd.prefill, pd.decode = p, d
        await _idle(p, d)
        assert p.switch_role("prefill") == "" and d.switch_role("decode") == ""
        p.on_tokens, p.on_kv_fallback, p.on_prefilled, d.on_tokens, d.on_kv_fallback, d.on_prefilled = saved
        await p.reset_prefix_cache()  # best effort, as above
        await d.reset_prefix_cache()


KEEP_TOKENS = 300  # a stream long enough to be running when the switch comes (the first 16: WANT_A)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_decode_engine_switched_to_prefill_streams_its_running_decode_to_the_end(pd: PD) -> None:
    """A flip that keeps its decodes (`keeps_decodes`, kv_both): a decode streaming when the
    decode engine takes the prefill role goes on there to its last token (it is its own vLLM
    request task), reported as the prefill role's decode batch; what the worker does not keep
    refuses the switch. Switched back at the end, holding nothing, for the modules that share it."""
    d, out = pd.decode, pd.out
    seen = (len(out.fallbacks), len(out.failed))
    rid = "keep-across"
    assert d.keeps_decodes
    try:
        d.add(request(rid, PROMPT_A, max_tokens=KEEP_TOKENS))
        for _ in range(4000):
            if out.tokens.get(rid):
                break
            await asyncio.sleep(0.005)
        # (no await from here to the load: the stream cannot move meanwhile)
        assert rid in d.held() and rid not in out.finish and len(out.tokens[rid]) < KEEP_TOKENS
        assert "holds 1 requests" in d.switch_role("prefill", keep=["another"]) and d.role == "decode"
        assert d.switch_role("prefill", keep=[rid]) == "" and d.role == "prefill"
        load = d.load()
        assert (load.batch, load.queued_requests) == (1, 0) and load.kv_tokens > len(PROMPT_A)
        toks = await out.wait(rid, 120)
        assert len(toks) == KEEP_TOKENS and toks[:len(WANT_A)] == WANT_A and out.finish[rid] == "length"
        assert (out.fallbacks[seen[0]:], out.failed[seen[1]:]) == ([], [])
        assert not d._llm.errored
    finally:
        await _idle(d)
        assert d.switch_role("decode") == "" and d.role == "decode"


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = ClusterSpec.ephemeral(prefill=2, decode=1, engine="vllm", model=str(tiny_model),
                                 profile="cpu-tiny-llama", vllm_profile="cpu-tiny-llama",
                                 policy="disagg-least-loaded", monitor=False,
                                 worker_env={"KAIROS_VLLM_KV_CACHE_MIB": "64"},
                                 log_dir=str(tmp_path_factory.mktemp("kairos-flip")),
                                 router_env={"KAIROS_MAX_PROMPT_TOKENS": "2048",
                                             "KAIROS_LIVENESS": "50",  # 5 s: the 2 shared CI cores stall workers
                                             "KAIROS_PLANNER": "true", "KAIROS_PLANNER_INTERVAL_S": "0.25",
                                             "KAIROS_LOG_REQUESTS": "1",
                                             # the moved worker prefills for 3 s at least before it may move
                                             "KAIROS_PLANNER_WINDOW_S": "1", "KAIROS_PLANNER_MIN_DWELL_S": "3",
                                             "KAIROS_PLANNER_MIN_GAP_S": "0", "KAIROS_PLANNER_STEP_HI": "1e-9",
                                             "KAIROS_PLANNER_STEP_LO": "1e-10"})
    c = Cluster(spec)
    c.start(timeout=300)
    yield c
    c.stop(30)


def _events(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():  # vLLM's own lines in the same file are not JSON
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def test_a_vllm_prefill_worker_becomes_a_decode_worker_in_place_under_load(cluster: Cluster) -> None:
    api = cluster.spec.api
    pids = {name: svc.proc.pid for name, svc in cluster.services.items() if svc.proc is not None}
    answers: list[httpx.Response] = []
    stop = threading.Event()

    def stream(k: int) -> None:  # one client of three, each one request after another until told to stop
        i = k
        while not stop.is_set():
            answers.append(httpx.post(api + "/v1/completions", timeout=120, json={
                "prompt": [5 + i % 7] * (24 + i % 5), "max_tokens": MAX_TOKENS, "ignore_eos": True}))
            i += 3

    def decoded_by(wid: str) -> list[httpx.Response]:
        return [r for r in list(answers) if r.headers.get("x-kairos-decode-worker") == wid]

    roles: dict[str, str] = {}
    s: Any = {}
    moved = ""
    with ThreadPoolExecutor(3) as pool:
        clients = [pool.submit(stream, k) for k in range(3)]
        try:
            deadline = time.monotonic() + 150  # a worker that refuses the SetRole never gets there
            while time.monotonic() < deadline and not (moved and len(decoded_by(moved)) >= 3):
                time.sleep(0.2)
                _, s = cluster.get("/v1/kairos/stats")
                roles = {w: v["role"] for w, v in s["workers"].items()}
                if s["planner"]["flips"] and s["planner"]["pending"] is None and len(roles) == 3:
                    moved = next((w for w, r in roles.items() if w.startswith("prefill") and r == "decode"), "")
        finally:
            stop.set()
            for c in clients:
                c.result()
    assert sorted(roles.values()) == ["decode", "decode", "prefill"], (roles, s.get("planner"))
    assert s["planner"]["flips"] == {"decode_short": 1}  # planner_min_prefill keeps the last prefill worker
    assert [r.status_code for r in answers] == [200] * len(answers), [r.text for r in answers if r.status_code != 200]
    assert all(r.json()["usage"]["completion_tokens"] == MAX_TOKENS for r in answers)
    # the moved engine consumed KV the other prefill worker handed it (it produced KV before the flip)
    assert len(decoded_by(moved)) >= 3 and all(r.headers["x-kairos-route"] == "disagg" for r in decoded_by(moved))
    _, s = cluster.get("/v1/kairos/stats")
    assert s["counts"]["completed"] >= len(answers) and not s["counts"].get("failed"), s["counts"]
    for _ in range(100):  # the router writes a request's line as it ends: let the last ones land
        router_log = _events(Path(cluster.spec.log_dir, "router.log"))
        done = [x for x in router_log if x.get("event") == "request_done"]
        if len(done) >= len(answers):
            break
        time.sleep(0.1)
    assert len(done) == len(answers) and all(x["outcome"] == "ok" and not x["kv_fallback"] for x in done), done
    assert any(x["prefill_worker"] == moved for x in done)  # it prefilled before the flip (min dwell)
    # the flip: the router's decision, the worker's drain, the engine switched in place
    flip = [x for x in router_log if x.get("event") == "role_flip"]
    assert len(flip) == 1 and flip[0]["worker"] == moved and flip[0]["to"] == "decode"
    assert any(x.get("event") == "role_flip_done" and x.get("worker") == moved for x in router_log)
    worker_log = _events(Path(cluster.spec.log_dir, f"{moved}.log"))
    events = [x.get("event") for x in worker_log]
    assert "role_change_refused" not in events
    assert events.index("role_change_started") < events.index("vllm_role_switched") < events.index("role_started")
    # no restart: one process, one engine start (one model load), in the kv_both role
    started = [x for x in worker_log if x.get("event") == "vllm_engine_started"]
    assert len(started) == 1 and started[0]["kv_role"] == "kv_both" and events.count("worker_starting") == 1
    svc = cluster.services[moved]
    assert svc.proc is not None and svc.proc.poll() is None and svc.proc.pid == pids[moved] == started[0]["pid"]
