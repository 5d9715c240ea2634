"""Routing policies, selectable by name. See base.py for the shared types."""

from __future__ import annotations

from common.perf_model import PerfModel
from common.policy.base import (
    ClusterView,
    Decision,
    DecodeView,
    Hold,
    NoDecodeRoom,
    NoKvRoom,
    NoWorkers,
    Policy,
    PrefillView,
    RequestSpec,
)
from common.policy.baselines import (
    ChunkedPrefill,
    ConditionalConfig,
    ConditionalDisagg,
    DeflectAll,
    DisaggLeastLoaded,
    DisaggRoundRobin,
    KvAware,
    KvAwareConfig,
)
from common.policy.kairos import Kairos, KairosConfig

POLICIES = ("kairos", "disagg-least-loaded", "disagg-round-robin", "conditional-disagg", "chunked-prefill",
            "deflect-all", "kv-aware")
NO_PREFILL_POLICIES = ("chunked-prefill",)  # a decode pool alone: `kairos sim` gives it every GPU

__all__ = [
    "NO_PREFILL_POLICIES",
    "POLICIES",
    "ClusterView",
    "ConditionalConfig",
    "Decision",
    "DecodeView",
    "Hold",
    "Kairos",
    "KairosConfig",
    "KvAwareConfig",
    "NoDecodeRoom",
    "NoKvRoom",
    "NoWorkers",
    "Policy",
    "PrefillView",
    "RequestSpec",
    "make_policy",
]


def make_policy(name: str, *, kairos: KairosConfig | None = None, conditional: ConditionalConfig | None = None,
                default_model: PerfModel | None = None, kv_aware: KvAwareConfig | None = None) -> Policy:
    """A fresh policy object by name (round-robin keeps a counter, so make one per router)."""
    if name == "kairos":
        return Kairos(kairos, default_model=default_model)
    if name == "disagg-least-loaded":
        return DisaggLeastLoaded()
    if name == "disagg-round-robin":
        return DisaggRoundRobin()
    if name == "conditional-disagg":
        return ConditionalDisagg(conditional)
    if name == "chunked-prefill":
        return ChunkedPrefill()
    if name == "deflect-all":
        return DeflectAll()
    if name == "kv-aware":
        return KvAware(kv_aware)
    raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}")
