#!/usr/bin/env bash
# Replay one slice of a shifting workload live (`kairos up`, simulated engines, the role planner on)
# and through `kairos sim`, and print each side's TBT and both-SLO attainment and its role flips.
#
#   scripts/live-vs-sim.sh DIR [bench.live_vs_sim options]   e.g. --start 100 --duration 150 --rate-scale 0.75
#                                                            --time-scale 2 (both sides 2x slower: half the CPU)
#                                                            --tbt-delivery-allowance-ms 15 (both sides' configured
#                                                            TBT delivery allowance; live adds its measured part)
#
# Defaults: shift-code's report slice, trace time [100, 250) s (the end of a code phase, then an
# output-heavy phase) at x0.75, 2P2D, H100 profile; about 4 minutes of wall time for the live side
# (K times that with --time-scale K).
# The live side shares the host's CPUs with the client: run it on an idle machine for a figure to
# compare (the summary, DIR/live-vs-sim.json, records the load average and the client's send lag).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -lt 1 || "$1" == -* ]]; then
  sed -n '2,14p' "$0"; exit 2
fi
out="$1"; shift
PY="${PYTHON:-$ROOT/.venv/bin/python}"
cd "$ROOT"
exec nice -n "${NICE:-10}" "$PY" -m bench.live_vs_sim --out "$out" "$@"
