"""deploy/kubernetes: every overlay renders and validates, and runs what the compose files run.

- `kubectl kustomize` renders every overlay; `kubernetes-validate --strict` passes on each
  (offline, the API schemas of the oldest and newest Kubernetes we claim); the ServiceMonitor
  component (a CRD, not in those schemas) is checked against the monitor Service by hand.
- GPU overlays request as many `nvidia.com/gpu` per worker as its pool's tensor parallel size
  (overlays/vllm/parallel.yaml, 1 by default), its `--tensor-parallel-size` the same; probes, PodDisruptionBudgets and
  NetworkPolicies are there and select the pods they mean.
- Agreement with compose: overlays/sim against docker-compose.multihost.yml, overlays/vllm
  against docker-compose.yml: the same image, command, probe commands and timings, grace
  periods, ports, and the same effective configuration (the ConfigMap's TOML plus the pod's
  environment, loaded by common/config.py as the service loads it), but for the listed
  network addresses, which differ by design.
- The keys Job's script makes keys once and keeps them on a second run; each role's mounted
  files are what common/sockets.py loads.
- overlays/sim's pods run here as processes (their commands, TOML, environment and key files;
  addresses moved to loopback): the workers register over CURVE and every probe passes.

kubectl comes from scripts/install-kubectl.sh (make test runs it); without it these tests fail
under CI and are skipped elsewhere, saying so.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

yaml = pytest.importorskip("yaml", reason="pyyaml is needed to read the manifests (the dev extra)")

from common import config, sockets  # noqa: E402
from kairos.up import Cluster, ClusterSpec, Service, kairos_cmd  # noqa: E402
from tests.test_compose import duration_s, environment, services  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
VERSIONS = ["1.29.0", "1.37.0"]  # the oldest and newest Kubernetes the manifests are validated for
GPU_COMPOSE = ROOT / "docker-compose.yml"
TWIN = {"sim": ROOT / "docker-compose.multihost.yml", "vllm": GPU_COMPOSE}
CONFIG_OF: dict[str, type[config.BusConfig]] = {
    "router": config.RouterConfig, "monitor": config.MonitorConfig,
    "prefill-worker": config.WorkerConfig, "decode-worker": config.WorkerConfig}
# Fields that differ from compose by design: pods find each other by name, every router replica
# by its own (compose: one router, or one host at 127.0.0.1); the router sits behind a Service.
ADDRESSES = {"router_host", "routers", "telemetry", "bind_host", "http_host",
             "vllm_side_channel_host", "vllm_side_channel_bind", "vllm_side_channel_port"}
# drain_grace_s: the replicas' grace behind a Service; curve_key_name: each router replica's own
# key pair, named after its pod (compose's routers share the default, `router`); http_reuse_port:
# compose's two routers share one host's HTTP port (SO_REUSEPORT), each pod has its own address
# behind the Service; replicas: the pods are replicas of one router (Deployment replicas: 2),
# docker-compose.multihost.yml runs one router.
ROUTER_ONLY = {"drain_grace_s", "curve_key_name", "http_reuse_port", "replicas"}
# Ports that differ by design: compose runs every worker on one host (9201, 9202, ...), each pod
# has its own address (9200 on all); on in one means on in the other.
# docker-compose.yml also gives each of its two routers a metrics port of its own on the shared
# host (its health check and scrape target); a router pod is scraped and probed on its own address.
PORTS = {"metrics_port"}
POD_IP = "10.1.2.3"


def kubectl() -> str:
    for k in (os.environ.get("KAIROS_KUBECTL"), str(Path(sys.executable).parent / "kubectl"), shutil.which("kubectl")):
        if k and Path(k).is_file() and os.access(k, os.X_OK):
            return k
    msg = "no kubectl: run scripts/install-kubectl.sh (make test does)"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


@cache
def render_text(target: str) -> str:
    r = subprocess.run([kubectl(), "kustomize", target], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"kubectl kustomize {target} failed:\n{r.stderr}"
    return r.stdout


def render(overlay: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(render_text(str(K8S / "overlays" / overlay))) if d]


def obj(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"want one {kind}/{name}, found {len(found)}"
    return found[0]


def pod_spec(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = obj(docs, kind, name)["spec"]["template"]["spec"]
    return spec


def validate(path: Path, version: str) -> subprocess.CompletedProcess[str]:
    exe = str(Path(sys.executable).parent / "kubernetes-validate")
    return subprocess.run([exe, "--strict", "--quiet", "-k", version, str(path)],
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------- render and validate


def test_overlays_are_the_documented_ones() -> None:
    assert OVERLAYS == ["sim", "vllm", "vllm-rdma"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_strictly(overlay: str, tmp_path: Path) -> None:
    out = tmp_path / f"{overlay}.yaml"
    out.write_text(render_text(str(K8S / "overlays" / overlay)))
    kinds = {d["kind"] for d in render(overlay)}
    assert {"StatefulSet", "Deployment", "Service", "ConfigMap", "Job", "PodDisruptionBudget",
            "NetworkPolicy"} <= kinds
    for v in VERSIONS:
        r = validate(out, v)
        assert r.returncode == 0, f"{overlay} against Kubernetes {v}:\n{r.stdout}{r.stderr}"


def test_strict_validation_refuses_an_unknown_field(tmp_path: Path) -> None:
    docs = render("sim")
    pod_spec(docs, "StatefulSet", "decode")["containers"][0]["healthCheck"] = {"cmd": "x"}  # not a k8s field
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump_all(docs))
    r = validate(bad, VERSIONS[0])
    assert r.returncode != 0 and "healthCheck" in r.stdout + r.stderr


def test_servicemonitor_component_selects_the_monitor_service(tmp_path: Path) -> None:
    # kustomize wants relative paths to other kustomizations
    rel = os.path.relpath(K8S, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{rel}/overlays/sim]\ncomponents: [{rel}/components/servicemonitor]\n")
    docs = [d for d in yaml.safe_load_all(render_text(str(tmp_path))) if d]
    sm = obj(docs, "ServiceMonitor", "kairos-monitor")
    svc = obj(docs, "Service", "monitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
    assert "metrics" in {p["name"] for p in svc["spec"]["ports"]}
    assert "ServiceMonitor" not in {d["kind"] for d in render("sim")}  # optional: not in the overlays
    pm = obj(docs, "PodMonitor", "kairos-workers")
    for owner in ("prefill", "decode"):
        labels = obj(docs, "StatefulSet", owner)["spec"]["template"]["metadata"]["labels"]
        assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics"]


# ------------------------------------------------------------------- what the issue asks for


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpus_one_per_vllm_worker_none_elsewhere(overlay: str) -> None:
    docs = render(overlay)
    for kind, name in [("StatefulSet", "prefill"), ("StatefulSet", "decode"), ("StatefulSet", "router"),
                       ("Deployment", "monitor")]:
        res = pod_spec(docs, kind, name)["containers"][0]["resources"]
        assert "memory" in res["limits"] and "memory" in res["requests"] and "cpu" in res["requests"]
        want = "1" if overlay.startswith("vllm") and name in ("prefill", "decode") else None
        assert res["limits"].get("nvidia.com/gpu") == want, (overlay, name)
        assert res["requests"].get("nvidia.com/gpu") == want, (overlay, name)
    rdma = [pod_spec(docs, "StatefulSet", w)["containers"][0]["securityContext"]["capabilities"].get("add")
            for w in ("prefill", "decode")]
    assert rdma == ([["IPC_LOCK"]] * 2 if overlay == "vllm-rdma" else [None, None])


def test_gpu_pools_take_their_parallel_size_from_one_value_each(tmp_path: Path) -> None:
    """overlays/vllm/parallel.yaml: TP8 prefill and TP4 decode (Llama-2-70B, docs/deployment.md) give
    each prefill pod 8 GPUs and --tensor-parallel-size 8, each decode pod 4 and 4; the ConfigMap that
    holds the values is not applied."""
    from common.engines import vllm_args

    shutil.copytree(K8S, tmp_path / "kubernetes")
    parallel = tmp_path / "kubernetes" / "overlays" / "vllm" / "parallel.yaml"
    text = parallel.read_text()
    assert 'prefill: "1"' in text and 'decode: "1"' in text
    parallel.write_text(text.replace('prefill: "1"', 'prefill: "8"').replace('decode: "1"', 'decode: "4"'))
    for overlay in ("vllm", "vllm-rdma"):
        out = subprocess.run([kubectl(), "kustomize", str(tmp_path / "kubernetes" / "overlays" / overlay)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        assert not [d for d in docs if d["metadata"]["name"] == "kairos-parallel"]
        for pool, tp in (("prefill", 8), ("decode", 4)):
            (c,) = pod_spec(docs, "StatefulSet", pool)["containers"]
            assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == str(tp)
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert vllm_args.split(env["KAIROS_VLLM_ENGINE_ARGS"]) == ["--tensor-parallel-size", str(tp)]
            vllm_args.check_gpus({"tensor_parallel_size": tp}, {"NVIDIA_VISIBLE_DEVICES": ",".join(["GPU"] * tp)})


def labels_of(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, str]:
    labels: dict[str, str] = obj(docs, kind, name)["spec"]["template"]["metadata"]["labels"]
    return labels


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return bool(selector["matchLabels"].items() <= labels.items())


def test_probes_disruption_budgets_and_network_policies() -> None:
    docs = render("sim")
    router, monitor = pod_spec(docs, "StatefulSet", "router"), pod_spec(docs, "Deployment", "monitor")
    rc = router["containers"][0]
    assert rc["readinessProbe"]["exec"]["command"] == ["kairos", "health", "router", "--ready"]
    assert rc["livenessProbe"]["exec"]["command"] == ["kairos", "health", "router"]
    assert rc["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    assert monitor["containers"][0]["livenessProbe"]["exec"]["command"] == ["kairos", "health", "monitor"]
    pods = {n: labels_of(docs, k, n) for k, n in [("StatefulSet", "router"), ("Deployment", "monitor"),
                                                 ("StatefulSet", "prefill"), ("StatefulSet", "decode")]}
    for w in ("prefill", "decode"):
        c = pod_spec(docs, "StatefulSet", w)["containers"][0]
        assert c["readinessProbe"]["exec"]["command"][:3] == ["kairos", "health", "worker"]
        assert "livenessProbe" not in c  # a router outage must not restart every worker
        assert obj(docs, "StatefulSet", w)["spec"]["updateStrategy"] == {"type": "RollingUpdate"}
    # A router restart (rollout, eviction) refuses no connection: two replicas behind the Service,
    # one down at a time, and the leaving one keeps serving (drain_grace_s, after the preStop) while
    # its endpoint is removed, before it stops listening (issue 48; docs/deployment.md)
    assert obj(docs, "StatefulSet", "router")["spec"]["replicas"] >= 2
    for overlay in OVERLAYS:
        cm = next(d for d in render(overlay) if d["kind"] == "ConfigMap"
                  and d["metadata"]["name"].startswith("kairos-config"))
        assert tomllib.loads(cm["data"]["router.toml"])["drain_grace_s"] > 0, overlay
    for name in ("router", "prefill", "decode"):  # a drain takes one pod of a pool at a time
        pdb = obj(docs, "PodDisruptionBudget", name)["spec"]
        assert pdb["maxUnavailable"] == 1
        assert [n for n, lab in pods.items() if selects(pdb["selector"], lab)] == [name]
    nps = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    for n, lab in pods.items():  # every pod is under a policy, so what is not allowed is refused
        assert any(selects(np["podSelector"], lab) for np in nps.values()), n
    allowed: dict[int, set[str]] = {}
    for rule in nps["kairos-router"]["ingress"]:
        froms = {n for n, lab in pods.items() for f in rule.get("from", [])
                 if selects(f["podSelector"], lab)} if "from" in rule else {"anyone"}
        for p in rule["ports"]:
            allowed.setdefault(p["port"], set()).update(froms)
    assert allowed == {8000: {"anyone"}, 5555: {"prefill", "decode"}, 5556: {"prefill", "decode"}, 5557: {"monitor"}}
    workers_rule, metrics_rule = nps["kairos-workers"]["ingress"]
    assert "ports" not in workers_rule  # the KV path: UCX picks its ports
    assert metrics_rule == {"ports": [{"protocol": "TCP", "port": 9200}]}  # /metrics only, from anyone
    peers = workers_rule["from"][0]["podSelector"]
    assert {n for n, lab in pods.items() if selects(peers, lab)} == {"prefill", "decode"}


# ------------------------------------------------------------------- agreement with compose


def effective_config(cls: type[config.BusConfig], env: dict[str, str]) -> dict[str, Any]:
    return msgspec.structs.asdict(config.load(cls, env=env))


def pod_env(container: dict[str, Any], pod_name: str, configmap: dict[str, Any], tmp: Path) -> dict[str, str]:
    """The container's environment as the service sees it, with its KAIROS_CONFIG file written out."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            field = e["valueFrom"]["fieldRef"]["fieldPath"]
            env[e["name"]] = {"metadata.name": pod_name, "status.podIP": POD_IP}[field]
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "config")
    rel = Path(env["KAIROS_CONFIG"]).relative_to(mount)
    (tmp / pod_name).mkdir()
    (tmp / pod_name / rel).write_text(configmap["data"][str(rel)])
    env["KAIROS_CONFIG"] = str(tmp / pod_name / rel)
    return env


