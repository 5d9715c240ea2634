"""`kairos bench-router`: how much one router process carries, and what it adds to TTFT.

    kairos bench-router --out router.json

Starts a local cluster on the simulated engine with the `fast` profile (0.5 ms steps: the
engines are never what is measured), pins the router to its own CPU(s) (--router-cpus) and
everything else (workers, load generator processes) to the others, then:

1. latency: a moderate open-loop load (--moderate-rate, 128-token prompts, 16 output tokens).
   For every request it compares three clocks: the client's TTFT (send to first SSE token),
   the router's own TTFT for the same request id (arrival to first token relayed, from the
   router's telemetry stream), and the engine's modeled time on the path taken (the profile's
   step times: one mixed step when deflected; prefill step + KV transfer + decode step when
   disaggregated). client - router = HTTP and SSE in the router process plus the client;
   router - modeled = bus, worker and event-loop overhead.
2. requests: open-loop Poisson request rates (--rates), 1 output token each, so every request
   is a full router round trip with the least streaming.
3. tokens: rates of requests with --stream-tokens output tokens each (--token-rates), which
   measures the streamed-token path (TokenBatch in, SSE events out: every token ready for a stream
   goes out in one event, so `router_us_per_token` is per event and `router_us_per_output_token`
   per token; a peer relaying the reference app writes one event per token).
At every step: offered and completed rate, client TTFT p50/p99, and the CPU seconds each
process used during the step (its CPU-time clock, all threads), so a step where the router's CPU is
pegged is told apart from one where the load generator or the workers ran out of CPU. The sustained
maximum is the highest step that completed >= 97% of its offered requests without errors
and kept the TTFT p50 within 2x (+2 ms) of the lowest step's. `router_us_per_request` and
`router_us_per_token` (router CPU time beyond its idle use / work done) give the capacity of one
dedicated router core independently of what the rest of the machine could feed it.
With --py-spy RATE, it also samples the router with py-spy during a request-rate step at RATE
and reports where the router's time goes (self and inclusive, by function).
With --account RATE, it accounts for the router's CPU during a request step at RATE from outside
the process (bench/router_account.py): user and system time and switches per thread, the workers'
threads too, perf record by shared object, syscalls per thread, bus messages by type.
4. reference (with the requests phase): the same request-rate steps against a minimal ASGI app
   (bench/reference_app.py: uvicorn with the router's settings, a fixed SSE answer) pinned to
   the router's CPUs, driven by the same load generator processes. `router_cost_ratio` =
   router CPU per request / the reference's at the same offered rate: absolute microseconds
   move between machines and days (a rerun on 2026-12-01 found about 930 us against 400-520 us
   earlier), the ratio to a reference measured in the same run compares.
5. heartbeats (only when asked: `--phases heartbeats --workers 128+128`): no cluster; one router
   pinned like the others, and --workers P+D fake workers registered from this process over real
   bus connections (bench/heartbeat_load.py), each heartbeating every --heartbeat-interval with a
   new load, so every heartbeat changes a view; no requests. Reports the router's cores, the
   heartbeats per second it took and its CPU per heartbeat.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from bench.heartbeat_load import parse_workers
from bench.heartbeat_load import run as heartbeat_run
from bench.steps import Bench, Clients, parse_cpus, request_steps, summarize_stacks, sustained, token_steps, wait_port
from bench.steps import fmt as _fmt
from common.errors import ConfigError
from common.perf_model import PerfModel, load_profile
from kairos.up import Cluster, ClusterSpec

# ---------------------------------------------------------------------------------- latency breakdown


def modeled_ttft(model: PerfModel, route: str, prompt: int) -> float:
    """The engine's own time to the first token on an idle cluster, by path."""
    if route == "deflect":
        return model.step_time(0, 0, [(prompt, 0)])
    return model.step_time(0, 0, [(prompt, 0)]) + model.xfer_time(prompt) + model.step_time(1, prompt)


