#!/usr/bin/env bash
# Every test tier, in order; stops at the first failing tier. Called by `make test` (and .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

echo "== lint (ruff)"
"$VENV/bin/ruff" check .

echo "== main suite (unit, loopback integration, chaos)"
"$VENV/bin/pytest" -q -m "not vllm and not browser" -p no:cacheprovider
