"""The compose files run what `kairos up` runs, and only real commands and config fields.

- docker-compose.sim.yml (the simulated cluster): each service's command and KAIROS_*
  environment equal what kairos/up.py's Cluster builds for the same shape (two routers on one
  HTTP port: `kairos up --routers 2`, so restarting one refuses no connection), at the defaults
  and with every parameter changed; the services then start as plain processes and every compose
  health check passes against them, each router's against that router alone.
- docker-compose.yml (GPU, vLLM): the same wiring as `kairos up --engine vllm --routers 2`, the
  GPUs of a worker reserved per worker (as many as its pool's KAIROS_PREFILL_TP / KAIROS_DECODE_TP),
  nothing reserved for the routers and monitor.
- Both: commands are `kairos` subcommands that start, KAIROS_* keys are config fields of that
  service, compose-only variables are documented, health checks parse, graceful stop periods
  cover the drain.
- scripts/check-compose.sh (`docker-compose config` of every file) when docker-compose is
  installed; .ci/run installs it.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is needed to read the compose files (the dev extra)")

from common import config  # noqa: E402
from common.errors import ConfigError  # noqa: E402
from common.ports import free_ports  # noqa: E402
from common.router_link import router_addresses  # noqa: E402
from kairos import health  # noqa: E402
from kairos.cli import COMMANDS  # noqa: E402
from kairos.up import Cluster, ClusterSpec, Service, kairos_cmd  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GPU_FILE = ROOT / "docker-compose.yml"
SIM_FILE = ROOT / "docker-compose.sim.yml"
RDMA_FILE = ROOT / "docker-compose.rdma.yml"
MULTI_FILE = ROOT / "docker-compose.multihost.yml"
ROUTERS = {"router", "router-1"}  # the default stacks' two routers (kairos up --routers 2)
SERVICES = {*ROUTERS, "monitor", "prefill-0", "prefill-1", "decode-0", "decode-1"}
WORKERS = SERVICES - ROUTERS - {"monitor"}
MULTI_SERVICES = SERVICES - {"router-1"}  # docker-compose.multihost.yml: one router
ROUTER_1_BUS = {"KAIROS_WORK_PORT_1": 5558, "KAIROS_HEARTBEAT_PORT_1": 5559, "KAIROS_TELEMETRY_PORT_1": 5560}
ROUTER_METRICS = {"router": 9199, "router-1": 9200}  # each router's /metrics and health check port
KEYS = "keys"  # the one-shot service that makes the bus's CURVE keys (not a cluster process)
KEYS_DIR = "/var/lib/kairos/keys"

CONFIG_OF: dict[str, type[config.BusConfig]] = {
    "router": config.RouterConfig,
    "monitor": config.MonitorConfig,
    "prefill-worker": config.WorkerConfig,
    "decode-worker": config.WorkerConfig,
}
# Variables the compose files interpolate that are not config fields (each file documents them).
COMPOSE_ONLY = {"KAIROS_IMAGE", "KAIROS_BASE_IMAGE", "KAIROS_KEYS_DIR", "KAIROS_MODELS_DIR", "KAIROS_MODEL_NAME",
                "KAIROS_MONITOR_PORT", "KAIROS_PROMETHEUS_IMAGE", "KAIROS_GRAFANA_IMAGE", "KAIROS_PROMETHEUS_PORT",
                "KAIROS_GRAFANA_PORT",
                "KAIROS_METRICS_PORT_PREFILL_0", "KAIROS_METRICS_PORT_PREFILL_1", "KAIROS_METRICS_PORT_DECODE_0",
                "KAIROS_METRICS_PORT_DECODE_1",
                "KAIROS_GPU_PREFILL_0", "KAIROS_GPU_PREFILL_1", "KAIROS_GPU_DECODE_0", "KAIROS_GPU_DECODE_1",
                "KAIROS_PREFILL_TP", "KAIROS_DECODE_TP",
                "KAIROS_SIDE_CHANNEL_PORT_PREFILL_0", "KAIROS_SIDE_CHANNEL_PORT_PREFILL_1",
                "KAIROS_METRICS_PORT_ROUTER", "KAIROS_METRICS_PORT_ROUTER_1", *ROUTER_1_BUS}
# Fields that list every router's address (workers' routers, the monitor's telemetry): made of the
# bus variables of both routers, the one place a field is set from other fields' variables.
ROUTER_LISTS = {"KAIROS_ROUTERS", "KAIROS_TELEMETRY"}
# Non-KAIROS variables passed through to GPU workers (UCX reads them; Kairos config does not).
PASSTHROUGH = {"UCX_TLS", "UCX_NET_DEVICES"}
# `kairos up` passes these to every worker; they only mean something to the simulated engine.
SIM_ONLY = {"KAIROS_KV_TRANSPORT", "KAIROS_TIME_SCALE"}
# kairos up's own supervision: the file it keeps of its services (services.json) for the monitor. Under
# compose, Docker restarts the services and `docker compose ps` is that view; there is no such file.
SUPERVISOR_ONLY = {"KAIROS_SERVICES_STATUS"}


# ------------------------------------------------------------------------- reading compose


_VAR = re.compile(r"\$(?:(?P<esc>\$)|\{(?P<braced>[^}]*)\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-)(?P<default>.*))?$", re.S)


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation, the subset we use: $$, $NAME, ${NAME}, ${NAME:-default}, ${NAME-default}."""

    def one(m: re.Match[str]) -> str:
        if m.group("esc"):
            return "$"
        if m.group("bare"):
            return env.get(m.group("bare"), "")
        b = _BRACED.match(m.group("braced"))
        if b is None:
            raise ValueError(f"unsupported interpolation ${{{m.group('braced')}}}")
        value = env.get(b.group("name"))
        if b.group("op") == ":-" and not value:
            return interpolate(b.group("default"), env)
        if b.group("op") == "-" and value is None:
            return interpolate(b.group("default"), env)
        return value or ""

    return _VAR.sub(one, text)


