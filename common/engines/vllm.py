"""The `vllm` engine: vLLM 0.32.0's AsyncLLM behind the Engine interface, for both roles.

Roles and the KV protocol (docs/reference/vllm.md sections 1-2):
- prefill role = KV producer. Each request runs with `max_tokens=1` and
  `kv_transfer_params={"do_remote_decode": True, ...}`; vLLM keeps the prompt's KV blocks and
  returns `kv_transfer_params` naming them (engine id, side-channel host/port, block ids).
  They go out untouched as `Prefilled.kv_params`; the router relays them in `KvHandle.params`.
- decode role = KV consumer. mode="handoff" submits the prompt with the relayed params: vLLM
  reads the blocks from the prefill engine over NIXL, recomputes the last prompt token and
  generates every output token (the first included). mode="deflect" submits it without KV
  params and with the router's chunk schedule in `extra_args["kairos_chunks"]`; the
  `KairosScheduler` (common/engines/vllm_scheduler.py) runs exactly those chunks, decodes first.
- Tokenizers: the prefill engine runs without one (`skip_tokenizer_init`); the decode engine loads
  the model's, which vLLM's structured outputs need to build a request's grammar
  (`Sampling.structured`: response_format, structured_outputs, tool_choice). Output text is still
  detokenized by the router (`detokenize=False`).

Pull, not push (`NixlConnector`, not `NixlPushConnector`). The router picks the decode worker
before prefill starts, but the prefill worker learns it only through the router, and in vLLM
0.32 push does not start any earlier: the decode side can register its blocks with the
prefill engine only once it holds the prefill engine's returned params (push_scheduler.py
reads remote_engine_id/host/port/tp_size from them), so the same relay is needed and push only
adds a registration round trip and a reverse handshake. With pull the decode side reads when
it has admitted the request (its KV room is checked first), the prefill side never needs to
know the decode side, and a failure is seen where it matters: the reading side gets it at once
(a failed handshake or READ ends the request with finish_reason "error"), whereas push leaves
the decode side waiting on a watchdog for a WRITE that never comes (480 s by default).

KV transfer failure: `kv_load_failure_policy="fail"` (never vLLM's silent recompute). When a
handoff ends in "error" before its first token, or no first token came within `kv_timeout`
seconds (a hung peer keeps a NIXL transfer "in progress" forever), the request is aborted
and resubmitted without KV params: an explicit in-place prefill, counted in `kv_fallbacks`,
logged with its reason and reported through `on_kv_fallback`.

Process layout. vLLM 0.32's AsyncLLM always runs the engine core in a child process
(`EngineCoreClient.make_client` refuses asyncio without multiprocessing; on CPU it is spawned).
On the CPU platform only, `VLLM_ENABLE_V1_MULTIPROCESSING=0` makes that core run the model
in-process (uniproc executor) instead of a third process, and `OMP_NUM_THREADS=1` keeps CPU
steps at milliseconds; on GPUs both are left as vLLM intends (an operator's explicit values
always win for OMP_NUM_THREADS). They are set before the core is started and inherited by it, as
are the NIXL side-channel variables, set per engine under a lock. The KV connector is vLLM's
pull `NixlConnector` loaded through common/engines/vllm_nixl.py, which on the CPU platform builds
its NIXL agent without the progress thread: NIXL's Python API makes that thread poll with a zero
timeout, a whole core spinning per engine even when idle (see that module).

Platform settings. Async scheduling is turned off (vLLM 0.32 turns it on by default on CUDA;
KairosScheduler refuses it: see vllm_scheduler.py). `kv_buffer_device` is the platform's device
by default (cuda on NVIDIA GPUs, cpu on CPU) and may be set to cpu on GPUs to stage KV through
host memory when the NIC/UCX build cannot register GPU memory. Before starting, the engine
checks every vLLM internal it relies on (vllm_compat.py) and refuses to start on a vLLM whose
hooks changed.

The NIXL side channel. vLLM binds its handshake listener on VLLM_NIXL_SIDE_CHANNEL_HOST and
advertises the same host to decode engines in `kv_transfer_params`. `side_channel_host` is the
address decode hosts reach; `side_channel_bind` (default: the same) is what the listener binds,
e.g. 0.0.0.0 when the advertised name is a DNS name or a container's network alias; the
prefill engine then rewrites `remote_host` in the params it returns to the advertised address.

Role changes (kv_both). An engine starts in vLLM's `kv_both` KV role by default (vllm_kv_both):
with vLLM 0.32's pull NixlConnector the direction of each transfer is the request's own
(`do_remote_decode` makes a request a producer's, `do_remote_prefill` a consumer's), so one engine
can prefill for others and read others' KV. What kv_role still changes there (read in the pinned
vLLM): a producer role recomputes a request preempted while its hand-off is pending
(`requires_kv_delivery`), a consumer role defers freeing blocks when batches overlap (async
scheduling, which Kairos turns off, or pipeline parallelism) and exports a KV-fetch gauge; NIXL
refuses consumer and kv_both roles with prefill context parallelism (such an engine keeps its
role) and logs once that kv_both is deprecated in favour of the per-instance roles. It costs
nothing measurable on the step path (docs/operations.md, "Role changes");
the one difference at start is that a prefill engine loads the tokenizer too (a decode engine
needs it for structured outputs). `switch_role` then moves the engine between roles in place
when it holds nothing but the decodes the worker keeps (the worker drained the rest): the same
AsyncLLM, weights, KV and prefix cache and NIXL side channel; only what Kairos does per role
changes (which requests `add` takes, their sampling, the load it reports). Each request is a
task of its own streaming from vLLM, so a decode running when a decode engine switches to the
prefill role streams on to its end there (`keeps_decodes`; the prefill role reports it in its
load's batch); it takes no new decode in that role. The token budget and the in-place chunk
(long_prefill_token_threshold) stay those it started with: vLLM fixes them at start.

Because the scheduler lives in the core process, chunk schedules
travel with each request (`extra_args`), and per-step records come back from the scheduler
over a ZeroMQ PUSH/PULL pair (ipc, in a private temp dir); vLLM's iteration details arrive
through a stat logger and are cross-checked against them. See vllm_scheduler.py for why the
step time is measured by the scheduler and not taken from `elapsed_ms`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import zmq

from common import logging as klog
from common.engines.base import Engine, EngineLoad, EngineRequest, Prefilled, PrefixEvents
from common.engines.step_error import TARGET, StepErrorEstimator
from common.errors import ConfigError, KvTransferError, Overloaded
from common.messages import Coeffs, StructuredOutputs, TokenItem, TokenLogprobs
from common.perf_model import PerfModel, Profile, StepSample, fit
from common.ports import free_port
from common.prediction_error import STEP_ERROR_MAXLEN, STEP_ERROR_WINDOW_S, ErrorWindow

if TYPE_CHECKING:
    from common.config import WorkerConfig


def prepare_process_env(on_cpu: bool) -> None:
    """CPU-platform settings the spawned engine core inherits (see the module docstring); none on GPUs."""
    if on_cpu:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # an operator's explicit value wins


def platform_device() -> str:
    """vLLM's platform device type: 'cpu' on the CPU build, 'cuda' on NVIDIA GPUs."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