class Telemetry:
    """Subscribes to the router's telemetry PUB and keeps each request's router-side TTFT."""

    def __init__(self, port: int) -> None:
        import zmq

        from common import codec
        from common import messages as m
        from common.sockets import TELEMETRY_TOPIC

        self._zmq, self._codec, self._m = zmq, codec, m
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 1_000_000)
        self.sock.setsockopt(zmq.SUBSCRIBE, TELEMETRY_TOPIC)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.ttft: dict[str, float] = {}
        self.decision_us: dict[str, float] = {}
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._loop, daemon=True)
        self._th.start()

    def _loop(self) -> None:
        zmq, m = self._zmq, self._m
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self.sock.recv_multipart()
            try:
                msg = self._codec.telemetry_inbox.decode(frames[-1])
            except self._codec.DecodeError:
                continue
            if isinstance(msg, m.RequestRecord) and msg.ttft_s is not None:
                self.ttft[msg.client_request_id or msg.request_id] = msg.ttft_s
            elif isinstance(msg, m.DecisionRecord):
                self.decision_us[msg.client_request_id or msg.request_id] = msg.decision_us

    def close(self) -> None:
        self._stop.set()
        self._th.join(2)
        self.sock.close()
        self.ctx.term()


def latency_breakdown(step: dict[str, Any], tele: Telemetry, model: PerfModel, prompt: int) -> dict[str, Any]:
    client, router, modeled, decision = [], [], [], []
    routes: Counter[str] = Counter()
    for ttft, _e2e, _tok, _gap, err, route, rid in step["_rows"]:
        if err is not None or ttft is None or rid not in tele.ttft:
            continue
        routes[route] += 1
        client.append(ttft)
        router.append(tele.ttft[rid])
        modeled.append(modeled_ttft(model, route, prompt))
        if rid in tele.decision_us:
            decision.append(tele.decision_us[rid] / 1e6)
    c, r, mo = (np.asarray(x) for x in (client, router, modeled))
    out: dict[str, Any] = {"matched": len(client), "routes": dict(routes)}
    if len(client):
        for q in (50, 99):
            out[f"client_ttft_p{q}"] = float(np.percentile(c, q))
            out[f"router_ttft_p{q}"] = float(np.percentile(r, q))
            out[f"modeled_ttft_p{q}"] = float(np.percentile(mo, q))
            out[f"added_p{q}"] = float(np.percentile(c - mo, q))
            out[f"http_sse_p{q}"] = float(np.percentile(c - r, q))
            out[f"bus_worker_p{q}"] = float(np.percentile(r - mo, q))
        if decision:
            out["decision_p50"] = float(np.percentile(decision, 50))
            out["decision_p99"] = float(np.percentile(decision, 99))
    return out


# ---------------------------------------------------------------------------------- py-spy


def py_spy(pid: int, seconds: float, out_dir: Path, cpus: Sequence[int], *, native: bool = False,
           hz: int = 200) -> dict[str, Any] | None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        return {"error": "py-spy not installed (pip install py-spy)"}
    raw = out_dir / "router-pyspy.txt"
    cmd = [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(hz),
           "--format", "raw", "--gil", "--output", str(raw), *(["--native"] if native else ["--nonblocking"])]
    if cpus:
        cmd = ["taskset", "-c", ",".join(map(str, cpus)), *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 30)
    if proc.returncode != 0 or not raw.exists():
        return {"error": f"py-spy failed ({proc.returncode}): {proc.stderr.strip()[-400:]}"}
    return summarize_stacks(raw.read_text(), raw_path=str(raw))


_READS = ("read", "readv", "recvfrom", "recvmsg", "recvmmsg")
_WRITES = ("write", "writev", "sendto", "sendmsg", "sendmmsg")
_WAITS = ("epoll_wait", "epoll_pwait", "poll", "ppoll")


def parse_perf_counts(text: str) -> dict[str, int]:
    """Calls by syscall from `perf stat -x,` output over syscalls:sys_enter_* tracepoints."""
    calls: dict[str, int] = {}
    for line in text.splitlines():
        f = line.split(",")
        if len(f) >= 3 and f[0].strip().isdigit() and f[2].startswith("syscalls:sys_enter_"):
            calls[f[2].removeprefix("syscalls:sys_enter_")] = int(f[0])
    return calls


