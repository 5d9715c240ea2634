"""`kairos bench-decision`: the cost of one routing decision (the paper: < 1 ms per request).

For each cluster size (N prefill + N decode workers) it builds a set of realistic, loaded
views (seeded): decode workers with 8-64 (a fifth: 64-200) running decodes of 1-4k tokens of context each, a
TBT SLO of 100 ms, a quarter of them with a deflection in flight; prefill workers idle (half
of them) or with 1-60k queued prompt tokens, held as requests of the trace's lengths (the
backlog the replay predictor reads, and its replay, which the worker computes for its
heartbeat). Prompts are drawn from the Azure code trace
(synthetic code-like lengths if the trace is absent). The views change between decisions as
in the router (untimed, `Cluster`): decisions 10 ms apart; every worker's heartbeat every
0.1 s (the router's default), staggered, brings a fresh state (a prefill worker's queue must
be replayed afresh); each request joins its prefill worker's ledger, takes its decode worker's
KV, and a deflection is in flight on its decode worker until its predicted TTFT; a worker's
view stays the same object until one of these changes it, as `WorkerTable.view` keeps it.
Each decision is timed alone with perf_counter_ns, after a warm-up, with the garbage collector
on (as in the router), in several passes; the median
pass's p50 and p99 are reported (a shared machine's preemptions hit single passes), with the
maximum over all passes and the routes taken, so that one can see the decisions were not trivial.
The policies' passes alternate (pass 1 of each policy, then pass 2, ...) on the same views and
requests, so that a change in the machine's load between passes hits every policy alike; the
ratio of each policy's p50 and p99 to the last policy's at the same size is reported ("x ref").
The views are prepared before each decision, apart (`Kairos.prepare`: the request-independent
work on the workers whose view changed, which the router does when a heartbeat or a dispatch
changes a view, see services/router/service.py); that is timed too, and reported alone and
summed with the decision (the router's CPU per request); `--no-prepare` leaves it to the decision.
Each pass is run twice: on the wall clock (perf_counter_ns, what a request waits) and on the
thread's CPU clock (thread_time_ns, the work itself: preemption by other processes does not
count, the clock read costs about a microsecond more; in a shared VM, other processes' cache
and memory traffic still inflate it).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from common.engines.replay import drain
from common.errors import ConfigError
from common.perf_model import PerfModel, load_profile
from common.policy import (
    ClusterView,
    Decision,
    DecodeView,
    KairosConfig,
    PrefillView,
    RequestSpec,
    make_policy,
)
from common.policy.schedule import reserved_step_cost
from common.traces import synthetic


def make_prefill(rng: random.Random, wid: str, model: PerfModel, budget: int, lengths: list[int],
                 now: float) -> PrefillView:
    queued = 0 if rng.random() < 0.5 else rng.randint(1, 60_000)
    backlog: list[tuple[int, int]] = []
    left = queued
    while left > 0:
        p = min(rng.choice(lengths), left)
        backlog.append((p, 0))
        left -= p
    if backlog:
        p0 = backlog[0][0]
        backlog[0] = (p0, rng.randint(0, p0 - 1))
    busy = now + rng.uniform(0.0, 0.2) if queued else 0.0
    # the worker replays its own queue for its heartbeat (drain): not the router's work
    return PrefillView(worker_id=wid, queued_tokens=queued, queued_requests=len(backlog), token_budget=budget,
                       model=model, backlog=tuple(backlog), busy_until=busy, max_batch=256,
                       drain=drain(model, budget, 256, busy, backlog))


def make_view(rng: random.Random, n: int, model: PerfModel, prefill_budget: int, decode_budget: int,
              kv_capacity: int, lengths: list[int] | None = None, now: float = 0.0) -> ClusterView:
    prefill = tuple(make_prefill(rng, f"prefill-{i:03d}", model, prefill_budget, lengths or [2048], now)
                    for i in range(n))
    decode = []
    for i in range(n):
        batch = rng.randint(8, 64) if rng.random() < 0.8 else rng.randint(64, 200)
        kv = sum(rng.randint(1000, 4000) for _ in range(batch))
        defl = 1 if rng.random() < 0.25 else 0
        decode.append(DecodeView(worker_id=f"decode-{i:03d}", batch=batch, kv_tokens=kv,
                                 kv_free_tokens=kv_capacity - kv, kv_capacity_tokens=kv_capacity,
                                 resident_prefill_tokens=rng.randint(500, 6000) if defl else 0, deflections=defl,
                                 strictest_tbt_slo=0.1, token_budget=decode_budget, model=model,
                                 pending=rng.randint(0, 3)))
    return ClusterView(prefill=prefill, decode=tuple(decode))


DT_S = 0.01  # between decisions (100 requests/s)
HEARTBEATS_PER_DT = 10  # a worker's heartbeat every 10 decisions: the router's default 0.1 s


def beats(i: int, n: int) -> list[int]:
    """The workers (of `n`, heartbeats evenly staggered) whose heartbeat comes between decision
    i - 1 and decision i."""
    r = HEARTBEATS_PER_DT
    return [j for j in range(n) if (i * n - r * j) // (r * n) > ((i - 1) * n - r * j) // (r * n)]


class Cluster:
    """The views a router holds between decisions, as `WorkerTable.view` builds them: a worker's
    view is its last heartbeat plus what this router dispatched to it since (the ledger), and
    stays the same object until one of them changes. A heartbeat (staggered, `beats`) brings a
    fresh state from `views` and acknowledges the ledger; a request dispatched to a prefill
    worker joins its ledger; one dispatched to a decode worker takes its KV (until the worker's
    next heartbeat), and a deflection is in flight there (reserved step cost, largest chunk,
    predicted end) until its predicted TTFT has passed (the router's stand-in: its first token)."""

    def __init__(self, views: list[ClusterView], model: PerfModel, prefill_budget: int, lengths: list[int]) -> None:
        self.views, self.model, self.prefill_budget, self.lengths = views, model, prefill_budget, lengths

    def reset(self) -> ClusterView:
        self.prefill = list(self.views[0].prefill)
        self.base = list(self.views[0].decode)
        self.decode = list(self.base)
        self.ledger: list[list[tuple[int, int, bool]]] = [[] for _ in self.base]  # (tokens, KV, deflect)
        self.inflight: list[dict[int, tuple[float, float, int]]] = [{} for _ in self.base]
        return ClusterView(prefill=tuple(self.prefill), decode=tuple(self.decode))

    def _fold(self, j: int) -> None:
        b, led, fl = self.base[j], self.ledger[j], self.inflight[j]
        if not led and not fl:
            self.decode[j] = b
            return
        self.decode[j] = msgspec.structs.replace(
            b, kv_free_tokens=max(0, b.kv_free_tokens - sum(kv for _, kv, _ in led)),
            resident_prefill_tokens=b.resident_prefill_tokens + sum(t for t, _, df in led if df),
            pending=b.pending + sum(1 for _, _, df in led if not df), deflections=b.deflections + len(fl),
            reserved_step_s=b.reserved_step_s + sum(r for _, r, _ in fl.values()),
            reserved_tokens=b.reserved_tokens + sum(c for _, _, c in fl.values()), inflight=tuple(fl.values()))

    def after(self, hb_rng: random.Random, i: int, req: RequestSpec, d: Decision, now: float) -> ClusterView:
        """The next decision's view, after decision `d` on request number `i` at `now`."""
        pre, n = self.prefill, len(self.prefill)
        if d.prefill_worker is not None:
            j = next(k for k, p in enumerate(pre) if p.worker_id == d.prefill_worker)
            p = pre[j]
            pre[j] = msgspec.structs.replace(p, queued_tokens=p.queued_tokens + req.prompt_tokens,
                                             ledger=(*p.ledger, (req.prompt_tokens, now)))
        nxt = (i + 1) * DT_S
        changed = set()
        if d.decode_worker is not None:
            j = next(k for k, x in enumerate(self.decode) if x.worker_id == d.decode_worker)
            deflect = d.route == "deflect"
            self.ledger[j].append((req.prompt_tokens, req.prompt_tokens + req.max_tokens, deflect))
            if deflect:
                sched = d.chunk_schedule
                self.inflight[j][i] = (now + (d.ttft_decode_pred or 0.0),
                                       reserved_step_cost(self.model, sched, self.base[j].token_budget),
                                       max(sched, default=0))
            changed.add(j)
        for j, fl in enumerate(self.inflight):
            for k in [k for k, (end, _, _) in fl.items() if end <= nxt]:
                del fl[k]
                changed.add(j)
        for j in beats(i + 1, n):
            pre[j] = make_prefill(hb_rng, pre[j].worker_id, self.model, self.prefill_budget, self.lengths, nxt)
            self.base[j] = self.views[(i + 1) % len(self.views)].decode[j]
            self.ledger[j] = []
            changed.add(j)
        for j in changed:
            self._fold(j)
        return ClusterView(prefill=tuple(pre), decode=tuple(self.decode))


def prompts(trace: str, n: int, seed: int) -> list[int]:
    from common.traces import load_trace, trace_path

    try:
        lengths = [r.input_length for r in load_trace(trace_path(trace))]
    except ConfigError:
        lengths = [r.input_length for r in synthetic(rate=10.0, duration=1000.0, seed=seed)]
    rng = random.Random(seed)
    return [rng.choice(lengths) for _ in range(n)]


def measure(policy_names: list[str], n: int, *, decisions: int, seed: int, lengths: list[int], profile: str,
            kcfg: KairosConfig, repeat: int = 3, prepare: bool = True) -> list[dict[str, Any]]:
    """One row per policy at `n` + `n` workers, their passes interleaved (see the module doc)."""
    prof = load_profile(profile)
    rng = random.Random(seed * 1000 + n)
    views = [make_view(rng, n, prof.model, prof.prefill_token_budget, prof.decode_token_budget,
                       prof.kv_capacity_tokens, lengths) for _ in range(64)]
    cluster = Cluster(views, prof.model, prof.prefill_token_budget, lengths)
    reqs = [RequestSpec(request_id=str(i), prompt_tokens=lengths[i % len(lengths)], max_tokens=64, ttft_slo=2.0,
                        tbt_slo=0.1) for i in range(decisions)]

    policies = [make_policy(name, kairos=kcfg, default_model=prof.model) for name in policy_names]
    # the router prepares a policy's view when a worker's view changes (`prepare`, when the policy
    # `prepares`), apart from the decision a request waits for; both are timed, and their sum
    preps = [policy.prepare if prepare and policy.prepares else None for policy in policies]
    for policy, prep in zip(policies, preps, strict=True):  # warm-up
        hb_rng = random.Random(seed)
        view = cluster.reset()
        for i in range(min(500, decisions)):
            if prep is not None:
                prep(view, i * 0.01, reqs[i].tbt_slo)
            d = policy.decide(reqs[i], view, i * 0.01)
            view = cluster.after(hb_rng, i, reqs[i], d, i * 0.01)
    routes: list[dict[str, int]] = [{} for _ in policies]
    passes: list[dict[str, list[list[int]]]] = [{"wall": [], "cpu": [], "prep": [], "total": []} for _ in policies]
    for _ in range(repeat):
        for pi, (policy, prep) in enumerate(zip(policies, preps, strict=True)):
            for kind, clock in (("wall", time.perf_counter_ns), ("cpu", time.thread_time_ns)):
                ns: list[int] = []
                pns: list[int] = []
                routes[pi] = {}
                hb_rng = random.Random(seed)
                gc.collect()
                view = cluster.reset()
                for i, req in enumerate(reqs):
                    now = i * 0.01
                    t0 = clock()
                    if prep is not None:
                        prep(view, now, req.tbt_slo)
                    t1 = clock()
                    d = policy.decide(req, view, now)
                    ns.append(clock() - t1)
                    pns.append(t1 - t0)
                    routes[pi][d.route] = routes[pi].get(d.route, 0) + 1
                    view = cluster.after(hb_rng, i, req, d, now)
                if kind == "wall":
                    tot = sorted(a + b for a, b in zip(ns, pns, strict=True))
                    pns.sort()
                    passes[pi]["prep"].append(pns)
                    passes[pi]["total"].append(tot)
                ns.sort()
                passes[pi][kind].append(ns)

    def q(ns: list[int], f: float) -> float:
        return ns[min(len(ns) - 1, int(len(ns) * f))] / 1e3

    rows = []
    for name, rt, ps, prep in zip(policy_names, routes, passes, preps, strict=True):
        out: dict[str, Any] = {"policy": name, "prefill_workers": n, "decode_workers": n, "prepared": prep is not None,
                               "decisions": decisions, "repeat": repeat,
                               "deflect_share": rt.get("deflect", 0) / decisions}
        for kind, reps in ps.items():
            pre = "" if kind == "wall" else f"{kind}_"
            out[pre + "p50_us"] = statistics.median(q(ns, 0.5) for ns in reps)
            out[pre + "p99_us"] = statistics.median(q(ns, 0.99) for ns in reps)
            out[pre + "max_us"] = max(ns[-1] for ns in reps) / 1e3
            out[pre + "mean_us"] = statistics.median(sum(ns) / len(ns) for ns in reps) / 1e3
            out[pre + "p99_us_runs"] = [q(ns, 0.99) for ns in reps]
        rows.append(out)
    ref = rows[-1]
    for r in rows:
        for k in ("p50_us", "p99_us", "cpu_p50_us", "cpu_p99_us", "total_p50_us", "total_p99_us"):
            r[f"{k}_x_ref"] = r[k] / ref[k] if ref[k] > 0 else float("inf")
        r["ref_policy"] = ref["policy"]
    return rows


def _spin(n: int) -> float:
    x = 0.0
    for i in range(n):
        x += i * 0.5
    return x


def jitter(target_us: float = 50.0, runs: int = 5000) -> dict[str, float]:
    """The machine's own noise at this time scale: a fixed pure-Python loop of about
    `target_us`, timed `runs` times on the wall clock like a decision. Identical work every
    time, so its p99 / p50 is what preemption, interrupts and cache sharing alone add."""
    n = 20_000
    _spin(n)  # warm
    t0 = time.perf_counter_ns()
    _spin(n)
    per = max(1.0, (time.perf_counter_ns() - t0) / n)
    n = max(10, int(target_us * 1e3 / per))
    ns = []
    for _ in range(runs):
        t0 = time.perf_counter_ns()
        _spin(n)
        ns.append(time.perf_counter_ns() - t0)
    ns.sort()
    p50, p99 = ns[len(ns) // 2] / 1e3, ns[int(len(ns) * 0.99)] / 1e3
    return {"loop_iterations": n, "p50_us": p50, "p99_us": p99, "p99_over_p50": p99 / p50}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kairos bench-decision", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="2,8,32,128", help="decode (and prefill) workers per run, comma separated")
    ap.add_argument("--decisions", type=int, default=5000, help="timed decisions per size (default 5000)")
    ap.add_argument("--policy", action="append", default=None,
                    help="policies to time; the last is the reference of the ratios "
                         "(default: kairos and disagg-least-loaded)")
    ap.add_argument("--profile", default="a100-dsv2-lite",
                    help="cost model the views and the policy use (default a100-dsv2-lite, as in earlier runs)")
    ap.add_argument("--trace", default="code", help="prompt lengths from this trace (default code)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="timed passes per size; the median pass's p50/p99 are reported (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the views, prompts and heartbeats (default 0)")
    ap.add_argument("--predictor", choices=("replay", "paper"), default=None,
                    help="kairos: TTFT predictor (default: the policy's default)")
    ap.add_argument("--no-prepare", action="store_true",
                    help="do not prepare the views apart (the policy's `prepare`, which the router calls when a "
                         "worker's view changes): each decision then does that work itself, as in the simulator")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    err = Console(stderr=True)
    try:
        sizes = [int(x) for x in args.workers.split(",") if x.strip()]
        if not sizes or min(sizes) < 1 or args.decisions < 1 or args.repeat < 1:
            raise ConfigError("--workers needs positive integers; --decisions and --repeat must be >= 1")
        lengths = prompts(args.trace, 4096, args.seed)
        kcfg = KairosConfig() if args.predictor is None else KairosConfig(predictor=args.predictor)
        names = args.policy or ["kairos", "disagg-least-loaded"]
        by_size = [measure(names, n, decisions=args.decisions, seed=args.seed, lengths=lengths,
                           profile=args.profile, kcfg=kcfg, repeat=args.repeat, prepare=not args.no_prepare)
                   for n in sizes]
        rows = [row for name in names for rows_n in by_size for row in rows_n if row["policy"] == name]
    except (ConfigError, ValueError) as e:
        err.print(f"[red]kairos bench-decision: {e}[/]")
        return 2
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    tab = Table(title=f"decision cost, {args.profile}, prompts from {args.trace}, Python {platform.python_version()}")
    for col in ("policy", "P+D workers", "p50 µs", "p99 µs", "max µs", "CPU p50 µs", "CPU p99 µs", "deflect",
                "p50 / p99 x ref", "prepare mean µs", "with prepare p50 / p99 µs", "x ref"):
        tab.add_column(col, justify="left" if col == "policy" else "right")
    for r in rows:
        tab.add_row(r["policy"], f"{r['prefill_workers']}+{r['decode_workers']}", f"{r['p50_us']:.1f}",
                    f"{r['p99_us']:.1f}", f"{r['max_us']:.0f}", f"{r['cpu_p50_us']:.1f}", f"{r['cpu_p99_us']:.1f}",
                    f"{100 * r['deflect_share']:.0f}%", f"{r['p50_us_x_ref']:.1f} / {r['p99_us_x_ref']:.1f}",
                    f"{r['prep_mean_us']:.1f}", f"{r['total_p50_us']:.1f} / {r['total_p99_us']:.1f}",
                    f"{r['total_p50_us_x_ref']:.1f} / {r['total_p99_us_x_ref']:.1f}")
    console.print(tab)
    console.print("p50/p99: the decision a request waits for; prepare: the policy's work on the views that changed "
                  "since the last decision, which the router does when they change (--no-prepare: in the decision); "
                  "with prepare: both, per decision, the router's CPU per request.")
    jit = jitter()
    console.print(f"machine jitter: the same pure-Python loop timed 5,000 times: p50 {jit['p50_us']:.1f} µs, "
                  f"p99 {jit['p99_us']:.1f} µs ({jit['p99_over_p50']:.1f}x p50). Identical work each time: "
                  "a p99 above about this multiple of p50 is the machine, not the decision.")
    if args.out:
        Path(args.out).write_text(json.dumps({"python": platform.python_version(), "machine": platform.machine(),
                                              "profile": args.profile, "rows": rows, "jitter": jit},
                                             indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
