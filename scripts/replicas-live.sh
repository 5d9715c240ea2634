#!/usr/bin/env bash
# One router against four router replicas, live, alternated (issue 47 item 6): `kairos up` with
# simulated engines (2P2D, Kairos, the role planner off), the code trace's burst minute replayed by
# `kairos bench` at time scale 2, runs 1, 4, 4, 1; prints each run's load average, 429s, TTFT
# (served P95/P99), both-SLO attainment and requests per replica, and each pair's P95 ratio.
#
#   scripts/replicas-live.sh DIR [bench.replicas_live options]   e.g. --pairs 3 --time-scale 4
#                                                                --start 600 --duration 60 --planner on
#
# About 5-6 minutes of wall time a run at the defaults (K times the trace's 60 s / 0.35 at
# --time-scale K, plus the start). Run it on an otherwise idle host: the routers, the workers and
# the client share its CPUs (the summary, DIR/replicas-live.json, records the load average).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -lt 1 || "$1" == -* ]]; then
  sed -n '2,12p' "$0"; exit 2
fi
out="$1"; shift
PY="${PYTHON:-$ROOT/.venv/bin/python}"
cd "$ROOT"
exec nice -n "${NICE:-10}" "$PY" -m bench.replicas_live --out "$out" "$@"
