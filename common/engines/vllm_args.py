"""vLLM engine arguments, as `vllm serve` takes them, for a Kairos vLLM worker.

A worker passes every engine argument vLLM defines (`--tensor-parallel-size 4`, `--max-num-seqs 128`,
`--gpu-memory-utilization 0.9`, `--quantization fp8`, `--trust-remote-code`, `--seed 1`, ...) to
vLLM's `AsyncEngineArgs`. They come from `vllm_engine_args` (a shell-quoted string: the worker's
`--vllm-engine-args`, KAIROS_VLLM_ENGINE_ARGS in compose's `.env` and the Kubernetes overlays) and from
any option of the worker's (or `kairos up`'s) command line that Kairos itself does not define, when the
engine is vllm. They are parsed by vLLM's own parser (`AsyncEngineArgs.add_cli_args`), so the names,
aliases (`-tp`), value checks and `--foo.bar=baz` forms are vLLM's, whatever the pinned version defines.

Some settings Kairos must own (OWNED): its scheduler, the KV connector and role, the chunk sizes,
the prefix-cache events, synchronous steps. A user value that conflicts with Kairos's is refused before
the engine starts, with a ConfigError that names the argument, why, and what to set instead.
`check_owned` does this by name without importing vLLM (kairos up runs it before starting anything);
`parse` does it again on vLLM's parsed values (aliases and dotted forms included) in the worker.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from common.errors import ConfigError

ANY = object()  # OWNED: any explicit value is refused

# dest -> (the value Kairos requires, or ANY: any explicit value is refused; why, and what to set instead)
OWNED: dict[str, tuple[object, str]] = {
    "model": (ANY, "the worker's --model (KAIROS_MODEL) names the model; the router loads its tokenizer from it"),
    "scheduler_cls": (ANY, "Kairos runs its own scheduler in vLLM (KairosScheduler) to execute the router's "
                           "chunk schedules"),
    "kv_transfer_config": (ANY, "Kairos sets the KV connector (NIXL, pull) and the KV role from the worker's role "
                                "(prefill: producer, decode: consumer); set --vllm-kv-buffer-device and "
                                "--vllm-side-channel-* for its placement"),
    "kv_events_config": (ANY, "Kairos reads the prefix cache's events to report them to the router; turn the "
                              "prefix cache off with --no-prefix-cache"),
    "enable_prefix_caching": (ANY, "the router must know whether the worker keeps a prefix cache: use Kairos's "
                                   "--prefix-cache / --no-prefix-cache (KAIROS_PREFIX_CACHE)"),
    "max_num_batched_tokens": (ANY, "the step's token budget is the chunk schedule's: set --vllm-token-budget "
                                    "(or --prefill-token-budget / --decode-token-budget)"),
    "long_prefill_token_threshold": (ANY, "the largest in-place prefill chunk is the chunk schedule's: set "
                                          "--decode-chunk"),
    "enable_chunked_prefill": (True, "the chunk schedule needs chunked prefill"),
    "async_scheduling": (False, "KairosScheduler runs the router's chunk schedule one synchronous step at a time "
                                "(vLLM's async scheduling plans a step before the previous one ends)"),
    "skip_tokenizer_init": (ANY, "Kairos sets it per role (prefill engines run without a tokenizer; decode "
                                 "engines load it for structured outputs)"),
    "enable_logging_iteration_details": (True, "Kairos measures every step from vLLM's iteration details"),
    "data_parallel_size": (1, "one Kairos worker is one vLLM engine the router schedules: run more workers "
                              "(--decode N, compose/Kubernetes replicas) instead of vLLM's data parallelism"),
}


def split(text: str) -> list[str]:
    """The argument words of a shell-quoted string (KAIROS_VLLM_ENGINE_ARGS)."""
    try:
        return shlex.split(text)
    except ValueError as e:
        raise ConfigError(f"vllm_engine_args {text!r} is not valid shell quoting: {e}", key="vllm_engine_args",
                          fix="quote the vLLM engine arguments as a shell would (KAIROS_VLLM_ENGINE_ARGS)") from e


def join(words: Sequence[str]) -> str:
    return shlex.join(words)


def _dest(word: str) -> str | None:
    """The dest an option word names by vLLM's conventions (`--max_num_seqs`, `--no-foo`, `--a.b=c`)."""
    if not word.startswith("--"):
        return None
    return word[2:].split("=", 1)[0].split(".", 1)[0].replace("-", "_")


def _refusal(option: str, dest: str, value: object) -> ConfigError:
    required, why = OWNED[dest]
    shown = "" if value is ANY else f" {value!r}"
    return ConfigError(f"vLLM engine argument {option}{shown} is set by Kairos ({dest}"
                       + ("" if required is ANY else f" = {required!r}") + f"): {why}. Remove it from the "
                       "worker's engine arguments (--vllm-engine-args / KAIROS_VLLM_ENGINE_ARGS)",
                       key="vllm_engine_args", argument=option, owned=dest,
                       fix=f"remove {option} from the vLLM engine arguments (--vllm-engine-args, "
                           f"KAIROS_VLLM_ENGINE_ARGS, or the command line): {why}")