def syscall_counts(pid: int, seconds: float, out_dir: Path) -> dict[str, Any]:
    """The syscalls of `pid` (every thread) for `seconds`, counted in the kernel by `perf stat` on
    the syscall tracepoints (no ptrace: the router runs at its own speed): calls by syscall, and
    its reads, writes and waits."""
    exe = shutil.which("perf")
    if exe is None:
        return {"error": "perf not installed (linux-tools)"}
    events = ",".join(f"syscalls:sys_enter_{n}" for n in (*_READS, *_WRITES, *_WAITS))
    out = out_dir / "router-syscalls.txt"
    proc = subprocess.run([exe, "stat", "-x", ",", "-e", events, "-p", str(pid), "-o", str(out), "--", "sleep",
                           f"{seconds:g}"], capture_output=True, text=True, timeout=seconds + 30)
    calls = parse_perf_counts(out.read_text()) if out.exists() else {}
    if proc.returncode != 0 or not calls:
        return {"error": f"perf stat failed ({proc.returncode}): {proc.stderr.strip()[-400:]}"}
    return {"calls": calls, "reads": sum(calls.get(k, 0) for k in _READS),
            "writes": sum(calls.get(k, 0) for k in _WRITES), "waits": sum(calls.get(k, 0) for k in _WAITS),
            "raw": str(out)}


