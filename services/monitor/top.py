"""`kairos top`: the dashboard's picture in a terminal (rich), refreshed once a second.

It reads the monitor's `GET /api/state` rather than subscribing to the bus itself: the monitor
already holds the rolling window (a fresh subscriber would start with an empty one and miss
everything before it joined), the numbers match the dashboard and /metrics exactly, it needs
only HTTP access to the monitor (no bus port, no CURVE keys), and it adds no subscriber to the
router's telemetry socket.

    kairos top                          # live, Ctrl-C quits
    kairos top --once                   # one snapshot, then exit (scripts, tests)
    kairos top --url http://host:9100   # another monitor

Without --url it finds the monitor of the `kairos up` cluster whose log directory it is given
(`--log-dir`, default kairos-logs: the address the monitor logged in `monitor_started`), so a
cluster started on other ports is found too; else http://127.0.0.1:9100.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

BLOCKS = "▁▂▃▄▅▆▇█"
DEFAULT_URL = "http://127.0.0.1:9100"


def discover(log_dir: str) -> str | None:
    """The dashboard address the monitor of a `kairos up` cluster logged when it started (its
    last `monitor_started` line in LOG_DIR/monitor.log), or None."""
    path = Path(log_dir) / "monitor.log"
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - (1 << 20)))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if '"monitor_started"' not in line:
            continue
        try:
            url = str(json.loads(line)["dashboard"]).rstrip("/")
        except (ValueError, KeyError, TypeError):
            continue
        return url.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//127.0.0.1:")
    return None


def unreachable_hint(url: str, given: bool) -> str:
    """What to do when no monitor answers at `url`."""
    if given:
        return "is a monitor listening there? (`kairos up` prints the dashboard address)"
    return ("no monitor there: a cluster started on other ports? pass --url http://HOST:PORT (the dashboard "
            "address `kairos up` prints), or --log-dir with that cluster's log directory")


def lost_row(lost: dict[str, Any]) -> tuple[str, Text]:
    """A worker that left: a drained worker's departure (a planned restart or scale-down) is not a loss."""
    ago = f"{lost['ago_s']:.0f} s ago"
    if lost["reason"] == "departed":
        return "left", Text(f"left {ago} (drained)", style="dim")
    return "lost", Text(f"lost {ago}: {lost['reason']}", style="red")


def flip_row(f: dict[str, Any]) -> Text:
    """A role flip of the planner: started (the worker drains), done (back under its new role), abandoned."""
    ago = f"{f['ago_s']:.0f} s ago"
    what = f"role flip {f['from']} → {f['to']} ({f['reason']})"
    if f["phase"] == "started":
        return Text(f"{what}: draining since {ago}", style="bold cyan")
    if f["phase"] == "done":
        return Text(f"{what}: done {ago}, took {f['took_s']:.0f} s", style="cyan")
    return Text(f"{what}: abandoned {ago} after {f['took_s']:.0f} s", style="bold yellow")


def fmt_s(s: float | None) -> str:
    if s is None:
        return "–"
    if abs(s) < 1:
        return f"{s * 1000:.1f} ms" if abs(s) < 0.01 else f"{s * 1000:.0f} ms"
    return f"{s:.2f} s"


def fmt_pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def pred_err(e: dict[str, float] | None) -> str:
    """A prediction error summary (common/prediction_error.py) as "p50 / p90 (n)"."""
    return "–" if not e else f"{fmt_pct(e['median'])} / {fmt_pct(e['p90'])} (n={int(e['n'])})"


def fmt_n(x: float | None, digits: int = 0) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def spark(values: Sequence[float | None], width: int = 30) -> str:
    vals = list(values)[-width:]
    present = [v for v in vals if v is not None]
    top = max(present) if present else 0.0
    if top <= 0:
        return "".join(" " if v is None else BLOCKS[0] for v in vals)
    return "".join(" " if v is None else BLOCKS[min(7, int(7 * v / top + 0.5))] for v in vals)


def down_line(d: dict[str, Any]) -> str:
    """One service `kairos up` holds down or is restarting, for the operator."""
    if d["state"] == "held_down":
        nxt = "" if d.get("next_try_s") is None else f", next try in {d['next_try_s']:.0f} s"
        return f"{d['service']} HELD DOWN: crash-looping ({d['last_exit'] or '?'}){nxt}"
    return f"{d['service']} restarting after {d['last_exit'] or 'an exit'}"


