"""No poison messages: every kind of bad message a worker can receive fails at most the one
request it concerns, never the worker.

A real worker (sim engine, in this process) registers with a fake router (a ROUTER socket this
test binds); the test then sends each kind of poison and checks, by the worker's own answers,
that it keeps serving the others. Synchronised on messages: a valid request sent after the
poison is answered only once the worker has read everything before it (one ordered connection).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from common import codec, config
from common import messages as m
from common import worker as worker_mod
from common.engines.sim import SimEngine
from common.perf_model import load_profile
from common.ports import free_port
from services.decode_worker.service import DecodeWorker
from services.prefill_worker.service import PrefillWorker

SAMPLING = m.Sampling(max_tokens=3, ignore_eos=True)


class FakeRouter:
    def __init__(self, sock: zmq.asyncio.Socket, identity: bytes) -> None:
        self.sock, self.identity = sock, identity

    async def send(self, payload: bytes | m.Msg) -> None:
        data = payload if isinstance(payload, bytes) else codec.encode(payload)
        await self.sock.send_multipart([self.identity, data])

    async def recv(self, timeout: float = 10.0) -> m.Msg:
        _, payload = await asyncio.wait_for(self.sock.recv_multipart(), timeout)
        msg: m.Msg = codec.router_inbox.decode(payload)
        return msg

    async def until(self, pred: Any, timeout: float = 10.0) -> m.Msg:
        """The first message matching `pred` (others are skipped)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            msg = await self.recv(max(0.01, end - loop.time()))
            if pred(msg):
                return msg


async def _start(role: str, monkeypatch: pytest.MonkeyPatch, *, drain_timeout: float = 1.0,
                 **overrides: object) -> AsyncIterator[tuple[Any, FakeRouter]]:
    monkeypatch.setattr(worker_mod, "install_signals", lambda stop: None)  # the test process keeps its own
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = free_port()
    sock.bind(f"tcp://127.0.0.1:{port}")
    cfg = config.load(config.WorkerConfig, env={}, overrides={
        "work_port": port, "heartbeat_port": free_port(), "kv_transport": "modeled", "worker_id": f"{role}-p",
        "refit_interval": 0, "drain_timeout": drain_timeout, **overrides})
    engine = SimEngine(role, load_profile("fast"))  # type: ignore[arg-type]
    w = (DecodeWorker if role == "decode" else PrefillWorker)(cfg, engine)
    task = asyncio.create_task(w.run())
    router = FakeRouter(sock, f"{role}-p".encode())
    try:
        h = await router.until(lambda x: isinstance(x, m.Hello))
        assert isinstance(h, m.Hello)
        await router.send(m.Welcome(router_incarnation="fake", heartbeat_interval_s=0.1))
        yield w, router
        assert w.stop.is_set() or not task.done(), "the worker stopped"
    finally:
        w.stop.set()
        await asyncio.wait_for(task, 10)
        sock.close(0)
        ctx.term()


@pytest.fixture
async def decode(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[DecodeWorker, FakeRouter]]:
    async for x in _start("decode", monkeypatch):
        yield x


@pytest.fixture
async def prefill(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[PrefillWorker, FakeRouter]]:
    async for x in _start("prefill", monkeypatch):
        yield x


@pytest.fixture
async def prefill_long_drain(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[PrefillWorker, FakeRouter]]:
    async for x in _start("prefill", monkeypatch, drain_timeout=30.0):
        yield x


def work(rid: str, dispatch: int = 1) -> m.DecodeWork:
    return m.DecodeWork(request_id=rid, attempt=0, dispatch=dispatch, mode="deflect", prompt_token_ids=[1, 2, 3],
                        sampling=SAMPLING, tbt_slo=0.1, deadline_s=30.0)


async def served(router: FakeRouter, rid: str) -> None:
    """Wait for `rid`'s last token."""
    await router.until(lambda x: isinstance(x, m.TokenBatch) and any(
        it.request_id == rid and it.finish_reason == "length" for it in x.items))


async def failed(router: FakeRouter, rid: str) -> m.RequestFailed:
    msg = await router.until(lambda x: isinstance(x, m.RequestFailed) and x.request_id == rid)
    assert isinstance(msg, m.RequestFailed)
    return msg