# ---------------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kairos bench-router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", type=int, default=2, help="prefill workers (default 2)")
    p.add_argument("--decode", type=int, default=4, help="decode workers (default 4)")
    p.add_argument("--policy", default="kairos", help="routing policy (default kairos)")
    p.add_argument("--profile", default="fast", help="engine profile (default fast)")
    p.add_argument("--time-scale", type=float, default=1.0, help="scale every modeled step time (default 1)")
    p.add_argument("--kv-transport", choices=("modeled", "nixl"), default="modeled",
                   help="KV from prefill to decode workers: modeled (no bytes; default) or nixl (real transfers, "
                        "and one more message through the router per disaggregated request)")
    p.add_argument("--clients", type=int, default=0,
                   help="load generator processes (default: one per CPU not given to the router, at most 8)")
    p.add_argument("--connections", type=int, default=256, help="keep-alive connections per client (default 256)")
    p.add_argument("--routers", type=int, default=1,
                   help="router replicas on the one HTTP port (SO_REUSEPORT), all on --router-cpus; router CPU "
                        "figures are their sum (default 1)")
    p.add_argument("--router-cpus", default="0", help="CPUs for the router, taskset list (default 0; '' = no pinning)")
    p.add_argument("--other-cpus", default="",
                   help="CPUs for workers and clients (default: every CPU not given to the router)")
    p.add_argument("--step", type=float, default=5.0, help="seconds per load step (default 5)")
    p.add_argument("--moderate-rate", type=float, default=50.0, help="latency phase: requests/s (default 50)")
    p.add_argument("--rates", default="100,250,500,1000,1500,2000,3000",
                   help="request-rate steps, requests/s (1 output token each)")
    p.add_argument("--token-rates", default="20,50,100,200,400,600",
                   help="token-rate steps, requests/s of --stream-tokens tokens each")
    p.add_argument("--stream-tokens", type=int, default=100, help="output tokens per request in the token phase")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt length in the rate phases (default 16)")
    p.add_argument("--phases", default="latency,requests,tokens",
                   help="which phases to run: latency, requests, tokens (a local cluster) and heartbeats (a router "
                        "alone, with --workers P+D fake workers registered over real bus connections, each "
                        "heartbeating every --heartbeat-interval with a new load, no requests: the router's CPU)")
    p.add_argument("--workers", default="128+128", metavar="P+D",
                   help="heartbeats phase: prefill + decode workers (default 128+128)")
    p.add_argument("--heartbeat-interval", type=float, default=0.1, metavar="S",
                   help="heartbeats phase: seconds between one worker's heartbeats (default 0.1)")
    p.add_argument("--py-spy", type=float, default=None, metavar="RATE",
                   help="also sample the router with py-spy during a request step at RATE req/s")
    p.add_argument("--account", type=float, default=None, metavar="RATE",
                   help="also account for the router's CPU during a request step at RATE req/s: per thread user and "
                        "system time, syscalls per thread (perf stat), bus messages by type (strace), perf record "
                        "by shared object (bench/router_account.py; needs perf and strace, and root or "
                        "perf_event_paranoid <= 1)")
    p.add_argument("--py-spy-tokens", type=float, default=None, metavar="RATE",
                   help="also sample the router with py-spy during a token step at RATE req/s")
    p.add_argument("--syscalls-tokens", type=float, default=None, metavar="RATE",
                   help="also count the router's syscalls during a token step at RATE req/s (perf stat on the "
                        "syscall tracepoints, all threads): reads, writes and waits per output token")
    p.add_argument("--liveness", type=int, default=50,
                   help="router liveness (x 0.1 s heartbeats) before a silent worker is dropped; generous by default "
                        "so a CPU-starved worker on a shared machine is not declared dead mid-run (default 50)")
    p.add_argument("--native", action="store_true", help="py-spy: include native frames (libzmq, uvloop)")
    p.add_argument("--py-spy-hz", type=int, default=200, metavar="HZ",
                   help="py-spy: samples per second (default 200; 1000 sees more of a short request's frames, "
                        "at more of the sampler's own CPU on the machine)")
    p.add_argument("--router-env", action="append", default=[], metavar="KEY=VALUE",
                   help="one more environment variable for the router(s), e.g. KAIROS_LOG_REQUESTS=1 (repeatable)")
    p.add_argument("--log-level", default="info",
                   help="services' log level (default info, as deployed: one JSON line per request)")
    p.add_argument("--peers", default="", metavar="NAMES",
                   help="also measure these routers in the same run, e.g. sglang-router,vllm-router (installed by "
                        "you, on PATH: bench/peers.py says how; a missing one is skipped with a line)")
    p.add_argument("--peer-policy", default="round_robin",
                   help="the peers' routing policy (default round_robin, their cheapest)")
    p.add_argument("--peer-backend", default="burst,paced", metavar="MODES",
                   help="how the peers' mock backends write a stream, each mode measured and reported on its own: "
                        "burst (every event at once, as before) and paced (one event per stream per engine step, the "
                        "profile's decode step, one backend per --decode worker, as Kairos's simulated engine "
                        "writes); default burst,paced")
    p.add_argument("--log-dir", default="", help="cluster logs (default: a temporary folder)")
    p.add_argument("--out", default=None, help="write results JSON here")
    return p


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"expected comma-separated numbers, got {text!r}") from None


def step_table(title: str, steps: list[dict[str, Any]]) -> Table:
    tab = Table(title=title, title_justify="left")
    for col in ("offered/s", "done/s", "tokens/s", "TTFT p50 ms", "p99 ms", "errors", "router CPU",
                "workers CPU", "clients CPU", "machine CPU", "router us/req", "us/event", "us/out token"):
        tab.add_column(col, justify="right")
    for s in steps:
        tab.add_row(_fmt(s["offered_rate"], digits=0), _fmt(s["completed_rate"], digits=0),
                    _fmt(s["tokens_per_s"], digits=0), _fmt(s["ttft_p50"], 1e3, 2), _fmt(s["ttft_p99"], 1e3, 1),
                    ", ".join(f"{k} {v}" for k, v in s["errors"].items()) or "0",
                    _fmt(s["router_cpu"], 1, 2), _fmt(s["workers_cpu"], 1, 2), _fmt(s["clients_cpu"], 1, 2),
                    _fmt(s["machine_cpu"], 1, 2), _fmt(s["router_us_per_request"], digits=0),
                    _fmt(s["router_us_per_token"], digits=1), _fmt(s.get("router_us_per_output_token"), digits=1))
    return tab


