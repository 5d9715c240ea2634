"""The Docker tier's client side (scripts/docker-tier.sh runs it against a compose stack).

    python -m tests.docker_tier check    --url URL --compose "docker-compose -p P -f FILE" \
        [--prefill N --decode N] [--restart SVC ...] [--router-restart [SVC ...]] \
        [--monitor-url URL --routers N] [--report FILE]

Waits until the router lists every worker, sends requests with the official `openai` client,
then, under load from 4 concurrent clients, restarts each named service one at a time
(`docker-compose restart`, then waits until it is healthy again) and counts failed requests:
any failure while workers and the monitor restart fails the tier. The routers' restarts are run
last and only reported (a router's own clients see its restart), except with --routers-hold
(replicas behind one address, where none may fail). With `--monitor-url`, the
monitor must show `--routers` replicas, each reporting (router replicas: one monitor reads every
router). Finally it parses `docker-compose logs` as JSON lines and fails on any line that is not
one.
Not collected by pytest (no test_ prefix); it is a script with assertions.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any


def say(msg: str) -> None:
    print(f"[docker-tier] {msg}", flush=True)


def get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(url: str, prefill: int, decode: int, timeout: float) -> float:
    """Until the router lists `prefill` + `decode` registered, non-draining workers; seconds taken."""
    t0 = time.monotonic()
    last: Any = None
    while time.monotonic() - t0 < timeout:
        try:
            workers = get_json(url + "/v1/kairos/stats")["workers"]
            live = [w for w, info in workers.items() if not info.get("draining")]
            last = sorted(live)
            if sum(w.startswith("prefill") for w in live) >= prefill and \
                    sum(w.startswith("decode") for w in live) >= decode:
                return time.monotonic() - t0
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"workers not all registered within {timeout:.0f}s (registered: {last})")


@dataclass
class Load:
    """Concurrent clients sending completions until stopped; counts and keeps failures."""

    url: str
    clients: int = 4
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _client(self, i: int) -> None:
        from openai import OpenAI

        client = OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=30.0)
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                out = client.completions.create(model="kairos-sim", prompt=f"client {i} request {n} " * 20,
                                                max_tokens=8)
                assert out.choices and out.choices[0].finish_reason in ("length", "stop"), out
                with self._lock:
                    self.ok += 1
            except Exception as e:  # every failure is counted and reported, whatever its kind
                with self._lock:
                    self.failed.append(f"{type(e).__name__}: {str(e)[:160]}")
                time.sleep(0.05)

    def __enter__(self) -> Load:
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.clients)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.ok, len(self.failed)


def compose(cmd: str, *args: str, timeout: float = 180) -> str:
    r = subprocess.run([*shlex.split(cmd), *args], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd} {' '.join(args)} failed ({r.returncode}): {r.stderr[-2000:]}")
    return r.stdout


def wait_healthy(cmd: str, service: str, timeout: float) -> None:
    """Until docker reports the service's container healthy."""
    t0 = time.monotonic()
    cid = compose(cmd, "ps", "-q", service).strip()
    while time.monotonic() - t0 < timeout:
        r = subprocess.run(["docker", "inspect", "-f", "{{.State.Health.Status}}", cid], capture_output=True,
                           text=True, timeout=30)
        if r.stdout.strip() == "healthy":
            return
        time.sleep(0.5)
    raise TimeoutError(f"{service} not healthy within {timeout:.0f}s after its restart")


def worker_lost_events(cmd: str, router: str = "router") -> list[tuple[str, float, str]]:
    """(worker, seconds silent, time) of every worker_lost event in the router's log."""
    out = []
    for line in compose(cmd, "logs", "--no-color", router, timeout=120).splitlines():
        _, _, text = line.partition("|")
        try:
            ev = json.loads(text)
        except ValueError:
            continue
        if isinstance(ev, dict) and ev.get("event") == "worker_lost":
            out.append((str(ev.get("worker")), float(ev.get("silent_s", 0.0)), str(ev.get("timestamp", ""))[11:23]))
    return out


