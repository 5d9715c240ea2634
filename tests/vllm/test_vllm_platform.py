"""The vLLM integration is correct by construction on every platform.

- Every vLLM internal the scheduler and the wrapper rely on is there on the supported vLLM; a
  missing or changed one (simulated by monkeypatching vLLM) makes the worker refuse to start
  with one line naming it and the supported version.
- CPU-only process settings only on CPU; the NIXL KV buffer device per platform, configurable.
- Async scheduling off, and the scheduler keeps one pending record per scheduled step, so a
  batch queue (step N+1 scheduled before step N is recorded) cannot overwrite a record.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from common.errors import ConfigError
from tests.vllm.helpers import PD, VLLM_MISSING

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or "")]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def sched() -> Any:
    """vLLM's scheduler module, after importing every vLLM module these tests touch (vLLM's
    imports raise deprecation warnings, errors under this suite's filterwarnings=error)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm.v1.core.sched import scheduler

        import common.engines.vllm  # noqa: F401
        from common.engines import vllm_compat

        vllm_compat.problems()  # imports every module a hook lives in
    return scheduler


def test_supported_vllm_has_every_hook() -> None:
    from common.engines import vllm_compat

    assert vllm_compat.vllm_version().split("+")[0] == vllm_compat.SUPPORTED_VLLM
    assert vllm_compat.problems() == []
    vllm_compat.require_supported_vllm()


