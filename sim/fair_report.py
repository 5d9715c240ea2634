"""Markdown tables of a `python -m sim.fair_eval` result (docs/results.md and docs/results/).

    python -m sim.fair_report results/fair-eval/h100-llama2-70b-tp4.json
    python -m sim.fair_report --detail docs/results results/fair-eval/*.json

--detail writes each result's full tables, every workload in detail, into its own file
DIR/PROFILE-CONDITION.md (docs/results/h100-llama2-70b-tp4-exact.md): between that file's
`fair-eval` markers if it has them (the text around them is kept), else as a new file.

    python -m sim.fair_report --splice DOC.md results/fair-eval/*.json

--splice replaces, in DOC.md, the text between the lines `<!-- fair-eval PROFILE -->` and
`<!-- /fair-eval PROFILE -->` with the tables of PROFILE's result (without its title; headings demoted one level);
a result under model error (`--condition noise`) goes between `<!-- fair-eval PROFILE/noise -->` and its end line,
as its headline, goodput and tuned settings only.

    python -m sim.fair_report --matrix --splice docs/results.md results/fair-eval/h100-*.json

--matrix reads one result per condition and prints, per profile, one table of every workload under
every condition (regime, must-show, goodput against the best baseline, TBT at Kairos's goodput);
spliced between `<!-- fair-eval PROFILE/matrix -->` and its end line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from sim.stats import fmt
from sim.tune import GRIDS, _knobs_text

# Kairos's tuned setting again with late binding off, nothing retuned (sim/fair_eval.py `ablate`):
# a row beside the policies, never one of the baselines Kairos is compared with
ABLATION = "kairos, late binding off"


def not_a_result(res: Any) -> str | None:
    """The first field a `python -m sim.fair_eval` result must have that `res` lacks, if any."""
    if not isinstance(res, dict):
        return "profile"
    return next((k for k in ("profile", "workloads") if k not in res), None)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return [_row(head), _row(["---"] * len(head)), *(_row(r) for r in rows), ""]


def _pct(v: Any) -> str:
    return fmt(v, "%")


def _mape(s: dict[str, Any], route: str) -> str:
    r = s.get("by_route", {}).get(route)
    return "-" if r is None else _pct(r["ttft_pred_mape"])


def policies(res: dict[str, Any]) -> list[str]:
    """Every policy of any workload, in order of first appearance (workloads compare different
    sets: the session workloads add kv-aware)."""
    return list(dict.fromkeys(p for w in res["workloads"].values() for p in w["settings"]))


def _cell(pols: dict[str, Any], p: str) -> str:
    if p not in pols:
        return "-"
    s = pols[p]
    return f"{_pct(s['slo_attainment'])} / {fmt(s['ttft_p95'])} / {_pct(s['tbt_slo_attainment'])}"


def at_regime(w: dict[str, Any]) -> dict[str, Any]:
    """A workload's sweep point at its regime load (where the must-show is judged)."""
    return next(p for p in w["sweep"] if p["rate_scale"] == w["regime"])


def ablated(res: dict[str, Any]) -> bool:
    """Whether the result has the late-binding ablation (results written before it do not)."""
    return any(ABLATION in pt.get("ablation", {}) for w in res["workloads"].values() for pt in w["sweep"])


def _ablation_cell(w: dict[str, Any], pt: dict[str, Any]) -> str:
    if ABLATION in pt.get("ablation", {}):
        return _cell(pt["ablation"], ABLATION)
    return "(tuned off)" if "kairos" in w["settings"] else "-"


def headline(res: dict[str, Any]) -> list[str]:
    pols = policies(res)
    abl = ablated(res)
    head = ["workload", "GPUs", "rate x", "peak 10 s load", *[f"{p}: both / P95 s / TBT" for p in pols],
            *([f"{ABLATION}: both / P95 s / TBT"] if abl else []), "must-show"]
    rows = []
    for name, w in res["workloads"].items():
        pt = at_regime(w)
        ms = w["must_show"]
        rows.append([name, w.get("cluster", "2P2D"), f"{w['regime']:g}", f"{pt['peak_load']:.2f}",
                     *[_cell(pt["policies"], p) for p in pols], *([_ablation_cell(w, pt)] if abl else []),
                     "-" if ms is None else ("holds" if ms["holds"] else "**fails**")])
    return _table(head, rows)


