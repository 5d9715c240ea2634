"""The routing policies by name: one table, the only list of them.

`--policy` (the router's settings, `kairos up`, `kairos sim`, `kairos tune`) offers the names
here and its help lists their summaries; `make_policy` builds one from its entry. A new policy is
a class implementing `Policy` (base.py) and one row below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.perf_model import PerfModel
from common.policy.base import Policy
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


@dataclass(frozen=True, slots=True)
class Knobs:
    """The settings a factory may read (None: the policy's defaults)."""

    kairos: KairosConfig | None = None
    conditional: ConditionalConfig | None = None
    kv_aware: KvAwareConfig | None = None
    default_model: PerfModel | None = None


@dataclass(frozen=True, slots=True)
class Entry:
    """A policy's row: how to build it, what it is in a few words (--help), and whether it uses
    prefill workers (False: a decode pool alone; `kairos sim` gives it every GPU)."""

    build: Callable[[Knobs], Policy]
    summary: str
    prefill: bool = True


REGISTRY: dict[str, Entry] = {
    "kairos": Entry(lambda k: Kairos(k.kairos, default_model=k.default_model),
                    "disaggregated, deflecting a request's prefill onto a decode worker when that is predicted "
                    "to meet its SLOs sooner: the paper's policy"),
    "disagg-least-loaded": Entry(lambda k: DisaggLeastLoaded(),
                                 "always disaggregated, to the least-loaded prefill and decode workers"),
    "disagg-round-robin": Entry(lambda k: DisaggRoundRobin(), "always disaggregated, round-robin over each pool"),
    "conditional-disagg": Entry(lambda k: ConditionalDisagg(k.conditional),
                                "Dynamo's rule: prefill in place when the prompt is short or the prefill "
                                "worker busy"),
    "chunked-prefill": Entry(lambda k: ChunkedPrefill(),
                             "no disaggregation: every prompt prefilled in chunks on a decode worker "
                             "(no prefill workers)", prefill=False),
    "deflect-all": Entry(lambda k: DeflectAll(), "every prompt prefilled on the least-loaded decode worker"),
    "kv-aware": Entry(lambda k: KvAware(k.kv_aware),
                      "always disaggregated, placed by prefix-cache hits and load (Dynamo's KV router style)"),
}

POLICIES: tuple[str, ...] = tuple(REGISTRY)
NO_PREFILL_POLICIES: tuple[str, ...] = tuple(n for n, e in REGISTRY.items() if not e.prefill)


def policy_help() -> str:
    """The policies and their summaries, for --help."""
    return "; ".join(f"{name}: {e.summary}" for name, e in REGISTRY.items())


def make_policy(name: str, *, kairos: KairosConfig | None = None, conditional: ConditionalConfig | None = None,
                default_model: PerfModel | None = None, kv_aware: KvAwareConfig | None = None) -> Policy:
    """A fresh policy object by name (round-robin keeps a counter, so make one per router)."""
    entry = REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(REGISTRY)}")
    return entry.build(Knobs(kairos=kairos, conditional=conditional, kv_aware=kv_aware, default_model=default_model))
