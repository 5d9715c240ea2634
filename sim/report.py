"""`python -m sim.report results.json ...`: one markdown table over several `kairos sim` results.

One row per (file, rate scale, policy). The leading columns are the trace, the rate scale and
the offered prefill load, then any config field that differs between the files (alpha, chunk
candidates, heartbeat interval, ledger, ...), then the policy and its figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sim.stats import fmt

VARYING = ("cluster", "prefill_token_budget", "decode_token_budget", "decode_chunk", "alpha", "beta", "candidates",
           "max_deflections", "transfer_term", "eff_isl_threshold", "eff_isl_ratio_threshold", "prefill_busy_threshold",
           "heartbeat_interval", "ledger", "step_noise", "kv_wait_timeout", "ttft_slo", "tbt_slo", "profile")

COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("ttft_p50", "TTFT p50 s", "s"), ("ttft_p95", "TTFT p95 s", "s"), ("ttft_p99", "TTFT p99 s", "s"),
    ("tbt_p99", "TBT p99 ms", "ms"), ("ttft_slo_attainment", "TTFT SLO", "%"),
    ("tbt_slo_attainment", "TBT SLO", "%"), ("tbt_p99_slo_attainment", "TBT SLO (p99 gap)", "%"),
    ("slo_attainment", "both SLOs", "%"), ("rejected", "rejected", "n"), ("deflection_rate", "deflected", "%"),
)


def _fmt(v: Any, kind: str) -> str:
    """A config or result cell: booleans, lists and ints as themselves, the rest by stats.fmt."""
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, list):
        return ",".join(str(x) for x in v)
    if isinstance(v, int) and kind not in ("%", "ms"):
        return str(v)
    if isinstance(v, str):
        return v
    return fmt(v, kind)


def _settings(cfg: dict[str, Any], policy: str) -> dict[str, Any]:
    """The run's config with this policy's own settings (cluster, engine, knobs) on top."""
    own = cfg.get("settings", {}).get(policy, {})
    return {**cfg, "cluster": own.get("cluster", f"{cfg.get('prefill')}P{cfg.get('decode')}D"),
            **own.get("engine", {}), **own.get("policy", {})}


def table(results: list[dict[str, Any]], policies: list[str] | None = None) -> str:
    rows = []
    for res in results:
        cfg = res["config"]
        for point in res.get("sweep") or [{"rate_scale": cfg.get("rate_scales", [1])[0],
                                           "prefill_load": None, "policies": res["policies"]}]:
            for name, s in point["policies"].items():
                if not policies or name in policies:
                    rows.append((cfg, point, name, s, _settings(cfg, name)))
    # a setting is shown when it takes more than one value among the rows that have it
    varying = [k for k in VARYING
               if len({json.dumps(r[4][k]) for r in rows if r[4].get(k) is not None}) > 1]
    head = ["trace", "rate x", "prefill load", *varying, "policy", *(c[1] for c in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for cfg, point, name, s, settings in rows:
        row = [str(cfg.get("trace")), f"{point['rate_scale']:g}", _fmt(point.get("prefill_load"), "s"),
               *(_fmt(settings.get(k), "s") for k in varying), name,
               *(_fmt(s.get(k), kind) for k, _, kind in COLUMNS)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="results.json files written by kairos sim --out")
    ap.add_argument("--policy", action="append", default=None, help="only these policies")
    args = ap.parse_args(argv)
    try:
        results = [json.loads(Path(f).read_text()) for f in args.files]
    except (OSError, ValueError) as e:
        print(f"sim.report: {e}", file=sys.stderr)
        return 2
    print(table(results, args.policy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
