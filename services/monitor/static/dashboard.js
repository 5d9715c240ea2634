// Kairos dashboard: renders the monitor's /api/state snapshot, then every `state` server-sent
// event from /events (about once a second). No libraries, nothing from the network but the monitor.
"use strict";

const $ = (id) => document.getElementById(id);
const COLORS = { p50: "#5cc97b", p95: "#f2a541", p99: "#ef5b5b", rps: "#5aa9e6", deflect: "#f2a541" };
let updates = 0;
let lastUpdate = 0;

function fmtS(s) {
  if (s === null || s === undefined) return "–";
  if (s === 0) return "0";
  if (Math.abs(s) < 1) return (s * 1000).toFixed(Math.abs(s) < 0.01 ? 1 : 0) + " ms";
  return s.toFixed(2) + " s";
}
function fmtPct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(0) + "%"; }
function fmtN(x, d = 0) { return x === null || x === undefined ? "–" : Number(x).toFixed(d); }
function fmtAge(s) { return s < 60 ? s.toFixed(0) + " s" : (s / 60).toFixed(0) + " min"; }

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}
function svgEl(tag, attrs) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}
function bar(frac, label) {
  const f = Math.max(0, Math.min(1, frac || 0));
  const i = el("i", { class: f > 0.85 ? "hot" : "" });
  i.style.width = (100 * f).toFixed(0) + "%";
  return el("span", {}, el("span", { class: "bar" }, i), label);
}

// A line chart of the last 60 s: lines = [{key, label, color, scale}], null values leave gaps.
function chart(svg, series, lines, fmt, fixedMax) {
  const W = 360, H = 140, L = 44, R = 6, T = 16, B = 16;
  svg.replaceChildren();
  let max = 0;
  for (const p of series) for (const ln of lines) {
    const v = p[ln.key];
    if (v !== null && v !== undefined) max = Math.max(max, v * (ln.scale || 1));
  }
  max = fixedMax || (max > 0 ? max * 1.1 : 1);
  const x = (i) => L + (W - L - R) * (series.length > 1 ? i / (series.length - 1) : 0);
  const y = (v) => T + (H - T - B) * (1 - v / max);
  for (const f of [0, 0.5, 1]) {
    svg.append(svgEl("line", { class: "grid", x1: L, x2: W - R, y1: y(max * f), y2: y(max * f) }));
    const t = svgEl("text", { x: L - 4, y: y(max * f) + 3, "text-anchor": "end" });
    t.textContent = fmt(max * f);
    svg.append(t);
  }
  for (const [i, label] of [[0, "-60 s"], [series.length - 1, "now"]]) {
    const t = svgEl("text", { x: x(Math.max(i, 0)), y: H - 3, "text-anchor": i ? "end" : "start" });
    t.textContent = label;
    svg.append(t);
  }
  let lx = L;
  for (const ln of lines) {
    let d = "", pen = false;
    series.forEach((p, i) => {
      const v = p[ln.key];
      if (v === null || v === undefined) { pen = false; return; }
      d += (pen ? "L" : "M") + x(i).toFixed(1) + "," + y(v * (ln.scale || 1)).toFixed(1);
      pen = true;
    });
    if (d) svg.append(svgEl("path", { d, fill: "none", stroke: ln.color, "stroke-width": 1.6 }));
    const t = svgEl("text", { x: lx, y: 10, fill: ln.color, style: "fill:" + ln.color });
    t.textContent = ln.label;
    svg.append(t);
    lx += 8 + 6 * ln.label.length;
  }
}

function sparkline(points) {
  const W = 90, H = 20;
  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H });
  if (points.length > 1) {
    const t0 = points[0][0], t1 = points[points.length - 1][0];
    const max = Math.max(1, ...points.map((p) => p[1]));
    const d = points.map((p, i) => (i ? "L" : "M") + (W * (p[0] - t0) / Math.max(1, t1 - t0)).toFixed(1) + ","
      + (H - 1 - (H - 2) * p[1] / max).toFixed(1)).join("");
    svg.append(svgEl("path", { d, fill: "none", stroke: COLORS.rps, "stroke-width": 1.4 }));
  }
  return svg;
}