def compose_probe(svc: dict[str, Any]) -> tuple[list[str], dict[str, float]]:
    hc = svc["healthcheck"]
    assert hc["test"][0] == "CMD"
    return hc["test"][1:], {"periodSeconds": duration_s(hc["interval"]), "timeoutSeconds": duration_s(hc["timeout"]),
                            "failureThreshold": hc["retries"]}


@pytest.mark.parametrize("overlay", sorted(TWIN))
def test_manifests_run_what_compose_runs(overlay: str, tmp_path: Path) -> None:
    docs, compose = render(overlay), services(TWIN[overlay])
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("kairos-config"))
    pods = {"router": ("StatefulSet", "router"), "monitor": ("Deployment", "monitor")}
    pods |= {n: ("StatefulSet", n.split("-")[0]) for n in compose if n.startswith(("prefill-", "decode-"))}
    assert len(pods) == 6 and set(pods) <= set(compose)
    checked = 0
    for name, (kind, owner) in pods.items():
        svc, spec = compose[name], pod_spec(docs, kind, owner)
        (c,) = spec["containers"]
        assert c["image"] == svc["image"], name
        assert c["args"] == svc["command"] and "command" not in c, name  # the image's ENTRYPOINT is kairos
        assert spec["terminationGracePeriodSeconds"] >= duration_s(svc["stop_grace_period"]), name
        # the same configuration, field by field
        cls = CONFIG_OF[svc["command"][0]]
        compose_env = {k: v for k, v in environment(svc).items() if v is not None}
        want = effective_config(cls, compose_env)
        got = effective_config(cls, pod_env(c, name, cm, tmp_path))
        for cfg in (want, got):  # vLLM engine arguments: the same words (compose's may end in a space)
            if "vllm_engine_args" in cfg:
                cfg["vllm_engine_args"] = " ".join(cfg["vllm_engine_args"].split())
        differ = {f for f in want if want[f] != got[f]}
        assert differ <= ADDRESSES | ROUTER_ONLY | PORTS, (name, {f: (want[f], got[f]) for f in differ - ADDRESSES})
        for f in PORTS & set(want) - ({"metrics_port"} if name == "router" else set()):
            assert bool(want[f]) == bool(got[f]), (name, f, want[f], got[f])
            if got[f]:  # the pod declares it, named for the PodMonitor
                assert {"name": "metrics", "containerPort": got[f]} in c.get("ports", []), name
        assert not differ & ROUTER_ONLY or name == "router"
        assert got["log_format"] == "json" and got["curve_keys_dir"] == "/var/lib/kairos/keys"
        if cls is config.WorkerConfig:
            assert got["worker_id"] == name  # the pod's name is the compose service's worker id
        # UCX settings passed through as compose does
        for k in ("UCX_TLS", "UCX_NET_DEVICES"):
            assert {e["name"]: e.get("value") for e in c.get("env", [])}.get(k) == (environment(svc).get(k) or None)
        # ports: one containerPort per port the service listens on
        listens = {"router": ["http_port", "work_port", "heartbeat_port", "telemetry_port"], "monitor": ["http_port"]}
        fields = listens.get(name, ["vllm_side_channel_port"] if name.startswith("prefill") else [])
        fields += ["metrics_port"] if got.get("metrics_port") else []
        assert sorted(p["containerPort"] for p in c.get("ports", [])) == sorted(got[f] for f in fields), name
        # probes: compose's health check command and timings
        cmd, timing = compose_probe(svc)
        probe = c["readinessProbe"]
        if name == "router" and TWIN[overlay] == GPU_COMPOSE:
            # docker-compose.yml asks each router's own metrics port (two share the host's HTTP port)
            assert cmd[3:5] == ["--url", f"http://127.0.0.1:{want['metrics_port']}"], cmd
            cmd = cmd[:3]
        if name == "router":
            assert c["livenessProbe"]["exec"]["command"] == cmd
            assert probe["exec"]["command"] == [*cmd, "--ready"]
        elif name == "monitor":
            assert c["livenessProbe"]["exec"]["command"] == probe["exec"]["command"] == cmd
        else:  # the router URL: the router Service here, the one router in compose
            i = cmd.index("--router-url")
            assert probe["exec"]["command"][:i + 1] == cmd[:i + 1] and len(probe["exec"]["command"]) == len(cmd)
        for p in ("livenessProbe", "readinessProbe"):
            if p in c:
                assert {k: c[p][k] for k in timing} == timing, (name, p)
        checked += 1
    assert checked == 6