LOOP_LAG_WARN_MS = 100.0  # a router loop this late stalls every stream it serves: shown in yellow


def render(s: dict[str, Any], url: str) -> Group:
    w = s["window"]
    r = s["router"]
    if r is None:
        router = Text("router: no telemetry yet", style="bold red")
    elif r["age_s"] > 5:
        router = Text(f"router silent for {r['age_s']:.0f} s", style="bold red")
    else:
        reps = r.get("replicas") or []
        silent = [x["name"] for x in reps if x["age_s"] > 5]
        who = f"{len(reps)} routers" if len(reps) > 1 else "router"
        router = Text(f"{who} ok · {r['in_flight']} in flight · {r['accepted']} accepted · {r['failed']} failed "
                      f"· {r['rejected']} rejected · loop lag {r.get('loop_lag_ms', 0.0):.0f} ms"
                      f" · delivery allowance {r.get('delivery_allowance_ms', 0.0):.1f} ms",
                      style="bold yellow" if r.get("loop_lag_ms", 0.0) >= LOOP_LAG_WARN_MS else "green")
        if silent:
            router = Text(f"{len(silent)} of {len(reps)} routers silent ({', '.join(silent)}) · {r['in_flight']} in "
                          f"flight · {r['accepted']} accepted · {r['failed']} failed", style="bold yellow")
    live = s["live_workers"]
    head = Text.assemble(("Kairos ", "bold"), (f"policy {s['policy'] or '?'}  ", "dim"), router,
                         (f"   {live['prefill']} prefill · {live['decode']} decode workers   ", ""), (url, "dim"))
    down = s.get("services_down") or []
    top: Text | Group = head
    if down:
        top = Group(head, Text("  ".join(down_line(d) for d in down), style="bold red"))
    series = s["series"]
    kpis = Table.grid(padding=(0, 3))
    for _ in range(4):
        kpis.add_column()
    kpis.add_row(f"req/s [b]{fmt_n(w['rps'], 1)}[/b]", f"deflected [b]{fmt_pct(w['deflect_ratio'])}[/b]",
                 f"TTFT p50/p95 [b]{fmt_s(w['ttft_p50'])} / {fmt_s(w['ttft_p95'])}[/b]",
                 f"TBT p50/p99 [b]{fmt_s(w['tbt_p50'])} / {fmt_s(w['tbt_p99'])}[/b]")
    err_style = "bold red" if w["errors"] else "b"
    kpis.add_row(f"errors [{err_style}]{w['errors']}[/{err_style}]", f"KV fallbacks [b]{w['kv_fallbacks']}[/b]",
                 f"TTFT pred. − actual [b]{fmt_s(w['ttft_pred_bias'])}[/b]  error p50/p90 "
                 f"[b]{pred_err(w.get('ttft_pred_err'))}[/b]",
                 f"SLO attained [b]{fmt_pct(w['slo_attainment'])}[/b]  decision p99 "
                 f"[b]{fmt_n(w['decision_us_p99'])} µs[/b]")
    kpis.add_row(f"req/s  {spark([p['rps'] for p in series])}",
                 f"defl. {spark([p['deflect_ratio'] for p in series])}",
                 f"TTFT p95 {spark([p['ttft_p95'] for p in series])}",
                 f"TBT p99 {spark([p['tbt_p99'] for p in series])}")

    workers = Table(title=f"workers (last {s['window_s']} s)", expand=True, title_justify="left")
    for col in ("worker", "role", "load", "queue / batch", "KV used", "TBT slack", "step p50/max", "step err.",
                "loop lag", "defl.", "reported"):
        workers.add_column(col, no_wrap=True)
    for wk in s["workers"]:
        st = wk["state"]
        prefill = wk["role"] == "prefill"
        slack = st.get("tbt_slack_ms")
        stale = wk["age_s"] > 3
        workers.add_row(
            wk["worker_id"], wk["role"], spark([v for _, v in wk["load_history"]], 20),
            f"{fmt_n(st.get('queued_tokens'))} tok · {fmt_n(st.get('queued_requests'))} req" if prefill
            else f"batch {fmt_n(st.get('batch'))}",
            "" if prefill else fmt_pct(st.get("kv_used")),
            "" if prefill or slack is None or slack < 0 else fmt_s(slack / 1000),
            f"{fmt_n(st.get('step_ms_p50'), 1)} / {'–' if prefill else fmt_n(st.get('step_ms_max'), 1)} ms",
            f"{fmt_pct(st.get('step_err_p50'))} / {fmt_pct(st.get('step_err_p90'))}" if 'step_err_p50' in st else "–",
            Text(f"{fmt_n(st.get('loop_lag_ms'))} ms",
                 style="bold yellow" if (st.get("loop_lag_ms") or 0.0) >= LOOP_LAG_WARN_MS else ""),
            "" if prefill else fmt_n(st.get("deflections")),
            Text(f"{wk['age_s']:.0f} s ago!", style="bold yellow") if stale else Text("live", style="green"))
    if not s["workers"]:
        if r is not None and r["age_s"] > 5:  # the router is silent (frozen, down): the workers may well run
            workers.add_row(Text(f"unknown: no report from the router for {r['age_s']:.0f} s", style="bold yellow"))
        else:
            workers.add_row(Text("no workers reported yet", style="dim"))
    for lost in s["lost"]:
        workers.add_row(lost["worker_id"], lost["role"], lost_row(lost)[1])
    for f in s.get("flips", []):  # (a monitor older than the role planner sends none)
        workers.add_row(f["worker_id"], f["to"] if f["phase"] == "done" else f["from"], flip_row(f))

    recent = Table(title="recent decisions", expand=True, title_justify="left")
    for col in ("request", "route", "reason", "workers", "prompt", "pred. P / D", "TTFT", "outcome"):
        recent.add_column(col, no_wrap=True)
    for d in s["recent"][:12]:
        bad = d["outcome"] and d["outcome"] != "ok"
        recent.add_row(d["request_id"][:10], Text(d["route"], style="cyan" if d["route"] == "disagg" else "yellow"),
                       d["reason"], (f"{d['prefill_worker']} → " if d["prefill_worker"] else "") + d["decode_worker"],
                       str(d["prompt_tokens"]), f"{fmt_s(d['ttft_prefill_pred'])} / {fmt_s(d['ttft_decode_pred'])}",
                       fmt_s(d["ttft_s"]), Text(d["outcome"] or "running", style="bold red" if bad else ""))
    return Group(Panel(Group(top, kpis)), workers, recent)