def router_incarnations(url: str, n: int, prefill: int, decode: int, timeout: float,
                        new_since: set[str] | None = None) -> set[str]:
    """Router replicas on one address (SO_REUSEPORT or a balancer): ask /ready on new connections
    until `n` distinct routers (their incarnations) have answered ready with every worker
    registered, and, given `new_since` (the incarnations before a router restart), one of them
    is new: the restarted router is back and serving, not only the other. Their incarnations."""
    t0 = time.monotonic()
    seen: set[str] = set()
    while time.monotonic() - t0 < timeout:
        try:
            body = get_json(url + "/ready")
            # every worker registered, whatever its role now: the role planner (on by default) may
            # have moved one during the rolling restart (a 2P2D stack can be 1P3D here)
            if body.get("prefill_workers", 0) + body.get("decode_workers", 0) >= prefill + decode:
                seen.add(str(body["router"]))
        except (OSError, ValueError, KeyError):
            pass
        fresh = seen - (new_since or set())
        if len(seen) >= n and (new_since is None or fresh):
            return seen if new_since is None else (seen & new_since) | fresh
        time.sleep(0.05)
    raise TimeoutError(f"{n} router replicas did not all answer ready within {timeout:.0f}s (seen: {sorted(seen)})")


def wait_monitor_replicas(url: str, n: int, timeout: float) -> list[str]:
    """Until the monitor's /api/state lists `n` router replicas, each reported within 5 s; their names."""
    t0 = time.monotonic()
    last: Any = None
    while time.monotonic() - t0 < timeout:
        try:
            last = (get_json(url + "/api/state").get("router") or {}).get("replicas", [])
            if len(last) == n and all(r["age_s"] < 5 for r in last):
                return [str(r["name"]) for r in last]
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the monitor did not show {n} reporting router replicas within {timeout:.0f}s (last: {last})")


