"""A worker serving two routers (WorkerConfig.routers): it registers with each, sends every
request's messages to the router that sent it, acknowledges each router's own dispatch numbers
in the heartbeats it sends that router, and tells each router only of the requests it sent.

A real decode worker (sim engine, in this process) and two fake routers (a ROUTER socket each,
bound by the test: work and heartbeats arrive on it). Synchronised on messages, no sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from common import codec, config
from common import messages as m
from common import worker as worker_mod
from common.engines.sim import SimEngine
from common.errors import ConfigError
from common.perf_model import load_profile
from common.ports import free_port
from common.router_link import Origins, RouterLink, router_addresses
from common.sockets import telemetry_endpoints
from services.decode_worker.service import DecodeWorker

SAMPLING = m.Sampling(max_tokens=3, ignore_eos=True)


class Fake:
    """One fake router: its work socket, on which the worker's heartbeats arrive too."""

    def __init__(self, ctx: zmq.asyncio.Context, name: str, *, like: Fake | None = None) -> None:
        """`like`: a router again on that one's ports (it closed: a restart, or a broken connection)."""
        self.name = name
        self.work = ctx.socket(zmq.ROUTER)
        self.work.setsockopt(zmq.LINGER, 0)
        # the heartbeat port: configured, unused
        self.work_port, self.hb_port = (like.work_port, like.hb_port) if like else (free_port(), free_port())
        self.work.bind(f"tcp://127.0.0.1:{self.work_port}")
        self.got: list[m.Msg] = []
        self._pending: list[m.Msg] = []  # work messages read while waiting for a heartbeat

    async def send(self, msg: m.Msg) -> None:
        await self.work.send_multipart([b"decode-r", codec.encode(msg)])

    async def _next(self, end: float) -> m.Msg:
        loop = asyncio.get_running_loop()
        _, payload = await asyncio.wait_for(self.work.recv_multipart(), max(0.01, end - loop.time()))
        msg: m.Msg = codec.router_inbox.decode(payload)
        return msg

    async def until(self, pred: Any, timeout: float = 10.0) -> m.Msg:
        """The next work message (heartbeats skipped) that satisfies `pred`."""
        end = asyncio.get_running_loop().time() + timeout
        while True:
            msg = self._pending.pop(0) if self._pending else await self._next(end)
            if isinstance(msg, (m.PrefillHeartbeat, m.DecodeHeartbeat)):
                continue
            self.got.append(msg)
            if pred(msg):
                return msg

    async def beat_until(self, pred: Any, timeout: float = 10.0) -> m.Msg:
        """The next heartbeat that satisfies `pred` (work messages kept for `until`)."""
        end = asyncio.get_running_loop().time() + timeout
        while True:
            msg = await self._next(end)
            if not isinstance(msg, (m.PrefillHeartbeat, m.DecodeHeartbeat)):
                self._pending.append(msg)
                continue
            if pred(msg):
                return msg

    def close(self) -> None:
        self.work.close(0)


def work(rid: str, dispatch: int, max_tokens: int = 3) -> m.DecodeWork:
    return m.DecodeWork(request_id=rid, attempt=0, dispatch=dispatch, mode="deflect", prompt_token_ids=[1, 2, 3],
                        sampling=m.Sampling(max_tokens=max_tokens, ignore_eos=True), tbt_slo=0.1, deadline_s=30.0)


@pytest.fixture
async def two(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[DecodeWorker, Fake, Fake]]:
    monkeypatch.setattr(worker_mod, "install_signals", lambda stop: None)
    ctx = zmq.asyncio.Context()
    a, b = Fake(ctx, "A"), Fake(ctx, "B")
    cfg = config.load(config.WorkerConfig, env={}, overrides={
        "routers": f"127.0.0.1:{a.work_port}:{a.hb_port},127.0.0.1:{b.work_port}:{b.hb_port}",
        "kv_transport": "modeled", "worker_id": "decode-r", "refit_interval": 0, "drain_timeout": 1.0})
    w = DecodeWorker(cfg, SimEngine("decode", load_profile("fast")))
    task = asyncio.create_task(w.run())
    try:
        for fake in (a, b):
            await fake.until(lambda x: isinstance(x, m.Hello))
            await fake.send(m.Welcome(router_incarnation=fake.name, heartbeat_interval_s=0.1))
        yield w, a, b
    finally:
        w.stop.set()
        await asyncio.wait_for(task, 10)
        a.close()
        b.close()
        ctx.term()