function renderWorkers(s) {
  const tbody = $("workers").tBodies[0];
  const rows = s.workers.map((w) => {
    const st = w.state;
    const prefill = w.role === "prefill";
    const slack = st.tbt_slack_ms === undefined || st.tbt_slack_ms < 0 ? "–" : fmtS(st.tbt_slack_ms / 1000);
    const tr = el("tr", { "data-worker": w.worker_id, class: w.age_s > 3 ? "stale" : "" },
      el("td", {}, el("b", {}, w.worker_id), " ", el("span", { class: "muted" }, w.role)),
      el("td", {}, sparkline(w.load_history)),
      el("td", {}, prefill ? `${fmtN(st.queued_tokens)} tok · ${fmtN(st.queued_requests)} req`
        : `batch ${fmtN(st.batch)}`),
      el("td", {}, prefill ? "" : bar(st.kv_used, fmtPct(st.kv_used))),
      el("td", {}, prefill ? "" : slack),
      el("td", {}, `${fmtN(st.step_ms_p50, 1)} / ${prefill ? "–" : fmtN(st.step_ms_max, 1)} ms`),
      el("td", {}, st.loop_lag_ms === undefined ? "–" : `${fmtN(st.loop_lag_ms)} ms`),
      el("td", {}, prefill ? "" : fmtN(st.deflections)),
      el("td", {}, w.age_s > 3 ? `${fmtAge(w.age_s)} ago!` : "live"));
    return tr;
  });
  // no rows while the router is silent (frozen, down) says nothing about the workers: they may well run
  const r = s.router;
  const none = r && r.age_s > 5
    ? `worker state unknown: no report from the router for ${fmtAge(r.age_s)}`
    : "no workers reported yet";
  tbody.replaceChildren(...(rows.length ? rows : [el("tr", { class: "empty" },
    el("td", { colspan: 9 }, none))]));
  $("lost").replaceChildren(
    ...(s.services_down || []).map((d) => el("li", { class: "down" }, d.state === "held_down"
      ? `${d.service} held down by kairos up: crash-looping (${d.last_exit || "?"})`
        + (d.next_try_s == null ? "" : `, next try in ${Math.round(d.next_try_s)} s`)
      : `${d.service} restarting after ${d.last_exit || "an exit"}`)),
    ...s.lost.map((l) => l.reason === "departed"  // drained and left: a planned restart, not a loss
      ? el("li", { class: "left" }, `${l.worker_id} (${l.role}) left ${fmtAge(l.ago_s)} ago (drained)`)
      : el("li", {}, `${l.worker_id} (${l.role}) lost ${fmtAge(l.ago_s)} ago: ${l.reason}`)),
    ...(s.flips || []).map((f) => el("li", { class: "flip" },  // the role planner's
      `${f.worker_id} role flip ${f.from} → ${f.to} (${f.reason}): `
      + (f.phase === "started" ? `draining since ${fmtAge(f.ago_s)} ago`
        : f.phase === "done" ? `done ${fmtAge(f.ago_s)} ago, took ${fmtAge(f.took_s)}`
          : `abandoned ${fmtAge(f.ago_s)} ago after ${fmtAge(f.took_s)}`))));
}

function renderRecent(s) {
  const rows = s.recent.slice(0, 20).map((r) => {
    const bad = r.outcome && r.outcome !== "ok";
    return el("tr", {},
      el("td", {}, fmtAge(Math.max(0, s.at - r.at))),
      el("td", { title: r.request_id }, r.request_id.slice(0, 10)),
      el("td", { class: "route-" + r.route }, r.route),
      el("td", {}, r.reason + (r.attempt ? ` (retry ${r.attempt})` : "")),
      el("td", {}, (r.prefill_worker ? r.prefill_worker + " → " : "") + r.decode_worker),
      el("td", {}, r.prompt_tokens),
      el("td", {}, `${fmtS(r.ttft_prefill_pred)} / ${fmtS(r.ttft_decode_pred)}`),
      el("td", {}, r.chunk_schedule.length ? r.chunk_schedule.join("+") : ""),
      el("td", {}, fmtS(r.ttft_s)),
      el("td", { class: bad ? "outcome-bad" : "" }, r.outcome ? r.outcome + (r.kv_fallback ? " (kv fallback)" : "")
        : "running"),
      el("td", {}, fmtN(r.decision_us) + " µs"));
  });
  $("recent").tBodies[0].replaceChildren(...rows);
}

