"""`kairos bench-router --peers`: a peer that is not installed is skipped with the line that says
how to install it, the stub tokenizer is a local directory the peers can load (so they fetch
nothing), and the backend the peers sit in front of answers their health and discovery probes."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console

from bench import peers
from bench.steps import wait_port
from common.errors import ConfigError
from common.ports import free_port


def _args(tmp_path: Path) -> argparse.Namespace:
    return argparse.Namespace(log_dir=str(tmp_path), peer_policy="round_robin", step=0.5, moderate_rate=10.0,
                              prompt_tokens=8, stream_tokens=4, connections=4)


def test_a_missing_peer_is_skipped_with_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers, "find", lambda name: None)
    console = Console(record=True, width=300)
    kairos = {"requests": {"steps": [{"offered_rate": 20.0, "router_us_per_request": 900.0}]},
              "tokens": {"steps": []}, "latency": {"added_p50": 0.003}}
    out = peers.peers_phase(console, _args(tmp_path), ["sglang-router", "nope"], kairos, n_clients=1,
                            router_cpus=[], other_cpus=[])
    assert out["peers"] == {"sglang-router": {"skipped": "not installed"}, "nope": {"skipped": "unknown peer"}}
    text = console.export_text()
    assert "sglang-router: not installed, skipped" in text and "pip install sglang-router" in text
    floor = out["backend"]["latency"]  # the backend alone was still measured: the floor
    assert floor["completed"] > 0 and not floor["errors"] and out["kairos_added_ttft_p50_s"] == 0.003
    # like the peers' figure, Kairos's less the backend's own TTFT (the client and an HTTP turn)
    assert out["kairos_added_ttft_over_floor_p50_s"] == pytest.approx(0.003 - floor["ttft_p50"])


def test_the_backend_answers_a_peers_probes_with_a_local_model(tmp_path: Path) -> None:
    model = tmp_path / "stub"
    peers.write_stub_tokenizer(model)
    tok = json.loads((model / "tokenizer.json").read_text())
    assert tok["model"]["type"] == "WordLevel" and tok["model"]["vocab"]["[UNK]"] == 0
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.reference_app", "--port", str(port), "--model-path",
                             str(model)])
    try:
        wait_port(port, proc)
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/health").status_code == 200
        for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
            assert httpx.get(base + path).json()["model_path"] == str(model)  # a directory: nothing fetched
        r = httpx.post(base + "/v1/completions", json={"model": "reference", "prompt": "w1 w2", "max_tokens": 3})
        assert r.text.count("data: ") == 4 and r.text.endswith("data: [DONE]\n\n")
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_paced_backend_writes_one_event_per_stream_per_step() -> None:
    """--step-s: every stream in flight gets one event per engine step (the last with [DONE]), and a
    stream that arrives while a step runs joins the one after it, as on Kairos's simulated engine
    (the step's plan is made before its sleep)."""
    from bench.reference_app import _DONE, _LAST, _TOKEN, Engine

    sent: list[tuple[str, bytes]] = []

    def sender(name: str) -> Any:
        async def send(msg: dict[str, Any]) -> None:
            sent.append((name, msg["body"]))
        return send

    async def run() -> None:
        eng = Engine(0.001)
        a = asyncio.ensure_future(eng.stream(sender("a"), 3))
        b = asyncio.ensure_future(eng.stream(sender("b"), 2))
        await asyncio.sleep(0)  # both are in the first step's plan
        while not sent:
            await asyncio.sleep(0.0005)
        # arrives after the first step's writes, while the second (planned then) sleeps: joins the third
        c = asyncio.ensure_future(eng.stream(sender("c"), 1))
        await asyncio.gather(a, b, c)
        assert eng.task is None and not eng.streams  # the loop ends when idle

    asyncio.run(run())
    assert sent == [("a", _TOKEN), ("b", _TOKEN), ("a", _TOKEN), ("b", _LAST + _DONE), ("a", _LAST + _DONE),
                    ("c", _LAST + _DONE)]


def test_peer_backend_modes(tmp_path: Path) -> None:
    assert peers.parse_modes("paced, burst,paced") == ["paced", "burst"]
    for bad in ("", "bursty", "burst,x"):
        with pytest.raises(ConfigError, match="--peer-backend"):
            peers.parse_modes(bad)
    args = argparse.Namespace(profile="fast", decode=4, time_scale=2.0)
    assert peers.backend_mode("burst", args) == (2, 0.0)
    n, step = peers.backend_mode("paced", args)
    assert n == 4 and step == pytest.approx(2 * 0.0005, rel=1e-3)  # the fast profile: 0.5 ms a step, scaled


def test_syscall_counts_are_parsed() -> None:
    from bench.router_throughput import parse_perf_counts

    text = """# started on Sun Dec  6 16:45:00 2026

10783,,syscalls:sys_enter_recvfrom,5001234,100.00,,
19569,,syscalls:sys_enter_writev,5001234,100.00,,
0,,syscalls:sys_enter_sendmsg,5001234,100.00,,
<not counted>,,syscalls:sys_enter_read,0,0.00,,
"""
    assert parse_perf_counts(text) == {"recvfrom": 10783, "writev": 19569, "sendmsg": 0}


@pytest.mark.parametrize("scale", [1.0, 40.0])
def test_paced_backends_step_as_the_clusters_engines_under_time_scale(tmp_path: Path, scale: float) -> None:
    """One source for the step on both sides: bench-router's --time-scale reaches the decode
    workers' simulated engines (through the cluster's environment) and the peers' paced backends
    alike, and both step as the profile says, scaled (x40: the fast profile's 0.5 ms -> 20 ms)."""
    from bench.router_throughput import build_parser
    from common.config import WorkerConfig, load
    from common.engines import make_engine
    from common.perf_model import PerfModel
    from kairos.up import Cluster, ClusterSpec

    args = build_parser().parse_args(["--time-scale", f"{scale:g}", "--decode", "3"])
    spec = ClusterSpec.ephemeral(prefill=1, decode=args.decode, profile=args.profile, time_scale=args.time_scale,
                                 monitor=False, log_dir=str(tmp_path))
    worker = next(s for n, s in Cluster(spec).services.items() if n.startswith("decode"))
    engine = make_engine(load(WorkerConfig, env=worker.env), "decode")
    engine_step = PerfModel.from_coeffs(engine.coeffs()).step_time(1, 0)  # one stream decoding: what it sleeps
    n, step = peers.backend_mode("paced", args)
    assert n == 3
    assert step == pytest.approx(engine_step, rel=1e-9)
    assert step == pytest.approx(scale * 0.0005, rel=1e-3)


def test_a_step_reports_the_clients_itl_and_open_streams() -> None:
    """Bench.step: each request's mean inter-token time (first token to last over max_tokens - 1,
    however many tokens an SSE event joined), its median and p99, and the number of streams open at
    once while it sends (the time each was open, summed, over the sending window)."""
    import os

    from bench.steps import Bench

    rows = [(0.01, 1.01, 101, 0.02, None, "", ""), (0.02, 2.02, 30, 0.5, None, "", ""),
            (0.03, 1.53, 101, 0.02, None, "", ""), (None, None, 0, 0.0, "timeout", "", "")]

    class FakeClients:
        def run(self, step: Any) -> list[dict[str, Any]]:
            return [{"sent": 4, "results": rows, "pool_waits": 0, "cpu_s": 0.0, "cpu_send_s": 0.0,
                     "lag_max": 0.0, "span": 4.0}]

    s = Bench(None, FakeClients(), Console(), pid=os.getpid()).step(
        10, 0.05, max_tokens=101, prompt_tokens=8)  # type: ignore[arg-type]
    assert s["itl_p50"] == pytest.approx(0.015) and s["itl_p99"] == pytest.approx(0.02, rel=0.02)
    assert s["open_streams"] == pytest.approx((1.01 + 2.02 + 1.53) / 0.05)
    assert s["errors"] == {"timeout": 1}
    # 3 requests over the 4 s span less their median lifetime (1.53 s): not 3 / 4
    assert s["carried_rate"] == pytest.approx(3 / (4.0 - 1.53))


def test_kairos_added_ttft_is_never_counted_over_a_paced_floor() -> None:
    """A paced backend's TTFT holds its own first step, which the engines' modeled time already took
    off Kairos's figure: against paced backends Kairos's added TTFT uses the burst run's HTTP floor
    (or none), never the paced floor (that took the step off twice: 0.20 ms for 1.16 ms)."""
    def run(mode: str, floor: float, peer_added: float) -> dict[str, Any]:
        k_added = 0.00211  # client TTFT over the modeled engine time
        return {"backend_mode": mode, "kairos_added_ttft_p50_s": k_added,
                "kairos_added_ttft_over_floor_p50_s": k_added - floor if mode == "burst" else None,
                "peers": {"vllm-router": {"added_ttft_p50_s": peer_added,
                                          "kairos_added_ttft_above_peer_s": None},
                          "sglang-router": {"skipped": "not installed"}}}

    burst, paced = run("burst", 0.00040, 0.00055), run("paced", 0.00151, 0.00040)
    peers.settle_added_ttft([paced, burst])
    assert paced["kairos_added_ttft_over_floor_p50_s"] == pytest.approx(0.00171)  # the HTTP floor's figure
    assert paced["peers"]["vllm-router"]["kairos_added_ttft_above_peer_s"] == pytest.approx(0.00131)
    assert paced["kairos_added_ttft_floor"] == "burst"
    assert burst["kairos_added_ttft_over_floor_p50_s"] == pytest.approx(0.00171)  # unchanged
    assert "kairos_added_ttft_floor" not in burst
    alone = run("paced", 0.00151, 0.00040)
    peers.settle_added_ttft([alone])  # no burst run: no figure rather than a wrong one
    assert alone["kairos_added_ttft_over_floor_p50_s"] is None
    assert alone["peers"]["vllm-router"]["kairos_added_ttft_above_peer_s"] is None
    assert alone["kairos_added_ttft_floor"].startswith("none")
