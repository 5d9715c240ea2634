#!/usr/bin/env bash
# The GPU check: step times of a Llama-3-8B-shaped model (random weights, plain PyTorch) on this
# host's GPU, fitted to Kairos's step-time model, plus `kairos kv-bench` when NIXL is importable.
#
#   scripts/gpu-check.sh [OUT_DIR]           on a host with one NVIDIA GPU, PyTorch and CUDA (no vLLM,
#                                            no network); sized for under 8 minutes (not yet timed on a GPU)
#   scripts/gpu-check.sh --tiny [OUT_DIR]    CPU smoke run with tiny shapes (what the tests run)
#
# OUT_DIR (default gpu-check-results/) receives gpu-check.json (device, every timed step, the
# fit and its error per kind of step), gpu-check-profile.json (a profile: `--profile
# OUT_DIR/gpu-check-profile.json`), gpu-check.log, and kv-bench.json when NIXL is there.
# PYTHON picks the interpreter (default: .venv/bin/python when it has torch, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
tiny=()
if [[ "${1:-}" == "--tiny" ]]; then tiny=(--tiny); shift; fi
out=${1:-gpu-check-results}
if [[ -z "${PYTHON:-}" ]]; then
  PYTHON=python3
  [[ -x .venv/bin/python ]] && .venv/bin/python -c 'import torch' 2>/dev/null && PYTHON=.venv/bin/python
fi
"$PYTHON" -c 'import torch, numpy, msgspec' 2>/dev/null \
  || { echo "gpu-check: $PYTHON lacks torch, numpy or msgspec (pip install torch numpy msgspec)" >&2; exit 2; }
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 900 "$PYTHON" -W ignore -m bench.gpu_check "${tiny[@]}" --out "$out" 2>&1 | tee "$out/gpu-check.log"
