"""The router's table keeps its last cluster view and patches in only the workers touched since;
whatever happens to the fleet (heartbeats, dispatches, deflections, drains, unreachable sends,
departures, new workers and restarts), the patched view must equal a view built from scratch."""

from __future__ import annotations

import random

from common import messages as m
from common.perf_model import load_profile
from common.router_core.workers import LedgerEntry, WorkerTable
from tests.test_trust import hello

MODEL = load_profile("fast").model


def fresh(t: WorkerTable, use_ledger: bool):  # type: ignore[no-untyped-def]
    return t._build(use_ledger, frozenset())


def test_patched_view_equals_a_fresh_one() -> None:
    rng = random.Random(3)
    t = WorkerTable(MODEL, me="r1")
    seq = 0
    incs: dict[str, int] = {}
    patched = 0
    for step in range(3000):
        ids = list(t.workers)
        act = rng.random()
        if act < 0.08 or not ids:  # a worker registers (new, or a restart under a new incarnation)
            wid = rng.choice([f"{r}-{i}" for r in ("prefill", "decode") for i in range(6)])
            incs[wid] = incs.get(wid, 0) + (rng.random() < 0.5)
            t.register(hello(wid, role="prefill" if wid.startswith("prefill") else "decode",
                             incarnation=f"i{incs[wid]}"), wid.encode(), float(step))
        elif act < 0.6:  # a heartbeat
            e = t.workers[rng.choice(ids)]
            seq += 1
            q = rng.randint(0, 20000)
            if e.role == "prefill":
                hb: m.PrefillHeartbeat | m.DecodeHeartbeat = m.PrefillHeartbeat(
                    worker_id=e.worker_id, incarnation=e.incarnation, seq=seq, queued_tokens=q,
                    queued_requests=q // 900, token_budget=2048, last_dispatch=rng.randint(0, e.dispatch_no))
            else:
                hb = m.DecodeHeartbeat(worker_id=e.worker_id, incarnation=e.incarnation, seq=seq, batch=q // 500,
                                       kv_tokens=q, kv_free_tokens=10**6 - q, kv_capacity_tokens=10**6,
                                       resident_prefill_tokens=0, deflections=0, strictest_tbt_slo=0.1,
                                       token_budget=2048, last_dispatch=rng.randint(0, e.dispatch_no),
                                       draining=rng.random() < 0.02)
            t.heartbeat(hb, float(step))
        elif act < 0.8:  # a dispatch, maybe a deflection
            e = t.workers[rng.choice(ids)]
            defl = e.role == "decode" and rng.random() < 0.5
            e.next_dispatch(LedgerEntry(f"r{step}", rng.randint(1, 4000), rng.randint(1, 5000), defl))
            if defl:
                e.add_deflection(f"r{step}", 0.01, 512, 1.0)
        elif act < 0.88:
            e = t.workers[rng.choice(ids)]
            for rid in list(e.deflecting)[:1]:
                e.end_deflection(rid)
        elif act < 0.93:  # a send failed
            e = t.workers[rng.choice(ids)]
            e.unreachable = True
            e.touch()
        elif act < 0.96:
            t.remove(rng.choice(ids))
        else:  # a drain announced
            e = t.workers[rng.choice(ids)]
            e.draining = True
            e.touch()
        if rng.random() < 0.5:
            use_ledger = rng.random() < 0.9
            before = t._cv
            got = t.view(use_ledger=use_ledger)
            want = fresh(t, use_ledger)
            assert [id(v) for v in got.prefill] == [id(v) for v in want.prefill]
            assert [id(v) for v in got.decode] == [id(v) for v in want.decode]
            patched += before is not None and got is not before and t._cv is got
    assert patched > 300  # the patching path is what ran


def test_the_same_coefficients_in_every_heartbeat_keep_the_same_model_object() -> None:
    """Workers resend their coefficients in every heartbeat; the policy caches by the model
    object's identity, so only a change of coefficients may build a new one."""
    from tests.test_messages import COEFFS

    t = WorkerTable(MODEL, me="r1")
    e, _ = t.register(hello("decode-0", coeffs=COEFFS), b"decode-0", 0.0)
    first = e.model

    def beat(seq: int, coeffs: m.Coeffs) -> None:
        t.heartbeat(m.DecodeHeartbeat(worker_id="decode-0", incarnation="i1", seq=seq, batch=0, kv_tokens=0,
                                      kv_free_tokens=1000, kv_capacity_tokens=1000, resident_prefill_tokens=0,
                                      deflections=0, strictest_tbt_slo=None, token_budget=2048, coeffs=coeffs),
                    float(seq))

    beat(1, COEFFS)
    beat(2, COEFFS)
    assert e.model is first
    beat(3, m.Coeffs(**{**{f: getattr(COEFFS, f) for f in COEFFS.__struct_fields__}, "a0": 0.02}))
    assert e.model is not first and e.model.step_time(1, 0, []) != first.step_time(1, 0, [])