KV_BUFFER_DEVICES = {"cpu": ("cpu",), "cuda": ("cuda", "cpu")}  # vLLM 0.32's NIXL connector accepts these


def kv_buffer_device_for(platform: str, wanted: str = "") -> str:
    """The NIXL KV buffer device: `wanted`, or the platform's own device; ConfigError if unsupported."""
    device = wanted or platform
    allowed = KV_BUFFER_DEVICES.get(platform, (platform,))
    if device not in allowed:
        raise ConfigError(f"vllm_kv_buffer_device={device!r} is not supported on the {platform} platform: "
                          f"use {' or '.join(allowed)} (or leave it empty for {platform})")
    return device


from common.engines.vllm_scheduler import CHUNKS_KEY, ID_KEY, RESUME_KEY, StepRecord  # noqa: E402

SCHEDULER_CLS = "common.engines.vllm_scheduler.KairosScheduler"
CREATED_KEY = "kairos_cache_created_tokens"  # in a prefill's kv_params: its num_cache_creation_tokens
KV_CONNECTOR = "NixlConnector"  # pull; see the module docstring
KV_CONNECTOR_MODULE = "common.engines.vllm_nixl"  # vLLM's pull connector, progress thread off on CPU
PROGRESS_THREAD_KEY = "kairos_progress_thread"  # in kv_connector_extra_config, read by vllm_nixl.NixlConnector

_ENV_LOCK = threading.Lock()  # os.environ is process-wide; one engine is created at a time
_log = klog.get()


@dataclass(eq=False)
class _Held:
    req: EngineRequest
    key: str
    submitted: float
    task: asyncio.Task[None] | None = None
    computed: int = 0
    generated: int = 0
    first_chunk_at: float | None = None
    kv_wait: bool = False          # handoff still waiting for its KV (no token yet)
    fallback: str | None = None    # reason, once the KV path was abandoned
    cached: int | None = None      # prompt tokens vLLM found in a prefix cache (reported with the first token)
    created: int | None = None     # handoff: prompt tokens the prefill engine added to its cache

    @property
    def prompt_len(self) -> int:
        return len(self.req.prompt_token_ids)

    @property
    def in_place(self) -> bool:
        return self.req.mode == "deflect" or self.fallback is not None

    @property
    def remaining(self) -> int:
        """Prompt tokens still to compute: before the first chunk is recorded, all but what the
        router expects the prefix cache to hold (vLLM always recomputes the last one)."""
        done = self.computed or min(self.req.cached_tokens, self.prompt_len - 1)
        return max(self.prompt_len - done, 0)