def test_missing_hook_refuses(sched: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from common.config import WorkerConfig
    from common.engines import make_engine

    monkeypatch.delattr(sched.Scheduler, "_reserve_prefill_lookahead")
    (tmp_path / "config.json").write_text("{}")  # past the model-directory check, which comes first
    cfg = WorkerConfig(engine="vllm", model=str(tmp_path), vllm_profile="cpu-tiny-llama")
    with pytest.raises(ConfigError) as e:
        make_engine(cfg, "decode")
    msg = str(e.value)
    assert "_reserve_prefill_lookahead is missing" in msg and "vllm==0.32.0" in msg, msg


def test_changed_signature_refuses(sched: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from common.engines.vllm_compat import problems, require_supported_vllm

    def schedule(self: Any) -> Any:  # throttle_prefills gone
        return None

    monkeypatch.setattr(sched.Scheduler, "schedule", schedule)
    found = problems()
    assert any(p.endswith("Scheduler.schedule takes (), expected (throttle_prefills, ...)") for p in found), found
    # the other problems: schedule no longer calls the hooks it must (_reserve_prefill_lookahead,
    # _handle_blocked_waiting_request)
    with pytest.raises(ConfigError, match=r"is not supported: .* \(and 2 more\); .* need vllm==0\.32\.0"):
        require_supported_vllm()


def test_hook_no_longer_called_refuses(sched: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The override would exist but never run: the case that fails silently without the check."""
    from common.engines.vllm_compat import require_supported_vllm

    def schedule(self: Any, throttle_prefills: bool = False) -> Any:
        return self.something_else()

    monkeypatch.setattr(sched.Scheduler, "schedule", schedule)
    with pytest.raises(ConfigError, match=r"Scheduler\.schedule no longer calls _reserve_prefill_lookahead"):
        require_supported_vllm()


def test_worker_on_unsupported_vllm_exits_saying_why(tmp_path: Path) -> None:
    """The real worker process, on a vLLM whose hook is gone: exit 2, one JSON line on stdout (the
    start-up failure's form, common/startup.py), no traceback."""
    (tmp_path / "config.json").write_text("{}")  # past the model-directory check, which comes first
    code = ("import vllm.v1.core.sched.scheduler as s; del s.Scheduler._reserve_prefill_lookahead; "
            "import sys, runpy; sys.argv = ['kairos', 'decode-worker']; "
            "runpy.run_module('kairos.cli', run_name='__main__')")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAIROS_")}
    env.update(PYTHONPATH=str(ROOT), KAIROS_ENGINE="vllm", KAIROS_MODEL=str(tmp_path),
               KAIROS_VLLM_PROFILE="cpu-tiny-llama",
               KAIROS_ROUTER_HOST="127.0.0.1", KAIROS_WORK_PORT="1", KAIROS_HEARTBEAT_PORT="1",
               KAIROS_TELEMETRY_PORT="1")
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert line["event"] == "config_invalid" and line["error"].startswith("vllm 0.32.0"), line
    assert "_reserve_prefill_lookahead is missing" in line["error"] and line["fix"], line
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout


def test_cpu_settings_only_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from common.engines.vllm import prepare_process_env

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    prepare_process_env(on_cpu=False)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ and "OMP_NUM_THREADS" not in os.environ
    prepare_process_env(on_cpu=True)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and os.environ["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    prepare_process_env(on_cpu=True)
    assert os.environ["OMP_NUM_THREADS"] == "4", "an operator's explicit value wins"


def test_kv_buffer_device_per_platform() -> None:
    from common.engines.vllm import kv_buffer_device_for, platform_device

    assert platform_device() == "cpu"  # this tier runs the CPU build
    assert kv_buffer_device_for("cpu") == "cpu"
    assert kv_buffer_device_for("cuda") == "cuda"
    assert kv_buffer_device_for("cuda", "cpu") == "cpu"
    with pytest.raises(ConfigError, match="not supported on the cpu platform"):
        kv_buffer_device_for("cpu", "cuda")


@pytest.mark.asyncio(loop_scope="session")
async def test_running_engines_use_the_platform_settings(pd: PD) -> None:
    for engine in (pd.prefill, pd.decode):
        cfg = engine._llm.vllm_config
        assert cfg.scheduler_config.async_scheduling is False
        assert cfg.kv_transfer_config.kv_buffer_device == "cpu" == engine.kv_buffer_device
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # CPU platform


# ------------------------------------------------------------------ the pending step records


class _Sock:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, raw: bytes, flags: int = 0) -> None:
        from common.engines.vllm_scheduler import StepRecord

        self.sent.append(msgspec.msgpack.decode(raw, type=StepRecord))


def _request(rid: str, prompt: int) -> Any:
    return SimpleNamespace(request_id=rid, num_prompt_tokens=prompt, num_computed_tokens=0,
                           num_tokens_with_spec=prompt, sampling_params=SimpleNamespace(extra_args=None))


def test_step_records_survive_a_batch_queue(sched: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 1 is scheduled before step 0 is recorded (vLLM's batch queue): each update must
    complete its own step's record. A single pending slot would send step 1's record for step 0."""
    from common.engines.vllm_scheduler import KairosScheduler

    requests = {"a": _request("a", 64)}
    plan = iter([8, 16])

    def schedule(self: Any, throttle_prefills: bool = False) -> Any:
        n = next(plan)
        requests["a"].num_computed_tokens += n  # vLLM advances it at schedule time
        return SimpleNamespace(total_num_scheduled_tokens=n, num_scheduled_tokens={"a": n})

    monkeypatch.setattr(sched.Scheduler, "schedule", schedule)
    monkeypatch.setattr(sched.Scheduler, "update_from_output", lambda self, so, mo: None)
    s = object.__new__(KairosScheduler)  # the state KairosScheduler.__init__ sets up, without an engine
    sock = _Sock()
    s.__dict__.update(requests=requests, running=[], waiting=[], kv_holding_waiting=[], max_num_scheduled_tokens=256,
                      _bases={}, _others_left=0, _model_steps=0, _dropped=0, _pending={}, _sock=sock,
                      prefix=None)
    out0 = s.schedule()
    out1 = s.schedule()  # the batch queue schedules ahead
    s.update_from_output(out0, None)
    s.update_from_output(out1, None)
    assert [(r.index, r.chunks) for r in sock.sent] == [(0, [("a", 8, 0)]), (1, [("a", 16, 8)])]
    assert s._pending == {}


def test_scheduler_refuses_async_scheduling(sched: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from common.engines.vllm_scheduler import KairosScheduler

    def init(self: Any, *a: Any, **k: Any) -> None:
        self.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=True),
                                           additional_config=None)

    monkeypatch.setattr(sched.Scheduler, "__init__", init)
    with pytest.raises(ValueError, match="needs async_scheduling=False"):
        KairosScheduler()