def workload(name: str, w: dict[str, Any]) -> list[str]:
    out = [f"### {name}: {w['title']}", ""]
    sl = w["slices"]
    why = f": {w['regime_why']}" if w.get("regime_why") else ""
    out += [f"Tune slice {sl['tune']}, report slice {sl['report']} ({sl['unit']}). Regime load: "
            f"x{w['regime']:g} (chosen by {w['regime_chosen_by']}{why}). Wall time {w['wall_s']:.0f} s.", ""]
    out += ["Load probe (tune slice, disagg-least-loaded with the profile's settings):", ""]
    out += _table(["rate x", "requests", "prefill load", "peak 10 s", "TTFT SLO", "TTFT p95 s", "TBT SLO (max gap)",
                   "TBT p99 ms", "decode busy", "in regime"],
                  [[f"{p['rate_scale']:g}", str(p["requests"]), fmt(p["prefill_load"], "n"), fmt(p["peak_load"], "n"),
                    _pct(p["ttft_slo_attainment"]), fmt(p["ttft_p95"]), _pct(p["tbt_slo_attainment"]),
                    fmt(p["tbt_p99"], "ms"), _pct(p.get("decode_busy")), "yes" if p["in_regime"] else "no"]
                   for p in w["probe"]])
    first: dict[str, Any] = next(iter(w["tuned"].values()), {})
    stress = first.get("tune_stress")
    how = "" if not stress else (", the objective averaged over the slice at " + " and ".join(stress)
                                 + " that load (tune: both is that mean)")
    out += [f"Tuned at x{w['regime']:g} on the tune slice{how}:", ""]
    out += _table(["policy", "GPUs", "best setting (searched knobs)", "runs", "wall s", "tune: both", "report: both",
                   "defaults on tune: both"],
                  [[p, e["cluster"], _knobs_text(p, e, GRIDS[p]), str(e["evaluated"]), f"{e['wall_s']:.0f}",
                    _pct(e["tune"]["slo_attainment"]), _pct(e["report"]["slo_attainment"]),
                    _pct(e["defaults_tune"]["slo_attainment"])] for p, e in w["tuned"].items()])
    pt = at_regime(w)
    out += [f"At the regime load x{w['regime']:g}, report slice (prefill load {fmt(pt['prefill_load'], 'n')}, "
            f"busiest 10 s {fmt(pt['peak_load'], 'n')}):", ""]
    out += _table(["policy", "GPUs", "both SLOs", "both (p99 gap)", "TTFT SLO", "TBT max gap", "TBT p99 gap",
                   "TTFT p50 s", "p95 s", "p99 s", "deflected", "rejected", "pred err disagg", "pred err deflect"],
                  [[p, s["cluster"], _pct(s["slo_attainment"]), _pct(s["slo_attainment_p99"]),
                    _pct(s["ttft_slo_attainment"]), _pct(s["tbt_slo_attainment"]), _pct(s["tbt_p99_slo_attainment"]),
                    fmt(s["ttft_p50"]), fmt(s["ttft_p95"]), fmt(s["ttft_p99"]), _pct(s["deflection_rate"]),
                    str(s["rejected"]), _mape(s, "disagg"), _mape(s, "deflect")] for p, s in pt["policies"].items()])
    hits = {p: s.get("sim", {}).get("prefix_hit_rate") for p, s in pt["policies"].items()}
    if any(h is not None for h in hits.values()):  # prefix-cache hits: prompt tokens whose prefill a hit skipped
        out += ["Prefix-cache hits at the regime load (prompt tokens whose prefill a cache hit skipped): "
                + ", ".join(f"{p} {_pct(h)}" for p, h in hits.items()) + ".", ""]
    ms = w["must_show"]
    if ms is not None:
        parts = []
        for b, r in ms["baselines"].items():
            parts.append(f"{b}: attainment {'ok' if r['attainment_ok'] else 'LOWER'}, P95 "
                         f"{'lower' if r['p95_lower'] else 'NOT lower'}"
                         + (" (its TBT over 1 pt worse)" if r["baseline_tbt_worse"] and not r["p95_lower"] else ""))
        out += [f"Must-show at x{w['regime']:g}: **{'holds' if ms['holds'] else 'does not hold'}** "
                f"(Kairos against {'; '.join(parts)}).", ""]
    out += ["Where the TTFT goes at the regime load (routes; tail = requests at or above the policy's P95 TTFT):", ""]
    rows = []
    for p, s in pt["policies"].items():
        for route, r in s.get("by_route", {}).items():
            rows.append([p, route, _pct(r["share"]), f"{r['prompt_p50']:.0f}", f"{r['prompt_mean']:.0f}",
                         fmt(r["ttft_p95"]), _pct(r["ttft_slo_attainment"]), _pct(r["ttft_pred_mape"]),
                         _pct(s["ttft_tail_queue_share"]), _pct(s["ttft_tail_prefill_share"]),
                         _pct(s["ttft_tail_xfer_share"])])
    out += _table(["policy", "route", "share", "prompt p50", "prompt mean", "TTFT p95 s", "TTFT SLO", "pred err",
                   "tail: queue", "tail: prefill", "tail: xfer"], rows)
    rows = []
    for p, s in pt["policies"].items():
        for reason, r in s.get("by_reason", {}).items():
            rows.append([p, reason, str(r["route"]), str(r["requests"]), f"{r['prompt_p50']:.0f}", fmt(r["ttft_p50"]),
                         fmt(r["ttft_p95"]), str(r["missed_ttft"]), fmt(r["missed_ttft_p50"]),
                         fmt(r["missed_pred_p50"])])
    if rows:
        out += ["Routing reasons at the regime load (missed: TTFT above the SLO; predicted: the policy's TTFT "
                "prediction for the route it chose):", ""]
        out += _table(["policy", "reason", "route", "requests", "prompt p50", "TTFT p50 s", "TTFT p95 s", "missed",
                       "missed: TTFT p50 s", "missed: predicted p50 s"], rows)
    out += ["Load sweep (report slice, settings tuned at the regime load):", ""]
    rows = []
    for point in w["sweep"]:
        for p, s in point["policies"].items():
            rows.append([f"{point['rate_scale']:g}", fmt(point["prefill_load"], "n"), fmt(point["peak_load"], "n"), p,
                         _pct(s["slo_attainment"]), _pct(s["ttft_slo_attainment"]), _pct(s["tbt_slo_attainment"]),
                         _pct(s["tbt_p99_slo_attainment"]), fmt(s["ttft_p95"]), fmt(s["ttft_p99"]),
                         _pct(s["deflection_rate"]), str(s["rejected"])])
    out += _table(["rate x", "load", "peak 10 s", "policy", "both SLOs", "TTFT SLO", "TBT max gap", "TBT p99 gap",
                   "TTFT p95 s", "p99 s", "deflected", "rejected"], rows)
    return out


