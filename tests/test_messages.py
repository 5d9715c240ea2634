"""Codec round trips for every message, and schema evolution."""

from __future__ import annotations

import msgspec
import pytest

from common import codec
from common import messages as m

COEFFS = m.Coeffs(a0=0.01, a1=1e-4, a2=1e-7, a3=4e-5, a4=4e-9, a5=3e-8, xfer_t0=0.015, xfer_bandwidth=3e9,
                  kv_bytes_per_token=31104)
SAMPLING = m.Sampling(max_tokens=16, temperature=0.0, ignore_eos=True, seed=7)
KV = m.KvHandle(transport="modeled", source_worker="prefill-0", tokens=100, nbytes=3110400, transfer_s=0.02,
                params={"remote_block_ids": [[1, 2]], "do_remote_prefill": True})

SAMPLES: list[m.Msg] = [
    m.Hello(protocol=1, worker_id="decode-0", role="decode", incarnation="abc", engine="sim", model="x",
            token_budget=2304, kv_capacity_tokens=1000, max_batch=8, coeffs=COEFFS, kv_transport="nixl",
            max_model_len=8192, kv_block_tokens=16, held=["r"],
            kv_agent=m.KvAgentInfo(agent_name="decode-0", metadata=b"\x00\x01", region_addr=1234, region_bytes=4096,
                                   block_bytes=1024, num_blocks=4)),
    m.Welcome(router_incarnation="r1", heartbeat_interval_s=0.1, drop=["x", "y"]),
    m.Refused(router_incarnation="r1", reason="engine: the worker runs 'vllm', the cluster's workers run 'sim'"),
    m.Reregister(router_incarnation="r1", reason="unknown worker"),
    m.Goodbye(worker_id="decode-0", incarnation="abc"),
    m.Drain(reason="maintenance"),
    m.SetRole(role="decode", reason="decode_short", router_incarnation="r1"),
    m.PrefillHeartbeat(worker_id="prefill-0", incarnation="i", seq=3, queued_tokens=4096, queued_requests=2,
                       token_budget=2048, last_dispatch=9, step_ms_p50=210.0, steps=10, coeffs=COEFFS, routers=["r1"]),
    m.DecodeHeartbeat(worker_id="decode-0", incarnation="i", seq=4, batch=12, kv_tokens=30000, kv_free_tokens=900000,
                      kv_capacity_tokens=1290000, resident_prefill_tokens=1500, deflections=1,
                      strictest_tbt_slo=0.1, token_budget=2304, waiting_kv=2, tbt_slack_ms=40.5,
                      held=[m.HeldDeflection(router="r1", reserved_s=0.004, largest_chunk=512)],
                      queues=[m.RouterQueue(router="r1", oldest_at=1.7e9, late=False, waiting=3)]),
    m.DecodeHeartbeat(worker_id="decode-1", incarnation="i", seq=1, batch=0, kv_tokens=0, kv_free_tokens=10,
                      kv_capacity_tokens=10, resident_prefill_tokens=0, deflections=0, strictest_tbt_slo=None,
                      token_budget=64),
    m.PrefillWork(request_id="r", attempt=0, dispatch=1, prompt_token_ids=[1, 2, 3], sampling=SAMPLING,
                  decode_worker="decode-0", deadline_s=30.0),
    m.PrefillDone(request_id="r", attempt=0, worker_id="prefill-0", kv=KV, queue_s=0.1, prefill_s=0.2,
                  first_token_id=5),
    m.DecodeWork(request_id="r", attempt=1, dispatch=2, mode="handoff", prompt_token_ids=[1, 2], sampling=SAMPLING,
                 tbt_slo=0.1, deadline_s=10.0, chunk_schedule=(512, 256, 128)),
    m.KvTarget(request_id="r", attempt=0, decode_worker="decode-0", agent_name="decode-0", block_ids=[3, 4]),
    m.KvWant(request_id="r", attempt=0, tokens=100),
    m.KvReady(request_id="r", attempt=0, kv=KV),
    m.KvReady(request_id="r", attempt=0, kv=None, error="transfer failed"),
    m.Cancel(request_id="r", attempt=0, reason="client_disconnected"),
    m.QueueHead(router_incarnation="r1", oldest_at=1.7e9, late=True, waiting=2),
    m.QueueHead(router_incarnation="r1", oldest_at=1.7e9, late=False, waiting=3, waiting_tokens=6000),
    m.PlanBudget(router_incarnation="r1", allowance_s=0.0105, cap=0.5),
    m.TokenBatch(worker_id="decode-0", items=[m.TokenItem("r", 0, [7]), m.TokenItem("s", 2, [8, 9], "length")],
                 step_s=0.02, kv_fallback=["q"]),
    m.RequestFailed(request_id="r", attempt=0, worker_id="decode-0", reason="kv_full", retryable=True),
    m.DecodeWork(request_id="r", attempt=0, dispatch=3, mode="deflect", prompt_token_ids=[1, 2], sampling=SAMPLING,
                 tbt_slo=0.1, deadline_s=10.0, chunk_schedule=(2,), step_budget_s=0.09),
    m.RequestFailed(request_id="r", attempt=0, worker_id="decode-0", reason="step 1 of 1 ...", code="deflect_rejected"),
    m.RequestFailed(request_id="r", attempt=0, worker_id="decode-0", reason="too long", retryable=False,
                    code="invalid_request"),
    m.WorkerSeen(worker_id="decode-0", role="decode", incarnation="i", engine="sim", state={"batch": 3.0}, at=1.0),
    m.WorkerLost(worker_id="decode-0", role="decode", reason="heartbeat timeout", at=2.0),
    m.RoleFlip(worker_id="prefill-1", frm="prefill", to="decode", reason="decode_short", phase="started", at=3.0,
               evidence={"decode_wait_share": 0.4}),
    m.DecisionRecord(request_id="r", policy="kairos", route="deflect", prefill_worker=None, decode_worker="decode-0",
                     reason="decode_faster", prompt_tokens=2000, ttft_prefill_pred=1.2, ttft_decode_pred=0.3,
                     chunk_schedule=(512, 512), decision_us=25.0, at=3.0),
    m.RequestRecord(request_id="r", route="disagg", reason="least_loaded", prefill_worker="prefill-0",
                    decode_worker="decode-0", prompt_tokens=10, output_tokens=4, ttft_s=0.2, ttft_pred_s=0.25,
                    tbt_p50_s=0.02, tbt_p99_s=0.03, tbt_max_s=0.03, e2e_s=0.3, outcome="ok"),
    m.RouterStats(at=1.0, in_flight=3, accepted=10, completed=6, failed=1, rejected=0),
]