def heartbeat_phase(console: Console, args: argparse.Namespace, workers: tuple[int, int],
                    router_cpus: list[int]) -> dict[str, Any]:
    """A router alone with `workers` (prefill, decode) heartbeating and no requests: its CPU."""
    n_p, n_d = workers
    console.print(f"heartbeats: one router on CPUs {router_cpus or 'any'}, {n_p}+{n_d} workers every "
                  f"{args.heartbeat_interval:g} s, {max(args.step, 5.0):g} s window")
    got = heartbeat_run(n_p, max(args.step, 5.0), {"KAIROS_POLICY": args.policy, "KAIROS_PROFILE": args.profile},
                        args.heartbeat_interval, decode=n_d, cpus=",".join(map(str, router_cpus)))
    console.print(f"heartbeats: {got['heartbeats_per_s']:.0f}/s, router {got['router_cores']:.3f} cores, "
                  f"{got['router_us_per_heartbeat']:.1f} µs per heartbeat")
    return got


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console = Console(width=150)
    try:
        profile = load_profile(args.profile)
        rates, token_rates = _floats(args.rates), _floats(args.token_rates)
        phases = {p.strip() for p in args.phases.split(",") if p.strip()}
        if not phases <= {"latency", "requests", "tokens", "heartbeats"}:
            raise ConfigError(f"unknown phase in {args.phases!r}")
        hb_workers = parse_workers(args.workers)
        if args.peers:
            from bench.peers import parse_modes

            parse_modes(args.peer_backend)
        all_cpus = sorted(os.sched_getaffinity(0))
        router_cpus = sorted(parse_cpus(args.router_cpus)) if args.router_cpus else []
        other_cpus = sorted(parse_cpus(args.other_cpus)) if args.other_cpus else \
            [c for c in all_cpus if c not in router_cpus] or all_cpus
    except (ConfigError, ValueError) as e:
        console.print(f"[red]kairos bench-router: {e}[/]")
        return 2
    if "heartbeats" in phases:
        results_hb = heartbeat_phase(console, args, hb_workers, router_cpus)
        if phases == {"heartbeats"}:
            if args.out:
                Path(args.out).write_text(json.dumps({"heartbeats": results_hb}, indent=2) + "\n")
                console.print(f"results: {args.out}")
            return 0
    n_clients = args.clients or max(1, min(8, len(other_cpus)))
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kairos-bench-router-")
    spec = ClusterSpec.ephemeral(prefill=args.prefill, decode=args.decode, policy=args.policy, profile=args.profile,
                                 time_scale=args.time_scale, kv_transport=args.kv_transport, monitor=False,
                                 log_dir=log_dir, log_level=args.log_level,
                                 router_env={"KAIROS_LIVENESS": str(args.liveness),
                                             **dict(kv.split("=", 1) for kv in args.router_env)},
                                 routers=max(1, args.routers))
    cluster = Cluster(spec)
    for name, svc in cluster.services.items():
        cpus = router_cpus if name in spec.router_names else other_cpus
        if cpus:
            svc.command = ["taskset", "-c", ",".join(map(str, cpus)), *svc.command]
    console.print(f"cluster: {spec.routers} router(s) on CPUs {router_cpus or 'any'}, {args.prefill}P{args.decode}D "
                  "workers and "
                  f"{n_clients} client processes on CPUs {other_cpus}; profile {profile.name} x{args.time_scale:g},"
                  f" policy {args.policy}, KV {args.kv_transport}; logs {log_dir}")
    results: dict[str, Any] = {"config": {
        "prefill": args.prefill, "decode": args.decode, "routers": spec.routers, "policy": args.policy,
        "profile": profile.name,
        "time_scale": args.time_scale, "kv_transport": args.kv_transport, "clients": n_clients,
        "log_level": args.log_level,
        "connections": args.connections,
        "router_cpus": router_cpus, "other_cpus": other_cpus, "step_s": args.step,
        "prompt_tokens": args.prompt_tokens, "stream_tokens": args.stream_tokens,
        "date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {len(all_cpus)} CPUs"}}
    if "heartbeats" in phases:
        results["heartbeats"] = results_hb
    clients: Clients | None = None
    tele: Telemetry | None = None
    try:
        cluster.start()
        clients = Clients(n_clients, "127.0.0.1", spec.http_port, args.connections, other_cpus)
        bench = Bench(cluster, clients, console)
        bench.step(50, 1.5, max_tokens=4, prompt_tokens=args.prompt_tokens)  # warm up connections and workers
        idle = bench.measure_idle(3.0)
        results["router_idle_cpu"] = idle
        console.print(f"router CPU with no load: {idle:.3f} cores (subtracted from the per-request costs)")
        if "latency" in phases:
            tele = Telemetry(spec.telemetry_port)
            time.sleep(0.3)  # the subscription must reach the router before the records do
            s = bench.step(args.moderate_rate, max(args.step, 5.0), max_tokens=16, prompt_tokens=128, tag="lat")
            time.sleep(0.5)
            lat = latency_breakdown(s, tele, profile.model.scaled(args.time_scale)
                                    if args.time_scale != 1.0 else profile.model, 128)
            s.pop("_rows")
            results["latency"] = {"step": s, **lat}
            _print_latency(console, args, lat)
        if "requests" in phases:
            steps = request_steps(bench, console, args, rates, "requests", "router CPU", stop_past_saturation=True)
            best = sustained(steps)
            results["requests"] = {"steps": steps, "sustained": best}
            console.print(step_table("request rate (1 output token per request)", steps))
            ref_rates = [s["offered_rate"] for s in steps]
        if "tokens" in phases:
            steps = token_steps(bench, console, args, token_rates, "tokens", "router CPU",
                                stop_past_saturation=True)
            best = sustained(steps)
            results["tokens"] = {"steps": steps, "sustained": best}
            console.print(step_table(f"streamed tokens ({args.stream_tokens} per request)", steps))
        for key, rate, tokens in (("py_spy_requests", args.py_spy, 1), ("py_spy_tokens", args.py_spy_tokens,
                                                                       args.stream_tokens)):
            if rate is None:
                continue
            prof: dict[str, Any] = {}
            out_dir = Path(args.out).parent if args.out else Path(log_dir)
            out_dir = out_dir / key
            out_dir.mkdir(parents=True, exist_ok=True)

            def during(d: float, _prof: dict[str, Any] = prof, _dir: Path = out_dir) -> None:
                _prof.update(py_spy(bench.router_pid, d, _dir, other_cpus, native=args.native,
                                      hz=args.py_spy_hz) or {})

            s = bench.step(rate, args.step, max_tokens=tokens, prompt_tokens=args.prompt_tokens, during=during)
            s.pop("_rows")
            results[key] = {"step": s, "profile": prof}
            _print_profile(console, key, rate, s, prof)
        if args.account is not None:
            from bench.router_account import account, summary
            acc: dict[str, Any] = {}
            adir = (Path(args.out).parent if args.out else Path(log_dir)) / "account"

            def account_during(d: float, _a: dict[str, Any] = acc, _dir: Path = adir) -> None:
                w = max(1.0, (d - 4.0) / 3)  # three windows and a short strace, inside the step
                ws = {n: svc.proc.pid for n, svc in cluster.services.items()
                      if svc.proc and svc.proc.pid in bench.worker_pids}
                _a.update(account(bench.router_pid, args.account, w, min(2.0, max(0.0, d - 3 * w - 1)), _dir, ws))

            s = bench.step(args.account, args.step, max_tokens=1, prompt_tokens=args.prompt_tokens,
                           during=account_during)
            s.pop("_rows")
            results["account"] = {"step": s, **acc}
            for line in summary(acc, s["completed_rate"]):
                console.print(line, markup=False, highlight=False)
        if args.syscalls_tokens is not None:
            counts: dict[str, Any] = {}
            sdir = (Path(args.out).parent if args.out else Path(log_dir)) / "syscalls_tokens"
            sdir.mkdir(parents=True, exist_ok=True)

            def count_during(d: float, _c: dict[str, Any] = counts, _dir: Path = sdir) -> None:
                _c.update(syscall_counts(bench.router_pid, d, _dir))

            s = bench.step(args.syscalls_tokens, args.step, max_tokens=args.stream_tokens,
                           prompt_tokens=args.prompt_tokens, during=count_during)
            s.pop("_rows")
            # the count covers the sending window; the streams still running after it are not in it
            n_tok = s["output_tokens"] or 0
            per = {k: counts[k] / n_tok for k in ("reads", "writes", "waits") if k in counts and n_tok}
            results["syscalls_tokens"] = {"step": s, "counts": counts, "per_output_token": per}
            console.print(f"router syscalls at {args.syscalls_tokens:g} req/s x {args.stream_tokens} tokens: "
                          + (counts["error"] if "error" in counts else
                             ", ".join(f"{k} {v:.3f}" for k, v in per.items()) + " per output token "
                             f"({n_tok} tokens; SSE events {s['tokens']})"))
    except (RuntimeError, TimeoutError) as e:
        console.print(f"[red]kairos bench-router: {e}[/]")
        return 1
    finally:
        if tele is not None:
            tele.close()
        if clients is not None:
            clients.close()
        cluster.stop(10)
    if "requests" in results:
        try:
            results["reference"] = reference_phase(console, args, ref_rates, n_clients, router_cpus, other_cpus,
                                                   results["requests"]["steps"])
        except (RuntimeError, TimeoutError) as e:
            console.print(f"[red]kairos bench-router: reference app: {e}[/]")
            return 1
    if args.peers:
        from bench.peers import peers_phases, print_modes_summary

        results["peers"] = peers_phases(console, args, [n.strip() for n in args.peers.split(",") if n.strip()],
                                       results, n_clients=n_clients, router_cpus=router_cpus, other_cpus=other_cpus)
    _print_summary(console, results)
    if args.peers:
        print_modes_summary(console, results["peers"])
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        console.print(f"results: {args.out}")
    return 0