GOODPUT_AT = 0.9  # SLO goodput: the highest rate at which a policy keeps this both-SLO attainment (DistServe's)


def goodput(w: dict[str, Any], policy: str) -> tuple[float | None, dict[str, Any] | None]:
    """The highest swept rate scale at which `policy` keeps GOODPUT_AT both-SLO attainment, at
    it and at every lower swept rate, and its summary there (None: not even the lowest)."""
    best: tuple[float | None, dict[str, Any] | None] = (None, None)
    for point in sorted(w["sweep"], key=lambda pt: pt["rate_scale"]):
        s = point["policies"][policy] if policy != ABLATION else point.get("ablation", {}).get(policy)
        if s is None:
            return (None, None)
        if (s["slo_attainment"] or 0) < GOODPUT_AT:
            break
        best = (point["rate_scale"], s)
    return best


def goodput_table(res: dict[str, Any]) -> list[str]:
    pols = policies(res)
    abl = ablated(res)
    head = ["workload", "swept rates x", *[f"{p}: goodput x (TBT there)" for p in pols],
            *([f"{ABLATION}: goodput x"] if abl else []), "Kairos >= best baseline"]
    rows = []
    for name, w in res["workloads"].items():
        got = {p: goodput(w, p) for p in pols if p in w["settings"]}
        off = []
        if abl:
            has = any(ABLATION in pt.get("ablation", {}) for pt in w["sweep"])
            x = goodput(w, ABLATION)[0] if has else None
            off = [("< lowest" if x is None else f"{x:g}") if has else _ablation_cell(w, {})]

        def text(g: tuple[float | None, dict[str, Any] | None] | None) -> str:
            if g is None:
                return "-"
            x, s = g
            return "< lowest" if x is None or s is None else f"{x:g} ({_pct(s['tbt_slo_attainment'])})"

        verdict = "-"
        if all(g[0] is None for g in got.values()):
            verdict = "none reaches it"
        elif "kairos" in got and len(got) > 1:
            k = got["kairos"][0] or 0.0
            verdict = "yes" if all(k >= (g[0] or 0.0) for p, g in got.items() if p != "kairos") else "**no**"
        rows.append([name, "/".join(f"{pt['rate_scale']:g}" for pt in w["sweep"]), *[text(got.get(p)) for p in pols],
                     *off, verdict])
    return _table(head, rows)


