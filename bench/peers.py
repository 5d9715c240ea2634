"""The routers users would pick instead, measured like Kairos's: `kairos bench-router --peers ...`.

Each peer (sglang-router, vllm-router: Rust routers with a Python launcher) runs pinned to the
router's CPUs in front of mock OpenAI backends (bench/reference_app.py, on the other CPUs), and
the same load generator processes drive it with the same request-rate and token-rate steps as Kairos's router in the
same run. Measured per peer: its process's CPU per request and per streamed token (all threads,
CPU-time clock, its idle use subtracted), the carried rate, and TTFT p50 at the latency phase's rate;
the same TTFT straight to one backend is the floor both are compared against (a peer's TTFT less
it; Kairos's less it and less the engine's modeled time: `kairos_added_ttft_over_floor_p50_s`.
Until 2026-12-06 Kairos's figure kept the floor, so it was compared with the peers' with the
client's own HTTP turn counted on Kairos's side only).

How the backends write a stream (`--peer-backend`, both by default, each reported on its own):
- burst: two backends, each answering a completion with every SSE event at once (one socket
  write per event in one turn of its loop), so a peer reads many events per read (sglang-router
  at 50 req/s x 100 tokens, 2026-12-06, syscalls counted by perf: 0.07 reads and 1.0 writes per
  token; 0.79 and 1.2 with paced backends). Kairos's router gets its tokens one engine step at a
  time instead, so this mode alone is not like for like.
- paced: as many backends as Kairos has decode workers (--decode), each writing as an engine
  does: one event per stream in flight every step, the step being the profile's decode step
  (0.5 ms for `fast`, times --time-scale) on the simulated engine's absolute-deadline cadence
  (asyncio's sleep: about 0.63 ms a step on average). At 50 req/s that is about one token per
  read for a peer, as Kairos's router gets about one token per bus message.

What differs, and is said with every figure: a peer parses the body's JSON, picks a backend and
relays its bytes; Kairos's router validates the request field by field, decides the route with
the policy, talks to its workers over the bus and renders every SSE chunk itself. Prompts: Kairos
gets token ids (the bench's usual bodies: no tokenizing), the peers the same number of words as
text (sglang-router takes no token ids), which they do not tokenize in this mode either.

Nothing is installed at run time. Install the peers into any environment and put their
commands on PATH (or in this Python's bin directory), e.g.:

    python -m venv /opt/peers && /opt/peers/bin/pip install sglang-router==0.3.2 vllm-router==0.1.17
    PATH=$PATH:/opt/peers/bin kairos bench-router --peers sglang-router,vllm-router

A peer that is not found is skipped with a line saying so. The peers load a tokenizer for the
backends' model at start; the backends name a local directory holding a stub tokenizer written
here, so nothing is fetched from any network.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.steps import Bench, Clients, fmt, request_steps, sustained, token_steps, wait_port
from common.errors import ConfigError
from common.ports import free_ports

INSTALL = ("python -m venv /opt/peers && /opt/peers/bin/pip install sglang-router==0.3.2 vllm-router==0.1.17; "
           "then put /opt/peers/bin on PATH")
MODEL = "reference"  # what the load generator names in its bodies (sglang-router requires a model)


def _sglang(exe: str, port: int, prom: int, backends: list[str], policy: str) -> list[str]:
    return [exe, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *backends,
            "--policy", policy, "--log-level", "warn", "--prometheus-port", str(prom)]


def _vllm(exe: str, port: int, prom: int, backends: list[str], policy: str) -> list[str]:
    return [exe, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *backends,
            "--policy", policy, "--log-level", "warning", "--prometheus-port", str(prom)]


PEERS: dict[str, Callable[[str, int, int, list[str], str], list[str]]] = {
    "sglang-router": _sglang, "vllm-router": _vllm}


def find(name: str) -> str | None:
    """The peer's command: on PATH, or beside this Python (a venv's bin directory)."""
    here = Path(sys.executable).parent / name
    return shutil.which(name) or (str(here) if here.exists() else None)


def write_stub_tokenizer(d: Path) -> None:
    """A word-level tokenizer in Hugging Face's tokenizer.json format: the peers load one for the
    backends' model at start, and would look one up online for a name that is not a directory."""
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate("x hi hello world the a of to and in".split())}}
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}}))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": None}))
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))


def _pinned(cmd: list[str], cpus: Sequence[int]) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cpus)), *cmd] if cpus else cmd


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


MODES = ("burst", "paced")