async def test_undecodable_and_wrong_type_frames_are_dropped(decode: tuple[DecodeWorker, FakeRouter]) -> None:
    w, router = decode
    for junk in (b"\xc1garbage", b"", b'{"json": true}',
                 codec.encode(m.PrefillWork(request_id="x", attempt=0, dispatch=1, prompt_token_ids=[1],
                                            sampling=SAMPLING, decode_worker="d", deadline_s=1.0)),  # not for decode
                 codec.encode(m.TokenBatch(worker_id="d", items=[]))):                                # not for workers
        await router.send(junk)
    await router.send(work("after-junk"))
    await served(router, "after-junk")
    assert w.counters["bad_frames"] == 5


async def test_unknown_request_ids_are_ignored(decode: tuple[DecodeWorker, FakeRouter]) -> None:
    w, router = decode
    kv = m.KvHandle(transport="modeled", source_worker="p", tokens=3)
    for msg in (m.KvReady(request_id="nobody", attempt=0, kv=kv), m.KvReady(request_id="nobody", attempt=3, kv=None),
                m.KvWant(request_id="nobody", attempt=0, tokens=3), m.Cancel(request_id="nobody")):
        await router.send(msg)
    await router.send(work("after-unknown"))
    await served(router, "after-unknown")
    assert w.counters["handler_errors"] == 0


@pytest.mark.parametrize(("error", "retryable"), [(ValueError("prompt too long for this engine"), False),
                                                  (RuntimeError("engine fault"), True)])
async def test_engine_exception_fails_only_that_request(decode: tuple[DecodeWorker, FakeRouter],
                                                        error: Exception, retryable: bool) -> None:
    w, router = decode
    real_add = w.engine.add

    def add(req: Any) -> None:
        if req.request_id == "poison":
            raise error
        real_add(req)

    w.engine.add = add  # type: ignore[method-assign]
    await router.send(work("poison", 1))
    f = await failed(router, "poison")
    assert f.retryable is retryable and (f.code == "invalid_request") is not retryable
    assert str(error) in f.reason
    await router.send(work("after-poison", 2))
    await served(router, "after-poison")
    assert "poison" not in w.active