def markdown(res: dict[str, Any]) -> str:
    la0, la1 = res["loadavg_start"], res.get("loadavg_end", res["loadavg_start"])
    cond = res.get("condition", "exact")
    error = (", ".join(f"{k} {v}" for k, v in res.get("model_error", {}).items())
             or "none: steps take what the model says")
    out = [f"## {res['profile']}" + ("" if cond == "exact" else f", {cond}"), "",
           f"Model error (condition `{cond}`): {error}; every policy tuned and judged under it.", "",
           f"Run {res['date']} on {res['machine']} (load average {la0[0]:.1f} at the start, {la1[0]:.1f} at the end; "
           f"wall time {res.get('wall_s', 0):.0f} s), simulated: `{res['command']}`.", "",
           "Headline, at each workload's regime load, report slice (both = both-SLO attainment, TBT = largest-gap "
           "TBT attainment" + (f"; {ABLATION}: Kairos's tuned setting with late binding switched off, nothing "
                               "retuned, so the difference is what late binding gives; \"(tuned off)\": the tuner "
                               "left it off" if ablated(res) else "") + "):", ""]
    out += headline(res)
    out += [f"SLO goodput, report slice: the highest swept rate at which each policy keeps {GOODPUT_AT:.0%} both-SLO "
            "attainment (at that rate and every lower one swept; four to six rates per workload, so a coarse reading), "
            "with its TBT attainment of served requests there:", ""]
    out += goodput_table(res)
    for name, w in res["workloads"].items():
        out += workload(name, w)
    return "\n".join(out) + "\n"


def brief(res: dict[str, Any]) -> str:
    """A result under model error, for docs/results/model-error.md (section 7): the headline, the goodput and
    each workload's tuned settings (the full tables are in the .md fair_eval writes beside it)."""
    out = markdown(res).split("\n### ", 1)[0].rstrip("\n").splitlines()
    out += ["", "Tuned settings under this condition (tune slice; report: both-SLO attainment on the report slice):",
            ""]
    rows = []
    for name, w in res["workloads"].items():
        for p, e in w["tuned"].items():
            rows.append([name, p, _knobs_text(p, e, GRIDS[p]), _pct(e["report"]["slo_attainment"])])
    out += _table(["workload", "policy", "best setting (searched knobs)", "report: both"], rows)
    return "\n".join(out) + "\n"


CONDITION_NAMES = {"exact": "exact model", "noise": "10 % step noise", "slow": "engine 15 % slower",
                   "hetero": "mixed fleet (0.85-1.15)"}