# ------------------------------------------------------------------- CURVE keys


def job_script(docs: list[dict[str, Any]]) -> str:
    (init,) = pod_spec(docs, "Job", "kairos-keys")["initContainers"]
    assert init["command"] == ["sh", "-c"]
    script: str = init["args"][0]
    return script


def run_job_script(script: str, work: Path, existing: Path) -> dict[str, str]:
    script = script.replace("/existing", str(existing)).replace("/work", str(work))
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    secret = yaml.safe_load((work / "secret.json").read_text())
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "kairos-bus-keys"
    data: dict[str, str] = secret["data"]
    return data


def materialize(docs: list[dict[str, Any]], kind: str, owner: str, data: dict[str, str], d: Path) -> Path:
    """The `keys` volume as the kubelet writes it into the pod: only the Secret items listed."""
    vol = next(v for v in pod_spec(docs, kind, owner)["volumes"] if v["name"] == "keys")["secret"]
    assert vol["secretName"] == "kairos-bus-keys"
    for item in vol["items"]:
        (d / item["path"]).parent.mkdir(parents=True, exist_ok=True)
        (d / item["path"]).write_bytes(base64.b64decode(data[item["key"]]))
    return d


def test_keys_job_makes_keys_once_and_each_role_loads_its_files(tmp_path: Path) -> None:
    docs = render("sim")
    first = run_job_script(job_script(docs), tmp_path / "w1", tmp_path / "none")
    ids = ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    routers = ["router-0", "router-1"]  # the StatefulSet's pods, a key pair each
    assert {"monitor.key", "monitor.key_secret", *(f"{i}.key" for i in ids + routers),
            *(f"{i}.key_secret" for i in ids + routers)} <= set(first)
    assert "worker.key" not in first  # no shared worker key
    existing = tmp_path / "existing"  # the Secret as the Job's pod sees it the second time
    existing.mkdir()
    for k, v in first.items():
        (existing / k).write_bytes(base64.b64decode(v))
    assert run_job_script(job_script(docs), tmp_path / "w2", existing) == first  # kept, not rotated

    ctx = zmq.Context()
    try:
        for kind, name, cls, role in [("StatefulSet", "router", config.RouterConfig, None),
                                      ("Deployment", "monitor", config.MonitorConfig, sockets.MONITOR_DOMAIN),
                                      ("StatefulSet", "decode", config.WorkerConfig, sockets.WORKER_DOMAIN),
                                      ("StatefulSet", "prefill", config.WorkerConfig, sockets.WORKER_DOMAIN)]:
            d = materialize(docs, kind, name, first, tmp_path / f"mounted-{name}")
            cfg = cls(curve_keys_dir=str(d))
            sock = ctx.socket(zmq.DEALER)
            try:
                if role is None:  # the router: its key pair and both allow-lists, each worker key bound to its id
                    for r in routers:  # each pod serves with the pair named after it
                        sockets.curve_server(sock, cls(curve_keys_dir=str(d), curve_key_name=r),  # type: ignore[arg-type]
                                             sockets.WORKER_DOMAIN)
                    assert sorted(p.name for p in sockets.allow_list(d, sockets.MONITOR_DOMAIN).iterdir()) == [
                        "monitor.key"]
                    assert sorted(v or "" for v in sockets.worker_key_ids(cfg).values()) == sorted(ids)  # type: ignore[arg-type]
                elif role == sockets.MONITOR_DOMAIN:
                    sockets.curve_client(sock, cfg, role, routers[0])  # type: ignore[arg-type]
                else:  # a pool's pods: each finds the key named after its pod (its worker id)
                    for i in ids:
                        if i.startswith(name):
                            assert sockets.worker_key_name(cfg, i) == i  # type: ignore[arg-type]
                            sockets.curve_client(sock, cfg, i, routers[1])  # type: ignore[arg-type]
                    assert not any((d / f"{i}.key_secret").exists() for i in ids if not i.startswith(name))
                if role is not None:  # clients check each router's own key, and never get a router's secret
                    assert all(sockets.server_key(cfg, r) for r in routers)  # type: ignore[arg-type]
                    assert not list(d.glob("router*.key_secret"))
            finally:
                sock.close(0)
    finally:
        ctx.term()


