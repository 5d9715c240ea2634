"""A real local cluster with its monitor, a short mixed load, and readers for /metrics."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kairos.up import Cluster, ClusterSpec

LONG_PROMPT = " ".join(["word"] * 2000)   # 2000 tokens with the simple tokenizer: a long prefill
SHORT_PROMPT = "hello world, how are you"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def monitor_url(c: Cluster) -> str:
    return f"http://127.0.0.1:{c.spec.monitor_port}"


def start_monitored(tmp: Path, **kw: object) -> Cluster:
    """2 prefill + 2 decode workers on the default (A100-like) profile, policy kairos, monitor on;
    the role planner off unless the test sets KAIROS_PLANNER (a flip would move what it checks)."""
    kw["router_env"] = {"KAIROS_PLANNER": "false", **dict(kw.get("router_env") or {})}  # type: ignore[call-overload]
    c = Cluster(ClusterSpec.ephemeral(log_dir=str(tmp), **kw))
    try:
        c.start(timeout=60)
        wait_monitor_sees_workers(c, c.spec.prefill + c.spec.decode)
    except BaseException:
        c.stop(5)
        raise
    return c


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def wait_monitor_sees_workers(c: Cluster, n: int, timeout: float = 20.0) -> None:
    """Until the monitor reports `n` workers: its subscription is live, so no decision is missed."""
    def ok() -> bool:
        r = httpx.get(monitor_url(c) + "/api/state", timeout=2.0)
        return r.status_code == 200 and len(r.json()["workers"]) == n
    wait_until(ok, timeout, f"the monitor to report {n} workers")


def send_burst(api: str, n_long: int, n_short: int, max_tokens: int = 16) -> list[str]:
    """All requests at once (threads behind a barrier), so long prompts overlap and some of them
    cannot be deflected (one in-place prefill per decode worker): both routes appear."""
    prompts = [LONG_PROMPT] * n_long + [SHORT_PROMPT] * n_short
    routes: list[str] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(prompts))

    def one(prompt: str) -> None:
        try:
            with httpx.Client(timeout=30.0) as client:
                barrier.wait(timeout=10)
                r = client.post(api + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens})
                r.raise_for_status()
                routes.append(r.headers["x-kairos-route"])
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(routes) == len(prompts)
    return routes


class LoadInBackground:
    """Keeps a few clients busy until stopped (the dashboard tests need traffic while they look)."""

    def __init__(self, api: str, clients: int = 4) -> None:
        self.api = api
        self.stop = threading.Event()
        self.sent = 0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=30.0) as client:
            n = 0
            while not self.stop.is_set():
                prompt = LONG_PROMPT if (n + i) % 3 == 0 else SHORT_PROMPT
                try:
                    client.post(self.api + "/v1/completions", json={"prompt": prompt, "max_tokens": 24})
                    self.sent += 1
                except httpx.HTTPError:
                    time.sleep(0.1)
                n += 1

    def __enter__(self) -> LoadInBackground:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(40)


def parse_metrics(text: str) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def with_name(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


@pytest.fixture(scope="module")
def monitored_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_monitored(tmp_path_factory.mktemp("monitored"))
    yield c
    c.stop(20)