def _matrix_cell(w: dict[str, Any], abl: bool) -> str:
    """One workload under one condition: the regime, the must-show there, Kairos's goodput against
    the best baseline's, Kairos's TBT attainment at its goodput (bold where a promise is broken),
    and, when the run has the late-binding ablation (`abl`), what late binding adds to Kairos's
    both-SLO attainment at the regime load."""
    ms = w.get("must_show")
    verdict = "-" if ms is None else ("holds" if ms["holds"] else "**fails**")
    pols = [p for p in w["settings"] if p != "kairos"]
    k, ks = goodput(w, "kairos")
    base = {p: goodput(w, p)[0] for p in pols}
    best = max((x for x in base.values() if x is not None), default=None)
    if k is None and best is None:
        gp = "none reaches 90 %"
    else:
        kt = "< lowest" if k is None else f"x{k:g}"
        bt = "none" if best is None else f"x{best:g}"
        gp = f"{kt} / {bt}" if (k or 0.0) >= (best or 0.0) else f"**{kt} / {bt}**"
    tbt = "-"
    if ks is not None:
        t = ks.get("tbt_slo_attainment")
        tbt = _pct(t) if t is None or t >= 0.99 else f"**{_pct(t)}**"
    pt = at_regime(w)
    late = ""
    if ABLATION in pt.get("ablation", {}):
        d = (pt["policies"]["kairos"]["slo_attainment"] or 0) - (pt["ablation"][ABLATION]["slo_attainment"] or 0)
        late = f" · late binding {round(d * 100, 1) + 0.0:+.1f} pt"  # + 0.0: no "-0.0"
    elif abl:
        late = " · late binding tuned off"
    return f"x{w['regime']:g}: {verdict} · {gp} · {tbt}{late}"


def matrix(results: list[dict[str, Any]]) -> dict[str, str]:
    """Per profile, one table: every workload under every condition given (one fair_eval result per
    condition), read off each result's must-show and goodput. The cross-condition view of the
    tables that --splice puts in sections 2, 4 and 7.3."""
    tables: dict[str, str] = {}
    for profile in dict.fromkeys(r["profile"] for r in results):
        out: list[str] = []
        runs: dict[str, dict[str, Any]] = {str(r.get("condition", "exact")): r for r in results
                                           if r["profile"] == profile}
        conds = [c for c in CONDITION_NAMES if c in runs] + [c for c in runs if c not in CONDITION_NAMES]
        names = list(dict.fromkeys(n for c in conds for n in runs[c]["workloads"]))
        abl = {c: ablated(runs[c]) for c in conds}
        rows = []
        for n in names:
            ws = [runs[c]["workloads"].get(n) for c in conds]
            cluster = next(w.get("cluster", "2P2D") for w in ws if w is not None)
            rows.append([f"{n} ({cluster})", *["-" if w is None else _matrix_cell(w, abl[c])
                                               for c, w in zip(conds, ws, strict=True)]])
        out += [f"## {profile}, every condition", "",
                "Each cell: the regime load: the must-show there · SLO goodput, Kairos / the best baseline "
                "(bold where Kairos's is lower) · Kairos's TBT attainment at its goodput (bold under 99 %) · "
                "where the run has the ablation, the points of both-SLO attainment late binding adds at the "
                "regime load (Kairos's tuned setting with it off, nothing retuned).", ""]
        out += _table(["workload", *[CONDITION_NAMES.get(c, c) for c in conds]], rows)
        out += ["Runs: " + "; ".join(f"{CONDITION_NAMES.get(c, c)} {runs[c]['date']} (`{runs[c]['command']}`)"
                                     for c in conds) + ".", ""]
        tables[profile] = "\n".join(out)
    return tables


def splice(doc: str, profile: str, tables: str) -> str:
    start, end = f"<!-- fair-eval {profile} -->", f"<!-- /fair-eval {profile} -->"
    if start not in doc or end not in doc:
        raise ValueError(f"no '{start}' ... '{end}' block to replace: add the two lines where the tables go")
    head, rest = doc.split(start, 1)
    _, tail = rest.split(end, 1)
    lines = tables.splitlines()
    if lines[:1] and lines[0].startswith(f"## {profile.split('/')[0]}"):
        lines = lines[1:]  # the document has its own heading for the profile
    body = "\n".join(("#" + line) if line.startswith("#") else line for line in lines)
    return f"{head}{start}\n{body}\n{end}{tail}"


