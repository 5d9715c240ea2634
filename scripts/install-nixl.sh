#!/usr/bin/env bash
# Lean NIXL install into a venv (requirements/nixl.txt, with --no-deps: no torch, no CUDA), then a
# smoke check that common.kv can create agents.
#
#   scripts/install-nixl.sh [PYTHON]     default: .venv/bin/python of the repo
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${1:-$ROOT/.venv/bin/python}"
"$PY" -m pip install -q --no-deps -r "$ROOT/requirements/nixl.txt"
cd "$ROOT" && "$PY" -c 'import common.kv as kv, sys; sys.exit(0 if kv.nixl_available() else "NIXL did not import")'
echo "[install-nixl] NIXL $("$PY" -c 'import importlib.metadata as m; print(m.version("nixl"))') ready in $PY"
