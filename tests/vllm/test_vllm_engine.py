"""The vllm engine on the CPU build with the tiny model: three paths, one answer.

Greedy outputs must be token-for-token identical whether a prompt is served by one engine
alone, disaggregated (prefill engine -> NIXL -> decode engine), or deflected (prefilled in
place on the decode engine with a multi-chunk schedule while other requests decode); the
deflected request's steps must carry exactly the scheduled chunks (vLLM's iteration details
say so) with the other requests decoding in every one of them; and a KV transfer that fails
or hangs must end in a correct completion through the counted in-place fallback.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from common.errors import Overloaded
from tests.vllm.helpers import PD, VLLM_MISSING, request

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or ""),
    pytest.mark.asyncio(loop_scope="session"),
]

# docs/reference/vllm.md section 5: greedy ids of the tiny model, identical in vLLM and HF generate
REFERENCE = {
    (5, 6, 7, 8, 9): [515, 273, 598, 515, 468, 550, 515, 550, 515, 981, 118, 725, 550, 515, 598, 515],
    tuple(range(10, 40)): [865, 713, 713, 713, 713, 713, 713, 986, 8, 565, 159, 188, 593, 425, 515, 620],
}
LONG = [(7 * i + 3) % 1000 + 3 for i in range(300)]  # 300 tokens: two full KV blocks of 128 and a partial one


async def alone(pd: PD, rid: str, prompt: list[int], max_tokens: int = 16) -> list[int]:
    """The prompt served by the decode engine on its own, with an empty prefix cache before and after."""
    assert await pd.decode.reset_prefix_cache()
    toks = await pd.run_decode(request(rid, prompt, max_tokens))
    assert await pd.decode.reset_prefix_cache()
    return toks


def steps_of(pd: PD, key: str) -> list[tuple[int, int, int]]:
    """(step index, chunk, context) of every step in which request `key` computed prompt tokens."""
    return [(r.index, chi, k) for r in pd.decode.step_records for (rk, chi, k) in r.chunks if rk == key]


async def test_single_engine_matches_reference(pd: PD) -> None:
    for i, (prompt, want) in enumerate(REFERENCE.items()):
        assert await alone(pd, f"ref{i}", list(prompt)) == want
    assert pd.out.finish["ref0"] == "length"


async def test_disaggregated_matches_single_engine(pd: PD) -> None:
    want = await alone(pd, "pd-alone", LONG)
    pre = await pd.run_prefill("pd", LONG)
    assert pre.first_token_id == want[0]
    assert pre.kv_params["do_remote_prefill"] is True and pre.kv_params["transfer_mode"] == "pull"
    assert pre.kv_params["remote_port"] == pd.prefill.side_channel_port
    assert pre.prefill_s > 0 and pre.queue_s >= 0
    pd.decode.add(request("pd", LONG, kv_params=pre.kv_params, mode="handoff"))
    assert pd.decode.waiting_kv() == 1
    got = await pd.out.wait("pd")
    assert got == want
    assert pd.decode.waiting_kv() == 0
    assert pd.out.starts["pd"] == 0 and not pd.out.pos_errors  # TokenItem.pos from the first token on
    # the decode engine computed only the last prompt token: the other 299 came over NIXL
    assert [(chi, k) for _, chi, k in steps_of(pd, "pd:0")] == [(1, len(LONG) - 1)]
    assert pd.out.fallbacks == []


async def test_deflected_schedule_is_exact_while_others_decode(pd: PD) -> None:
    want = await alone(pd, "defl-alone", LONG)
    background = [f"bg{i}" for i in range(3)]
    for rid in background:
        pd.decode.add(request(rid, [5, 6, 7, 8, 9], max_tokens=80))
    while any(len(pd.out.tokens.get(rid, [])) < 2 for rid in background):
        await asyncio.sleep(0.002)
    schedule = (64, 32, 100, 104)
    calls_before = len(pd.out.calls)
    got = await pd.run_decode(request("defl", LONG, schedule=schedule))
    # one on_tokens call per engine step carries the tokens of every request in it
    assert max(pd.out.calls[calls_before:]) == len(background) + 1
    assert got == want
    for rid in background:
        assert (await pd.out.wait(rid))[:16] == REFERENCE[(5, 6, 7, 8, 9)]  # the others were left alone

    steps = steps_of(pd, "defl:0")
    assert [chi for _, chi, _ in steps] == list(schedule)
    assert [k for _, _, k in steps] == [0, 64, 96, 196]
    assert [i for i, _, _ in steps] == list(range(steps[0][0], steps[0][0] + len(schedule)))  # consecutive
    records = {r.index: r for r in pd.decode.step_records}
    details = {d.iteration_index: d for d in pd.decode.iteration_details}
    for (index, chi, _), _chunk in zip(steps, schedule, strict=True):
        assert sorted(records[index].decode_keys) == [f"{rid}:0" for rid in background]
        # vLLM's own account of the step: exactly the chunk as context tokens, and three decodes
        assert details[index].num_ctx_tokens == chi
        assert details[index].num_generation_requests == len(background)
    assert pd.decode.chunk_misses == 0
    assert pd.decode.step_mismatches == 0
    assert pd.out.fallbacks == []


async def test_step_samples_and_load(pd: PD) -> None:
    d = pd.decode
    assert d.steps > 0 and len(d.samples) > 0
    mixed = [s for s in d.samples if s.batch > 0 and s.chunks]
    assert mixed and all(s.seconds > 0 for s in d.samples)
    load = d.load()
    assert load.steps == d.steps and 0 < load.step_ms_p50 <= load.step_ms_max
    assert load.kv_capacity_tokens == d.kv_capacity_tokens == 32 * 1024  # 32 MiB at 1 KiB per token
    assert load.batch == 0 and load.kv_free_tokens == d.kv_capacity_tokens  # nothing held now

    d.add(request("held", LONG, max_tokens=200, schedule=(32,) * 10))
    during = d.load()
    assert during.deflections == 1 and during.queued_requests == 1
    assert during.kv_free_tokens == d.kv_capacity_tokens - (len(LONG) + 200)
    # a moved delivery allowance (PlanBudget) lowers a held request's budget, never raises it
    assert during.strictest_tbt_slo == 0.1
    assert d.lower_tbt_slo("held", 0.09) and not d.lower_tbt_slo("held", 0.095) and not d.lower_tbt_slo("gone", 0.05)
    assert d.load().strictest_tbt_slo == pytest.approx(0.09)
    assert d.abort("held") and not d.abort("held")
    assert d.held() == []
    saved = d.max_queue_requests
    d.max_queue_requests = 0
    try:
        with pytest.raises(Overloaded):
            d.add(request("refused", LONG))
    finally:
        d.max_queue_requests = saved
    assert not d.can_admit(d.kv_capacity_tokens, 1)


async def test_step_error_statistics_come_from_real_step_timings(pd: PD) -> None:
    """Issue 25: what a vLLM worker reports as its step margin and bias is measured, every step
    timed by the engine against the model the worker tells the routers (here the CPU profile)."""
    from common.perf_model import load_profile

    d = pd.decode
    model = load_profile("cpu-tiny-llama").model
    d.predict_with(model)
    assert d.estimator.steps == 0 and d.load().step_bias == 1.0 and d.load().step_margin == 1.0  # nothing seen
    before = len(d.samples)
    await pd.run_decode(request("timed", LONG, max_tokens=64))
    new = list(d.samples)[before:]
    assert d.estimator.steps == len(new) >= 32  # every step with a time, and enough to report
    ratios = sorted(s.seconds / model.step_time(s.batch, s.kv_tokens, s.chunks) for s in new)
    load = d.load()
    assert load.step_bias == pytest.approx(ratios[len(ratios) // 2])  # the median of what was timed
    assert load.step_margin >= load.step_bias and load.step_margin != 1.0


async def test_kv_load_failure_falls_back_to_in_place_prefill(pd: PD) -> None:
    want = await alone(pd, "fail-alone", LONG)
    pre = await pd.run_prefill("fail", LONG)
    broken = {**pre.kv_params, "remote_engine_id": "no-such-engine"}  # the handshake must refuse it
    before = pd.decode.kv_fallbacks
    got = await pd.run_decode(request("fail", LONG, kv_params=broken, mode="handoff"))
    assert got == want
    assert pd.decode.kv_fallbacks == before + 1
    assert pd.out.fallbacks[-1] == ("fail", "kv_load_failed")
    # the fallback prefilled all 300 prompt tokens in place
    assert sum(chi for _, chi, _ in steps_of(pd, "fail:0:fallback")) == len(LONG)


async def test_hung_kv_transfer_times_out_and_falls_back(pd: PD) -> None:
    want = await alone(pd, "hang-alone", LONG)
    pre = await pd.run_prefill("hang", LONG)
    with socket.socket() as silent:  # accepts connections, never answers the handshake
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        # a new engine id: the decode side has no cached handshake for it and must dial the port
        hung = {**pre.kv_params, "remote_engine_id": "hung-engine", "remote_port": silent.getsockname()[1]}
        saved = pd.decode.kv_timeout
        pd.decode.kv_timeout = 1.0
        try:
            t0 = time.monotonic()
            got = await pd.run_decode(request("hang", LONG, kv_params=hung, mode="handoff"))
            elapsed = time.monotonic() - t0
        finally:
            pd.decode.kv_timeout = saved
    assert got == want
    assert pd.out.fallbacks[-1] == ("hang", "timeout")
    assert 1.0 <= elapsed < 4.0  # vLLM's own handshake timeout (5 s) never came into play


async def test_unscheduled_prefill_gets_only_the_leftover_budget(pd: PD) -> None:
    want = await alone(pd, "mix-alone", LONG)
    other = [5 + (i % 50) for i in range(600)]  # no schedule: vLLM's own chunking, within what is left
    want_other = await alone(pd, "mix-other-alone", other, max_tokens=4)
    for rid in ("mbg0", "mbg1"):
        pd.decode.add(request(rid, [5, 6, 7, 8, 9], max_tokens=60))
    while any(len(pd.out.tokens.get(rid, [])) < 2 for rid in ("mbg0", "mbg1")):
        await asyncio.sleep(0.002)
    schedule = (100,) * 3
    pd.decode.add(request("mix-other", other, max_tokens=4))
    pd.decode.add(request("mix", LONG, schedule=schedule))
    assert await pd.out.wait("mix") == want
    assert await pd.out.wait("mix-other") == want_other
    for rid in ("mbg0", "mbg1"):
        await pd.out.wait(rid)

    ours = {i: chi for i, chi, _ in steps_of(pd, "mix:0")}
    assert list(ours.values()) == list(schedule)
    budget = pd.decode.token_budget
    for r in pd.decode.step_records:
        if r.index in ours:
            theirs = sum(chi for key, chi, _ in r.chunks if key == "mix-other:0")
            assert r.decodes == 2
            assert theirs <= budget - r.decodes - ours[r.index]
    assert sum(chi for _, chi, _ in steps_of(pd, "mix-other:0")) == len(other)
    assert pd.decode.chunk_misses == 0


def _core_cpu_seconds() -> dict[int, float]:
    """CPU seconds used so far by each vLLM engine-core process this test process started."""
    import psutil  # a dependency of vllm

    out: dict[int, float] = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline()):
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
        except psutil.Error:
            continue
    return out


async def test_idle_engines_leave_the_cpu_alone(pd: PD) -> None:
    """Engines with nothing to do use next to no CPU. With NIXL's progress thread on, each engine
    core kept one core at 100 % forever (the thread polls with a zero timeout; see
    common/engines/vllm_nixl.py), which halved every step on a 2-core host. An engine holding KV
    no decode engine will read (the fallback tests above leave some) steps until vLLM's 30 s lease
    expires, so the test waits for a quiet 3 s window, for at most 90 s."""
    first = _core_cpu_seconds()
    assert len(first) >= 2, f"expected the prefill and decode engine cores, found {first}"
    window, deadline = 3.0, time.monotonic() + 90
    busiest: dict[int, float] = {}
    while time.monotonic() < deadline:
        before = _core_cpu_seconds()
        await asyncio.sleep(window)
        after = _core_cpu_seconds()
        busiest = {pid: (after[pid] - before[pid]) / window for pid in before if pid in after}
        if busiest and max(busiest.values()) < 0.2:
            return
    pytest.fail(f"engine cores still busy while idle (share of a core each, last {window:.0f} s): {busiest}")