def marker_key(res: dict[str, Any]) -> str:
    """The marker a result's tables go between: PROFILE, or PROFILE/CONDITION under model error."""
    cond = res.get("condition", "exact")
    return str(res["profile"]) + ("" if cond == "exact" else f"/{cond}")


def write_detail(folder: Path, res: dict[str, Any]) -> Path:
    """Write `res`'s full tables to FOLDER/PROFILE-CONDITION.md: between the file's markers if it
    has them (its own title and notes kept), else as a new file with a title and the markers."""
    cond = res.get("condition", "exact")
    path = folder / f"{res['profile']}-{cond}.md"
    key = marker_key(res)
    if path.exists():
        path.write_text(splice(path.read_text(), key, markdown(res)))
        return path
    folder.mkdir(parents=True, exist_ok=True)
    name = CONDITION_NAMES.get(cond, cond)
    head = (f"# {res['profile']}, {name}: every workload in detail\n\n"
            f"Generated by `python -m sim.fair_report --detail {folder} RESULT.json` from a "
            f"`python -m sim.fair_eval` result.\n\n")
    path.write_text(splice(f"{head}<!-- fair-eval {key} -->\n<!-- /fair-eval {key} -->\n", key, markdown(res)))
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    target = None
    detail = None
    as_matrix = args[:1] == ["--matrix"]
    if as_matrix:
        args = args[1:]
    if args[:1] == ["--splice"] and len(args) >= 2:
        target, args = Path(args[1]), args[2:]
    elif args[:1] == ["--detail"] and len(args) >= 2 and not as_matrix:
        detail, args = Path(args[1]), args[2:]
    usage = ("usage: python -m sim.fair_report [--matrix] [--splice DOC.md | --detail DIR] RESULT.json ...\n"
             "Prints the markdown report of each RESULT.json that python -m sim.fair_eval wrote, or, with\n"
             "--splice, replaces its section in DOC.md (between its <!-- fair-eval PROFILE[/CONDITION] --> markers).\n"
             "--detail DIR: each result's full tables into DIR/PROFILE-CONDITION.md (between that file's markers\n"
             "if it exists, else a new file), e.g. --detail docs/results.\n"
             "--matrix: one table per profile, each workload under each condition of the RESULT.json files given\n"
             "(one per condition); with --splice it goes between <!-- fair-eval PROFILE/matrix --> markers.")
    if args[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    if not args:
        print(usage, file=sys.stderr)
        return 2
    results = []
    for path in args:
        try:
            results.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as e:
            print(f"fair_report: cannot read {path}: {e}", file=sys.stderr)
            return 2
        missing = not_a_result(results[-1])
        if missing:
            print(f"fair_report: {path} is not a result of python -m sim.fair_eval (no {missing!r})", file=sys.stderr)
            return 2
    if as_matrix:
        tables = matrix(results)
        if target is None:
            sys.stdout.write("\n".join(tables.values()))
            return 0
        try:
            for profile, text in tables.items():
                target.write_text(splice(target.read_text(), f"{profile}/matrix", text))
        except ValueError as e:
            print(f"fair_report: {target}: {e}", file=sys.stderr)
            return 2
        return 0
    for res in results:
        if detail is not None:
            try:
                print(f"wrote {write_detail(detail, res)}")
            except (OSError, ValueError) as e:
                print(f"fair_report: {detail}: {e}", file=sys.stderr)
                return 2
            continue
        if target is None:
            sys.stdout.write(markdown(res))
            continue
        try:
            cond = res.get("condition", "exact")
            key = marker_key(res)
            target.write_text(splice(target.read_text(), key, markdown(res) if cond == "exact" else brief(res)))
        except ValueError as e:
            print(f"fair_report: {target}: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