def backend_mode(mode: str, args: argparse.Namespace) -> tuple[int, float]:
    """(backends, step seconds) for a --peer-backend mode: burst, two backends writing every event
    at once (step 0); paced, one backend per Kairos decode worker, one event per stream per step of
    the profile's decode step."""
    if mode == "burst":
        return 2, 0.0
    from common.perf_model import load_profile

    model = load_profile(getattr(args, "profile", "fast")).model
    return max(1, int(getattr(args, "decode", 4))), model.step_time(1, 0) * float(getattr(args, "time_scale", 1.0))


def measure(console: Console, args: argparse.Namespace, target: str | None, *, rates: Sequence[float],
            token_rates: Sequence[float], n_clients: int, router_cpus: Sequence[int], other_cpus: Sequence[int],
            log_dir: Path, mode: str = "burst") -> dict[str, Any]:
    """One peer (`target`: its name), or with None the backend alone (the TTFT floor): the
    latency step, the request-rate and token-rate steps; the measured process's CPU. `mode`: how
    the backends write a stream (MODES)."""
    n_backends, step_s = backend_mode(mode, args)
    ports = free_ports(n_backends + 2)
    model_dir = log_dir / "stub-model"
    write_stub_tokenizer(model_dir)
    pace = ["--step-s", repr(step_s)] if step_s > 0 else []
    backends = [_pinned([sys.executable, "-m", "bench.reference_app", "--port", str(p), "--model-path",
                         str(model_dir), *pace], other_cpus) for p in ports[:n_backends]]
    procs: list[subprocess.Popen[bytes]] = []
    clients: Clients | None = None
    try:
        for cmd in backends:
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for p, port in zip(procs, ports[:n_backends], strict=True):
            wait_port(port, p)
        if target is None:
            port, pid = ports[0], procs[0].pid
        else:
            exe = find(target)
            assert exe is not None
            cmd = PEERS[target](exe, ports[-2], ports[-1], [f"http://127.0.0.1:{p}" for p in ports[:n_backends]],
                                args.peer_policy)
            with open(log_dir / f"{target}-{mode}.log", "wb") as logf:
                peer = subprocess.Popen(_pinned(cmd, router_cpus), stdout=logf, stderr=subprocess.STDOUT,
                                        env={**os.environ, "HF_HUB_OFFLINE": "1"})
            procs.append(peer)
            wait_port(ports[-2], peer, timeout=60)
            port, pid = ports[-2], peer.pid
        label = f"{target or 'backend'} ({mode})"
        clients = Clients(n_clients, "127.0.0.1", port, args.connections, other_cpus, model=MODEL)
        bench = Bench(None, clients, console, pid=pid)
        for _ in range(20):  # a peer routes once it has seen its backends healthy
            s = bench.step(20, 0.5, max_tokens=2, prompt_tokens=args.prompt_tokens)
            if s["completed"] and not s["errors"]:
                break
        idle = bench.measure_idle(2.0)
        lat = bench.step(args.moderate_rate, max(args.step, 5.0), max_tokens=16, prompt_tokens=128)
        lat.pop("_rows")
        console.print(f"  {label}: TTFT p50 {fmt(lat['ttft_p50'], 1e3, 2)} ms at {args.moderate_rate:g} req/s")
        out: dict[str, Any] = {"backend_mode": mode, "backends": n_backends, "backend_step_s": step_s,
                               "idle_cpu": idle, "latency": lat}
        if target is not None:
            out["requests"] = {"steps": request_steps(bench, console, args, rates, label, "CPU",
                                                      stop_past_saturation=False)}
            out["requests"]["sustained"] = sustained(out["requests"]["steps"])
            out["tokens"] = {"steps": token_steps(bench, console, args, token_rates, f"{label} tokens", "CPU",
                                                  stop_past_saturation=False)}
            out["tokens"]["sustained"] = sustained(out["tokens"]["steps"])
        return out
    finally:
        if clients is not None:
            clients.close()
        _stop(procs)


def _at(steps: list[dict[str, Any]], rate: float, key: str) -> float | None:
    s = next((x for x in steps if x["offered_rate"] == rate), None)
    v = s.get(key) if s else None
    return float(v) if v else None


def _ratios(kairos: dict[str, Any], peer: dict[str, Any], phase: str, per: str,
            rates: Sequence[float]) -> list[dict[str, Any]]:
    """Kairos's CPU per request (or token) over the peer's, at each offered rate both ran."""
    out = []
    for r in rates:
        a = _at(kairos[phase]["steps"], r, f"router_us_per_{per}")
        b = _at(peer[phase]["steps"], r, f"router_us_per_{per}")
        out.append({"offered_rate": r, f"kairos_us_per_{per}": a, f"peer_us_per_{per}": b,
                    "ratio": a / b if a and b else None})
    return out


