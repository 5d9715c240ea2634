"""The router's side of the replay TTFT predictor (common/engines/replay.py): per prefill
worker, the drain it reported (or its backlog replayed here) extended by the router's ledger,
cached so that a decision costs at most one short extension per worker."""

from __future__ import annotations

from common.engines.replay import Tail, extend
from common.perf_model import PerfModel


class ReplayCache:
    """Per prefill worker, its queue's replay (`base`: the drain it reported, or the replay of
    its backlog) extended by the ledger; extended further, not redone, when the ledger grows."""

    def __init__(self) -> None:
        self._by_worker: dict[str, tuple[Tail, PerfModel, tuple[tuple[int, float], ...], Tail]] = {}

    def tail(self, worker_id: str, model: PerfModel, budget: int, max_batch: int, base: Tail,
             ledger: tuple[tuple[int, float], ...]) -> Tail:
        e = self._by_worker.get(worker_id)
        seen: tuple[tuple[int, float], ...] = ()
        tail = base
        if e is not None and e[0] is base and e[1] is model:
            k = len(e[2])
            if k == len(ledger) and e[2] == ledger:
                return e[3]
            if k < len(ledger) and ledger[:k] == e[2]:
                seen, tail = e[2], e[3]
        for tokens, join in ledger[len(seen):]:
            tail = extend(model, budget, max_batch, tail, tokens, join)
        if len(self._by_worker) > 4096:
            self._by_worker.clear()
        self._by_worker[worker_id] = (base, model, ledger, tail)
        return tail