def check_owned(words: Sequence[str]) -> None:
    """Refuse, by name and without vLLM, an engine argument Kairos owns (its value is checked only
    where a value alone could conflict: `parse` checks those on vLLM's parsed values)."""
    for i, w in enumerate(words):
        dest = _dest(w)
        if dest is None:
            continue
        neg = dest.startswith("no_") and dest[3:] in OWNED
        key = dest[3:] if neg else dest
        if key not in OWNED:
            continue
        required, _ = OWNED[key]
        if required is ANY:
            raise _refusal(w.split("=", 1)[0], key, ANY)
        if isinstance(required, bool):
            given = not neg if "=" not in w else w.split("=", 1)[1].lower() in ("1", "true", "yes", "on")
            if given != required:
                raise _refusal(w, key, given)
        else:
            value = w.split("=", 1)[1] if "=" in w else (words[i + 1] if i + 1 < len(words) else "")
            if str(value) != str(required):
                raise _refusal(w.split("=", 1)[0], key, value)


def visible_gpus(env: Mapping[str, str]) -> int | None:
    """How many GPUs this process may use, from CUDA_VISIBLE_DEVICES or NVIDIA_VISIBLE_DEVICES (what
    Docker's and Kubernetes' NVIDIA device support set); None when neither says (unset, "all")."""
    for var in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        text = env.get(var)
        if text is None or text.strip() in ("all", ""):
            continue
        if text.strip() in ("void", "none"):
            return 0
        return len([d for d in text.split(",") if d.strip()])
    return None


def check_gpus(args: Mapping[str, Any], env: Mapping[str, str]) -> None:
    """Refuse an engine that needs more GPUs (tensor x pipeline parallel size) than it can see."""
    need = int(args.get("tensor_parallel_size") or 1) * int(args.get("pipeline_parallel_size") or 1)
    seen = visible_gpus(env)
    if seen is not None and need > seen:
        raise ConfigError(
            f"the vLLM engine needs {need} GPUs (tensor parallel size {args.get('tensor_parallel_size') or 1} x "
            f"pipeline parallel size {args.get('pipeline_parallel_size') or 1}) but this worker sees {seen} "
            f"(CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES): give it {need} GPUs (compose: KAIROS_GPU_<WORKER> "
            "as a comma list; Kubernetes: the pool's nvidia.com/gpu) or lower --tensor-parallel-size",
            key="vllm_engine_args", needed=need, visible=seen,
            fix=f"give this worker {need} GPUs or lower --tensor-parallel-size / --pipeline-parallel-size")


class _Refused(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    """vLLM's own `vllm serve` engine-argument parser; its errors raise instead of exiting."""
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layouts
        from vllm.utils import FlexibleArgumentParser
    from vllm.engine.arg_utils import AsyncEngineArgs

    class Parser(FlexibleArgumentParser):  # type: ignore[misc]
        def error(self, message: str) -> Any:
            raise _Refused(message)

        def exit(self, status: int = 0, message: str | None = None) -> Any:  # --help
            raise _Refused(message or "exit")

    parser = Parser(prog="vllm engine arguments", add_help=False)
    return AsyncEngineArgs.add_cli_args(parser)  # type: ignore[no-any-return]


def parse(words: Sequence[str]) -> dict[str, Any]:
    """The AsyncEngineArgs fields the words set, by vLLM's parser: {field: value} for those that
    differ from vLLM's defaults. ConfigError for an argument vLLM does not define, a bad value, or a
    setting Kairos owns that conflicts with Kairos's."""
    check_owned(words)
    if not words:
        return {}
    parser = _parser()
    try:
        default = vars(parser.parse_args([]))
        given = vars(parser.parse_args(list(words)))
    except _Refused as e:
        raise ConfigError(f"vLLM engine arguments {join(words)!r}: {e}", key="vllm_engine_args",
                          fix="correct the vLLM engine arguments: `vllm serve --help` lists them (its server "
                              "options, e.g. --host, --port, --api-key, --tool-call-parser, are the router's: "
                              "`kairos router --help`)") from e
    out: dict[str, Any] = {}
    for dest, value in given.items():
        try:
            same = bool(value == default.get(dest))
        except Exception:  # a value without a usable ==: count it as given
            same = False
        if not same:
            out[dest] = value
    for dest, value in out.items():
        if dest in OWNED:
            required, _ = OWNED[dest]
            if required is ANY or value != required:
                option = "--" + dest.replace("_", "-")
                raise _refusal(option, dest, value)
    extra = out.get("additional_config")
    if isinstance(extra, dict) and "kairos" in extra:
        raise ConfigError("vLLM engine argument --additional-config may not hold a 'kairos' key: Kairos passes its "
                          "scheduler's settings there. Remove it from the worker's engine arguments")
    return out
