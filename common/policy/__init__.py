"""Routing policies, selectable by name (registry.py). See base.py for the shared types and the
`Policy` interface."""

from __future__ import annotations

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
from common.policy.baselines import ConditionalConfig, KvAwareConfig
from common.policy.kairos import Kairos, KairosConfig
from common.policy.registry import NO_PREFILL_POLICIES, POLICIES, REGISTRY, make_policy, policy_help

__all__ = [
    "NO_PREFILL_POLICIES",
    "POLICIES",
    "REGISTRY",
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
    "policy_help",
]