def fetch(client: httpx.Client, url: str) -> dict[str, Any]:
    r = client.get(url.rstrip("/") + "/api/state")
    r.raise_for_status()
    data: dict[str, Any] = r.json()
    return data


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kairos top", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="the monitor (default: the one that LOG_DIR/monitor.log names, "
                   f"else {DEFAULT_URL})")
    p.add_argument("--log-dir", default="kairos-logs", help="log directory of the `kairos up` cluster to find the "
                   "monitor of (default kairos-logs)")
    p.add_argument("--interval", type=float, default=1.0, help="refresh period, seconds (default 1)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    a = p.parse_args(argv)
    given = a.url is not None
    a.url = a.url or discover(a.log_dir) or DEFAULT_URL
    console = Console()
    if not console.is_terminal:  # piped or logged (`--once > file`): the full tables, not 80 columns
        console = Console(width=160)
    with httpx.Client(timeout=5.0) as client:
        if a.once:
            try:
                console.print(render(fetch(client, a.url), a.url))
            except (httpx.HTTPError, ValueError) as e:
                print(f"error: cannot read {a.url}/api/state: {e}\n  {unreachable_hint(a.url, given)}",
                      file=sys.stderr)
                return 1
            return 0
        try:
            with Live(Text(f"connecting to {a.url}…"), console=console, refresh_per_second=4, screen=False) as live:
                while True:
                    try:
                        live.update(render(fetch(client, a.url), a.url))
                    except (httpx.HTTPError, ValueError) as e:
                        live.update(Text(f"cannot read {a.url}/api/state: {e} (retrying)\n"
                                         f"{unreachable_hint(a.url, given)}", style="bold red"))
                    time.sleep(max(0.1, a.interval))
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    sys.exit(main())