def finished(rid: str) -> Any:
    return lambda x: isinstance(x, m.TokenBatch) and any(i.request_id == rid and i.finish_reason for i in x.items)


async def test_replies_and_acknowledgements_go_to_the_sending_router(two: tuple[DecodeWorker, Fake, Fake]) -> None:
    w, a, b = two
    await a.send(work("from-a", dispatch=7))
    await b.send(work("from-b", dispatch=2))
    await a.until(finished("from-a"))
    await b.until(finished("from-b"))
    tokens_a = {i.request_id for x in a.got if isinstance(x, m.TokenBatch) for i in x.items}
    tokens_b = {i.request_id for x in b.got if isinstance(x, m.TokenBatch) for i in x.items}
    assert tokens_a == {"from-a"} and tokens_b == {"from-b"}
    # each router's heartbeats acknowledge that router's own dispatch numbers, not the other's
    hb_a = await a.beat_until(lambda x: isinstance(x, m.DecodeHeartbeat) and x.last_dispatch == 7)
    hb_b = await b.beat_until(lambda x: isinstance(x, m.DecodeHeartbeat) and x.last_dispatch > 0)
    assert isinstance(hb_a, m.DecodeHeartbeat) and isinstance(hb_b, m.DecodeHeartbeat)
    assert hb_b.last_dispatch == 2
    assert w.links[0].incarnation == "A" and w.links[1].incarnation == "B"


async def test_hello_to_a_restarted_router_lists_only_its_requests(two: tuple[DecodeWorker, Fake, Fake]) -> None:
    w, a, b = two
    await a.send(work("long-a", dispatch=1, max_tokens=10_000))
    await b.send(work("long-b", dispatch=1, max_tokens=10_000))
    await a.until(lambda x: isinstance(x, m.TokenBatch) and any(i.request_id == "long-a" for i in x.items))
    await b.until(lambda x: isinstance(x, m.TokenBatch) and any(i.request_id == "long-b" for i in x.items))
    await b.send(m.Reregister(router_incarnation="B2", reason="restarted"))
    h = await b.until(lambda x: isinstance(x, m.Hello))
    assert isinstance(h, m.Hello) and h.held == ["long-b"]
    await b.send(m.Welcome(router_incarnation="B2", heartbeat_interval_s=0.1, drop=["long-b", "long-a"]))
    # B's request is freed; A's is not B's to drop and keeps streaming to A
    await b.beat_until(lambda x: w.counters["dropped_on_welcome"] == 1)
    assert "long-b" not in w.held_ids() and "long-a" in w.held_ids()
    n = len(a.got)
    await a.until(lambda x: isinstance(x, m.TokenBatch) and any(i.request_id == "long-a" for i in x.items))
    assert len(a.got) > n
    assert w.counters["dropped_on_welcome"] == 1


def test_router_addresses() -> None:
    one = config.load(config.WorkerConfig, env={}, overrides={"work_port": 6000, "heartbeat_port": 6001})
    addr = [(c.router_host, c.work_port, c.heartbeat_port) for c in router_addresses(one)]
    assert addr == [("127.0.0.1", 6000, 6001)]
    two = config.load(config.WorkerConfig, env={}, overrides={"routers": "r1:5555:5556, r2:6555:6556"})
    assert [(c.router_host, c.work_port, c.heartbeat_port) for c in router_addresses(two)] == [
        ("r1", 5555, 5556), ("r2", 6555, 6556)]
    bad = config.load(config.WorkerConfig, env={}, overrides={"routers": "r1:5555"})
    with pytest.raises(ConfigError, match="host:work_port:heartbeat_port"):
        router_addresses(bad)


def test_token_batch_split_per_router() -> None:
    cfg = config.load(config.WorkerConfig, env={}, overrides={})
    links = [RouterLink(0, cfg), RouterLink(1, cfg)]
    o = Origins(links)
    o.note("a", links[0])
    o.note("b", links[1])
    batch = m.TokenBatch(worker_id="w", items=[m.TokenItem("a", 0, [1]), m.TokenItem("b", 0, [2], "length")],
                         step_s=0.01, kv_fallback=["b"], kv_fallback_reasons=["no kv"])
    parts = {link.index: msg for link, msg in o.split(batch)}
    assert isinstance(parts[0], m.TokenBatch) and isinstance(parts[1], m.TokenBatch)
    assert [i.request_id for i in parts[0].items] == ["a"] and parts[0].kv_fallback == []
    assert [i.request_id for i in parts[1].items] == ["b"] and parts[1].kv_fallback == ["b"]
    assert parts[1].kv_fallback_reasons == ["no kv"] and parts[0].step_s == 0.01
    assert o.of("b") is links[0]  # finished: forgotten (an unknown request answers on the first link)
    assert [link.index for link, _ in o.split(m.Goodbye(worker_id="w", incarnation="i"))] == [0, 1]
    failed = m.RequestFailed(request_id="a", attempt=0, worker_id="w", reason="x")
    assert [link.index for link, _ in o.split(failed)] == [0]