async def test_handler_exception_fails_only_that_request(decode: tuple[DecodeWorker, FakeRouter],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    w, router = decode
    real = w.core.on_cancel

    def cancel(c: m.Cancel) -> bool:
        if c.request_id == "poison":
            raise KeyError("a bug")
        return real(c)

    monkeypatch.setattr(w.core, "on_cancel", cancel)
    await router.send(m.Cancel(request_id="poison", attempt=0))
    f = await failed(router, "poison")
    assert "KeyError" in f.reason and f.retryable
    await router.send(work("after-bug"))
    await served(router, "after-bug")
    assert w.counters["handler_errors"] == 1


async def test_prompt_over_max_model_len_is_refused_as_invalid(decode: tuple[DecodeWorker, FakeRouter]) -> None:
    w, router = decode
    w.core.info = msgspec.structs.replace(w.core.info, max_model_len=3)  # as an engine with that context says
    await router.send(work("too-long"))  # 3 prompt tokens: no room for an output token
    f = await failed(router, "too-long")
    assert not f.retryable and f.code == "invalid_request" and "max_model_len is 3" in f.reason


async def test_welcome_drop_frees_what_the_router_no_longer_tracks(decode: tuple[DecodeWorker, FakeRouter]) -> None:
    w, router = decode
    long = m.DecodeWork(request_id="orphan", attempt=0, dispatch=1, mode="handoff", prompt_token_ids=[1, 2, 3],
                        sampling=SAMPLING, tbt_slo=0.1, deadline_s=30.0, prefill_worker="p")
    await router.send(long)
    await router.send(m.Reregister(router_incarnation="fake-2", reason="restarted"))
    h = await router.until(lambda x: isinstance(x, m.Hello))
    assert isinstance(h, m.Hello) and h.held == ["orphan"]
    assert w.core.reserved() > 0
    await router.send(m.Welcome(router_incarnation="fake-2", heartbeat_interval_s=0.1, drop=["orphan"]))
    # the answer to a Hello sent twice: the second Welcome frees (and logs) nothing more
    await router.send(m.Welcome(router_incarnation="fake-2", heartbeat_interval_s=0.1, drop=["orphan"]))
    await router.send(work("after-drop"))
    await served(router, "after-drop")
    assert "orphan" not in w.pending and w.core.reserved() == 0
    assert w.counters["dropped_on_welcome"] == 1  # dropped_untracked_requests was logged twice (issue 48)


async def test_refused_worker_says_why_and_keeps_trying(decode: tuple[DecodeWorker, FakeRouter]) -> None:
    w, router = decode
    await router.send(m.Reregister(router_incarnation="fake-2"))
    await router.until(lambda x: isinstance(x, m.Hello))
    await router.send(m.Refused(router_incarnation="fake-2", reason="engine: not this one"))
    await router.send(work("while-refused"))  # the loop still reads (and serves what it is sent)
    await served(router, "while-refused")
    assert w.refused == "engine: not this one" and not w.welcomed.is_set()


async def test_prefill_worker_engine_exception_fails_only_that_request(
        prefill: tuple[PrefillWorker, FakeRouter]) -> None:
    w, router = prefill
    real_add = w.engine.add

    def add(req: Any) -> None:
        if req.request_id == "poison":
            raise RuntimeError("engine fault")
        real_add(req)

    w.engine.add = add  # type: ignore[method-assign]

    def pw(rid: str, dispatch: int) -> m.PrefillWork:
        return m.PrefillWork(request_id=rid, attempt=0, dispatch=dispatch, prompt_token_ids=[1, 2, 3],
                             sampling=SAMPLING, decode_worker="d", deadline_s=30.0)

    await router.send(b"\x93\x01\x02")  # msgpack, but no message
    await router.send(pw("poison", 1))
    f = await failed(router, "poison")
    assert f.retryable and "engine fault" in f.reason
    await router.send(pw("after-poison", 2))
    done = await router.until(lambda x: isinstance(x, m.PrefillDone))
    assert isinstance(done, m.PrefillDone) and done.request_id == "after-poison"
    assert w.counters["bad_frames"] == 1


async def test_prefill_drain_waits_until_the_decode_side_has_pulled_the_kv(
        prefill_long_drain: tuple[PrefillWorker, FakeRouter]) -> None:
    """Pull mode (vLLM: the decode worker READs the KV from the prefill worker): a draining
    prefill worker stays until the router says the decode side has it."""
    w, router = prefill_long_drain
    real = w.engine.on_prefilled

    def pulled(p: Any) -> None:  # what a pull-mode engine reports: where the KV can be read
        p.kv_params = {"remote_block_ids": [1, 2], "do_remote_prefill": True}
        real(p)

    w.engine.on_prefilled = pulled
    await router.send(m.PrefillWork(request_id="pull", attempt=0, dispatch=1, prompt_token_ids=[1, 2, 3],
                                    sampling=SAMPLING, decode_worker="d", deadline_s=30.0))
    done = await router.until(lambda x: isinstance(x, m.PrefillDone))
    assert isinstance(done, m.PrefillDone) and done.kv.params
    assert "pull" in w.kv_out and not w.held_requests()
    w.stop.set()  # SIGTERM
    bye = await router.until(lambda x: isinstance(x, m.Goodbye))
    assert isinstance(bye, m.Goodbye) and bye.reason == "shutdown"
    # Holding nothing else, it would say Goodbye("drained") within ~50 ms; it waits for the read.
    # (No event marks a wait that goes on: 0.5 s with nothing but heartbeats on its socket shows it.)
    with pytest.raises(TimeoutError):
        await router.until(lambda x: not isinstance(x, (m.PrefillHeartbeat, m.DecodeHeartbeat)), timeout=0.5)
    assert w.draining and "pull" in w.kv_out
    await router.send(m.Cancel(request_id="pull", attempt=0, reason="kv_consumed"))
    left = await router.until(lambda x: isinstance(x, m.Goodbye), timeout=5)
    assert isinstance(left, m.Goodbye) and left.reason == "drained"
    assert not w.kv_out


@pytest.fixture
async def decode_short_handoff(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[DecodeWorker, FakeRouter]]:
    async for x in _start("decode", monkeypatch, kv_handoff_timeout=0.3):
        yield x


async def test_a_kv_handoff_that_never_comes_expires_after_kv_handoff_timeout(
        decode_short_handoff: tuple[DecodeWorker, FakeRouter]) -> None:
    """Not after the request's 300 s deadline: its KV space is given back and it is prefilled in
    place (reported as a KV fallback) after `kv_handoff_timeout`."""
    w, router = decode_short_handoff
    assert not w.pending
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await router.send(m.DecodeWork(request_id="waits", attempt=0, dispatch=1, mode="handoff",
                                   prompt_token_ids=[1, 2, 3], sampling=SAMPLING, tbt_slo=0.1, deadline_s=300.0,
                                   prefill_worker="gone"))
    batch = await router.until(lambda x: isinstance(x, m.TokenBatch) and "waits" in x.kv_fallback)
    assert isinstance(batch, m.TokenBatch)
    assert batch.kv_fallback_reasons == ["kv_timeout"]
    assert loop.time() - t0 < 30  # bounded by kv_handoff_timeout (0.3 s), nowhere near the 300 s deadline
    await served(router, "waits")
    assert not w.pending and w.core.reserved() == 0


async def test_kv_kept_for_a_pull_is_named_in_hello_and_dropped_if_the_router_forgot_it(
        prefill: tuple[PrefillWorker, FakeRouter]) -> None:
    w, router = prefill
    real = w.engine.on_prefilled

    def pulled(p: Any) -> None:
        p.kv_params = {"remote_block_ids": [1]}
        real(p)

    w.engine.on_prefilled = pulled
    await router.send(m.PrefillWork(request_id="kept", attempt=0, dispatch=1, prompt_token_ids=[1, 2, 3],
                                    sampling=SAMPLING, decode_worker="d", deadline_s=30.0))
    await router.until(lambda x: isinstance(x, m.PrefillDone))
    await router.send(m.Reregister(router_incarnation="restarted"))
    h = await router.until(lambda x: isinstance(x, m.Hello))
    assert isinstance(h, m.Hello) and h.held == ["kept"]
    await router.send(m.Welcome(router_incarnation="restarted", heartbeat_interval_s=0.1, drop=["kept"]))
    await router.send(m.PrefillWork(request_id="next", attempt=0, dispatch=2, prompt_token_ids=[1, 2, 3],
                                    sampling=SAMPLING, decode_worker="d", deadline_s=30.0))
    await router.until(lambda x: isinstance(x, m.PrefillDone) and x.request_id == "next")
    assert list(w.kv_out) == ["next"]  # "kept" freed; "next" still waits for its reader


async def test_the_live_decode_worker_sends_the_text_its_router_asks_for(
        decode: tuple[DecodeWorker, FakeRouter]) -> None:
    """Not poison: the real decode worker (the simulated engine's word tokenizer) sends each token's
    text with its ids when the work asks for it with that tokenizer's fingerprint, and ids only
    otherwise (common/worker_core/decode.py, common/tokenizer.py TextStream)."""
    from common.tokenizer import SimpleTokenizer

    _, router = decode
    tok = SimpleTokenizer()
    for rid, text in (("texted", tok.fingerprint), ("plain", "")):
        await router.send(m.DecodeWork(request_id=rid, attempt=0, dispatch=1, mode="deflect",
                                       prompt_token_ids=[1, 2, 3], tbt_slo=0.1, deadline_s=30.0,
                                       sampling=m.Sampling(max_tokens=5, ignore_eos=True, text=text)))
        items: list[m.TokenItem] = []
        while not items or items[-1].finish_reason is None:
            b = await router.until(lambda x: isinstance(x, m.TokenBatch))
            assert isinstance(b, m.TokenBatch)
            items += [it for it in b.items if it.request_id == rid]
        ids = [t for it in items for t in it.token_ids]
        assert len(ids) == 5
        if text:
            assert "".join(it.text or "" for it in items) == tok.decode(ids) and all(it.text for it in items)
        else:
            assert all(it.text is None for it in items)
