"""vLLM engine arguments through the worker commands and `kairos up` (no vLLM needed: the by-name
check of the settings Kairos owns; vLLM's own parser is exercised in tests/vllm/test_engine_args.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common import config
from common.engines import vllm_args
from common.errors import ConfigError


def test_worker_takes_unknown_options_as_vllm_engine_args_with_engine_vllm() -> None:
    cfg = config.flags(["--engine", "vllm", "--model", "/m", "--tensor-parallel-size", "2", "--max-num-seqs=8",
                        "--vllm-engine-args", "--dtype bfloat16", "--trust-remote-code"],
                       config.WorkerConfig, "kairos decode-worker", "")
    assert cfg.model == "/m"
    assert vllm_args.split(cfg.vllm_engine_args) == ["--dtype", "bfloat16", "--tensor-parallel-size", "2",
                                                     "--max-num-seqs=8", "--trust-remote-code"]


def test_worker_refuses_unknown_options_without_engine_vllm() -> None:
    with pytest.raises(ConfigError, match=r"unrecognized arguments: --max-num-seqs 8 .*need --engine vllm"):
        config.flags(["--max-num-seqs", "8"], config.WorkerConfig, "kairos decode-worker", "")


def test_engine_args_from_the_environment() -> None:
    cfg = config.load(config.WorkerConfig, env={"KAIROS_VLLM_ENGINE_ARGS": "--seed 7 --quantization fp8"})
    assert vllm_args.split(cfg.vllm_engine_args) == ["--seed", "7", "--quantization", "fp8"]


@pytest.mark.parametrize("words, named", [
    (["--scheduler-cls", "x.Y"], "scheduler_cls"),
    (["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1"}'], "kv_transfer_config"),
    (["--kv_transfer_config.kv_role=kv_both"], "kv_transfer_config"),
    (["--max-num-batched-tokens", "8192"], "max_num_batched_tokens"),
    (["--long-prefill-token-threshold=64"], "long_prefill_token_threshold"),
    (["--async-scheduling"], "async_scheduling"),
    (["--async-scheduling=true"], "async_scheduling"),
    (["--no-enable-chunked-prefill"], "enable_chunked_prefill"),
    (["--data-parallel-size", "2"], "data_parallel_size"),
    (["--model", "/other"], "model"),
    (["--no-enable-prefix-caching"], "enable_prefix_caching"),
])
def test_owned_settings_are_refused_by_name(words: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=f"set by Kairos \\({named}") as e:
        vllm_args.check_owned(words)
    assert "Remove it" in str(e.value)


@pytest.mark.parametrize("words", [
    ["--no-async-scheduling"], ["--enable-chunked-prefill"], ["--data-parallel-size", "1"],
    ["--tensor-parallel-size", "4", "--gpu-memory-utilization", "0.9", "--max-num-seqs", "128"],
])
def test_values_kairos_agrees_with_pass(words: list[str]) -> None:
    vllm_args.check_owned(words)


def test_a_worker_refuses_more_parallelism_than_gpus_it_sees() -> None:
    tp4 = {"tensor_parallel_size": 4}
    vllm_args.check_gpus(tp4, {})  # nothing says: vLLM finds out
    vllm_args.check_gpus(tp4, {"NVIDIA_VISIBLE_DEVICES": "all"})
    vllm_args.check_gpus(tp4, {"NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c,GPU-d"})
    vllm_args.check_gpus({**tp4, "pipeline_parallel_size": 2}, {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})
    with pytest.raises(ConfigError, match=r"needs 8 GPUs .* sees 4"):
        vllm_args.check_gpus({**tp4, "pipeline_parallel_size": 2}, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    with pytest.raises(ConfigError, match=r"needs 4 GPUs .* sees 1"):
        vllm_args.check_gpus(tp4, {"NVIDIA_VISIBLE_DEVICES": "3"})


def test_kairos_up_passes_engine_args_to_every_worker_and_refuses_owned_ones_before_starting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from kairos.up import Cluster, parse_args, spec_from_args

    (tmp_path / "config.json").write_text("{}")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # kairos up checks vLLM is importable; it need not be here
                        lambda name, *a: object() if name == "vllm" else real(name, *a))
    a = parse_args(["--engine", "vllm", "--model", str(tmp_path), "--prefill", "1", "--decode", "1", "--insecure",
                    "--tensor-parallel-size", "2", "--vllm-engine-args", "--seed 3"])
    services = Cluster(spec_from_args(a)).services
    for name in ("prefill-0", "decode-0"):
        assert services[name].env["KAIROS_VLLM_ENGINE_ARGS"] == "--seed 3 --tensor-parallel-size 2"
    assert "KAIROS_VLLM_ENGINE_ARGS" not in services["router"].env
    with pytest.raises(ConfigError, match="async_scheduling"):
        spec_from_args(parse_args(["--engine", "vllm", "--model", str(tmp_path), "--insecure", "--async-scheduling"]))
    with pytest.raises(SystemExit):
        parse_args(["--max-num-seqs", "8"])  # sim engine: not an engine argument
