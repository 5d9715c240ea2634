"""`ClusterPrep`: what Kairos's decision needs of a cluster view before a request comes, kept
up to date one worker at a time.

A heartbeat or a dispatch changes one worker's view; the router (and the simulator) hand the
policy a new `ClusterView` in which every unchanged worker keeps its very view object. So the
prepared form is updated by identity: only the workers whose view object changed are replayed
(`Kairos._tail_entry`, `Kairos._prep`, both cached per worker) and moved within the orderings by
bisection; nothing is done for the rest. The result is exactly what a build from scratch gives,
entry for entry and in the same order (tests/test_prepared.py checks it on random changes), so
decisions do not depend on how the view was reached.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import compress
from operator import is_, is_not, itemgetter
from typing import Any, Protocol

from common.engines.replay import Tail
from common.perf_model import PerfModel
from common.policy.base import ClusterView, DecodeView, PrefillView
from common.policy.schedule import BoundTerms

# `Kairos._prep` of one decode view: (view, TBT SLO, model, step budget, busy_until, stale wait,
# token cap, candidates, bound terms, reserved cost of the deflections in flight, whether even
# the smallest candidate cannot start, its `least_loaded_decode` key, the prompt size from which
# no schedule exists, the terms of `decode_time(batch + 1, ...)` for a handoff: a0 + a1*(batch + 1),
# a2, and the GEMM terms, and its decode room: the largest prompt a new decode may bring, `Kairos._room`)
_Prep = tuple[DecodeView, float, PerfModel, float, float, float, int, list[int], BoundTerms, float, bool,
              tuple[int, int, str], float, tuple[float, float, float], float]
# `Kairos._tail_entry` of one prefill view: (view, model, replayed tail, its last step's tokens and
# attention sum (`last_step_sums`))
_TailEntry = tuple[PrefillView, PerfModel, Tail, int, float]


class _Policy(Protocol):
    """What `ClusterPrep` uses of `Kairos` (common/policy/kairos.py): its settings and its
    per-worker caches."""

    cfg: Any
    default_model: PerfModel | None
    _replay_p: bool
    _last_tail: dict[str, _TailEntry]
    _dprep: dict[str, _Prep]

    def _tail_entry(self, p: PrefillView, m: PerfModel, now: float) -> _TailEntry: ...

    def _prep(self, d: DecodeView, slo: float) -> _Prep: ...


_INF = float("inf")
_key0 = itemgetter(0)
# a decode worker's place among the deflection candidates: 0 at `max_deflections` (none), 1 below
# it (`dec`), 2 where a token fits in a step (`alive`), 3 where the smallest chunk does too (`live`)
_FULL, _DEC, _ALIVE, _LIVE = 0, 1, 2, 3


def _nonneg(m: PerfModel) -> bool:
    return min(m.a0, m.a1, m.a2, m.a3, m.a4, m.a5, m.a6, m.a7) >= 0.0


class ClusterPrep:
    """What `Kairos.decide` needs of a cluster view that does not depend on the request (beyond
    its TBT SLO, which idle decode workers take as theirs) or the clock: the prefill workers in
    increasing end of their replayed queues (`pre`: the prefill path's search stops at the first
    whose queue alone outlasts the best so far), the decode workers in the handoff's order
    (`ll`, as `least_loaded_decode`), and, in view order, those that may take a deflection:
    below `max_deflections` (`dec`), of those the ones where a token fits in a step (`alive`),
    and of those, for a prompt of at least the smallest candidate, the ones not stuck (`live`;
    `Kairos._prep`: even the smallest chunk would break their TBT budget at the first step).

    `update` brings it to a view that differs in some workers' view objects (same workers, same
    order); it returns False where it cannot (then build a new one)."""

    __slots__ = ("_at", "_dflag", "_dprep", "_inc", "_k", "_llk", "_models", "_nfull", "_pentry", "_prek",
                 "alive", "dec", "decode", "defl_full", "live", "ll", "monotone", "pre", "prefill", "slo")

    def __init__(self, k: _Policy, view: ClusterView, slo: float, now: float, incremental: bool = True) -> None:
        self.prefill, self.decode, self.slo = view.prefill, view.decode, slo
        self._k = k
        self._inc = incremental
        if not incremental:  # a small fleet: rebuilt on every change, which costs less there
            self._lean(view, now)
            return
        # prefill: one entry per view position, and `pre` sorted by `_prek`'s (end, position)
        self._pentry: list[tuple[float, int, PrefillView, PerfModel, _TailEntry | None]] = [
            self._pre_entry(i, p, now) for i, p in enumerate(view.prefill)]
        self.pre = sorted(self._pentry, key=_key0_1) if k._replay_p else list(self._pentry)
        self._prek = [(e[0], e[1]) for e in self.pre]
        self._models: dict[int, list[Any]] = {}  # id(model) -> [model, how many prefill workers use it]
        for e in self._pentry:
            self._count_model(e[3], 1)
        self._set_monotone()
        # decode: one `_prep` and one flag per view position; `ll` sorted by `_llk`
        self._dprep = [self._decode_prep(d) for d in view.decode]
        self._dflag = [self._flag(p) for p in self._dprep]
        self._nfull = self._dflag.count(_FULL)
        self.defl_full = self._nfull > 0
        pairs = sorted(((p[11], p) for p in self._dprep), key=_key0)  # keys end in the unique worker id
        self._llk = [key for key, _ in pairs]
        self.ll = [p for _, p in pairs]
        self._filter()

    def _lean(self, view: ClusterView, now: float) -> None:
        """The same lists without what `update` needs: one pass with everything in locals (this
        runs on every change in a small fleet, where a method call per worker shows)."""
        k = self._k
        cfg = k.cfg
        dflt = None if cfg.per_worker_models else k.default_model
        replay_p = k._replay_p
        pre: list[tuple[float, int, PrefillView, PerfModel, _TailEntry | None]] = []
        models = set()
        if replay_p:
            tails, entry = k._last_tail, k._tail_entry
            for i, p in enumerate(view.prefill):
                m = p.model if dflt is None else dflt
                e = tails.get(p.worker_id)
                if e is None or e[0] is not p or e[1] is not m:
                    e = entry(p, m, now)
                pre.append((e[2].end, i, p, m, e))
                models.add(id(m))
            pre.sort()  # by (end, position): positions are unique, so the rest is never compared
        else:
            pre = [(-_INF, i, p, p.model if dflt is None else dflt, None) for i, p in enumerate(view.prefill)]
        self.pre = pre
        self.monotone = bool(replay_p and len(models) == 1 and _nonneg(pre[0][3]))
        preps, prep_of, slo = k._dprep, k._prep, self.slo
        max_defl = cfg.max_deflections
        dec, alive, live, ll = [], [], [], []
        full = False
        for d in view.decode:
            s = d.strictest_tbt_slo if d.strictest_tbt_slo is not None else slo
            prep = preps.get(d.worker_id)
            if prep is None or prep[0] is not d or prep[1] != s:
                prep = prep_of(d, s)
            ll.append((prep[11], prep))
            if d.deflections >= max_defl:
                full = True
                continue
            dec.append(prep)
            if prep[12] > 1.0:
                alive.append(prep)
                if not prep[10]:
                    live.append(prep)
        ll.sort()  # by key, which ends in the unique worker id
        self.ll = [prep for _, prep in ll]
        self.dec, self.alive, self.live, self.defl_full = dec, alive, live, full

    # -- per worker ----------------------------------------------------------------------------

    def _pre_entry(self, i: int, p: PrefillView, now: float) -> tuple[float, int, PrefillView, PerfModel,
                                                                      _TailEntry | None]:
        k = self._k
        m = p.model if k.cfg.per_worker_models or k.default_model is None else k.default_model
        if not k._replay_p:  # Equation 1 reads no queue: view order, no early stop
            return (-_INF, i, p, m, None)
        e = k._last_tail.get(p.worker_id)
        if e is None or e[0] is not p or e[1] is not m:
            e = k._tail_entry(p, m, now)
        return (e[2].end, i, p, m, e)

    def _decode_prep(self, d: DecodeView) -> _Prep:
        k = self._k
        s = d.strictest_tbt_slo if d.strictest_tbt_slo is not None else self.slo
        prep = k._dprep.get(d.worker_id)
        if prep is None or prep[0] is not d or prep[1] != s:
            prep = k._prep(d, s)
        return prep

    def _flag(self, prep: _Prep) -> int:
        if prep[0].deflections >= self._k.cfg.max_deflections:
            return _FULL
        if prep[12] > 1.0:
            return _ALIVE if prep[10] else _LIVE
        return _DEC

    def _count_model(self, m: PerfModel, by: int) -> None:
        got = self._models.get(id(m))
        if got is None:
            self._models[id(m)] = [m, by]
        else:
            got[1] += by
            if got[1] == 0:
                del self._models[id(m)]

    def _set_monotone(self) -> None:
        # the queue ends bound the prefill path's TTFT from below in increasing order only when
        # every worker pays the same transfer and steps cost more with more tokens
        self.monotone = bool(self._k._replay_p and len(self._models) == 1 and self._pentry
                             and _nonneg(next(iter(self._models.values()))[0]))

    def _filter(self) -> None:
        ps, fs = self._dprep, self._dflag
        self._at = ([i for i, f in enumerate(fs) if f], [i for i, f in enumerate(fs) if f >= _ALIVE],
                    [i for i, f in enumerate(fs) if f == _LIVE])  # the view positions in each list
        self.dec, self.alive, self.live = ([ps[i] for i in at] for at in self._at)

    # -- incremental ---------------------------------------------------------------------------

    def update(self, view: ClusterView, now: float) -> bool:
        """Bring this to `view`, in which only some workers' view objects differ from the last
        one's (same workers, same positions). False, changing nothing, where `view` is not that
        (workers came, went or moved): build a new one then."""
        pre, dec = view.prefill, view.decode
        if len(pre) != len(self.prefill) or len(dec) != len(self.decode):
            return False
        if not self._inc:  # only the same views in new tuples
            if all(map(is_, pre, self.prefill)) and all(map(is_, dec, self.decode)):
                self.prefill, self.decode = pre, dec
                return True
            return False
        cp_ = list(compress(range(len(pre)), map(is_not, pre, self.prefill)))
        cd_ = list(compress(range(len(dec)), map(is_not, dec, self.decode)))
        if not (cp_ or cd_):  # the same views in new tuples
            self.prefill, self.decode = pre, dec
            return True
        old_p, old_d = self.prefill, self.decode
        if any(pre[i].worker_id != old_p[i].worker_id for i in cp_) or \
                any(dec[i].worker_id != old_d[i].worker_id for i in cd_):
            return False
        self.prefill, self.decode = pre, dec
        if cp_:
            self._update_prefill(pre, cp_, now)
        if cd_:
            self._update_decode(dec, cd_)
        return True

    def _update_prefill(self, pre: tuple[PrefillView, ...], changed: list[int], now: float) -> None:
        replay = self._k._replay_p
        for i in changed:
            old = self._pentry[i]
            new = self._pentry[i] = self._pre_entry(i, pre[i], now)
            if old[3] is not new[3]:
                self._count_model(old[3], -1)
                self._count_model(new[3], 1)
            if not replay:  # view order: the same place
                self.pre[i] = new
                continue
            j = bisect_left(self._prek, (old[0], i))
            del self._prek[j]
            del self.pre[j]
            key = (new[0], i)
            j = bisect_left(self._prek, key)
            self._prek.insert(j, key)
            self.pre.insert(j, new)
        self._set_monotone()

    def _update_decode(self, dec: tuple[DecodeView, ...], changed: list[int]) -> None:
        refilter = False
        for i in changed:
            old = self._dprep[i]
            new = self._dprep[i] = self._decode_prep(dec[i])
            f_old, f_new = self._dflag[i], self._flag(new)
            if f_old != f_new:
                self._dflag[i] = f_new
                self._nfull += (f_new == _FULL) - (f_old == _FULL)
                refilter = True
            elif not refilter:  # in the same lists: swap it in where it stands
                for lst, at in zip((self.dec, self.alive, self.live), self._at, strict=True):
                    j = bisect_left(at, i)
                    if j < len(at) and at[j] == i:
                        lst[j] = new
            j = bisect_left(self._llk, old[11])
            del self._llk[j]
            del self.ll[j]
            j = bisect_left(self._llk, new[11])
            self._llk.insert(j, new[11])
            self.ll.insert(j, new)
        self.defl_full = self._nfull > 0
        if refilter:
            self._filter()


_key0_1 = itemgetter(0, 1)  # (end, position): positions are unique, so the rest is never compared
