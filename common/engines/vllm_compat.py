"""The vLLM internals Kairos relies on, checked before an engine starts.

`KairosScheduler` overrides private hooks of vLLM's `Scheduler`, and the engine wrapper reads a
few private attributes. On another vLLM version an override whose name or signature changed is
silently never called (chunk schedules stop being enforced, with no error), so a worker checks
every one of them at start and refuses to start, naming what is missing, instead of serving
wrong schedules. The list below is exactly what common/engines/vllm.py and vllm_scheduler.py
use; keep it in step with them.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from common.errors import ConfigError

SUPPORTED_VLLM = "0.32.0"


@dataclass(frozen=True)
class Hook:
    """One vLLM internal: `module:qualname`, and what it must look like.

    params: the leading parameter names of a callable (after self), in order.
    called_by: methods of the same class that must call it (its name in their code), so that an
      override is not silently bypassed.
    attrs: instance attributes the class's __init__ must set.
    fields: dataclass fields the class must have.
    """

    target: str
    params: tuple[str, ...] | None = None
    called_by: tuple[str, ...] = ()
    attrs: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()


SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
HOOKS: tuple[Hook, ...] = (
    # the scheduler (vllm_scheduler.KairosScheduler)
    Hook(SCHEDULER, attrs=("running", "waiting", "kv_holding_waiting", "requests", "max_num_scheduled_tokens",
                           "vllm_config")),
    Hook(SCHEDULER + "._reserve_prefill_lookahead", params=("request", "num_computed_tokens", "num_new_tokens"),
         called_by=("schedule",)),
    Hook(SCHEDULER + ".schedule", params=("throttle_prefills",)),
    Hook(SCHEDULER + ".update_from_output", params=("scheduler_output", "model_runner_output")),
    Hook(SCHEDULER + ".shutdown", params=()),
    # resumed grammars (KairosScheduler._handle_blocked_waiting_request)
    Hook(SCHEDULER + "._handle_blocked_waiting_request", params=("request",), called_by=("schedule",)),
    Hook(SCHEDULER, attrs=("grammar_compile_error_reqs",)),
    Hook("vllm.v1.request:RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"),
    Hook("vllm.v1.request:Request", attrs=("status", "structured_output_request", "prompt_token_ids")),
    Hook("vllm.v1.structured_output.request:StructuredOutputRequest.grammar"),
    Hook("vllm.v1.structured_output.backend_types:StructuredOutputGrammar.accept_tokens",
         params=("request_id", "tokens")),
    # the prefix cache's events (vllm_prefix.PrefixTranslator, KairosScheduler._KeepEvents)
    Hook(SCHEDULER, attrs=("enable_kv_cache_events", "kv_event_publisher", "kv_cache_manager")),
    Hook("vllm.distributed.kv_events:NullEventPublisher.publish", params=("events",)),
    Hook("vllm.distributed.kv_events:NullEventPublisher.shutdown", params=()),
    Hook("vllm.distributed.kv_events:EventBatch", fields=("events",)),
    Hook("vllm.distributed.kv_events:BlockStored", fields=("block_hashes", "parent_block_hash", "token_ids",
                                                           "block_size", "lora_id", "medium", "lora_name",
                                                           "extra_keys")),
    Hook("vllm.distributed.kv_events:BlockRemoved", fields=("block_hashes", "medium")),
    Hook("vllm.distributed.kv_events:AllBlocksCleared"),
    Hook("vllm.config:KVEventsConfig", fields=("enable_kv_cache_events", "publisher")),
    Hook("vllm.outputs:RequestOutput", attrs=("num_cached_tokens", "num_cache_creation_tokens")),
    Hook("vllm.v1.request:Request", attrs=("num_computed_tokens", "num_prompt_tokens", "sampling_params",
                                           "request_id")),
    Hook("vllm.v1.request:Request.num_tokens_with_spec"),
    # the engine wrapper (vllm.VllmEngine)
    Hook("vllm.engine.arg_utils:AsyncEngineArgs",
         fields=("scheduler_cls", "additional_config", "async_scheduling", "enable_logging_iteration_details",
                 "kv_cache_memory_bytes", "long_prefill_token_threshold", "kv_transfer_config",
                 "kv_events_config")),
    Hook("vllm.config:KVTransferConfig", fields=("kv_connector", "kv_role", "kv_load_failure_policy",
                                                 "kv_buffer_device", "engine_id")),
    Hook("vllm.v1.engine.async_llm:AsyncLLM.from_engine_args", params=("engine_args",)),
    Hook("vllm.v1.engine.async_llm:AsyncLLM.generate", params=("prompt", "sampling_params", "request_id")),
    Hook("vllm.v1.engine.async_llm:AsyncLLM.notify_kv_transfer_request_rejected",
         params=("request_id", "kv_transfer_params")),
    Hook("vllm.v1.engine.async_llm:AsyncLLM.reset_prefix_cache"),
    Hook("vllm.v1.engine.async_llm:AsyncLLM.errored"),
    Hook("vllm.v1.metrics.loggers:StatLoggerBase.record", params=("scheduler_stats", "iteration_stats")),
    Hook("vllm.v1.metrics.stats:SchedulerIterationDetails",
         fields=("iteration_index", "num_ctx_tokens", "num_generation_requests", "is_dummy")),
    # the KV connector (vllm_nixl.NixlConnector): vLLM's pull connector, its worker's agent config
    Hook("vllm.config:KVTransferConfig", fields=("kv_connector_module_path", "kv_connector_extra_config")),
    Hook("vllm.config:KVTransferConfig.get_from_extra_config", params=("key", "default")),
    Hook("vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector:NixlPullConnector.__init__",
         params=("vllm_config", "role", "kv_cache_config")),
    Hook("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker:nixl_agent_config"),
    # (its __init__ must still read the module's nixl_agent_config when it builds nixl_wrapper)
    Hook("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker:NixlBaseConnectorWorker",
         attrs=("nixl_agent_config", "nixl_wrapper")),
    # the NIXL side channel (vLLM reads these at engine start)
    Hook("vllm.envs:VLLM_NIXL_SIDE_CHANNEL_HOST"),
    Hook("vllm.envs:VLLM_NIXL_SIDE_CHANNEL_PORT"),
)


def _resolve(target: str) -> Any:
    """The object at `module:qualname`; AttributeError/ImportError when it is not there."""
    module, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
    return obj


def _function(obj: Any) -> Any:
    if isinstance(obj, (staticmethod, classmethod)):
        return obj.__func__
    if isinstance(obj, property):
        return obj.fget
    return obj


def _code_names(fn: Any) -> set[str]:
    """Every name the function's code (and its nested code) refers to."""
    code = getattr(_function(fn), "__code__", None)
    names: set[str] = set()
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if inspect.iscode(k))
    return names


