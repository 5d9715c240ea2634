#!/usr/bin/env bash
# The README's commands from a fresh clone, with nothing beside it: clone the committed HEAD into
# an empty temporary directory (no shared/ folder next to it, no venv), run the README's set-up
# (`make venv`, what `make demo` and `make test` start with) and a short version of the main
# job: the demo's simulated comparison on a 30 s slice of the shipped code trace, then
# `kairos sim --trace code --duration 300`. Fails if any of them fails.
#
#   scripts/fresh-clone-check.sh            clone HEAD of this repository
#   KEEP=1 scripts/fresh-clone-check.sh     keep the temporary directory (printed) for a look
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tmp="$(mktemp -d /tmp/kairos-fresh.XXXXXX)"
[[ "${KEEP:-0}" == "1" ]] || trap 'rm -rf "$tmp"' EXIT
say() { printf '[fresh-clone] %s\n' "$*"; }

git clone -q "$ROOT" "$tmp/kairos"
cd "$tmp/kairos"
say "cloned $(git rev-parse --short HEAD) into $tmp/kairos (no shared/ beside it)"
[[ ! -e "$tmp/shared" ]] || { say "unexpected $tmp/shared"; exit 1; }

make -s venv
say "set-up done"
.venv/bin/kairos sim --trace code --duration 300 --policy disagg-least-loaded --policy kairos --out "$tmp/sim-results.json" \
  | tail -n 8
test -s "$tmp/sim-results.json" || { say "kairos sim wrote no results JSON"; exit 1; }
say "kairos sim on the shipped code trace: ok"
.venv/bin/kairos demo --duration 30 --out-dir "$tmp/demo-out" --no-progress | tail -n 25
test -s "$tmp/demo-out/results.json" || { say "kairos demo wrote no results.json"; exit 1; }
say "kairos demo on a 30 s slice: ok"