def peers_phase(console: Console, args: argparse.Namespace, names: Sequence[str], kairos: dict[str, Any], *,
                n_clients: int, router_cpus: Sequence[int], other_cpus: Sequence[int],
                mode: str = "burst") -> dict[str, Any]:
    """Every peer in `names` (skipped where not installed), measured at Kairos's offered rates in
    front of backends in `mode` (MODES), and Kairos's ratio to each: CPU per request and per token
    at each rate both ran, TTFT p50 over the backend floor at the latency rate."""
    rates = [s["offered_rate"] for s in kairos.get("requests", {}).get("steps", [])]
    token_rates = [s["offered_rate"] for s in kairos.get("tokens", {}).get("steps", [])]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kairos-bench-peers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"policy": args.peer_policy, "backend_mode": mode, "peers": {}}
    n_backends, step_s = backend_mode(mode, args)
    console.print(f"backends {mode}: {n_backends}, {writes(step_s)}")
    console.print("backend alone (the floor a router adds to):")
    floor = measure(console, args, None, rates=rates, token_rates=token_rates, n_clients=n_clients,
                    router_cpus=router_cpus, other_cpus=other_cpus, log_dir=log_dir, mode=mode)
    out["backend"] = floor
    floor_ttft = floor["latency"]["ttft_p50"]
    # Kairos's: client TTFT over the engines' modeled time, per request (the latency phase's added_p50)
    k_added = out["kairos_added_ttft_p50_s"] = (kairos.get("latency") or {}).get("added_p50")
    # ... and over what the peers' figure is over: a peer's added TTFT is its TTFT less the backend's
    # own (the client, an HTTP server answering at once, the loopback), which Kairos's added_p50
    # still holds. What a client pays for Kairos instead of reaching the engine's own HTTP server is
    # its TTFT less the engine's time and less that same floor: like for like with the peers' figure.
    # Only an HTTP floor counts so: a paced backend's TTFT holds its own first step, which the
    # engines' modeled time has already taken off Kairos's figure (the step would be subtracted
    # twice); `peers_phases` gives such a mode the burst run's floor, or nothing (`settle_added_ttft`).
    out["kairos_added_ttft_over_floor_p50_s"] = (k_added - floor_ttft if k_added is not None
                                                 and floor_ttft is not None and step_s == 0 else None)
    for name in names:
        if name not in PEERS:
            console.print(f"[yellow]peer {name}: unknown (known: {', '.join(PEERS)}); skipped[/]")
            out["peers"][name] = {"skipped": "unknown peer"}
            continue
        if find(name) is None:
            console.print(f"[yellow]peer {name}: not installed, skipped. To include it: {INSTALL}[/]")
            out["peers"][name] = {"skipped": "not installed"}
            continue
        console.print(f"peer {name} (policy {args.peer_policy}) on CPUs {list(router_cpus) or 'any'}:")
        try:
            m = measure(console, args, name, rates=rates, token_rates=token_rates, n_clients=n_clients,
                        router_cpus=router_cpus, other_cpus=other_cpus, log_dir=log_dir, mode=mode)
        except (RuntimeError, TimeoutError) as e:
            console.print(f"[red]peer {name}: {e} (its log: {log_dir / f'{name}-{mode}.log'})[/]")
            out["peers"][name] = {"skipped": f"failed: {e}"}
            continue
        p_ttft = m["latency"]["ttft_p50"]
        m["added_ttft_p50_s"] = p_ttft - floor_ttft if p_ttft is not None and floor_ttft is not None else None
        k_over = out["kairos_added_ttft_over_floor_p50_s"]
        m["kairos_added_ttft_above_peer_s"] = (k_over - m["added_ttft_p50_s"] if k_over is not None
                                               and m["added_ttft_p50_s"] is not None else None)
        m["kairos_over_peer_per_request"] = _ratios(kairos, m, "requests", "request", rates)
        m["kairos_over_peer_per_token"] = _ratios(kairos, m, "tokens", "token", token_rates)
        m["kairos_over_peer_per_output_token"] = _ratios(kairos, m, "tokens", "output_token", token_rates)
        out["peers"][name] = m
    return out