class VllmEngine(Engine):
    """AsyncLLM for one role. Construct, `await start()`, run `run()` as a task; see the module
    docstring. Of the Engine interface's optional parts it calls `on_kv_fallback(request_id, reason)`
    and `on_failed(request_id, attempt, reason, retryable=True)` (a request that cannot complete here;
    retryable=False when vLLM refused the request itself, a ValueError), reports `waiting_kv()`,
    `max_model_len` and `block_size`, refits its step-time model (`refit`, `predict_with`) and moves
    KV between roles itself (`moves_kv`)."""

    name = "vllm"
    can_refit = True
    moves_kv = True

    def __init__(self, role: Literal["prefill", "decode"], *, model: str, max_model_len: int = 2048,
                 kv_cache_mib: int = 256, token_budget: int = 512, max_batch: int = 64, default_chunk: int = 0,
                 side_channel_host: str = "127.0.0.1", side_channel_port: int = 5600, kv_timeout: float = 10.0,
                 max_queue_requests: int = 1024, profile: Profile | None = None, prefix_caching: bool = True,
                 overrun_target: float = TARGET,
                 dtype: str | None = None, enforce_eager: bool | None = None, seed: int = 0,
                 cache_root: str | None = None, kv_transfer: bool = True, engine_id: str | None = None,
                 kv_buffer_device: str = "", side_channel_bind: str = "",
                 otlp_traces_endpoint: str = "", engine_args: dict[str, Any] | None = None,
                 profile_store: str | None = None, kv_both: bool = True) -> None:
        super().__init__()
        # no profile and a store: start() loads this engine's measured profile, or measures it (measured.py)
        self.profile_store = profile_store
        self.profile_keys: dict[str, str] = {}
        self.profile_measured = False
        self.measuring = False  # measured.measure runs: a prefill engine serves in-place requests too
        self.otlp_traces_endpoint = otlp_traces_endpoint  # vLLM's own tracing (its llm_request spans); "": off
        # vLLM engine arguments the operator gave (vllm_args.parse: vLLM's names, Kairos's owned ones
        # already refused); those Kairos also has a setting for win over it
        self.engine_args = dict(engine_args or {})
        # vLLM's kv_both KV role: the engine produces and consumes KV, so it takes either role in place
        # (switch_role; see the module docstring, "Role changes"); off: kv_producer or kv_consumer.
        # vLLM's NixlConnector refuses kv_both with prefill context parallelism: such an engine keeps its role
        pcp = int(self.engine_args.get("prefill_context_parallel_size") or 1)
        self.kv_both = kv_both and kv_transfer and pcp == 1
        self.can_switch_role = self.kv_both
        # its requests are tasks of their own, not a batch of Kairos's: a decode streaming when the
        # engine switches to prefill goes on (`switch_role(keep=...)`); it only takes no new one there
        self.keeps_decodes = self.kv_both
        max_batch = int(self.engine_args.get("max_num_seqs") or max_batch)
        max_model_len = int(self.engine_args.get("max_model_len") or max_model_len)
        if token_budget <= max_batch:
            raise ValueError(f"token_budget ({token_budget}) must exceed max_batch ({max_batch}): "
                             "each step carries one token per decode plus the prefill chunks")
        self.role = role
        self.model_dir = model
        self.max_model_len = max_model_len
        self.kv_cache_mib = kv_cache_mib
        self.token_budget = token_budget
        self.max_batch = max_batch
        self.default_chunk = default_chunk
        self.side_channel_host = side_channel_host
        self.side_channel_port = side_channel_port
        self.side_channel_bind = side_channel_bind or side_channel_host
        self.kv_buffer_device = kv_buffer_device  # "" until start(): the platform's device
        self.kv_timeout = kv_timeout
        self.max_queue_requests = max_queue_requests
        self.profile = profile
        self.prefix_caching = prefix_caching
        self.dtype = dtype
        self.enforce_eager = enforce_eager
        self.seed = seed
        self.cache_root = cache_root
        self.kv_transfer = kv_transfer
        self.engine_id = engine_id
        self.kv_capacity_tokens = 0  # known after start()
        self.block_size = 0

        self._llm: Any = None
        self._held: dict[str, _Held] = {}        # by request_id
        self._by_key: dict[str, _Held] = {}      # by the id vLLM sees
        self._pending_items: list[TokenItem] = []
        self._background: set[asyncio.Task[None]] = set()
        self._flush_scheduled = False
        self._step_ms: deque[float] = deque(maxlen=64)
        self.samples: deque[StepSample] = deque(maxlen=4096)      # wall time: what the requests felt
        self.cpu_samples: deque[StepSample] = deque(maxlen=4096)  # engine-core CPU time (for profiling)
        self.step_records: deque[StepRecord] = deque(maxlen=4096)
        # every step's measured / predicted time (step_error.py): margin and bias in the heartbeats,
        # predicted by the model routers are told (the profile's until a refit is accepted: predict_with)
        self.overrun_target = overrun_target
        self.estimator = StepErrorEstimator(target=overrun_target)
        self.step_errors = ErrorWindow(window_s=STEP_ERROR_WINDOW_S, maxlen=STEP_ERROR_MAXLEN)
        self._predict: PerfModel | None = profile.model if profile is not None else None
        self.iteration_details: deque[Any] = deque(maxlen=4096)
        self._details_by_index: dict[int, Any] = {}
        self._records_by_index: dict[int, StepRecord] = {}
        self.steps = 0
        self.steps_dropped = 0
        self.step_mismatches = 0
        self.chunk_misses = 0
        self.kv_fallbacks = 0
        self.kv_fallback_reasons: Counter[str] = Counter()
        self._prefix_net: dict[int, bool] = {}  # block hash -> stored (True) / removed, since the last take
        self._prefix_cleared = False
        self._prefix_held: set[int] = set()     # what the cache holds, as reported so far
        self._prefix_resync = False             # _prefix_net outgrew its bound: send everything instead
        self._tmpdir: str | None = None
        self._zctx: zmq.Context[Any] | None = None
        self._pull: zmq.Socket[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None


    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        from common.engines.vllm_compat import require_supported_vllm

        require_supported_vllm()  # a changed vLLM internal: refuse now, not serve wrong schedules
        if not os.path.isdir(self.model_dir):
            raise FileNotFoundError(f"vllm engine: model directory {self.model_dir!r} does not exist "
                                    "(make one with `kairos make-tiny-model DIR`)")
        self._loop = asyncio.get_running_loop()
        self._tmpdir = tempfile.mkdtemp(prefix="kairos-vllm-")
        addr = f"ipc://{self._tmpdir}/steps"
        self._zctx = zmq.Context()
        self._pull = self._zctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 100_000)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(addr)
        self._loop.add_reader(int(self._pull.getsockopt(zmq.FD)), self._drain_steps)
        t0 = time.monotonic()
        # AsyncLLM's constructor blocks until the core is up (seconds): keep it off the loop.
        self._llm = await asyncio.to_thread(self._make_llm, addr)
        cache = self._llm.vllm_config.cache_config
        self.block_size = int(cache.block_size)
        self.kv_capacity_tokens = int(cache.num_gpu_blocks or 0) * self.block_size
        _log.info("vllm_engine_started", role=self.role, kv_role=self.kv_role if self.kv_transfer else None,
                  model=self.model_dir, seconds=round(time.monotonic() - t0, 2), pid=os.getpid(),
                  kv_capacity_tokens=self.kv_capacity_tokens, block_size=self.block_size,
                  side_channel=f"{self.side_channel_host}:{self.side_channel_port}" if self.kv_transfer else None,
                  side_channel_bind=self.side_channel_bind if self.kv_transfer else None,
                  kv_buffer_device=self.kv_buffer_device or None,
                  engine_args={k: v if isinstance(v, (int, float, str, bool)) else str(v)
                               for k, v in self.engine_args.items()} or None)
        if self.profile is None and self.profile_store:
            await self._own_profile(Path(self.profile_store))

    async def _own_profile(self, store: Path) -> None:
        """This engine's stored profile, or one measured now (common/engines/measured.py)."""
        from common.engines.measured import device_name, keys_of, profile_for, stored_path

        self.profile_keys = keys_of(self._llm.vllm_config, model=self.model_dir,
                                    device=device_name(platform_device()), vllm_version=_vllm_version())
        t0 = time.monotonic()
        self.profile, self.profile_measured = await profile_for(self, store, self.profile_keys)
        self.predict_with(self.profile.model)
        _log.info("profile_measured" if self.profile_measured else "profile_loaded", role=self.role,
                  path=str(stored_path(store, self.profile_keys)), seconds=round(time.monotonic() - t0, 2),
                  fit_mape=self.profile.fit_mape.get("all"), keys=self.profile_keys)

    def _make_llm(self, step_channel: str) -> Any:
        device = platform_device()
        on_cpu = device == "cpu"
        self.kv_buffer_device = kv_buffer_device_for(device, self.kv_buffer_device)
        prepare_process_env(on_cpu)
        with _ENV_LOCK:
            saved = {k: os.environ.get(k) for k in
                     ("VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_CACHE_ROOT")}
            os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = self.side_channel_bind
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
            if self.cache_root:
                os.environ["VLLM_CACHE_ROOT"] = self.cache_root
            try:
                from vllm.config import KVEventsConfig, KVTransferConfig
                from vllm.engine.arg_utils import AsyncEngineArgs
                from vllm.v1.engine.async_llm import AsyncLLM

                kv_cfg = None
                if self.kv_transfer:
                    # our NixlConnector (vllm_nixl.py): vLLM's, without NIXL's spinning progress thread on CPU
                    kv_cfg = KVTransferConfig(
                        kv_connector=KV_CONNECTOR, kv_connector_module_path=KV_CONNECTOR_MODULE,
                        kv_connector_extra_config={PROGRESS_THREAD_KEY: not on_cpu},
                        kv_role=self.kv_role,
                        kv_load_failure_policy="fail", engine_id=self.engine_id,
                        kv_buffer_device=self.kv_buffer_device)
                args = AsyncEngineArgs(**self.engine_kwargs(on_cpu, step_channel, kv_cfg, KVEventsConfig))
                return AsyncLLM.from_engine_args(args, stat_loggers=[self._stat_logger_factory()])
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v

    def engine_kwargs(self, on_cpu: bool, step_channel: str, kv_cfg: Any, events_cls: Any) -> dict[str, Any]:
        """AsyncEngineArgs' fields: Kairos's settings, then the operator's engine arguments (those
        Kairos owns were refused by vllm_args.parse). A given --gpu-memory-utilization or
        --kv-cache-memory-bytes sizes the KV cache instead of vllm_kv_cache_mib."""
        user = self.engine_args
        kw: dict[str, Any] = dict(
            model=self.model_dir, dtype=self.dtype or ("float32" if on_cpu else "auto"),
            enforce_eager=on_cpu if self.enforce_eager is None else self.enforce_eager,
            max_model_len=self.max_model_len, max_num_seqs=self.max_batch,
            enable_chunked_prefill=True, max_num_batched_tokens=self.token_budget,
            long_prefill_token_threshold=self.default_chunk,
            enable_prefix_caching=self.prefix_caching,
            # the prefix cache's events, kept in the core process (no publisher socket):
            # KairosScheduler translates them and sends them with its step records
            kv_events_config=events_cls(enable_kv_cache_events=True, publisher="null") if self.prefix_caching else None,
            # a prefill engine needs no tokenizer, unless it may become a decode engine (kv_both)
            seed=self.seed, skip_tokenizer_init=self.role == "prefill" and not self.kv_both,
            enable_logging_iteration_details=True,
            disable_log_stats=True, scheduler_cls=SCHEDULER_CLS, async_scheduling=False,
            kv_transfer_config=kv_cfg)
        if "gpu_memory_utilization" not in user and "kv_cache_memory_bytes" not in user:
            kw["kv_cache_memory_bytes"] = self.kv_cache_mib << 20
        kw.update(user)
        if self.otlp_traces_endpoint:  # vLLM's spans join the request's trace (DecodeWork.traceparent)
            kw["otlp_traces_endpoint"] = self.otlp_traces_endpoint
        kw["additional_config"] = {**(user.get("additional_config") or {}), "kairos": {"step_channel": step_channel}}
        return kw

    @property
    def kv_role(self) -> str:
        """vLLM's KVTransferConfig.kv_role for this engine."""
        if self.kv_both:
            return "kv_both"
        return "kv_producer" if self.role == "prefill" else "kv_consumer"

    def role_fixed(self) -> str:
        if not self.kv_transfer:
            return "the vllm engine runs without a KV connector (kv_transfer off), so it cannot change role"
        if int(self.engine_args.get("prefill_context_parallel_size") or 1) > 1:
            return (f"the vllm engine was started with kv_role {self.kv_role}: vLLM's NIXL connector refuses "
                    "kv_both with --prefill-context-parallel-size above 1")
        return (f"the vllm engine was started with kv_role {self.kv_role} (vllm_kv_both off), which it keeps "
                "until it restarts")

    def switch_role(self, role: Literal["prefill", "decode"], keep: Collection[str] = ()) -> str:
        """Take `role` in place: the same AsyncLLM, its KV cache, prefix cache and NIXL side channel
        (KV of finished prefills still leased to decode engines stays readable). Only what the
        role decides here changes: which requests `add` takes, their sampling and the load report.
        The step-time figures of the other role go; the prefix cache is reported afresh (whole)."""
        if role == self.role:
            return ""
        if not self.can_switch_role:
            return self.role_fixed()
        others = [rid for rid in self._held if rid not in keep]
        if others:
            return f"the engine still holds {len(others)} requests (the worker drains before it changes role)"
        if busy := [rid for rid, h in self._held.items() if h.req.mode == "prefill"]:
            return f"requests {busy[:3]} are prefills: only decodes stream on in the new role"
        _log.info("vllm_role_switched", role=role, previous=self.role, kv_role=self.kv_role,
                  engine_id=self.engine_id, token_budget=self.token_budget, kept=len(self._held))
        self.role = role
        self._step_ms.clear()
        self._prefix_resync = True  # the new role's reporter starts empty: send it everything the cache holds
        return ""

    def _stat_logger_factory(self) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        engine = self

        class _IterationDetailsLogger(StatLoggerBase):  # type: ignore[misc]
            """Collects vLLM's per-step iteration details (runs in AsyncLLM's output handler)."""

            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                details = getattr(scheduler_stats, "iteration_details", None)
                if details is not None and not details.is_dummy:
                    engine._on_details(details)

            def log_engine_initialized(self) -> None:
                pass

        return _IterationDetailsLogger

    async def run(self) -> None:
        """vLLM steps itself; this loop watches that it stays alive and returns only when cancelled."""
        while True:
            await asyncio.sleep(0.5)
            if self._llm is not None and self._llm.errored:
                raise RuntimeError(f"vllm engine core died: {self._llm.dead_error}")

    async def close(self) -> None:
        for h in list(self._held.values()):
            if h.task is not None:
                h.task.cancel()
        tasks = [h.task for h in self._held.values() if h.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        if self._llm is not None:
            llm, self._llm = self._llm, None
            handler = getattr(llm, "output_handler", None)
            if handler is not None:  # stop reading first, else it logs the core's exit as an error
                handler.cancel()
            await asyncio.to_thread(llm.shutdown)
        if self._pull is not None and self._loop is not None:
            self._loop.remove_reader(int(self._pull.getsockopt(zmq.FD)))
            self._pull.close(linger=0)
            self._pull = None
        if self._zctx is not None:
            self._zctx.term()
            self._zctx = None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    async def reset_prefix_cache(self, timeout: float = 10.0) -> bool:
        """Drop vLLM's prefix cache (tests and benchmarks that replay one prompt on purpose).

        vLLM refuses while blocks of finished or aborted requests are not yet freed (an aborted
        handoff keeps its blocks until its NIXL handshake gives up), so retry until `timeout`."""
        deadline = time.monotonic() + timeout
        while not await self._llm.reset_prefix_cache():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    # -- Engine interface -------------------------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        if self._llm is None:
            raise RuntimeError("vllm engine not started")
        if req.request_id in self._held:
            raise ValueError(f"request {req.request_id} is already held")
        if len(self._held) >= self.max_queue_requests:
            raise Overloaded(f"{self.role} engine holds {len(self._held)} requests (limit {self.max_queue_requests})")
        if self.role == "prefill" and req.mode != "prefill" and not self.measuring:
            raise ValueError(f"prefill engine got mode {req.mode!r}")
        if self.role == "decode":
            if req.mode == "prefill":
                raise ValueError("decode engine got mode 'prefill'")
            if req.mode == "handoff" and (req.kv is None or not req.kv.params):
                raise ValueError(f"handoff {req.request_id} carries no kv params to load")
            if not self.can_admit(len(req.prompt_token_ids), req.sampling.max_tokens):
                if req.mode == "handoff" and req.kv is not None:
                    self.release_kv(f"{req.request_id}:{req.attempt}:rejected", req.kv.params)
                raise Overloaded(f"decode engine KV full ({self._kv_free()} tokens free, "
                                 f"{len(req.prompt_token_ids) + req.sampling.max_tokens} needed)")
        h = _Held(req=req, key=f"{req.request_id}:{req.attempt}", submitted=time.monotonic(),
                  kv_wait=req.mode == "handoff")
        self._held[req.request_id] = h
        self._by_key[h.key] = h
        serve = self._serve_prefill(h) if req.mode == "prefill" else self._serve_decode(h)
        h.task = asyncio.get_running_loop().create_task(serve, name=f"vllm-{h.key}")

    def release_kv(self, key: str, kv_params: dict[str, object]) -> None:
        """Decode role: tell the prefill engine to free the KV blocks of a handoff this engine will
        not load (refused, or cancelled before it was added), instead of holding them until the
        lease expires (vLLM's notify_kv_transfer_request_rejected)."""
        if self._llm is None or self.role != "decode" or not kv_params:
            return
        task = asyncio.get_running_loop().create_task(
            self._llm.notify_kv_transfer_request_rejected(key, dict(kv_params)), name=f"vllm-release-{key}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def abort(self, request_id: str) -> bool:
        h = self._held.pop(request_id, None)
        if h is None:
            return False
        self._by_key.pop(h.key, None)
        if h.task is not None:
            h.task.cancel()  # cancelling the generate() consumer aborts the request in vLLM
        return True

    def held(self) -> list[str]:
        return list(self._held)

    def lower_tbt_slo(self, request_id: str, tbt_slo: float) -> bool:
        """Its budget as the load reports it (`strictest_tbt_slo`: the routers' view of this
        worker's room). The steps themselves follow the chunk schedules the router planned."""
        h = self._held.get(request_id)
        if h is None or h.req.tbt_slo <= tbt_slo:
            return False
        h.req.tbt_slo = tbt_slo
        return True

    def take_prefix_events(self) -> PrefixEvents | None:
        """What vLLM's prefix cache stored and evicted since the last call (see vllm_prefix.py);
        None with prefix caching off."""
        if not self.prefix_caching or self.block_size <= 0:
            return None
        self._drain_steps()
        if self._prefix_resync:
            self._prefix_resync = self._prefix_cleared = False
            self._prefix_net = {}
            return PrefixEvents(block_tokens=self.block_size, stored=list(self._prefix_held), cleared=True)
        net, self._prefix_net = self._prefix_net, {}
        cleared, self._prefix_cleared = self._prefix_cleared, False
        return PrefixEvents(block_tokens=self.block_size, stored=[h for h, s in net.items() if s],
                            removed=[h for h, s in net.items() if not s], cleared=cleared)

    def waiting_kv(self) -> int:
        """Decode role: handed-off requests whose KV has not landed yet (DecodeHeartbeat.waiting_kv)."""
        return sum(1 for h in self._held.values() if h.kv_wait)

    def can_admit(self, prompt_tokens: int, max_tokens: int) -> bool:
        return self._kv_free() >= prompt_tokens + max_tokens

    def _kv_free(self) -> int:
        reserved = sum(h.prompt_len + h.req.sampling.max_tokens for h in self._held.values())
        return self.kv_capacity_tokens - reserved

    def coeffs(self) -> Coeffs | None:
        return self.profile.model.to_coeffs() if self.profile is not None else None

    def predict_with(self, model: PerfModel) -> None:
        """Measure step error against `model` from now on (the worker's accepted refit, which it
        reports to the routers): the ratios so far were against another model, so they go."""
        self._predict = model
        self.estimator = StepErrorEstimator(target=self.overrun_target)
        self.step_errors = ErrorWindow(window_s=STEP_ERROR_WINDOW_S, maxlen=STEP_ERROR_MAXLEN)

    def refit(self, min_samples: int = 64) -> tuple[PerfModel, float] | None:
        """Least-squares refit of the step-time model on this engine's recent steps, or None."""
        if len(self.samples) < min_samples:
            return None
        return fit(list(self.samples), base=self.profile.model if self.profile else None)

    def load(self) -> EngineLoad:
        held = list(self._held.values())
        steps = sorted(self._step_ms)
        p50 = steps[len(steps) // 2] if steps else 0.0
        mx = steps[-1] if steps else 0.0
        if self.role == "prefill":
            prefills = [h for h in held if h.req.mode == "prefill"]
            kept = [h for h in held if h.req.mode != "prefill"]  # decodes kept across a switch from decode
            return self.step_errors.fill(EngineLoad(
                queued_tokens=sum(h.remaining for h in prefills), queued_requests=len(prefills), step_ms_p50=p50,
                step_ms_max=mx, steps=self.steps, step_bias=self.estimator.bias(),
                batch=len(kept), kv_tokens=sum(h.prompt_len + h.generated for h in kept),
                strictest_tbt_slo=min((h.req.tbt_slo for h in kept), default=None),
                step_margin=self.estimator.margin()), time.monotonic())
        decoding = [h for h in held if h.generated > 0]
        prefilling = [h for h in held if h.generated == 0 and h.in_place]
        remaining = sum(h.remaining for h in prefilling)
        return self.step_errors.fill(EngineLoad(
            queued_tokens=remaining, queued_requests=len(held),
            batch=len(decoding), kv_tokens=sum(h.prompt_len + h.generated for h in decoding),
            kv_free_tokens=self._kv_free(), kv_capacity_tokens=self.kv_capacity_tokens,
            resident_prefill_tokens=remaining, deflections=len(prefilling),
            strictest_tbt_slo=min((h.req.tbt_slo for h in held), default=None),
            step_ms_p50=p50, step_ms_max=mx, steps=self.steps,
            step_margin=self.estimator.margin(), step_bias=self.estimator.bias()), time.monotonic())

    # -- serving one request ----------------------------------------------------------------
    def _sampling(self, req: EngineRequest, *, max_tokens: int, extra: dict[str, Any], delta: bool) -> Any:
        """vLLM's SamplingParams for this request. The prefill role samples one token that nobody
        sees (the decode side recomputes the last prompt token and samples every output token,
        the first included), so it takes only what changes the prompt's own work: prompt logprobs.
        A handoff's decode side gets no prompt logprobs: its prompt KV was computed elsewhere."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = req.sampling
        kind = RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY
        if self.role == "prefill" and req.mode != "handoff":  # (a handoff kept across a switch decodes)
            return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                                  prompt_logprobs=s.prompt_logprobs, output_kind=kind, extra_args=extra)
        in_place = req.mode == "deflect" or "kv_transfer_params" not in extra
        return SamplingParams(
            max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or 0, min_p=s.min_p,
            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty, seed=s.seed, ignore_eos=s.ignore_eos,
            min_tokens=min(s.min_tokens, max_tokens), stop_token_ids=list(s.stop_token_ids),
            logit_bias=dict(s.logit_bias) or None, allowed_token_ids=list(s.allowed_token_ids) or None,
            logprobs=s.logprobs, prompt_logprobs=s.prompt_logprobs if in_place else None,
            structured_outputs=_structured(s.structured), detokenize=False, output_kind=kind, extra_args=extra)

    async def _serve_prefill(self, h: _Held) -> None:
        req = h.req
        params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
        sp = self._sampling(req, max_tokens=1, extra={"kv_transfer_params": params, ID_KEY: h.key}, delta=False)
        try:
            last = None
            async for out in self._llm.generate({"prompt_token_ids": req.prompt_token_ids}, sp, request_id=h.key,
                                             trace_headers=req.trace_headers):
                last = out
            done = time.monotonic()
            self._drain_steps()  # the scheduler's record of the last chunk may still sit in the socket
            if last is None or not last.outputs:
                raise KvTransferError("vllm returned no output")
            comp = last.outputs[0]
            if comp.finish_reason == "error" or not last.kv_transfer_params:
                raise KvTransferError(f"prefill ended with finish_reason={comp.finish_reason!r} "
                                      f"and kv_transfer_params={last.kv_transfer_params!r}")
            started = h.first_chunk_at if h.first_chunk_at is not None else h.submitted
            kv_params = dict(last.kv_transfer_params)
            # vLLM relays this engine's prefix-cache hits to the decode side itself
            # (remote_prefill_cached_tokens); the tokens it added to its cache go the same way
            kv_params[CREATED_KEY] = int(last.num_cache_creation_tokens or 0)
            if kv_params.get("remote_host") == self.side_channel_bind:  # the bind address: say where to reach it
                kv_params["remote_host"] = self.side_channel_host
            self.on_prefilled(Prefilled(
                request_id=req.request_id, attempt=req.attempt, queue_s=max(started - h.submitted, 0.0),
                prefill_s=max(done - started, 0.0), first_token_id=comp.token_ids[0] if comp.token_ids else None,
                kv_params=kv_params, prompt_logprobs=_prompt_logprobs(last.prompt_logprobs)))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # one request failing must not take the engine down
            _log.warning("vllm_request_failed", request_id=req.request_id, role=self.role, error=str(e))
            # ValueError: vLLM refused the request itself (e.g. over max_model_len): no retry helps
            self.on_failed(req.request_id, req.attempt, f"vllm prefill failed: {e}",
                           retryable=not isinstance(e, ValueError))
        finally:
            self._forget(h)

    async def _serve_decode(self, h: _Held) -> None:
        req = h.req
        try:
            if req.mode == "handoff":
                assert req.kv is not None
                params = dict(req.kv.params)
                created = params.pop(CREATED_KEY, None)
                h.created = created if isinstance(created, int) else None
                reason = await self._generate(h, {"kv_transfer_params": params},
                                              deadline=h.submitted + self.kv_timeout)
                if reason is None:
                    return
                self._fall_back(h, reason)
            extra: dict[str, Any] = {}
            if req.mode == "deflect" and req.chunk_schedule:
                extra[CHUNKS_KEY] = list(req.chunk_schedule)
            reason = await self._generate(h, extra, deadline=None)
            if reason is not None:
                raise KvTransferError(reason)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            _log.warning("vllm_request_failed", request_id=req.request_id, role=self.role, error=str(e))
            self._emit(TokenItem(req.request_id, req.attempt, [], "error"))
            self.on_failed(req.request_id, req.attempt, f"vllm decode failed: {e}",
                           retryable=not isinstance(e, ValueError))
        finally:
            self._forget(h)

    async def _generate(self, h: _Held, extra: dict[str, Any], *, deadline: float | None) -> str | None:
        """Stream one vLLM request into on_tokens. Returns None when it completed, else why the KV
        path failed before the first token (only when `deadline` is set: a handoff)."""
        req = h.req
        extra = {**extra, ID_KEY: h.key}
        if req.resume_tokens and req.sampling.structured is not None:  # the grammar continues after them
            extra[RESUME_KEY] = req.resume_tokens
        sp = self._sampling(req, max_tokens=req.sampling.max_tokens, extra=extra, delta=True)
        agen = self._llm.generate({"prompt_token_ids": req.prompt_token_ids}, sp, request_id=h.key,
                                             trace_headers=req.trace_headers).__aiter__()
        try:
            return await self._stream(h, agen, deadline)
        finally:
            await agen.aclose()  # a no-op once finished; otherwise it aborts the request in vLLM

    async def _stream(self, h: _Held, agen: Any, deadline: float | None) -> str | None:
        req = h.req
        while True:
            try:
                if deadline is not None and h.generated == 0:
                    out = await asyncio.wait_for(agen.__anext__(), timeout=max(deadline - time.monotonic(), 0.0))
                else:
                    out = await agen.__anext__()
            except StopAsyncIteration:
                return None
            except TimeoutError:  # wait_for cancelled the generator, which aborted the request in vLLM
                return f"timeout: no first token within {self.kv_timeout:g} s of the handoff"
            comp = out.outputs[0]
            finish = comp.finish_reason if out.finished else None
            if finish == "error":
                if deadline is not None and h.generated == 0:
                    return "kv_load_failed: vLLM ended the handoff with finish_reason=error"
                raise KvTransferError(f"vllm ended the request with an error after {h.generated} tokens")
            tokens = list(comp.token_ids)
            cached = created = None
            if tokens:
                h.kv_wait = False
                if h.generated == 0 and out.num_cached_tokens is not None:
                    cached = h.cached = int(out.num_cached_tokens)
                    # a handoff's prompt was added to the prefill engine's cache, not to this one's
                    created = h.created if h.created is not None and not h.in_place else \
                        int(out.num_cache_creation_tokens or 0)
            pos = req.resume_tokens + h.generated  # the output position of tokens[0] (TokenItem.pos)
            h.generated += len(tokens)
            lps = _logprobs(comp.logprobs) if req.sampling.logprobs is not None and tokens else None
            plps = _prompt_logprobs(out.prompt_logprobs) if req.sampling.prompt_logprobs is not None else None
            if tokens or finish is not None or plps:
                self._emit(TokenItem(req.request_id, req.attempt, tokens, finish, lps, plps, cached, created,
                                     pos=pos))
            if out.finished:
                return None

    def _fall_back(self, h: _Held, reason: str) -> None:
        """The KV path failed: prefill in place instead (an explicit, counted deflection)."""
        kind = reason.split(":", 1)[0]
        self.kv_fallbacks += 1
        self.kv_fallback_reasons[kind] += 1
        self._by_key.pop(h.key, None)
        h.key = f"{h.req.request_id}:{h.req.attempt}:fallback"
        self._by_key[h.key] = h
        h.fallback = kind
        h.kv_wait = False
        h.computed = 0
        h.first_chunk_at = None
        _log.warning("kv_fallback", request_id=h.req.request_id, attempt=h.req.attempt, reason=reason,
                     prompt_tokens=h.prompt_len, fallbacks=self.kv_fallbacks)
        self.on_kv_fallback(h.req.request_id, kind)

    def _forget(self, h: _Held) -> None:
        if self._held.get(h.req.request_id) is h:
            del self._held[h.req.request_id]
        self._by_key.pop(h.key, None)

    # -- tokens out, one callback per step -------------------------------------------------------
    def _emit(self, item: TokenItem) -> None:
        self._pending_items.append(item)
        if not self._flush_scheduled and self._loop is not None:
            self._flush_scheduled = True
            # the outputs of one step wake every consumer task in the same loop iteration; a
            # call_soon queued by the first runs after the others, so one callback gets them all
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        items, self._pending_items = self._pending_items, []
        if items:
            self.on_tokens(items, self._step_ms[-1] / 1000.0 if self._step_ms else 0.0)

    # -- per-step records --------------------------------------------------------------------------
    def _drain_steps(self) -> None:
        if self._pull is None:
            return
        while True:
            try:
                raw = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                rec = msgspec.msgpack.decode(raw, type=StepRecord)
            except msgspec.DecodeError as e:
                _log.warning("step_record_undecodable", error=str(e))
                continue
            self._on_step(rec)

    def _on_step(self, rec: StepRecord) -> None:
        self.steps += 1
        self.steps_dropped = rec.dropped
        self.step_records.append(rec)
        if rec.prefix_stored or rec.prefix_removed or rec.prefix_cleared:
            self._on_prefix(rec)
        self._step_ms.append(rec.seconds * 1000.0)
        for key, chi, k in rec.chunks:
            h = self._by_key.get(key)
            if h is not None:
                h.computed = k + chi
                if h.first_chunk_at is None:
                    h.first_chunk_at = rec.started
        if rec.misses:
            self.chunk_misses += len(rec.misses)
            _log.warning("chunk_schedule_missed", step=rec.index, misses=rec.misses)
        if rec.seconds > 0:
            chunks = [(chi, k) for _, chi, k in rec.chunks]
            self.samples.append(StepSample(rec.decodes, rec.kv_tokens, chunks, rec.seconds))
            if self._predict is not None and not self.measuring:
                pred = self._predict.step_time(rec.decodes, rec.kv_tokens, chunks)
                self.estimator.observe(pred, rec.seconds)
                self.step_errors.observe(pred, rec.seconds, time.monotonic())
            if rec.cpu_seconds > 0:
                self.cpu_samples.append(StepSample(rec.decodes, rec.kv_tokens, chunks, rec.cpu_seconds))
        details = self._details_by_index.pop(rec.index, None)
        if details is not None:
            self._check(rec, details)
        else:
            self._records_by_index[rec.index] = rec
            _trim(self._records_by_index)

    def _on_prefix(self, rec: StepRecord) -> None:
        if rec.prefix_cleared:
            self._prefix_net.clear()
            self._prefix_held.clear()
            self._prefix_cleared = True
        self._prefix_held.update(rec.prefix_stored)
        self._prefix_held.difference_update(rec.prefix_removed)
        if self._prefix_resync:
            return
        self._prefix_net.update((h, True) for h in rec.prefix_stored)
        self._prefix_net.update((h, False) for h in rec.prefix_removed)
        # nobody took them for long (the removals of evicted blocks pile up): bounded instead by
        # sending the whole content, as after a reset, at the next take
        if len(self._prefix_net) > 2 * len(self._prefix_held) + 4096:
            self._prefix_net.clear()
            self._prefix_resync = True

    def _on_details(self, details: Any) -> None:
        self.iteration_details.append(details)
        self._drain_steps()
        rec = self._records_by_index.pop(details.iteration_index, None)
        if rec is not None:
            self._check(rec, details)
        else:
            self._details_by_index[details.iteration_index] = details
            _trim(self._details_by_index)

    def _check(self, rec: StepRecord, details: Any) -> None:
        """vLLM's own account of the step must match what the scheduler planned."""
        if details.num_ctx_tokens != sum(chi for _, chi, _ in rec.chunks) or \
                details.num_generation_requests != rec.decodes:
            self.step_mismatches += 1
            _log.warning("step_record_mismatch", step=rec.index, planned_chunks=rec.chunks, decodes=rec.decodes,
                         ctx_tokens=details.num_ctx_tokens, generation_requests=details.num_generation_requests)


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def _structured(so: StructuredOutputs | None) -> Any:
    """vLLM's StructuredOutputsParams for the wire's grammar (the decode role loads the tokenizer
    the grammar backends need: skip_tokenizer_init is off there)."""
    if so is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(
        json=msgspec.json.decode(so.json) if so.json is not None else None, regex=so.regex,
        choice=list(so.choice) if so.choice is not None else None,
        grammar=so.grammar, json_object=so.json_object, structural_tag=so.structural_tag,
        disable_any_whitespace=so.disable_any_whitespace,
        disable_additional_properties=so.disable_additional_properties, whitespace_pattern=so.whitespace_pattern)


def _position(lp: Any) -> TokenLogprobs:
    """One position of vLLM's logprobs (a {token_id: Logprob} mapping, chosen token first)."""
    ids, vals, ranks = [], [], []
    for tid, v in lp.items():
        ids.append(int(tid))
        vals.append(float(v.logprob))
        ranks.append(int(v.rank) if v.rank is not None else 0)
    return TokenLogprobs(ids, vals, ranks)


def _logprobs(lps: Any) -> list[TokenLogprobs] | None:
    return None if lps is None else [_position(lp) for lp in lps]


def _prompt_logprobs(lps: Any) -> list[TokenLogprobs | None] | None:
    return None if not lps else [None if lp is None else _position(lp) for lp in lps]


def _trim(d: dict[int, Any], keep: int = 1024) -> None:
    while len(d) > keep:
        del d[next(iter(d))]


def make_vllm_engine(cfg: WorkerConfig, role: Literal["prefill", "decode"]) -> VllmEngine:
    """A worker's engine from its config: model, vllm_max_model_len, vllm_kv_cache_mib,
    vllm_token_budget (or the role's prefill/decode_token_budget when set), decode_chunk,
    vllm_max_batch, vllm_kv_buffer_device, kv_timeout, max_queue_requests, prefix_cache (vLLM's
    automatic prefix caching and its reports), vllm_engine_args (any other vLLM engine argument,
    vllm_args.py; a conflicting one is a ConfigError before anything starts) and vllm_profile (the
    step-time model it reports: `measured`, the default, is this engine's own, stored in
    profile_store under its keys and measured at the first start when none is stored
    (common/engines/measured.py); or a profile name or .json path, e.g. cpu-tiny-llama for the tiny
    model on a CPU).

    The NIXL side channel (vllm_side_channel_host/_port/_bind): the prefill engine's host and
    port travel inside its returned kv_transfer_params, so the decode side needs no
    configuration; port 0 picks a free one (set one to open it in a firewall). The host must be
    an address the decode workers reach (127.0.0.1 on one machine).
    """
    from common.engines.measured import MEASURED, default_store
    from common.engines.vllm_args import check_gpus, parse, split
    from common.perf_model import load_profile

    own = cfg.vllm_profile == MEASURED
    if not cfg.model:
        raise ConfigError("engine 'vllm' needs --model (a model directory; `kairos make-tiny-model DIR` makes one)")
    engine_args = parse(split(cfg.vllm_engine_args))  # refused here, before the engine starts
    check_gpus(engine_args, os.environ)
    budget = (cfg.prefill_token_budget if role == "prefill" else cfg.decode_token_budget) or cfg.vllm_token_budget
    bind = cfg.vllm_side_channel_bind
    return VllmEngine(role, model=cfg.model, max_model_len=cfg.vllm_max_model_len,
                      kv_cache_mib=cfg.vllm_kv_cache_mib, token_budget=budget,
                      default_chunk=cfg.decode_chunk if role == "decode" else 0,
                      kv_timeout=cfg.kv_timeout, max_queue_requests=cfg.max_queue_requests,
                      overrun_target=cfg.overrun_target,
                      side_channel_host=cfg.vllm_side_channel_host,
                      side_channel_port=cfg.vllm_side_channel_port or free_port(bind or "0.0.0.0"),
                      side_channel_bind=cfg.vllm_side_channel_bind, kv_buffer_device=cfg.vllm_kv_buffer_device,
                      max_batch=cfg.vllm_max_batch,
                      profile=None if own else load_profile(cfg.vllm_profile),
                      profile_store=str(Path(cfg.profile_store) if cfg.profile_store else default_store()) if own
                      else None,
                      prefix_caching=cfg.prefix_cache, otlp_traces_endpoint=cfg.otlp_traces_endpoint,
                      engine_args=engine_args, kv_both=cfg.vllm_kv_both)