def check_logs(cmd: str) -> dict[str, int]:
    """Every line of a service's `docker-compose logs` must be one JSON object; lines per service.
    The one-shot `keys` container is a command (`kairos keys`) printing a human summary, not a service;
    `lb` is HAProxy (docker-compose.replicas.yml), whose log is its own."""
    out = compose(cmd, "logs", "--no-color", timeout=120)
    per: dict[str, int] = {}
    bad: list[str] = []
    for line in out.splitlines():
        if "|" not in line:
            continue  # compose's own "Attaching to ..." header
        svc, _, text = line.partition("|")
        text = text.strip()
        if not text or svc.strip().rsplit("_", 1)[0].rsplit("-", 1)[0] in ("keys", "lb"):
            continue
        try:
            obj = json.loads(text)
            assert isinstance(obj, dict) and "event" in obj
        except (ValueError, AssertionError):
            bad.append(line[:200])
            continue
        name = svc.strip()
        per[name] = per.get(name, 0) + 1
    if bad:
        raise AssertionError(f"{len(bad)} log lines are not JSON objects with an event, e.g.:\n" + "\n".join(bad[:5]))
    return per


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.docker_tier")
    ap.add_argument("--url", required=True)
    ap.add_argument("--compose", required=True, help="the docker-compose command, with -p and -f")
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--requests", type=int, default=20, help="sequential requests before the restarts")
    ap.add_argument("--restart", nargs="*", default=[], help="services to restart one at a time under load")
    ap.add_argument("--router-restart", nargs="*", default=None, metavar="SVC",
                    help="then restart these router services one at a time (default: router; reported only)")
    ap.add_argument("--routers-hold", action="store_true",
                    help="router replicas behind one address: every request during their restarts must succeed "
                         "(the restarting router drains; the others take its clients)")
    ap.add_argument("--monitor-url", default="", help="the monitor's URL: check it sees --routers replicas")
    ap.add_argument("--routers", type=int, default=1, help="router replicas the monitor must show")
    ap.add_argument("--same-port", action="store_true",
                    help="the routers share the HTTP port (SO_REUSEPORT): before the next router restart, wait "
                         "until the restarted one answers /ready itself. Not for routers behind a balancer, "
                         "which picks who answers a probe (the replicas stack's HAProxy sent 120 s of probes to "
                         "one router while both were up); its health checks stand in there")
    ap.add_argument("--ready-timeout", type=float, default=120.0)
    ap.add_argument("--report", default="", help="append one JSON line with the figures to this file")
    args = ap.parse_args(argv)
    from openai import OpenAI

    report: dict[str, Any] = {"compose": args.compose}
    report["ready_s"] = round(wait_ready(args.url, args.prefill, args.decode, args.ready_timeout), 1)
    say(f"all {args.prefill}P+{args.decode}D workers registered after {report['ready_s']}s")
    client = OpenAI(base_url=args.url + "/v1", api_key="unused", max_retries=0, timeout=30.0)
    for i in range(args.requests):
        out = client.completions.create(model="kairos-sim", prompt=f"warm-up {i} " * 30, max_tokens=8)
        assert out.choices[0].finish_reason in ("length", "stop") and out.usage is not None, out
    say(f"{args.requests} requests through the openai client: ok")
    routers = args.router_restart or ["router"]
    if args.monitor_url:
        reps = wait_monitor_replicas(args.monitor_url, args.routers, 60)
        report["monitor_replicas"] = reps
        say(f"the monitor shows {len(reps)} router replicas, each reporting: {reps}")

    if args.restart:
        with Load(args.url) as load:
            for svc in args.restart:
                before = load.snapshot()
                t0 = time.monotonic()
                compose(args.compose, "restart", svc)
                wait_healthy(args.compose, svc, 120)
                if svc.startswith(("prefill", "decode")):
                    wait_ready(args.url, args.prefill, args.decode, 120)
                after = load.snapshot()
                say(f"restarted {svc} in {time.monotonic() - t0:.1f}s under load: "
                    f"{after[0] - before[0]} ok, {after[1] - before[1]} failed")
            time.sleep(1.0)
        report["rolling"] = {"services": args.restart, "ok": load.ok, "failed": len(load.failed)}
        if load.failed:
            say(f"FAIL: {len(load.failed)} of {load.ok + len(load.failed)} requests failed during the rolling "
                f"restart, e.g. {load.failed[:3]}")
            lost = worker_lost_events(args.compose, routers[0])
            if lost:
                say(f"the router declared workers lost {len(lost)} times (heartbeats silent past the liveness "
                    f"window; a restart accounts for one per restarted worker): {lost[:6]}")
            print(json.dumps(report))
            return 1
        say(f"rolling restart of {len(args.restart)} services: {load.ok} requests, none failed")

    if args.router_restart is not None:
        failed = 0
        for svc in routers:
            # replicas on one address: know who answers now, to see the restarted one come back
            before = router_incarnations(args.url, args.routers, args.prefill, args.decode, 120) \
                if args.routers > 1 and args.same_port else None
            with Load(args.url) as load:
                t0 = time.monotonic()
                compose(args.compose, "restart", svc)
                wait_healthy(args.compose, svc, 120)
                wait_ready(args.url, args.prefill, args.decode, 120)
                if before is not None:  # before the next router goes, this one must serve again
                    router_incarnations(args.url, args.routers, args.prefill, args.decode, 120, new_since=before)
                recovered = time.monotonic() - t0
                time.sleep(2.0)
            kinds: dict[str, int] = {}
            for f in load.failed:
                kinds[f.split(":", 1)[0]] = kinds.get(f.split(":", 1)[0], 0) + 1
            report.setdefault("router_restart", {})[svc] = {
                "ok": load.ok, "failed": len(load.failed), "recovered_s": round(recovered, 1), "failures": kinds}
            failed += len(load.failed)
            say(f"{svc} restart ({'asserted' if args.routers_hold else 'reported, not asserted'}): "
                f"{len(load.failed)} of {load.ok + len(load.failed)} requests failed, healthy and serving "
                f"{recovered:.1f}s after the restart began {kinds}"
                + (f" e.g. {load.failed[:3]}" if load.failed else ""))
        if args.routers_hold and failed:
            say(f"FAIL: {failed} requests failed while the router replicas restarted one after the other")
            print(json.dumps(report))
            return 1

    per = check_logs(args.compose)
    report["log_lines"] = per
    say(f"docker-compose logs: {sum(per.values())} lines, all JSON ({per})")
    if args.report:
        with open(args.report, "a") as f:
            f.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