function render(s) {
  updates += 1;
  lastUpdate = Date.now();
  const w = s.window;
  $("policy").textContent = s.policy ? "policy " + s.policy : "";
  const r = s.router;
  const rt = $("router");
  if (!r) { rt.textContent = "router: no telemetry yet"; rt.className = "pill bad"; }
  else if (r.age_s > 5) { rt.textContent = `router silent for ${fmtAge(r.age_s)}`; rt.className = "pill bad"; }
  else {
    const reps = r.replicas || [];
    const silent = reps.filter((x) => x.age_s > 5).map((x) => x.name);
    if (silent.length) {
      rt.textContent = `${silent.length} of ${reps.length} routers silent (${silent.join(", ")}) · ${r.accepted} accepted · ${r.failed} failed`;
      rt.className = "pill bad";
    } else {
      const who = reps.length > 1 ? `${reps.length} routers` : "router";
      rt.textContent = `${who} ok · ${r.accepted} accepted · ${r.failed} failed · ${r.rejected} rejected`;
      rt.className = "pill ok";
    }
  }
  $("live").textContent = `${s.live_workers.prefill} prefill · ${s.live_workers.decode} decode workers`;
  const u = $("updated");
  u.dataset.updates = String(updates);
  u.textContent = "updated " + new Date(s.at * 1000).toLocaleTimeString();
  $("kpi-rps").textContent = fmtN(w.rps, 1);
  $("kpi-deflect").textContent = fmtPct(w.deflect_ratio);
  $("kpi-ttft").textContent = `${fmtS(w.ttft_p50)} / ${fmtS(w.ttft_p95)}`;
  $("kpi-tbt").textContent = `${fmtS(w.tbt_p50)} / ${fmtS(w.tbt_p99)}`;
  $("kpi-errors").textContent = String(w.errors);
  $("kpi-errors").className = w.errors ? "bad" : "";
  $("kpi-inflight").textContent = r ? String(r.in_flight) : "–";
  // the router's event loop: its worst wake-up lag in the last second (100 ms or more stalls every stream)
  $("kpi-looplag").textContent = r && r.loop_lag_ms !== undefined ? `${Math.round(r.loop_lag_ms)} ms` : "–";
  $("kpi-looplag").className = r && r.loop_lag_ms >= 100 ? "bad" : "";
  $("kpi-slo").textContent = fmtPct(w.slo_attainment);
  $("kpi-prederr").textContent = w.ttft_pred_bias === null ? "–"
    : `${w.ttft_pred_bias >= 0 ? "+" : ""}${fmtS(w.ttft_pred_bias)}`;
  const missed = s.totals.messages.missed || 0;
  $("window-note").textContent = `last ${s.window_s} s: ${w.completed} finished, ${w.decisions} decisions, `
    + `${w.kv_fallbacks} KV fallbacks, decisions took ${fmtN(w.decision_us_p50)} µs (p50) / `
    + `${fmtN(w.decision_us_p99)} µs (p99); charts: each point covers ${s.smooth_s} s`
    + (missed ? `; ${missed} telemetry messages lost since start (router send queue full)` : "");
  chart($("chart-ttft"), s.series, [{ key: "ttft_p50", label: "p50", color: COLORS.p50 },
    { key: "ttft_p95", label: "p95", color: COLORS.p95 }], fmtS);
  chart($("chart-tbt"), s.series, [{ key: "tbt_p50", label: "p50", color: COLORS.p50 },
    { key: "tbt_p99", label: "p99", color: COLORS.p99 }], fmtS);
  chart($("chart-rps"), s.series, [{ key: "rps", label: "finished/s", color: COLORS.rps },
    { key: "errors_per_s", label: "errors/s", color: COLORS.p99 }], (v) => fmtN(v, 1));
  chart($("chart-deflect"), s.series, [{ key: "deflect_ratio", label: "deflected", color: COLORS.deflect }],
    fmtPct, 1);
  renderWorkers(s);
  $("routes").tBodies[0].replaceChildren(...Object.entries(w.ttft_by_route).map(([route, t]) =>
    el("tr", {}, el("td", { class: "route-" + route }, route), el("td", {}, t.n), el("td", {}, fmtS(t.p50)),
      el("td", {}, fmtS(t.p95)), el("td", {}, fmtS(t.p99)))));
  $("reasons").tBodies[0].replaceChildren(...Object.entries(s.totals.decisions).map(([k, n]) =>
    el("tr", {}, el("td", { class: "route-" + k.split("/")[0] }, k), el("td", {}, n))));
  renderRecent(s);
}

// With the monitor's API key on, open the dashboard as /?key=<key>: the key goes along.
const KEY = new URLSearchParams(location.search).get("key");
const Q = KEY ? "?key=" + encodeURIComponent(KEY) : "";

async function poll() {
  try {
    const res = await fetch("/api/state" + Q, { cache: "no-store" });
    if (res.ok) render(await res.json());
  } catch (e) { /* the monitor is restarting: the next tick retries */ }
}

function connect() {
  if (!window.EventSource) { setInterval(poll, 2000); return; }
  const es = new EventSource("/events" + Q);
  es.addEventListener("state", (ev) => render(JSON.parse(ev.data)));
  es.onerror = () => { $("updated").textContent = "reconnecting…"; };
}

setInterval(() => {
  if (lastUpdate && Date.now() - lastUpdate > 5000) {
    $("updated").textContent = `no update for ${fmtAge((Date.now() - lastUpdate) / 1000)}: is the monitor up?`;
    poll();
  }
}, 1000);
poll().then(connect);