def peers_phases(console: Console, args: argparse.Namespace, names: Sequence[str], kairos: dict[str, Any], *,
                 n_clients: int, router_cpus: Sequence[int], other_cpus: Sequence[int]) -> dict[str, Any]:
    """`peers_phase` in each --peer-backend mode: the first mode's result, with every other mode's
    whole result under `other_modes[mode]`."""
    modes = parse_modes(getattr(args, "peer_backend", "burst"))
    runs = [peers_phase(console, args, names, kairos, n_clients=n_clients, router_cpus=router_cpus,
                        other_cpus=other_cpus, mode=mode) for mode in modes]
    settle_added_ttft(runs)
    out = runs[0]
    out["other_modes"] = {r["backend_mode"]: r for r in runs[1:]}
    return out


def settle_added_ttft(runs: Sequence[dict[str, Any]]) -> None:
    """Kairos's added TTFT against each peer's, like for like in every mode. Kairos's figure is its
    client TTFT less the engines' modeled time (their first step included) and less an HTTP floor:
    a backend answering at once (burst mode's floor). A paced backend's floor holds its own first
    step (and its timer's lateness), so subtracting it as well took the step off twice (2026-12-06:
    0.20 ms "above vllm-router" against paced backends where the burst floor gave 1.16 ms). A
    paced run therefore takes the burst run's floor for Kairos's figure, or has none when no burst
    run was made; a peer's own added TTFT stays its TTFT less its own backends' floor."""
    burst = next((r for r in runs if r.get("backend_mode") == "burst"), None)
    over = burst.get("kairos_added_ttft_over_floor_p50_s") if burst is not None else None
    for r in runs:
        if r.get("backend_mode") == "burst":
            continue
        r["kairos_added_ttft_over_floor_p50_s"] = over
        r["kairos_added_ttft_floor"] = "burst" if over is not None else (
            "none: a paced backend's floor holds its own step; run --peer-backend burst too")
        for m in r.get("peers", {}).values():
            if "skipped" in m:
                continue
            added = m.get("added_ttft_p50_s")
            m["kairos_added_ttft_above_peer_s"] = over - added if over is not None and added is not None else None


def writes(step_s: float) -> str:
    """How a backend with step `step_s` (0: burst) writes a stream, for the report."""
    return f"one event per stream every {step_s * 1e3:g} ms" if step_s else "every event at once"


def parse_modes(text: str) -> list[str]:
    """--peer-backend: a comma-separated list of MODES, in the order to run them."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ConfigError(f"--peer-backend: expected a comma-separated list of {', '.join(MODES)}, got {text!r}")
    return list(dict.fromkeys(modes))


def print_summary(console: Console, peers: dict[str, Any]) -> None:
    console.print(f"Kairos's added TTFT p50 (client TTFT over the engines' modeled time): "
                  f"{fmt(peers.get('kairos_added_ttft_p50_s'), 1e3, 2)} ms; less the backend's own TTFT, as the "
                  f"peers' is: {fmt(peers.get('kairos_added_ttft_over_floor_p50_s'), 1e3, 2)} ms"
                  + (f" (floor: {peers['kairos_added_ttft_floor']})" if "kairos_added_ttft_floor" in peers else ""))
    for name, m in peers["peers"].items():
        if "skipped" in m:
            console.print(f"peer {name}: skipped ({m['skipped']})")
            continue
        req = ", ".join(f"{x['offered_rate']:g}/s {fmt(x['ratio'], digits=2)}x"
                        for x in m["kairos_over_peer_per_request"])
        tok = ", ".join(f"{x['offered_rate']:g}/s {fmt(x['ratio'], digits=2)}x"
                        for x in m["kairos_over_peer_per_token"])
        out_tok = ", ".join(f"{x['offered_rate']:g}/s {fmt(x['ratio'], digits=2)}x"
                            for x in m["kairos_over_peer_per_output_token"])
        console.print(f"peer {name}: added TTFT p50 {fmt(m.get('added_ttft_p50_s'), 1e3, 2)} ms (over the backend "
                      f"alone; Kairos's, the same way, {fmt(m.get('kairos_added_ttft_above_peer_s'), 1e3, 2)} ms "
                      f"above it); Kairos's CPU per request over its: {req}; per SSE event: {tok}; "
                      f"per output token: {out_tok}")


def print_modes_summary(console: Console, peers: dict[str, Any]) -> None:
    """`print_summary` for every mode `peers_phases` ran, each under a line naming its backends."""
    for mode, got in [(peers.get("backend_mode", "burst"), peers), *peers.get("other_modes", {}).items()]:
        n_backends = got["backend"].get("backends", 2)
        step_s = got["backend"].get("backend_step_s", 0.0)
        console.print(f"with the peers' backends {mode} ({n_backends} backends, {writes(step_s)}):")
        print_summary(console, got)