def check_hook(hook: Hook) -> str | None:
    """What is wrong with one hook, or None."""
    try:
        obj = _resolve(hook.target)
    except (ImportError, AttributeError):
        return f"{hook.target} is missing"
    if hook.params is not None:
        try:
            sig = inspect.signature(_function(obj))
        except (TypeError, ValueError):
            return f"{hook.target} is not a function"
        names = [p for p in sig.parameters if p not in ("self", "cls")]
        if tuple(names[: len(hook.params)]) != hook.params:
            return f"{hook.target} takes ({', '.join(names)}), expected ({', '.join(hook.params)}, ...)"
    if hook.called_by:
        owner, _, name = hook.target.rpartition(".")
        cls = _resolve(owner)
        for caller in hook.called_by:
            if name not in _code_names(inspect.getattr_static(cls, caller, None)):
                return f"{owner}.{caller} no longer calls {name}"
    if hook.attrs:
        init_names = _code_names(inspect.getattr_static(obj, "__init__", None))
        for attr in hook.attrs:
            if attr not in init_names and not hasattr(obj, attr):
                return f"{hook.target} no longer has the attribute {attr!r}"
    if hook.fields:
        have = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
        if not have:  # pydantic dataclasses and plain classes: look at the annotations
            have = set(getattr(obj, "__annotations__", {}))
        for f in hook.fields:
            if f not in have:
                return f"{hook.target} no longer has the field {f!r}"
    return None


def vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except ImportError:
        return "not installed"


def problems() -> list[str]:
    """Every hook that is missing or changed (empty on the supported vLLM)."""
    return [p for p in (check_hook(h) for h in HOOKS) if p is not None]


def require_supported_vllm() -> None:
    """Raise ConfigError (the worker exits 2 with this one line) when an internal we rely on changed."""
    found = problems()
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ConfigError(f"vllm {vllm_version()} is not supported: {found[0]}{more}; Kairos's scheduler "
                          f"hooks need vllm=={SUPPORTED_VLLM} (pip install 'vllm=={SUPPORTED_VLLM}')")