def reference_phase(console: Console, args: argparse.Namespace, rates: Sequence[float], n_clients: int,
                    router_cpus: Sequence[int], other_cpus: Sequence[int],
                    router_steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The request-rate steps again against bench/reference_app.py on the router's CPUs, and the
    router's CPU per request as a ratio to the reference's at each offered rate."""
    from common.ports import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "bench.reference_app", "--port", str(port)]
    if router_cpus:
        cmd = ["taskset", "-c", ",".join(map(str, router_cpus)), *cmd]
    proc = subprocess.Popen(cmd)
    clients: Clients | None = None
    try:
        wait_port(port, proc)
        clients = Clients(n_clients, "127.0.0.1", port, args.connections, other_cpus)
        bench = Bench(None, clients, console, pid=proc.pid)
        bench.step(50, 1.5, max_tokens=4, prompt_tokens=args.prompt_tokens)  # warm up connections
        bench.measure_idle(1.0)
        steps = request_steps(bench, console, args, rates, "reference", "CPU", stop_past_saturation=False)
    finally:
        if clients is not None:
            clients.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    ratios = []
    for rs, fs in zip(router_steps, steps, strict=False):
        a, b = rs.get("router_us_per_request"), fs.get("router_us_per_request")
        ratios.append({"offered_rate": rs["offered_rate"], "router_us_per_request": a, "reference_us_per_request": b,
                       "router_cost_ratio": a / b if a and b else None})
    best = sustained(router_steps)
    at = next((x for x in ratios if best is not None and x["offered_rate"] == best["offered_rate"]), None)
    return {"steps": steps, "ratios": ratios, "router_cost_ratio": at["router_cost_ratio"] if at else None}


def _print_latency(console: Console, args: argparse.Namespace, lat: dict[str, Any]) -> None:
    if not lat.get("matched"):
        console.print("[yellow]latency: no request matched the router's telemetry[/]")
        return
    ms = 1e3
    console.print(
        f"latency at {args.moderate_rate:g} req/s (128-token prompts, {lat['matched']} requests, routes "
        f"{lat['routes']}): client TTFT p50 {lat['client_ttft_p50'] * ms:.2f} ms / p99 "
        f"{lat['client_ttft_p99'] * ms:.2f} ms; router TTFT p50 {lat['router_ttft_p50'] * ms:.2f} ms; engine model "
        f"p50 {lat['modeled_ttft_p50'] * ms:.2f} ms -> added p50 {lat['added_p50'] * ms:.2f} ms / p99 "
        f"{lat['added_p99'] * ms:.2f} ms (HTTP+SSE p50 {lat['http_sse_p50'] * ms:.2f} ms, bus+workers p50 "
        f"{lat['bus_worker_p50'] * ms:.2f} ms)")


def _print_profile(console: Console, key: str, rate: float, s: dict[str, Any], prof: dict[str, Any]) -> None:
    if "error" in prof:
        console.print(f"[yellow]{key}: {prof['error']}[/]")
        return
    tab = Table(title=f"router profile at {rate:g} req/s ({key}; {prof.get('samples', 0)} samples, router CPU "
                      f"{s['router_cpu']:.2f})", title_justify="left")
    tab.add_column("self", justify="right")
    tab.add_column("function (self time)")
    tab.add_column("inclusive", justify="right")
    tab.add_column("function (inclusive)")
    selfs, incl = prof.get("self", [])[:15], prof.get("inclusive", [])[:15]
    for i in range(max(len(selfs), len(incl))):
        a = selfs[i] if i < len(selfs) else ("", 0.0)
        b = incl[i] if i < len(incl) else ("", 0.0)
        tab.add_row(f"{100 * a[1]:.1f}%" if a[0] else "", a[0], f"{100 * b[1]:.1f}%" if b[0] else "", b[0])
    console.print(tab)


def _print_summary(console: Console, results: dict[str, Any]) -> None:
    for key, unit, per in (("requests", "requests/s", "request"), ("tokens", "tokens/s", "token")):
        part = results.get(key)
        if not part:
            continue
        best = part["sustained"]
        ck = "router_us_per_request" if key == "requests" else "router_us_per_token"
        if best is None:
            console.print(f"{key}: no step kept up")
        else:
            rate = best["completed_rate"] if key == "requests" else best["tokens_per_s"]
            cost = best[ck]
            console.print(f"{key}: sustained {rate:,.0f} {unit} (step {best['offered_rate']:g} req/s, TTFT p50 "
                          f"{_fmt(best['ttft_p50'], 1e3, 2)} ms, router CPU {best['router_cpu']:.2f}, "
                          f"{_fmt(cost, digits=1)} us per {per}"
                          + (f" -> ~{1e6 / cost:,.0f} {unit} per dedicated router core at that cost)" if cost else ")"))
        top = max(part["steps"], key=lambda s: s["completed_rate"])
        console.print(f"  most carried: {top['completed_rate']:,.0f} requests/s, {top['tokens_per_s']:,.0f} tokens/s "
                      f"(step {top['offered_rate']:g} req/s) with router CPU {top['router_cpu']:.2f} and "
                      f"{_fmt(top[ck], digits=1)} us per {per}; machine CPU {top['machine_cpu']:.2f} of "
                      f"{os.cpu_count()}")
    ref = results.get("reference")
    if ref:
        pairs = ", ".join(f"{x['offered_rate']:g}/s: {_fmt(x['router_cost_ratio'], digits=2)}" for x in ref["ratios"])
        console.print(f"router CPU per request over the reference app's (same load, same run): "
                      f"{_fmt(ref['router_cost_ratio'], digits=2)}x at the sustained step ({pairs})")


if __name__ == "__main__":
    sys.exit(main())
