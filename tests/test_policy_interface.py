"""The policy's declared interface (`Policy`, common/policy/base.py) and the registry
(common/policy/registry.py): the router core calls the declared hooks of any policy, not only
Kairos's, and the registry is the one list of names the router offers."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from common import config
from common import messages as m
from common.policy import (
    NO_PREFILL_POLICIES,
    POLICIES,
    REGISTRY,
    ClusterView,
    Decision,
    Hold,
    Policy,
    RequestSpec,
    make_policy,
)
from common.policy.base import least_loaded_decode
from common.router_core.core import RouterCore
from services.router.__main__ import main as router_main
from tests.router_fakes import FakeOutbox, hello

SAMPLING = m.Sampling(max_tokens=4)
NOW = 100.0


class Gated(Policy):
    """Deflects to the least-loaded decode worker while `open`, else holds (late binding's `Hold`);
    its wait order is the reverse of arrival when `reverse`; it records what the core asked."""

    name = "gated"

    def __init__(self, *, reverse: bool = False, prepares: bool = False) -> None:
        self.open = False
        self.reverse = reverse
        self.prepares = prepares  # type: ignore[misc]
        self.prepared: list[tuple[int, float, float]] = []

    def decide(self, req: RequestSpec, view: ClusterView, now: float) -> Decision:
        if not self.open:
            raise Hold("gated")
        d = least_loaded_decode(view, req)
        return Decision(route="deflect", prefill_worker=None, decode_worker=d.worker_id, reason="gated")

    def prepare(self, view: ClusterView, now: float, tbt_slo: float) -> None:
        self.prepared.append((len(view.decode), now, tbt_slo))

    def orders_waiting(self) -> bool:
        return self.reverse

    def retry_order(self, latest: Sequence[float], now: float) -> list[int]:
        if not self.reverse:
            assert all(t == 0.0 for t in latest)  # not computed: orders_waiting() is false
            return super().retry_order(latest, now)
        assert all(t > now for t in latest)  # each one's latest start, computed because orders_waiting()
        return list(reversed(range(len(latest))))


def core_with(policy: Policy) -> tuple[RouterCore, FakeOutbox]:
    cfg = config.load(config.RouterConfig, env={}, overrides={"profile": "fast", "queue_budget": -1.0})
    box = FakeOutbox()
    core = RouterCore(cfg, box, policy=policy)
    core.on_message(b"decode-0", hello("decode-0", "decode"), NOW)
    box.take()
    return core, box


def dispatched(box: FakeOutbox) -> list[int]:
    """The prompts' first tokens of the DecodeWork sent, in send order."""
    return [msg.prompt_token_ids[0] for _, msg in box.take() if isinstance(msg, m.DecodeWork)]


@pytest.mark.parametrize("reverse", [False, True])
def test_the_wait_queue_retries_in_the_policys_declared_order(reverse: bool) -> None:
    policy = Gated(reverse=reverse)
    core, box = core_with(policy)
    for i in (1, 2, 3):
        core.submit([i] * 8, SAMPLING, NOW + i * 0.01)
    assert len(core.kv_waiting) == 3 and dispatched(box) == []  # all held
    policy.open = True
    core.retry_waiting(NOW + 0.1)
    assert dispatched(box) == ([3, 2, 1] if reverse else [1, 2, 3])


def test_the_core_prepares_only_a_policy_that_prepares() -> None:
    lazy = Gated()
    core, _ = core_with(lazy)
    core.prepare(NOW)
    assert lazy.prepared == []  # `prepares` false: not called (no view built for it)
    eager = Gated(prepares=True)
    core, _ = core_with(eager)
    core.prepare(NOW + 1.0)
    assert eager.prepared == [(1, NOW + 1.0, core.cfg.tbt_slo)]


def test_a_policy_declaring_only_decide_gets_the_defaults() -> None:
    class Bare(Policy):
        name = "bare"

        def decide(self, req: RequestSpec, view: ClusterView, now: float) -> Decision:
            raise Hold("never")

    p = Bare()
    assert not p.prepares and p.prepare(ClusterView((), ()), 0.0, 0.1) is None
    assert not p.orders_waiting() and p.retry_order([5.0, 1.0, 3.0], 0.0) == [0, 1, 2]


def test_the_registry_builds_every_policy_it_names() -> None:
    assert POLICIES == tuple(REGISTRY)
    for name in POLICIES:
        p = make_policy(name)
        assert p.name == name and Policy in type(p).__mro__
    assert NO_PREFILL_POLICIES == ("chunked-prefill",)
    with pytest.raises(ValueError, match="choose one of: kairos, "):
        make_policy("nope")


def test_the_routers_policy_flag_offers_the_registry(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100000")  # no wrapping (argparse breaks lines at hyphens)
    with pytest.raises(SystemExit):
        router_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name, entry in REGISTRY.items():
        assert f"{name} ({' '.join(entry.summary.split())})" in text
    assert router_main(["--policy", "nope"]) != 0  # refused at the flags, before anything starts
