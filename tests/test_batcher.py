"""The batching class, from tables."""

from __future__ import annotations

from collections import deque

import pytest

from common.engines.batcher import Batcher, Seq


def decode_batcher(budget: int = 100, default_chunk: int = 32, kv: int = 10_000) -> Batcher:
    return Batcher(role="decode", token_budget=budget, max_batch=64, kv_capacity_tokens=kv, default_chunk=default_chunk)


def run_until_done(b: Batcher, limit: int = 1000) -> list[tuple[int, list[tuple[str, int]]]]:
    """Step to completion; returns per step (decode count, [(request, chunk)])."""
    steps = []
    for _ in range(limit):
        plan = b.plan()
        if plan is None:
            return steps
        steps.append((plan.batch, [(s.request_id, chi) for s, chi, _ in plan.chunks]))
        b.commit(plan)
    raise AssertionError("did not finish")


@pytest.mark.parametrize(("prompt", "schedule", "expected_chunks"), [
    (100, [64, 32, 4], [64, 32, 4]),
    (100, [64, 64], [64, 36]),          # capped by the remaining prompt
    (10, [], [10]),                     # no schedule: default chunking
    (70, [], [32, 32, 6]),
    (5, [128], [5]),
])
def test_deflected_prompt_follows_its_schedule_exactly(prompt: int, schedule: list[int],
                                                       expected_chunks: list[int]) -> None:
    b = decode_batcher()
    b.add(Seq(request_id="d", attempt=0, prompt_len=prompt, max_tokens=3,
              schedule=deque(schedule) if schedule else None, deflected=True))
    steps = run_until_done(b)
    chunks = [c for _, cs in steps for _, c in cs]
    assert chunks == expected_chunks
    # the last chunk's step samples the first token; then 2 more decode steps
    assert len(steps) == len(expected_chunks) + 2


def test_decodes_go_first_and_keep_decoding_during_a_deflected_prefill() -> None:
    b = decode_batcher(budget=40, default_chunk=64)
    for i in range(3):
        b.add(Seq(request_id=f"r{i}", attempt=0, prompt_len=8, max_tokens=20, computed=8))  # handed-off
    b.add(Seq(request_id="d", attempt=0, prompt_len=100, max_tokens=2))  # no schedule: budget-limited
    plan = b.plan()
    assert plan is not None and plan.batch == 3
    assert [(s.request_id, chi, k) for s, chi, k in plan.chunks] == [("d", 37, 0)]
    out = b.commit(plan)
    assert [s.request_id for s in out.tokens] == ["r0", "r1", "r2"]
    assert [s.request_id for s in out.first_tokens] == ["r0", "r1", "r2"]
    steps = run_until_done(b)
    assert all(batch == 3 for batch, cs in steps if cs)  # every prefill step still decoded the three


def test_finish_and_kv_accounting() -> None:
    b = decode_batcher(kv=100)
    s = Seq(request_id="a", attempt=0, prompt_len=50, max_tokens=10, computed=50)
    assert b.can_admit(s)
    b.add(s)
    assert b.kv_free() == 40
    assert not b.can_admit(Seq(request_id="b", attempt=0, prompt_len=40, max_tokens=10))
    outs = []
    while (plan := b.plan()) is not None:
        outs.append(b.commit(plan))
    assert sum(len(o.tokens) for o in outs) == 10
    assert outs[-1].finished and outs[-1].finished[0].request_id == "a"
    assert b.kv_free() == 100 and len(b) == 0


def test_prefill_role_fifo_with_budget() -> None:
    b = Batcher(role="prefill", token_budget=100, max_batch=8, kv_capacity_tokens=1, default_chunk=100)
    b.add(Seq(request_id="a", attempt=0, prompt_len=150, max_tokens=1))
    b.add(Seq(request_id="b", attempt=0, prompt_len=30, max_tokens=1))
    assert b.queued_tokens() == 180
    p1 = b.plan()
    assert p1 is not None
    assert [(s.request_id, chi) for s, chi, _ in p1.chunks] == [("a", 100)]
    assert b.commit(p1).prefilled == []
    p2 = b.plan()
    assert p2 is not None
    assert [(s.request_id, chi, k) for s, chi, k in p2.chunks] == [("a", 50, 100), ("b", 30, 0)]
    done = b.commit(p2).prefilled
    assert [s.request_id for s in done] == ["a", "b"]
    assert b.plan() is None and b.queued_tokens() == 0


def test_abort_mid_prefill_and_load_figures() -> None:
    b = decode_batcher()
    b.add(Seq(request_id="d", attempt=0, prompt_len=100, max_tokens=2, schedule=deque([50, 50]), tbt_slo=0.05))
    b.add(Seq(request_id="r", attempt=0, prompt_len=10, max_tokens=5, computed=10, tbt_slo=0.2))
    assert b.deflections() == 1 and b.resident_prefill_tokens() == 100 and b.strictest_tbt_slo() == 0.05
    plan = b.plan()
    assert plan is not None
    assert b.remove("d") is not None
    out = b.commit(plan)  # the removed request is skipped
    assert [s.request_id for s in out.tokens] == ["r"]
    assert b.deflections() == 0 and b.decode_batch() == 1 and b.kv_tokens() == 11


def test_duplicate_add_is_refused() -> None:
    b = decode_batcher()
    b.add(Seq(request_id="x", attempt=0, prompt_len=1, max_tokens=1))
    with pytest.raises(ValueError):
        b.add(Seq(request_id="x", attempt=1, prompt_len=1, max_tokens=1))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_step_planned_before_a_new_attempt_leaves_the_new_attempt_alone(role: str) -> None:
    """Cancel attempt 0 and add attempt 1 of the same request while a step that includes attempt 0
    is in flight (what a re-dispatch to the same worker does): that step must neither advance
    nor remove attempt 1 (it used to remove it, and the request hung)."""
    b = Batcher(role=role, token_budget=100, max_batch=64, kv_capacity_tokens=10_000,  # type: ignore[arg-type]
                default_chunk=100)
    b.add(Seq(request_id="r", attempt=0, prompt_len=50, max_tokens=1 if role == "prefill" else 3))
    plan = b.plan()
    assert plan is not None and [s.attempt for s, _, _ in plan.chunks] == [0]
    b.remove("r")
    b.add(Seq(request_id="r", attempt=1, prompt_len=50, max_tokens=1 if role == "prefill" else 3))
    out = b.commit(plan)
    assert out.prefilled == [] and out.tokens == []
    new = b.get("r")
    assert new is not None and new.attempt == 1 and new.computed == 0
    steps = run_until_done(b)
    assert steps and b.get("r") is None  # attempt 1 runs to its end