INBOXES = [codec.router_inbox, codec.heartbeat_inbox, codec.prefill_inbox, codec.decode_inbox, codec.telemetry_inbox]


def test_every_message_has_a_sample() -> None:
    assert {type(s) for s in SAMPLES} == set(m.ALL_MESSAGES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).__name__)
def test_round_trip_through_its_inbox(msg: m.Msg) -> None:
    payload = codec.encode(msg)
    decoded = [d.decode(payload) for d in INBOXES if _accepts(d, payload)]
    assert decoded, f"no inbox accepts {type(msg).__name__}"
    assert all(x == msg for x in decoded)


def _accepts(dec: codec.Decoder[object], payload: bytes) -> bool:
    try:
        dec.decode(payload)
        return True
    except msgspec.ValidationError:
        return False


def test_inboxes_reject_messages_not_meant_for_them() -> None:
    with pytest.raises(msgspec.ValidationError):
        codec.heartbeat_inbox.decode(codec.encode(m.Cancel(request_id="x")))
    with pytest.raises(codec.DecodeError):
        codec.router_inbox.decode(b"\xc1garbage")


def test_schema_evolution_both_directions() -> None:
    """A newer peer adds a field (with a default): an older decoder ignores it; an older peer omits
    it: the newer decoder fills the default."""

    class CancelV1(msgspec.Struct, tag="Cancel", frozen=True, kw_only=True):
        request_id: str

    class CancelV3(msgspec.Struct, tag="Cancel", frozen=True, kw_only=True):
        request_id: str
        attempt: int = -1
        reason: str = ""
        urgency: int = 0  # a field from the future

    enc = msgspec.msgpack.Encoder()
    new_payload = enc.encode(CancelV3(request_id="r", attempt=2, reason="x", urgency=5))
    assert msgspec.msgpack.decode(new_payload, type=CancelV1) == CancelV1(request_id="r")
    got = codec.prefill_inbox.decode(new_payload)
    assert got == m.Cancel(request_id="r", attempt=2, reason="x")
    old_payload = enc.encode(CancelV1(request_id="r"))
    assert codec.decode_inbox.decode(old_payload) == m.Cancel(request_id="r", attempt=-1, reason="")


def test_seq_frame() -> None:
    assert codec.unpack_seq(codec.pack_seq(2**40 + 5)) == 2**40 + 5