# ------------------------------------------------------------------- the pods, run here


def test_sim_pods_run_as_processes_and_pass_their_probes(tmp_path: Path) -> None:
    """overlays/sim's router, monitor, prefill-0 and decode-0 as local processes: their command,
    their TOML and environment, their role's key files from the keys Job's script; only the
    addresses are moved to loopback ports. Workers register over CURVE, every probe passes."""
    docs = render("sim")
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    keys = run_job_script(job_script(docs), tmp_path / "job", tmp_path / "none")
    spec = ClusterSpec.ephemeral(prefill=1, decode=1, log_dir=str(tmp_path / "logs"))
    bus = {"KAIROS_ROUTER_HOST": "127.0.0.1", "KAIROS_WORK_PORT": str(spec.work_port),
           "KAIROS_HEARTBEAT_PORT": str(spec.heartbeat_port), "KAIROS_TELEMETRY_PORT": str(spec.telemetry_port)}
    loopback = {
        "router": {"KAIROS_BIND_HOST": "127.0.0.1", "KAIROS_HTTP_HOST": "127.0.0.1",
                   "KAIROS_HTTP_PORT": str(spec.http_port)},
        "monitor": {"KAIROS_HTTP_HOST": "127.0.0.1", "KAIROS_HTTP_PORT": str(spec.monitor_port),
                    "KAIROS_TELEMETRY": f"127.0.0.1:{spec.telemetry_port}:router-0"},
        "worker": {"KAIROS_ROUTERS": f"127.0.0.1:{spec.work_port}:{spec.heartbeat_port}:router-0"}}
    cluster = Cluster(spec)
    cluster.services = {}
    containers = {}
    for name, pod, kind, owner in [("router", "router-0", "StatefulSet", "router"),
                                   ("monitor", "monitor", "Deployment", "monitor"),
                                   ("prefill-0", "prefill-0", "StatefulSet", "prefill"),
                                   ("decode-0", "decode-0", "StatefulSet", "decode")]:
        (c,) = pod_spec(docs, kind, owner)["containers"]
        d = materialize(docs, kind, owner, keys, tmp_path / f"keys-{name}")
        env = {**pod_env(c, pod, cm, tmp_path), **bus, **loopback.get(name, loopback["worker"]),
               "KAIROS_CURVE_KEYS_DIR": str(d)}
        assert c["args"][0] in CONFIG_OF and len(c["args"]) == 1
        cluster.services[name] = Service(name, kairos_cmd(c["args"][0]), env)
        containers[name] = c
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KAIROS_")}
    cluster.start(timeout=90)
    try:
        for name, c in containers.items():
            for p in ("startupProbe", "livenessProbe", "readinessProbe"):
                if p not in c:
                    continue
                cmd = [spec.api if a == "http://router:8000" else a for a in c[p]["exec"]["command"]]
                assert cmd[0] == "kairos"
                r = subprocess.run([sys.executable, "-m", "kairos.cli", *cmd[1:]], capture_output=True, text=True,
                                   timeout=30, env={**clean, **cluster.services[name].env}, cwd=ROOT)
                assert r.returncode == 0, f"{name} {p}: {r.stdout}{r.stderr}"
    finally:
        cluster.stop(20)