def resolve(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {k: resolve(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [resolve(v, env) for v in node]
    return node


def services(path: Path, env: dict[str, str] | None = None, *, profiles: bool = False) -> dict[str, dict[str, Any]]:
    """The file's services after YAML anchors/merges and interpolation (env: the shell's variables);
    the cluster's only, unless `profiles` (then also those of a profile: Prometheus, Grafana)."""
    data = yaml.safe_load(path.read_text())
    svcs: dict[str, dict[str, Any]] = resolve(data["services"], env or {})
    return {k: v for k, v in svcs.items() if profiles or not v.get("profiles")}


def environment(svc: dict[str, Any]) -> dict[str, str | None]:
    raw = svc.get("environment") or {}
    if isinstance(raw, list):  # KEY=VALUE or KEY (pass-through)
        raw = dict(item.split("=", 1) if "=" in item else (item, None) for item in raw)
    return {k: None if v is None else str(v) for k, v in raw.items()}


def kairos_env(svc: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in environment(svc).items() if k.startswith("KAIROS_") and v is not None}


def interpolated_names(path: Path) -> set[str]:
    names = set()
    for m in _VAR.finditer(path.read_text()):
        if m.group("braced"):
            b = _BRACED.match(m.group("braced"))
            assert b is not None, f"{path.name}: unsupported interpolation ${{{m.group('braced')}}}"
            names.add(b.group("name"))
        elif m.group("bare"):
            names.add(m.group("bare"))
    return names


def field_env_names(cls: type[msgspec.Struct]) -> set[str]:
    return {config.ENV_PREFIX + name.upper() for name in cls.__struct_fields__}


ALL_FIELDS = set().union(*(field_env_names(c) for c in CONFIG_OF.values()))


def duration_s(text: str) -> float:
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a compose duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def cluster_services(spec: ClusterSpec) -> dict[str, tuple[list[str], dict[str, str]]]:
    """What `kairos up` runs for `spec`: service name -> (kairos arguments, environment)."""
    out = {}
    for name, svc in Cluster(spec).services.items():
        prefix = kairos_cmd("")[:-1]  # [python, -m, kairos.cli]
        assert svc.command[: len(prefix)] == prefix
        out[name] = (svc.command[len(prefix):], {k: v for k, v in svc.env.items() if k not in SUPERVISOR_ONLY})
    return out


# ------------------------------------------------------------------------- both files


@pytest.fixture(params=[GPU_FILE, SIM_FILE], ids=["gpu", "sim"])
def compose_file(request: pytest.FixtureRequest) -> Path:
    path: Path = request.param
    return path


@pytest.fixture(params=[GPU_FILE, SIM_FILE, MULTI_FILE], ids=["gpu", "sim", "multihost"])
def any_compose_file(request: pytest.FixtureRequest) -> Path:
    path: Path = request.param
    return path


def test_services_are_the_cluster(compose_file: Path) -> None:
    assert set(services(compose_file)) == SERVICES | {KEYS}


def test_observability_profile(compose_file: Path) -> None:
    """Prometheus and Grafana only with --profile observability, reading the repository's files."""
    extra = {k: v for k, v in services(compose_file, profiles=True).items() if k not in SERVICES | {KEYS}}
    assert set(extra) == {"prometheus", "grafana"}
    assert all(v["profiles"] == ["observability"] for v in extra.values())
    for svc in extra.values():
        for volume in svc["volumes"]:
            host = volume.split(":", 1)[0]
            if host.startswith("./"):
                assert (ROOT / host).exists(), f"{compose_file.name}: {host} is not in the repository"
    prom = yaml.safe_load((ROOT / "observability/prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    # each router's own metrics port (both share 8000, where a scrape reaches either) and the monitor's
    assert {"127.0.0.1:9199", "127.0.0.1:9200", "127.0.0.1:9100"} <= targets
    assert "127.0.0.1:8000" not in targets


def test_curve_is_on_with_keys_from_the_keys_service(compose_file: Path) -> None:
    svcs = services(compose_file)
    keys = svcs[KEYS]
    assert keys["command"] == ["keys", KEYS_DIR, "--add"] and keys["restart"] == "no"
    assert keys["volumes"] == [f"kairos-keys:{KEYS_DIR}"]
    for name in SERVICES:
        svc = svcs[name]
        assert kairos_env(svc).get("KAIROS_CURVE_KEYS_DIR") == KEYS_DIR, f"{name}: CURVE on by default"
        assert f"kairos-keys:{KEYS_DIR}:ro" in svc["volumes"], f"{name}: the keys, read-only"
        assert svc["depends_on"][KEYS]["condition"] == "service_completed_successfully", name
    assert "kairos-keys" in yaml.safe_load(compose_file.read_text())["volumes"]
    off = services(compose_file, {"KAIROS_CURVE_KEYS_DIR": ""})  # set and empty: CURVE off
    assert all(kairos_env(off[n]).get("KAIROS_CURVE_KEYS_DIR") == "" for n in SERVICES)
    mounted = services(compose_file, {"KAIROS_KEYS_DIR": "/etc/kairos/keys"})
    assert mounted["router"]["volumes"][-1] == f"/etc/kairos/keys:{KEYS_DIR}:ro"


@functools.cache
def _help(cmd: tuple[str, ...]) -> tuple[int, str]:
    """`kairos CMD --help` run once per distinct command line in the session (the compose files
    share theirs: 5 processes instead of 15, each about 1.5 s of imports): (exit code, stderr)."""
    r = subprocess.run([sys.executable, "-m", "kairos.cli", *cmd, "--help"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=_clean_env())
    return r.returncode, r.stderr


def test_commands_are_kairos_subcommands_that_start(any_compose_file: Path) -> None:
    compose_file = any_compose_file
    commands = {tuple(svc["command"]) for svc in services(compose_file).values()}
    for cmd in commands:
        assert cmd[0] in COMMANDS, f"{compose_file.name}: `kairos {cmd[0]}` is not a kairos command"
        assert cmd[0] in CONFIG_OF or cmd[0] == KEYS, f"{compose_file.name}: `kairos {cmd[0]}` is not a service"
        code, err = _help(cmd)
        assert code == 0, f"`kairos {' '.join(cmd)} --help` failed:\n{err[-2000:]}"


def test_environment_keys_are_config_fields_of_the_service(any_compose_file: Path) -> None:
    compose_file = any_compose_file
    for name, svc in services(compose_file).items():
        if name == KEYS:
            assert not environment(svc), f"{compose_file.name}: the keys service needs no configuration"
            continue
        cls = CONFIG_OF[svc["command"][0]]
        for key, value in environment(svc).items():
            if key.startswith("KAIROS_"):
                assert key in field_env_names(cls), (
                    f"{compose_file.name}: {name} sets {key}, which is not a field of {cls.__name__}")
            elif compose_file == MULTI_FILE:
                assert (key, value) == ("UCX_TLS", "tcp") and name in WORKERS, (
                    f"{compose_file.name}: {name} sets {key}={value}: only UCX_TLS=tcp on workers")
            else:
                assert compose_file == GPU_FILE and key in PASSTHROUGH and value is None, (
                    f"{compose_file.name}: {name} sets {key}: services are configured by KAIROS_* only "
                    f"(pass-through allowed for {sorted(PASSTHROUGH)} on GPU workers)")
        cfg = config.load(cls, env=kairos_env(svc))  # the values convert: ports are ints, ...
        assert cfg.log_format == "json", f"{compose_file.name}: {name} must log JSON (KAIROS_LOG_FORMAT=json)"


def test_interpolated_variables_are_fields_or_documented(any_compose_file: Path) -> None:
    compose_file = any_compose_file
    text = compose_file.read_text()
    header = text.split("\nx-", 1)[0]
    for var in interpolated_names(compose_file):
        if var in ALL_FIELDS:
            continue
        assert var in COMPOSE_ONLY | PASSTHROUGH, (
            f"{compose_file.name}: ${{{var}}} is neither a config field nor a documented compose variable")
        assert var in header, f"{compose_file.name}: compose variable {var} is not documented in the header"
    # A field-named variable sets that same field: no `KAIROS_HTTP_PORT: ${KAIROS_WORK_PORT}` crossings.
    for name, svc in yaml.safe_load(text)["services"].items():
        for key, value in (svc.get("environment") or {}).items():
            for var in interpolated_names_in(str(value)):
                assert var not in ALL_FIELDS or var == key or key in ROUTER_LISTS, (
                    f"{compose_file.name}: {name}: {key} is set from ${{{var}}}, another field's variable")


def interpolated_names_in(text: str) -> set[str]:
    out = set()
    for m in _VAR.finditer(text):
        b = _BRACED.match(m.group("braced") or "")
        if b is not None:
            out.add(b.group("name"))
    return out


def test_operations_settings(compose_file: Path) -> None:
    drain = config.WorkerConfig().drain_timeout
    for name, svc in services(compose_file).items():
        where = f"{compose_file.name}: {name}"
        if name == KEYS:  # one-shot: runs, exits 0, is not restarted, has nothing to check
            assert svc.get("restart") == "no" and svc["healthcheck"] == {"disable": True}, where
            continue
        assert svc.get("network_mode") == "host", f"{where}: host networking"
        assert svc.get("restart") == "unless-stopped", f"{where}: restart: unless-stopped"
        assert svc.get("init") is True, f"{where}: init: true (signals, zombie reaping)"
        assert "ports" not in svc, f"{where}: host networking publishes no ports"
        test = svc["healthcheck"]["test"]
        assert test[:3] == ["CMD", "kairos", "health"], f"{where}: health check is `kairos health ...`"
        health.parser().parse_args(test[3:])  # valid arguments (argparse exits on a bad flag)
        grace = duration_s(svc.get("stop_grace_period", "10s"))
        if name in WORKERS:
            env_drain = float(kairos_env(svc).get("KAIROS_DRAIN_TIMEOUT", drain))
            assert grace >= env_drain + 10, f"{where}: stop_grace_period {grace}s leaves no time after the drain"
            assert test[3] == "worker"
            assert all(svc["depends_on"][r]["condition"] == "service_healthy" for r in ROUTERS), where
        elif name in ROUTERS:
            assert grace >= 40, f"{where}: the router drains for 30 s on SIGTERM"
            # its own metrics port: the shared HTTP port answers from either router
            assert test[3:] == ["router", "--url", f"http://127.0.0.1:{ROUTER_METRICS[name]}"], where
            assert kairos_env(svc)["KAIROS_METRICS_PORT"] == str(ROUTER_METRICS[name]), where
            assert kairos_env(svc)["KAIROS_HTTP_REUSE_PORT"] == "true", f"{where}: both routers on the HTTP port"
        else:
            assert test[3] == "monitor"


# ------------------------------------------------------------------------- the simulated cluster


WORKER_METRICS = {"prefill-0": 9201, "prefill-1": 9202, "decode-0": 9203, "decode-1": 9204}  # the files' defaults
TWO_ROUTERS = {"routers": 2, "replica_ports": [(5558, 5559, 5560)]}
SIM_SHAPES = {
    "defaults": ({}, {"metrics_ports": {**ROUTER_METRICS, **WORKER_METRICS}, **TWO_ROUTERS}),
    "everything-changed": (
        {"KAIROS_POLICY": "disagg-least-loaded", "KAIROS_PROFILE": "fast", "KAIROS_HTTP_PORT": "18000",
         "KAIROS_WORK_PORT": "15555", "KAIROS_HEARTBEAT_PORT": "15556", "KAIROS_TELEMETRY_PORT": "15557",
         "KAIROS_MONITOR_PORT": "19100", "KAIROS_KV_TRANSPORT": "nixl", "KAIROS_TIME_SCALE": "0.5",
         "KAIROS_LOG_LEVEL": "debug", "KAIROS_METRICS_PORT_PREFILL_0": "19201", "KAIROS_METRICS_PORT_PREFILL_1": "0",
         "KAIROS_METRICS_PORT_DECODE_0": "19203", "KAIROS_METRICS_PORT_DECODE_1": "19204",
         "KAIROS_WORK_PORT_1": "15558", "KAIROS_HEARTBEAT_PORT_1": "15559", "KAIROS_TELEMETRY_PORT_1": "15560",
         "KAIROS_METRICS_PORT_ROUTER": "19199", "KAIROS_METRICS_PORT_ROUTER_1": "19200"},
        {"policy": "disagg-least-loaded", "profile": "fast", "http_port": 18000, "work_port": 15555,
         "heartbeat_port": 15556, "telemetry_port": 15557, "monitor_port": 19100, "kv_transport": "nixl",
         "time_scale": 0.5, "log_level": "debug",
         "metrics_ports": {"router": 19199, "router-1": 19200, "prefill-0": 19201, "prefill-1": 0, "decode-0": 19203,
                           "decode-1": 19204}, "routers": 2, "replica_ports": [(15558, 15559, 15560)]}),
}


@pytest.mark.parametrize("shape", SIM_SHAPES)
def test_sim_runs_exactly_what_kairos_up_runs(shape: str) -> None:
    shell, spec_kw = SIM_SHAPES[shape]
    want = cluster_services(ClusterSpec(prefill=2, decode=2, curve_keys_dir=KEYS_DIR, **spec_kw))  # type: ignore[arg-type]
    got = services(SIM_FILE, shell)
    del got[KEYS]
    assert set(got) == set(want)
    for name, (args, env) in want.items():
        assert got[name]["command"] == args, f"{name}: compose runs `kairos {' '.join(got[name]['command'])}`"
        assert environment(got[name]) == env, f"{name}: environment differs from kairos up's"


def test_sim_needs_no_gpu() -> None:
    data = yaml.safe_load(SIM_FILE.read_text())
    assert "nvidia" not in SIM_FILE.read_text()
    for name, svc in services(SIM_FILE).items():
        assert "deploy" not in svc, f"{name}: the simulated cluster reserves nothing"
        assert svc["image"] == "kairos:cpu" and svc["build"]["dockerfile"] == "docker/Dockerfile.cpu"
        assert kairos_env(svc).get("KAIROS_ENGINE", "sim") == "sim"
    assert "services" in data


# ------------------------------------------------------------------------- the GPU cluster


def test_gpu_wiring_matches_kairos_up_vllm() -> None:
    model = "/models/DeepSeek-V2-Lite"  # the file's default: /models/${KAIROS_MODEL_NAME}
    want = cluster_services(ClusterSpec(prefill=2, decode=2, engine="vllm", model=model, curve_keys_dir=KEYS_DIR,
                                        metrics_ports=dict(ROUTER_METRICS), **TWO_ROUTERS))  # type: ignore[arg-type]
    got = services(GPU_FILE)
    for name, (args, env) in want.items():
        assert got[name]["command"] == args
        have = kairos_env(got[name])
        for key, value in env.items():
            if key in SIM_ONLY:
                continue
            assert have.get(key) == value, f"{name}: {key}={have.get(key)!r}, kairos up sets {value!r}"
        assert have.get("KAIROS_ENGINE", "sim") == ("vllm" if name in WORKERS else "sim")


def test_gpu_one_reserved_gpu_per_worker() -> None:
    seen: list[str] = []
    for name, svc in services(GPU_FILE).items():
        devices = (((svc.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices")
        if name not in WORKERS:
            assert devices is None, f"{name} needs no GPU"
            continue
        assert isinstance(devices, list) and len(devices) == 1, f"{name}: one device reservation"
        d = devices[0]
        assert d["driver"] == "nvidia" and d["capabilities"] == ["gpu"] and len(d["device_ids"]) == 1
        seen += d["device_ids"]
        assert svc.get("ipc") == "host"
        assert "/models:ro" in " ".join(svc.get("volumes", []))
    assert sorted(seen) == ["0", "1", "2", "3"], f"GPUs must differ per worker: {seen}"
    moved = services(GPU_FILE, {"KAIROS_GPU_DECODE_1": "7"})
    assert moved["decode-1"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["7"]


def test_gpu_pools_take_their_parallel_size_from_one_variable_each() -> None:
    """Llama-2-70B with TP8 prefill and TP4 decode workers on 24 GPUs: each pool's tensor parallel
    size is one variable, each worker's GPUs a comma list of that many; other engine arguments reach
    every worker; a worker given fewer GPUs than its parallel size refuses to start."""
    from common.engines import vllm_args

    gpus = {"KAIROS_GPU_PREFILL_0": "0,1,2,3,4,5,6,7", "KAIROS_GPU_PREFILL_1": "8,9,10,11,12,13,14,15",
            "KAIROS_GPU_DECODE_0": "16,17,18,19", "KAIROS_GPU_DECODE_1": "20,21,22,23"}
    svcs = services(GPU_FILE, {"KAIROS_PREFILL_TP": "8", "KAIROS_DECODE_TP": "4", **gpus,
                               "KAIROS_VLLM_ENGINE_ARGS": "--gpu-memory-utilization 0.9 --max-num-seqs 128"})
    for name in WORKERS:
        cfg = config.load(config.WorkerConfig, env=kairos_env(svcs[name]))
        words = vllm_args.split(cfg.vllm_engine_args)
        tp = "8" if name.startswith("prefill") else "4"
        assert words == ["--tensor-parallel-size", tp, "--gpu-memory-utilization", "0.9", "--max-num-seqs", "128"]
        vllm_args.check_owned(words)
        (dev,) = svcs[name]["deploy"]["resources"]["reservations"]["devices"]
        ids = gpus["KAIROS_GPU_" + name.upper().replace("-", "_")]
        assert dev["device_ids"] == [ids] and len(ids.split(",")) == int(tp)
        # what the NVIDIA runtime shows the container (the reserved ids, comma-joined) is enough
        vllm_args.check_gpus({"tensor_parallel_size": int(tp)}, {"NVIDIA_VISIBLE_DEVICES": ids})
    default = config.load(config.WorkerConfig, env=kairos_env(services(GPU_FILE)["decode-0"]))
    assert vllm_args.split(default.vllm_engine_args) == ["--tensor-parallel-size", "1"]
    with pytest.raises(ConfigError, match="needs 4 GPUs"):  # KAIROS_DECODE_TP=4 with the one default GPU
        vllm_args.check_gpus({"tensor_parallel_size": 4}, {"NVIDIA_VISIBLE_DEVICES": "2"})


def test_multihost_services_are_separate_hosts() -> None:
    """Each service its own container and address: no host networking; the KV network joins only
    the workers; only the API and the dashboard are published, on loopback."""
    data = yaml.safe_load(MULTI_FILE.read_text())
    svcs = services(MULTI_FILE)
    assert set(svcs) == MULTI_SERVICES | {"keys"}
    assert set(data["networks"]) == {"control", "kv"}
    keys = svcs.pop("keys")  # the one-shot key maker joins no network at all
    assert keys["network_mode"] == "none" and keys["restart"] == "no"
    for name, svc in svcs.items():
        assert "network_mode" not in svc, f"{name}: no host networking in the multi-host example"
        want = {"control", "kv"} if name in WORKERS else {"control"}
        assert set(svc["networks"]) == want, name
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: publish on loopback only ({port})"
        env = kairos_env(svc)
        if name != "router":
            assert env["KAIROS_ROUTER_HOST"] == "router"
    router = kairos_env(svcs["router"])
    assert router["KAIROS_BIND_HOST"] == router["KAIROS_HTTP_HOST"] == "0.0.0.0"
    for name in ("prefill-0", "prefill-1"):
        prefill = kairos_env(svcs[name])
        assert prefill["KAIROS_VLLM_SIDE_CHANNEL_HOST"] == name, "advertised as its name on the kv network"
        assert prefill["KAIROS_VLLM_SIDE_CHANNEL_BIND"] == "0.0.0.0"


def test_gpu_prefill_workers_have_fixed_side_channel_ports() -> None:
    svcs = services(GPU_FILE)
    ports = [kairos_env(svcs[w]).get("KAIROS_VLLM_SIDE_CHANNEL_PORT") for w in ("prefill-0", "prefill-1")]
    assert ports == ["5600", "5601"], "fixed side-channel ports (firewalls), distinct on one host"
    for w in WORKERS:
        assert kairos_env(svcs[w])["KAIROS_VLLM_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    moved = services(GPU_FILE, {"KAIROS_VLLM_SIDE_CHANNEL_HOST": "10.0.0.7"})
    assert kairos_env(moved["prefill-1"])["KAIROS_VLLM_SIDE_CHANNEL_HOST"] == "10.0.0.7"


def test_rdma_override_only_adds_devices_to_workers() -> None:
    data = yaml.safe_load(RDMA_FILE.read_text())
    assert set(data["services"]) == WORKERS
    for svc in data["services"].values():
        assert set(svc) <= {"devices", "cap_add", "ulimits"}


# ------------------------------------------------------------------------- the Dockerfiles (no daemon: static)


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
            pending = ""
    return out


def dockerignored(rel: str) -> bool:
    from fnmatch import fnmatch

    patterns = [p.strip().removeprefix("**/") for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    parts = Path(rel).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch(pre, pat) or fnmatch(Path(pre).name, pat) for pat in patterns for pre in prefixes)


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_dockerfile(name: str) -> None:
    path = ROOT / "docker" / name
    ins = dockerfile_instructions(path)
    text = " ".join(args for _, args in ins)
    assert ins[0][0] in ("ARG", "FROM")
    stages = [i for i, (w, _) in enumerate(ins) if w == "FROM"]
    final = ins[stages[-1]:]
    users = [args for w, args in final if w == "USER"]
    assert users and users[-1] not in ("root", "0"), f"{name}: the final stage runs as a non-root user"
    assert ("ENTRYPOINT", '["kairos"]') in final, f"{name}: ENTRYPOINT [\"kairos\"] (exec form)"
    for w, args in ins:
        if w == "FROM":
            assert not args.split()[0].endswith(":latest")
        if w in ("CMD", "ENTRYPOINT"):
            assert args.startswith("["), f"{name}: {w} in exec form, so signals reach the service"
        if w == "COPY" and "--from=" not in args:
            for src in args.split()[:-1]:
                if src != ".":
                    assert (ROOT / src).exists(), f"{name}: COPY {src}: no such file"
                    assert not dockerignored(src), f"{name}: COPY {src} is excluded by .dockerignore"
        if w == "RUN" and "apt-get install" in args:
            assert "--no-install-recommends" in args
    for needed in ("pyproject.toml", "requirements/vllm-cpu.txt", "common", "services", "kairos", "sim", "bench"):
        assert not dockerignored(needed), f".dockerignore must keep {needed} (pip install . needs it)"
    if "docker/gpu-deps.sh" in text:  # Dockerfile.gpu's pins live in the script it runs (and the tests dry-run)
        text += " " + (ROOT / "docker/gpu-deps.sh").read_text()
    assert "nixl==1.5.1" in text
    if name == "Dockerfile.cpu":
        assert "python:3.11-slim" in text
        assert "--no-deps nixl-cu13==1.5.1 nixl==1.5.1" in text, "the lean NIXL install"
    else:
        assert "vllm==0.32.0" in text and "vllm/vllm-openai:v0.32.0" in text


# ------------------------------------------------------------------------- docker-compose itself


def test_check_compose_script() -> None:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (.ci/run installs it: scripts/check-compose.sh)")
    r = subprocess.run(["bash", str(ROOT / "scripts/check-compose.sh"), "--no-install"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------------- running the sim services


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KAIROS_")}


@pytest.fixture(scope="module")
def sim_processes(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """docker-compose.sim.yml's services as plain processes: its commands, its environment."""
    names = ["KAIROS_HTTP_PORT", "KAIROS_WORK_PORT", "KAIROS_HEARTBEAT_PORT", "KAIROS_TELEMETRY_PORT",
             "KAIROS_MONITOR_PORT", *ROUTER_1_BUS, "KAIROS_METRICS_PORT_ROUTER", "KAIROS_METRICS_PORT_ROUTER_1",
             *("KAIROS_METRICS_PORT_" + w.upper().replace("-", "_") for w in WORKER_METRICS)]
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    shell = {k: str(v) for k, v in ports.items()}
    svcs = services(SIM_FILE, shell)
    keys = svcs.pop(KEYS)
    keys_dir = tmp_path_factory.mktemp("compose-keys") / "keys"  # the keys service, run here: its command
    r = subprocess.run([sys.executable, "-m", "kairos.cli", keys["command"][0], str(keys_dir), *keys["command"][2:]],
                       capture_output=True, text=True, timeout=60, env=_clean_env(), cwd=ROOT)
    assert r.returncode == 0, r.stderr
    spec = ClusterSpec(prefill=2, decode=2, http_port=ports["KAIROS_HTTP_PORT"], routers=2,
                       replica_ports=[(ports["KAIROS_WORK_PORT_1"], ports["KAIROS_HEARTBEAT_PORT_1"],
                                       ports["KAIROS_TELEMETRY_PORT_1"])],
                       log_dir=str(tmp_path_factory.mktemp("compose-sim")))
    c = Cluster(spec)
    c.services = {name: Service(name, kairos_cmd(svc["command"][0]),
                                {**kairos_env(svc), "KAIROS_CURVE_KEYS_DIR": str(keys_dir)})
                  for name, svc in svcs.items()}
    c.start(timeout=90)
    yield c, svcs
    c.stop(20)


def run_healthcheck(svc: dict[str, Any], deadline_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    """The service's compose health check, in its environment, until it passes or time runs out."""
    args = [sys.executable, "-m", "kairos.cli", *svc["healthcheck"]["test"][2:]]
    env = {**_clean_env(), **kairos_env(svc)}
    end = time.monotonic() + deadline_s
    while True:
        r = subprocess.run(args, capture_output=True, text=True, timeout=30, env=env, cwd=ROOT)
        if r.returncode == 0 or time.monotonic() > end:
            return r
        time.sleep(0.5)


@pytest.mark.parametrize("name", ["router", "router-1", "prefill-0", "prefill-1", "decode-0", "decode-1"])
def test_sim_healthchecks_pass_against_the_running_services(sim_processes: Any, name: str) -> None:
    _, svcs = sim_processes
    r = run_healthcheck(svcs[name])
    assert r.returncode == 0, f"{name}: {r.stdout}{r.stderr}"
    assert len(r.stdout.strip().splitlines()) == 1 and " ok" in r.stdout


def test_sim_each_router_health_check_asks_that_router_alone(sim_processes: Any) -> None:
    """Stopped, a router fails its own health check while the other still answers on the shared
    HTTP port: Docker sees which router is down (a check on the HTTP port would pass for both)."""
    c, svcs = sim_processes
    c.stop_service("router-1", 40)  # SIGTERM: it drains and exits
    try:
        env = {**_clean_env(), **kairos_env(svcs["router-1"])}
        r = subprocess.run([sys.executable, "-m", "kairos.cli", *svcs["router-1"]["healthcheck"]["test"][2:]],
                           capture_output=True, text=True, timeout=30, env=env, cwd=ROOT)
        assert r.returncode != 0, f"router-1 is stopped but its health check passed: {r.stdout}"
        assert run_healthcheck(svcs["router"], deadline_s=5).returncode == 0
        assert c.get("/health")[0] == 200  # the API port: router alone serves it now
    finally:
        c.restart("router-1")
        c.wait_ready(60)


def test_sim_monitor_healthcheck_passes(sim_processes: Any) -> None:
    _, svcs = sim_processes
    r = run_healthcheck(svcs["monitor"], deadline_s=10)
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------------- router replicas

REPLICAS_FILE = ROOT / "docker-compose.replicas.yml"
HAPROXY_CFG = ROOT / "docker" / "haproxy-replicas.cfg"


def test_replicas_workers_register_with_every_router_and_the_balancer_checks_each() -> None:
    svcs = services(REPLICAS_FILE)
    routers = sorted(n for n, s in svcs.items() if s.get("command") == ["router"])
    assert routers == ["router-a", "router-b"]
    fields = field_env_names(config.WorkerConfig)
    for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        env = kairos_env(svcs[name])
        assert set(env) <= fields | {"KAIROS_VLLM_SIDE_CHANNEL_HOST", "KAIROS_VLLM_SIDE_CHANNEL_PORT",
                                     "KAIROS_VLLM_SIDE_CHANNEL_BIND"}
        wcfg = config.load(config.WorkerConfig, env=env)
        assert [c.router_host for c in router_addresses(wcfg)] == routers
        assert set(svcs[name]["depends_on"]) >= set(routers)
    for name in routers:
        rcfg = config.load(config.RouterConfig, env=kairos_env(svcs[name]))
        assert rcfg.bind_host == "0.0.0.0" and rcfg.http_host == "0.0.0.0"
        assert rcfg.work_port == 5555 and rcfg.heartbeat_port == 5556
    lb = svcs["lb"]
    assert any(v.startswith("./docker/haproxy-replicas.cfg:") for v in lb["volumes"])
    cfg = HAPROXY_CFG.read_text()
    assert "option httpchk GET /ready" in cfg
    for name in routers:
        assert f"server {name} {name}:8000 check" in cfg