def test_kairos_up_routers_flag() -> None:
    from kairos.up import Cluster, parser, spec_from_args

    spec = spec_from_args(parser().parse_args(["--routers", "3", "--bus-port", "7000", "--kv-transport", "modeled"]))
    assert spec.router_names == ["router", "router-1", "router-2"]
    assert spec.router_bus() == [(7000, 7001, 7002), (7003, 7004, 7005), (7006, 7007, 7008)]
    c = Cluster(spec)
    for name, (work, hb, tel) in zip(spec.router_names, spec.router_bus(), strict=True):
        env = c.services[name].env
        assert c.services[name].command[-1] == "router"
        assert (env["KAIROS_WORK_PORT"], env["KAIROS_HEARTBEAT_PORT"], env["KAIROS_TELEMETRY_PORT"]) == (
            str(work), str(hb), str(tel))
        assert env["KAIROS_HTTP_PORT"] == str(spec.http_port) and env["KAIROS_HTTP_REUSE_PORT"] == "true"
        # each replica knows it is one of several (it takes turns at a heartbeat's room)
        assert config.load(config.RouterConfig, env=env).replicas == 3
    wcfg = config.load(config.WorkerConfig, env=c.services["decode-0"].env)
    assert [(a.work_port, a.heartbeat_port) for a in router_addresses(wcfg)] == [(7000, 7001), (7003, 7004),
                                                                                 (7006, 7007)]
    # CURVE (kairos up's default): a key pair per router, each named in the workers' and the monitor's lists
    assert c.router_keys == ("router", "router-1", "router-2")
    assert [c.services[n].env["KAIROS_CURVE_KEY_NAME"] for n in spec.router_names] == spec.router_names
    assert [a.curve_server_key for a in router_addresses(wcfg)] == spec.router_names
    mcfg = config.load(config.MonitorConfig, env=c.services["monitor"].env)
    assert [k for _, _, k in telemetry_endpoints(mcfg)] == spec.router_names
    insecure = Cluster(spec_from_args(parser().parse_args(["--routers", "2", "--insecure"])))
    assert insecure.router_keys == ("router",) and "KAIROS_CURVE_KEY_NAME" not in insecure.services["router-1"].env
    assert "KAIROS_CURVE_KEYS_DIR" not in insecure.services["decode-0"].env
    one = Cluster(spec_from_args(parser().parse_args(["--kv-transport", "modeled"])))
    assert "KAIROS_ROUTERS" not in one.services["decode-0"].env
    assert "KAIROS_HTTP_REUSE_PORT" not in one.services["router"].env and "router-1" not in one.services
    assert "KAIROS_REPLICAS" not in one.services["router"].env


def test_kairos_up_banner_names_the_dashboard_only_when_a_monitor_runs() -> None:
    from kairos.up import banner, parser, spec_from_args

    on = spec_from_args(parser().parse_args(["--monitor-port", "9177", "--insecure"]))
    assert "dashboard:   http://127.0.0.1:9177/" in banner(on, None) and "kairos-sim" in banner(on, None)
    off = spec_from_args(parser().parse_args(["--monitor-port", "9177", "--no-monitor", "--insecure"]))
    text = banner(off, "/models/tiny-llama")
    assert "9177" not in text and "dashboard:   none (--no-monitor)" in text and "(model: tiny-llama)" in text


def test_reuse_port_socket_shares_the_port_and_says_who_holds_it() -> None:
    import socket

    from kairos.up import parser, spec_from_args
    from services.router.__main__ import reuse_port_socket

    with pytest.raises(ConfigError, match="--routers"):
        spec_from_args(parser().parse_args(["--routers", "0"]))
    port = free_port()
    a, b = reuse_port_socket("127.0.0.1", port), reuse_port_socket("127.0.0.1", port)  # two replicas, one port
    a.close()
    b.close()
    with socket.socket() as plain:  # a process without SO_REUSEPORT holds it
        plain.bind(("127.0.0.1", port))
        plain.listen()
        with pytest.raises(ConfigError, match="SO_REUSEPORT"):
            reuse_port_socket("127.0.0.1", port)
